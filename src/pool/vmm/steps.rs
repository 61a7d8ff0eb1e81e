//! The driver calls of the arena's planned steps (Note [arena chunks] in `arena/mod.rs`): map,
//! re-cut, create and release chunks, and note in an [`Outcome`] what became of each, for
//! the arena's books to take in one go under the pool lock.

use super::super::arena::{Arena, Step, Taken};
use super::super::DevicePool;
use super::unmapper::Stale;
use crate::backend::BackendError;
use crate::config::{self, Key};
use crate::trace::record::segment as trace_driver;
use crate::trace::DriverAction;

/// A chunk in an [`Outcome`]: one the arena's books know, or memory just created (which
/// [`Outcome::apply`] gives a record).
#[derive(Copy, Clone)]
enum ChunkRef {
    Known(u32),
    New { handle: u64, granules: u32 },
}

impl ChunkRef {
    fn id_in(self, a: &mut Arena) -> u32 {
        match self {
            ChunkRef::Known(id) => id,
            ChunkRef::New { handle, granules } => a.new_chunk(handle, granules),
        }
    }
}

/// What the driver calls of one map or release did, applied to the arena's books in one
/// go under the pool lock.
#[derive(Default)]
pub(super) struct Outcome {
    /// Chunks mapped now, with their first granule.
    mapped: Vec<(ChunkRef, usize)>,
    /// Chunks held and mapped nowhere.
    idle: Vec<ChunkRef>,
    /// Taken chunks no call changed: back where they were.
    pub(super) untouched: Vec<Taken>,
    /// Chunks whose memory was released.
    dropped: Vec<u32>,
    /// Granules created and released, and the calls that took.
    pub(super) created: u64,
    pub(super) creates: u64,
    pub(super) released: u64,
    pub(super) releases: u64,
    map_calls: u64,
    unmap_calls: u64,
    unmapped: u64,
    /// Time in the calls, as `Arena::call_ns`.
    call_ns: [u64; 4],
}

/// Indices of `Arena::call_ns`.
const CREATE: usize = 0;
const MAP: usize = 1;
const UNMAP: usize = 2;
const RELEASE: usize = 3;

/// The largest piece of physical memory to create now, for a pool holding `reserved`
/// bytes: `vmm_chunk`, and with `vmm_chunk_divisor` at most that share of what the pool
/// holds (Note [arena chunks]).
pub(super) fn chunk_limit(reserved: u64) -> u64 {
    let chunk = config::get(Key::VmmChunk);
    match config::get(Key::VmmChunkDivisor) {
        0 => chunk,
        d => chunk.min(reserved / d),
    }
}

/// Note [merged chunks]: with chunks sized by the pool (`vmm_chunk_divisor`), the small
/// ones made while it was small are merged as they move.
pub(super) fn merges_chunks() -> bool {
    config::get(Key::VmmChunkDivisor) != 0
}

/// Runs one driver call, adding its time to `out.call_ns[kind]`.
fn timed<T>(out: &mut Outcome, kind: usize, call: impl FnOnce() -> T) -> T {
    let start = std::time::Instant::now();
    let r = call();
    out.call_ns[kind] += start.elapsed().as_nanos() as u64;
    r
}

impl Outcome {
    pub(super) fn note_created(&mut self, granules: u32) {
        self.created += granules as u64;
        self.creates += 1;
    }

    pub(super) fn apply(self, a: &mut Arena) {
        for (chunk, at) in self.mapped {
            let id = chunk.id_in(a);
            a.maps += a.chunk_len(id) as u64;
            a.record_mapped(id, at);
        }
        for chunk in self.idle {
            let id = chunk.id_in(a);
            a.record_idle(id);
        }
        for t in self.untouched {
            restore(a, t);
        }
        for id in self.dropped {
            a.drop_chunk(id);
        }
        a.map_calls += self.map_calls;
        a.unmap_calls += self.unmap_calls;
        a.unmaps += self.unmapped;
        for (total, ns) in a.call_ns.iter_mut().zip(self.call_ns) {
            *total += ns;
        }
    }
}

/// Puts a taken chunk back where it was.
pub(super) fn restore(a: &mut Arena, t: Taken) {
    match t.was_at {
        Some(at) => a.record_mapped(t.id, at),
        None => a.record_idle(t.id),
    }
}

impl DevicePool {
    /// Makes the driver calls of one planned step, noting what became of each chunk.
    pub(super) fn run_step(
        &self,
        step: Step,
        base: u64,
        g: u64,
        out: &mut Outcome,
    ) -> core::result::Result<(), BackendError> {
        let ctx = self.ctx.id;
        match step {
            Step::Map { chunk, at } => {
                let chunk = match chunk.was_at {
                    // Note [unmaps off the launching thread]: mapped here now, unmapped
                    // where it was later.
                    Some(was) if self.defers_unmaps() => {
                        self.leave_stale(Stale::new(
                            base + was as u64 * g,
                            chunk.len as u64 * g,
                            chunk.handle,
                        ));
                        Taken {
                            was_at: None,
                            ..chunk
                        }
                    }
                    _ => self.unmap_taken(chunk, base, g, out)?,
                };
                let bytes = chunk.len as u64 * g;
                self.map_chunk(
                    ChunkRef::Known(chunk.id),
                    chunk.handle,
                    bytes,
                    (at, base + at as u64 * g),
                    out,
                )
            }
            Step::Recut { chunk, len, at } => {
                let chunk_len = chunk.len;
                self.release_taken(chunk, base, g, out)?;
                // The rest first: if the driver has less than before (another process
                // took it meanwhile), the run fails rather than the memory held shrinking.
                let rest = chunk_len - len;
                let rest_handle = timed(out, CREATE, || {
                    self.backend.create_physical(ctx, rest as u64 * g)
                })?;
                out.note_created(rest);
                out.idle.push(ChunkRef::New {
                    handle: rest_handle,
                    granules: rest,
                });
                self.create_and_map(len, at, base, g, out)
            }
            Step::Create { len, at } => self.create_and_map(len, at, base, g, out),
            Step::Drop { chunk } => self.release_taken(chunk, base, g, out),
        }
    }

    /// Releases a taken chunk's memory, unmapping it first when it was stolen. A chunk
    /// that will not unmap stays where it was; one that will not release stays idle.
    pub(super) fn release_taken(
        &self,
        chunk: Taken,
        base: u64,
        g: u64,
        out: &mut Outcome,
    ) -> core::result::Result<(), BackendError> {
        let chunk = self.unmap_taken(chunk, base, g, out)?;
        self.clear_stale_handle(chunk.handle);
        if let Err(e) = timed(out, RELEASE, || {
            self.backend.release_physical(self.ctx.id, chunk.handle)
        }) {
            out.idle.push(ChunkRef::Known(chunk.id));
            return Err(e);
        }
        out.releases += 1;
        out.released += chunk.len as u64;
        out.dropped.push(chunk.id);
        Ok(())
    }

    fn create_and_map(
        &self,
        len: u32,
        at: usize,
        base: u64,
        g: u64,
        out: &mut Outcome,
    ) -> core::result::Result<(), BackendError> {
        let bytes = len as u64 * g;
        let handle = timed(out, CREATE, || {
            self.backend.create_physical(self.ctx.id, bytes)
        })?;
        out.note_created(len);
        let chunk = ChunkRef::New {
            handle,
            granules: len,
        };
        self.map_chunk(chunk, handle, bytes, (at, base + at as u64 * g), out)
    }

    /// Maps `chunk` (physical memory `handle` of `bytes`) at granule `at`, address `ptr`:
    /// mapped on success, idle on failure.
    fn map_chunk(
        &self,
        chunk: ChunkRef,
        handle: u64,
        bytes: u64,
        (at, ptr): (usize, u64),
        out: &mut Outcome,
    ) -> core::result::Result<(), BackendError> {
        // Note [unmaps off the launching thread]: a chunk back where it was is mapped
        // there still; other old places in the way go first.
        if self.ready_for_map(ptr, bytes, handle) {
            out.mapped.push((chunk, at));
            return Ok(());
        }
        match timed(out, MAP, || {
            self.backend.map_physical(self.ctx.id, ptr, bytes, handle)
        }) {
            Ok(()) => {
                out.map_calls += 1;
                trace_driver(DriverAction::Map, ptr, bytes, self.ctx.device);
                out.mapped.push((chunk, at));
                Ok(())
            }
            Err(e) => {
                out.idle.push(chunk);
                Err(e)
            }
        }
    }

    /// Unmaps a stolen chunk (an idle one passes through). A chunk that will not unmap
    /// stays mapped where it was.
    pub(super) fn unmap_taken(
        &self,
        chunk: Taken,
        base: u64,
        g: u64,
        out: &mut Outcome,
    ) -> core::result::Result<Taken, BackendError> {
        let Some(was) = chunk.was_at else {
            return Ok(chunk);
        };
        let at = base + was as u64 * g;
        let bytes = chunk.len as u64 * g;
        match timed(out, UNMAP, || {
            self.backend.unmap_physical(self.ctx.id, at, bytes)
        }) {
            Ok(()) => {
                out.unmap_calls += 1;
                trace_driver(DriverAction::Unmap, at, bytes, self.ctx.device);
                out.unmapped += chunk.len as u64;
                Ok(Taken {
                    was_at: None,
                    ..chunk
                })
            }
            Err(e) => {
                crate::log::warn(&format!("cupool: unmapping arena memory failed: {e:?}"));
                out.untouched.push(chunk);
                Err(e)
            }
        }
    }
}
