//! The VMM arena's driver side (`vmm:on`): reserving the arena, backing blocks with
//! physical memory, releasing it, and granting peers access. The bookkeeping, and the
//! notes on how the arena works, are in `arena/mod.rs` (Note [vmm arena], Note [arena chunks]);
//! the driver calls of each planned step in `vmm/steps.rs`.
//!
//! Mapping and unmapping happen with the pool's `events` mutex held (the lock held across
//! backend calls), never the spin lock, and never while a capture is active.

use super::arena::{Arena, Step, ARENA_MIN, ARENA_PER_DEVICE_BYTE};
use super::block::{BlockIdx, Place, SegmentKind};
use super::counters::{Level, ThreadCounters};
use super::size_class::ALIGNMENT;
use super::{address_map, DevicePool, Request, ADDRESSES, BACKEND_OFF, BLOCKS};
use crate::backend::BackendError;
use crate::config::{self, Key};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;
use steps::{chunk_limit, merges_chunks, restore, Outcome};

mod steps;
pub mod unmapper;

impl DevicePool {
    /// Reserves the arena if the pool has none; on a backend without virtual memory
    /// management, turns VMM off for this pool (large blocks use segments).
    pub(super) fn ensure_arena(&self) {
        if self.shared.lock().arena.is_some() || !self.may_order() {
            return;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if self.shared.lock().arena.is_some() {
            return;
        }
        let ctx = self.ctx.id;
        let reserved = (|| {
            let g = self.backend.vmm_granularity(ctx)?;
            let total = self.backend.memory_info(ctx)?.1;
            let size = total.saturating_mul(ARENA_PER_DEVICE_BYTE).max(ARENA_MIN);
            let size = size.div_ceil(g) * g;
            let base = self.backend.reserve_range(ctx, size)?;
            Ok::<_, BackendError>((base, size, g))
        })();
        let (base, size, g) = match reserved {
            Ok(r) => r,
            Err(e) => {
                crate::log::info(&format!(
                    "cupool: device {}: no virtual memory management ({e:?}); large blocks use segments",
                    self.ctx.device
                ));
                self.vmm.store(false, Ordering::Relaxed);
                return;
            }
        };
        let usable = base % g == 0
            && base % ALIGNMENT == 0
            && base + size <= address_map::ADDRESS_LIMIT
            && g % ALIGNMENT == 0;
        let record = if usable { BLOCKS.allocate() } else { None };
        let Some(idx) = record else {
            let _ = self.backend.free_range(ctx, base, size);
            crate::log::error("cupool: the reserved range cannot be tracked; VMM off");
            self.vmm.store(false, Ordering::Relaxed);
            return;
        };
        let mut sh = self.shared.lock();
        // SAFETY: the record is new and ours; pool lock held.
        unsafe {
            BLOCKS.init_segment_head(idx, base, size, self.index, SegmentKind::Large);
            BLOCKS.get(idx).set_place(Place::FreeShared);
            BLOCKS.get(idx).publish_free(base);
            ADDRESSES.set(base, idx);
            sh.segments.insert(base, idx);
            sh.large.insert(&BLOCKS, idx);
        }
        sh.arena = Some(Arena::new(base, size, g));
    }

    /// Carves a large block from the arena, creating physical memory if needed.
    pub(super) fn carve_arena(&self, c: &ThreadCounters, req: Request) -> Result<u64> {
        let taken = {
            let mut sh = self.shared.lock();
            // SAFETY: pool lock held.
            unsafe { self.take_shared(&mut sh, req) }
        };
        match taken {
            None => Err(CupoolStatus::CupoolErrorOutOfMemory),
            Some((idx, true)) => Ok(self.hand_out(c, idx, req)),
            Some((idx, false)) => self.map_or_put_back(c, idx, req, true),
        }
    }

    /// Maps every unmapped granule under the arena block `idx` (taken by the caller, so
    /// pinned), run by run, from idle chunks, stolen chunks, re-cut chunks, else (with
    /// `may_create`) new memory within the limit (Note [arena chunks]). On failure what was
    /// mapped stays mapped (it is stealable once the caller puts the block back).
    pub(super) fn map_arena_block(
        &self,
        c: &ThreadCounters,
        idx: BlockIdx,
        may_create: bool,
    ) -> Result<()> {
        // Note [capture exclusion]: held until the maps are done.
        let Some(_calls) = self.enter_ordering_calls() else {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        };
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller owns `idx`; its range does not change meanwhile.
        let (ptr, size) = unsafe {
            let d = BLOCKS.get(idx).data();
            (d.ptr, d.size)
        };
        // Note [creation within free memory]: without a limit, new memory is bounded by
        // what the device has free (the driver's count, which leaves out the pool's idle
        // chunks: those are planned first). A request that cannot fit fails at once, as
        // `cuMemAlloc` would, instead of creating every free granule first and releasing
        // them again (a 1 TiB request took all 80 GB of an H100 in 10 068 calls, and the
        // driver's own stream-ordered pool then failed until the process ended).
        let free = match may_create {
            true => self
                .backend
                .memory_info(self.ctx.id)
                .ok()
                .map(|(free, _)| free),
            false => None,
        };
        // Plan under the pool lock; other threads map only with `events` held, so the
        // plan stays valid while the calls run.
        let (base, g, steps, create_bytes) = {
            let mut sh = self.shared.lock();
            let reserved = sh.reserved;
            let a = sh.arena.as_mut().expect("arena block without an arena");
            let todo = a.unmapped(ptr, size);
            if todo.is_empty() {
                return Ok(());
            }
            let g = a.granule;
            let limit = self.limit();
            let mut create = match (may_create, limit) {
                (false, _) => 0,
                (true, 0) => u64::MAX,
                (true, l) => l.saturating_sub(reserved) / g,
            };
            if let Some(free) = free {
                create = create.min(free / g);
            }
            let allowed = create;
            // Note [arena chunks]: the `vmm_chunk` option, in granules.
            let max_chunk = (chunk_limit(reserved) / g).clamp(1, u32::MAX as u64) as u32;
            let merge = merges_chunks();
            let split = config::get(Key::VmmChunkSplit) as usize;
            let mut steps = Vec::new();
            for run in todo.chunk_by(|x, y| *x + 1 == *y) {
                let piece = match split {
                    0 => max_chunk,
                    k => max_chunk.max((run.len() / k).min(u32::MAX as usize) as u32),
                };
                match a.plan_run(run[0], run.len(), &mut create, piece, merge) {
                    Some(s) => steps.extend(s),
                    None => {
                        // Give back what earlier runs took; nothing was called yet.
                        for chunk in steps.into_iter().filter_map(Step::taken) {
                            restore(a, chunk);
                        }
                        return Err(CupoolStatus::CupoolErrorOutOfMemory);
                    }
                }
            }
            // New memory counts against the limit from now on.
            let create_bytes = (allowed - create) * g;
            let base = a.base;
            sh.reserved += create_bytes;
            (base, g, steps, create_bytes)
        };
        let mut outcome = Outcome::default();
        let mut failed: Option<BackendError> = None;
        for step in steps {
            if failed.is_some() {
                // Not started: chunks go back where they were, or idle once unmapped.
                outcome.untouched.extend(step.taken());
                continue;
            }
            if let Err(e) = self.run_step(step, base, g, &mut outcome) {
                failed = Some(e);
            }
        }
        // Granules created minus released: re-cuts do both.
        let net = outcome.created as i64 - outcome.released as i64;
        {
            let mut sh = self.shared.lock();
            // Planned creations were counted already; re-cuts release and create.
            sh.reserved = sh.reserved - create_bytes + outcome.created * g - outcome.released * g;
            sh.reserved_peak = sh.reserved_peak.max(sh.reserved);
            sh.slow.device_allocs += outcome.creates;
            sh.slow.device_frees += outcome.releases;
            let a = sh.arena.as_mut().unwrap();
            outcome.apply(a);
        }
        if net > 0 && c.raise(Level::Cached, net as u64 * g, self.peak_epoch()).0 {
            self.update_peak(Level::Cached);
        } else if net < 0 {
            c.lower(Level::Cached, (-net) as u64 * g);
        }
        match failed {
            None => Ok(()),
            Some(BackendError::OutOfMemory) => Err(CupoolStatus::CupoolErrorOutOfMemory),
            Some(e) => {
                crate::log::info(&format!("cupool: mapping arena memory failed: {e:?}"));
                Err(e.into())
            }
        }
    }

    /// Unmaps every chunk wholly inside a free shared block of the arena and releases all
    /// idle physical memory; frees the reservation when nothing is left in it. Returns the
    /// bytes released.
    pub(super) fn release_arena(&self, c: &ThreadCounters) -> u64 {
        if !self.may_order() || self.shared.lock().arena.is_none() {
            return 0;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        // Note [unmaps off the launching thread]: the handles and the range go back.
        self.clear_all_stale();
        let ctx = self.ctx.id;
        let floor = self.reserve_floor();
        let Some((base, g, taken)) = ({
            let mut sh = self.shared.lock();
            // Note [reserve at start]: only what lies above the reserve may go.
            let above = sh.reserved.saturating_sub(floor);
            sh.arena
                .as_mut()
                .map(|a| (a.base, a.granule, a.take_unused(above / a.granule)))
        }) else {
            return 0;
        };
        let mut out = Outcome::default();
        for chunk in taken {
            if let Err(e) = self.release_taken(chunk, base, g, &mut out) {
                // Never seen from CUDA; the memory stays in the pool's books.
                crate::log::warn(&format!("cupool: releasing arena memory failed: {e:?}"));
            }
        }
        let released = out.released * g;
        let free_range = {
            let mut sh = self.shared.lock();
            sh.reserved -= released;
            sh.slow.device_frees += out.releases;
            let a = sh.arena.as_mut().unwrap();
            out.apply(a);
            let (held, size, base) = (a.held(), a.size, a.base);
            // SAFETY: pool lock held.
            unsafe {
                let head = sh.segments.get(&base).copied();
                match head {
                    Some(idx)
                        if held == 0
                            && BLOCKS.get(idx).place() == Place::FreeShared
                            && BLOCKS.get(idx).data().size == size =>
                    {
                        sh.large.remove(&BLOCKS, idx);
                        ADDRESSES.clear(base);
                        BLOCKS.release(idx);
                        sh.segments.remove(&base);
                        let a = sh.arena.take().unwrap();
                        sh.mapped_peak = sh.mapped_peak.max(a.mapped_peak * a.granule);
                        crate::log::info(&format!(
                            "cupool: device {}: VMM arena released ({} granules mapped in {} calls, {} unmapped in {})",
                            self.ctx.device, a.maps, a.map_calls, a.unmaps, a.unmap_calls
                        ));
                        Some((base, size))
                    }
                    _ => None,
                }
            }
        };
        if released > 0 {
            c.lower(Level::Cached, released);
        }
        if let Some((base, size)) = free_range {
            if let Err(e) = self.backend.free_range(ctx, base, size) {
                crate::log::warn(&format!("cupool: freeing the arena's range failed: {e:?}"));
            }
        }
        released
    }

    /// Gives `device` access to every granule mapped now (Note [vmm peer access] in the
    /// CUDA backend: later maps grant it themselves once the backend has recorded the
    /// peer). Maps happen with `events` held, so none is missed. Returns the runs whose
    /// grant failed.
    pub fn grant_mapped_to(&self, device: i32) -> usize {
        if BACKEND_OFF.load(Ordering::Relaxed) || device == self.ctx.device {
            return 0;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let runs = match self.shared.lock().arena.as_ref() {
            Some(a) => a.mapped_runs(),
            None => return 0,
        };
        let mut failed = 0;
        for (ptr, bytes) in runs {
            if let Err(e) = self.backend.grant_access(self.ctx.id, ptr, bytes, device) {
                failed += 1;
                crate::log::warn(&format!(
                    "cupool: device {}: granting device {device} access to {bytes} bytes at {ptr:#x} failed: {e:?}",
                    self.ctx.device
                ));
            }
        }
        failed
    }

    /// The arena's mapped address ranges `(address, bytes)`, ascending (none without one).
    pub fn arena_mapped_runs(&self) -> Vec<(u64, u64)> {
        let sh = self.shared.lock();
        sh.arena.as_ref().map_or_else(Vec::new, |a| a.mapped_runs())
    }

    /// VMM figures of this pool.
    pub fn vmm_stats(&self) -> VmmStats {
        // Read before the pool lock: its own lock is not to be taken under a spin lock.
        let u = self.unmapper_counts();
        let sh = self.shared.lock();
        let mut s = VmmStats {
            enabled: self.vmm.load(Ordering::Relaxed),
            ..VmmStats::default()
        };
        if let Some(a) = sh.arena.as_ref() {
            s.range_bytes = a.size;
            s.mapped_bytes = a.mapped * a.granule;
            s.idle_bytes = a.idle_granules() * a.granule;
            s.maps = a.maps;
            s.unmaps = a.unmaps;
            s.map_calls = a.map_calls;
            s.unmap_calls = a.unmap_calls;
            (s.mapped_chunks, s.held_chunks) = a.chunk_counts();
            s.call_ns = a.call_ns;
            // Note [unmaps off the launching thread]: the unmaps of stale aliases are the
            // arena's unmap calls too.
            s.unmaps += u.bytes / a.granule;
            s.unmap_calls += u.worker_calls + u.inline_calls;
            s.call_ns[2] += u.worker_ns + u.inline_ns;
            s.deferred_unmap_calls = u.worker_calls;
            s.deferred_unmap_ns = u.worker_ns;
            s.revived_aliases = u.revived;
            s.stale_bytes = u.stale_bytes;
        }
        s
    }
}

/// VMM figures of one pool ([`super::DevicePool::vmm_stats`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VmmStats {
    /// Whether the pool carves large blocks from an arena.
    pub enabled: bool,
    /// Bytes of the reserved virtual range (0 when none is reserved now).
    pub range_bytes: u64,
    pub mapped_bytes: u64,
    pub idle_bytes: u64,
    /// Granules mapped and unmapped, and the driver calls those took (Note [arena chunks]).
    pub maps: u64,
    pub unmaps: u64,
    pub map_calls: u64,
    pub unmap_calls: u64,
    /// Pieces of physical memory mapped now and held (Note [arena chunks]).
    pub mapped_chunks: u64,
    pub held_chunks: u64,
    /// Time in the driver's VMM calls (ns): create, map with its access grant, unmap,
    /// release.
    pub call_ns: [u64; 4],
    /// Unmap calls the pool's worker thread made and their time (ns; both counted in the
    /// unmaps above too), and bytes of moved memory's old places still mapped now (Note
    /// [unmaps off the launching thread]).
    pub deferred_unmap_calls: u64,
    pub deferred_unmap_ns: u64,
    pub stale_bytes: u64,
    /// Moves back to exactly a chunk's old place, made without a call (its stale alias).
    pub revived_aliases: u64,
}

impl VmmStats {
    /// One JSON object: the counts above and the driver time by call, in ns
    /// (`create_ns`, `map_ns`, `unmap_ns`, `release_ns`), so a program can read the mapping
    /// work of a stretch of its run as the difference of two readings.
    pub fn to_json(&self) -> String {
        use crate::stats::print::json_value;
        let mut out = format!("{{\"enabled\":{}", self.enabled);
        for (name, v) in [
            ("range_bytes", self.range_bytes),
            ("mapped_bytes", self.mapped_bytes),
            ("idle_bytes", self.idle_bytes),
            ("maps", self.maps),
            ("unmaps", self.unmaps),
            ("map_calls", self.map_calls),
            ("unmap_calls", self.unmap_calls),
            ("mapped_chunks", self.mapped_chunks),
            ("held_chunks", self.held_chunks),
            ("create_ns", self.call_ns[0]),
            ("map_ns", self.call_ns[1]),
            ("unmap_ns", self.call_ns[2]),
            ("release_ns", self.call_ns[3]),
            ("deferred_unmap_calls", self.deferred_unmap_calls),
            ("deferred_unmap_ns", self.deferred_unmap_ns),
            ("stale_bytes", self.stale_bytes),
            ("revived_aliases", self.revived_aliases),
        ] {
            json_value(&mut out, name, v);
        }
        out.push('}');
        out
    }

    /// One line for the exit summary.
    pub fn to_line(&self) -> String {
        let ms = |ns: u64| ns as f64 / 1e6;
        format!(
            "  vmm: {} MiB mapped in {} chunks ({} held); {} granules mapped in {} calls, {} unmapped in {} calls; driver time: create {:.1} ms, map {:.1} ms, unmap {:.1} ms, release {:.1} ms\n",
            self.mapped_bytes >> 20,
            self.mapped_chunks,
            self.held_chunks,
            self.maps,
            self.map_calls,
            self.unmaps,
            self.unmap_calls,
            ms(self.call_ns[0]),
            ms(self.call_ns[1]),
            ms(self.call_ns[2]),
            ms(self.call_ns[3]),
        )
    }
}
