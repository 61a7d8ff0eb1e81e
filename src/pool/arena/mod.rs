//! Bookkeeping of the VMM arena: one reserved virtual address range per pool that large
//! blocks are carved from, which of its granules are backed by physical memory, and in
//! which chunks that memory was created. No driver calls here: `vmm.rs` makes them.
//! Here: the arena, its pins and where a block is placed; `chunks.rs`: the chunks and the
//! plans that back a run of granules; `stealable.rs`: the set of stealable chunks.
//!
//! Note [vmm arena]: the arena is a segment like the others (its blocks tile it, free
//! neighbours merge, best fit through the shared large index), except that it is huge (4×
//! the device's memory, at least 1 TiB) and only partly backed. Each granule (2 MiB, the
//! backend's granularity) is mapped or not; blocks do not own granules, so neighbouring
//! blocks share the granule at their boundary (no per-block rounding).
//! - A granule is **pinned** while any block overlapping it is not `FreeShared`
//!   (allocated, in a thread cache, on a stream's list, awaiting a fence): `pins[g]` counts
//!   those blocks. A pinned granule is always mapped and is never unmapped: work may still
//!   use it.
//! - Pins change only where a block crosses the shared boundary: taken from the shared
//!   index (the whole block is pinned before it is split, the remainder unpins itself when
//!   it goes back), given to it (`insert_shared` unpins the incoming block before merging),
//!   and when a block outside it is split (the boundary granule gains a pin).
//! - Reserved bytes are physical memory held (mapped plus idle chunks).
//!
//! Note [arena chunks]: physical memory is created in **chunks** of one or more adjacent granules
//! (one `cuMemCreate` handle each), mapped whole and unmapped whole (CUDA maps a handle
//! from its start and unmaps only whole mappings). The driver's cost is per call, not per
//! byte: on an H100, mapping and granting a 2 MiB handle takes ~30 µs, a 128 MiB handle
//! ~39 µs (0.6 µs per granule), and unmapping 20 µs against 22 µs (docs/BENCHMARKS.md,
//! `gpu/vmm_cost.cu`). So a run of granules is backed by as few chunks as can be found:
//! - a mapped chunk none of whose granules is pinned lies wholly inside one free shared
//!   block (shared free neighbours merge) whose fence has completed: it is **stealable**;
//! - a block handed out over unmapped granules takes, for each run of them, idle chunks
//!   that fit, else stealable chunks that fit (unmapping them where they were: stitching),
//!   else a larger idle or stealable chunk **re-cut** (released and created again as the
//!   part needed plus the rest, which stays idle: the memory held does not change), else
//!   new memory within the limit. So the footprint follows the live bytes, not the history
//!   of sizes, and the number of driver calls follows the number of runs, not granules.
//! - new chunks are at most `vmm_chunk`, and at most the pool's reserved bytes /
//!   `vmm_chunk_divisor`: a chunk that a block covers only in part keeps its other granules
//!   mapped beside it (free but stuck), and in a pool of a few hundred MiB an 8 MiB chunk
//!   strands a larger share of it than in a pool of many GiB. The small chunks made while
//!   the pool was small are merged as they move (Note [merged chunks] in `chunks.rs`), so
//!   a grown pool's memory moves in chunks of the grown size.
//!
//! Note [exported chunks]: a block exported through CUDA IPC is mapped by its importer from
//! the chunks under it, which the importer reaches through their file descriptors (Note
//! [exportable memory] in the CUDA backend). Those chunks keep one extra busy count for
//! good: never stolen, re-cut or released, so that a descriptor handed out always names
//! the memory it named, as exported segments are kept (Note [exported segments]).

mod chunks;
mod stealable;

use std::collections::BTreeSet;
use std::ops::RangeInclusive;

/// The arena reserves this many bytes of address space per byte of device memory...
pub const ARENA_PER_DEVICE_BYTE: u64 = 4;
/// ...and at least this many (address space costs nothing until mapped).
pub const ARENA_MIN: u64 = 1 << 40;

const NO_CHUNK: u32 = u32::MAX;

/// Physical memory of one handle: `len` granules, mapped from granule `at` or idle.
#[derive(Copy, Clone, Debug)]
struct Chunk {
    handle: u64,
    len: u32,
    /// First granule it is mapped at; `NO_CHUNK` while idle or unused.
    at: u32,
    /// Its granules that are pinned now, plus one for good once it is exported
    /// (stealable when 0 and mapped).
    busy: u32,
    /// Exported through CUDA IPC (Note [exported chunks]).
    exported: bool,
    /// Descriptor it was exported as, -1 before.
    shared_fd: i32,
    /// Has an entry in the stealable set, maybe a stale one (Note [lazy stealable set]).
    listed: bool,
}

/// A chunk of an exported block ([`Arena::export`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ExportedChunk {
    pub id: u32,
    pub handle: u64,
    pub bytes: u64,
    pub fd: i32,
}

/// A chunk taken out of the arena's bookkeeping to be mapped, unmapped or released.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    pub id: u32,
    pub handle: u64,
    pub len: u32,
    /// Where it was mapped (stolen chunks), `None` for idle ones.
    pub was_at: Option<usize>,
}

/// One step of backing a run of unmapped granules ([`Arena::plan_run`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Map this idle or stolen chunk at granule `at`.
    Map { chunk: Taken, at: usize },
    /// Release `chunk` (unmapping it first when stolen), create `len` granules mapped at
    /// `at` and `chunk.len - len` granules left idle.
    Recut { chunk: Taken, len: u32, at: usize },
    /// Create `len` granules of new memory and map them at `at`.
    Create { len: u32, at: usize },
    /// Release `chunk` (unmapping it first when stolen): the `Create` that follows its
    /// group makes the same granules again as one chunk (Note [merged chunks]).
    Drop { chunk: Taken },
}

impl Step {
    /// The chunk this step takes from the arena's books, if any (a `Create` takes none).
    pub fn taken(self) -> Option<Taken> {
        match self {
            Step::Map { chunk, .. } | Step::Recut { chunk, .. } | Step::Drop { chunk } => {
                Some(chunk)
            }
            Step::Create { .. } => None,
        }
    }
}

pub struct Arena {
    pub base: u64,
    pub size: u64,
    pub granule: u64,
    /// Chunk mapped at each granule, `NO_CHUNK` when none.
    chunk_at: Vec<u32>,
    /// Blocks not in the shared index overlapping each granule.
    pins: Vec<u32>,
    chunks: Vec<Chunk>,
    unused_ids: Vec<u32>,
    /// Mapped chunks with no pinned granule, by (granules, id), plus stale entries of
    /// chunks pinned since (Note [lazy stealable set]).
    stealable: BTreeSet<(u32, u32)>,
    /// Granules of the chunks that are stealable now (exact).
    stealable_granules: u64,
    /// Chunks held but mapped nowhere, by (granules, id).
    idle: BTreeSet<(u32, u32)>,
    idle_granules: u64,
    /// Granules mapped now.
    pub mapped: u64,
    /// One past the highest granule ever mapped: every granule from here on is unmapped.
    pub top: usize,
    /// Most granules mapped at once since the arena was reserved or the peaks were reset.
    pub mapped_peak: u64,
    /// Counters: granules mapped and unmapped, and the driver calls those took.
    pub maps: u64,
    pub unmaps: u64,
    pub map_calls: u64,
    pub unmap_calls: u64,
    /// Time spent in the driver's VMM calls, by kind: create, map (with its access
    /// grant), unmap, release (ns).
    pub call_ns: [u64; 4],
}

impl Arena {
    pub fn new(base: u64, size: u64, granule: u64) -> Self {
        let n = (size / granule) as usize;
        Arena {
            base,
            size,
            granule,
            chunk_at: vec![NO_CHUNK; n],
            pins: vec![0; n],
            chunks: Vec::new(),
            unused_ids: Vec::new(),
            stealable: BTreeSet::new(),
            stealable_granules: 0,
            idle: BTreeSet::new(),
            idle_granules: 0,
            mapped: 0,
            top: 0,
            mapped_peak: 0,
            maps: 0,
            unmaps: 0,
            map_calls: 0,
            unmap_calls: 0,
            call_ns: [0; 4],
        }
    }

    #[inline]
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr - self.base < self.size
    }

    /// Granules overlapping `[ptr, ptr + size)`.
    #[inline]
    pub fn granules(&self, ptr: u64, size: u64) -> RangeInclusive<usize> {
        let first = (ptr - self.base) / self.granule;
        let last = (ptr + size - 1 - self.base) / self.granule;
        first as usize..=last as usize
    }

    #[inline]
    pub fn address(&self, g: usize) -> u64 {
        self.base + g as u64 * self.granule
    }

    #[inline]
    fn is_mapped(&self, g: usize) -> bool {
        self.chunk_at[g] != NO_CHUNK
    }

    /// Granules of physical memory held: mapped and idle.
    pub fn held(&self) -> u64 {
        self.mapped + self.idle_granules
    }

    pub fn idle_granules(&self) -> u64 {
        self.idle_granules
    }

    /// Granules of mapped chunks none of whose granules is in use (Note [arena chunks]).
    pub fn stealable_granules(&self) -> u64 {
        self.stealable_granules
    }

    /// Granules no block in use touches, in mapped chunks another granule of which is in
    /// use (or that were exported): free, but they cannot move while the chunk is busy.
    pub fn granules_free_in_busy_chunks(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|c| c.handle != 0 && c.at != NO_CHUNK && c.busy > 0)
            .map(|c| {
                (c.at..c.at + c.len)
                    .filter(|&g| self.pins[g as usize] == 0)
                    .count() as u64
            })
            .sum()
    }

    pub fn granule_count(&self) -> usize {
        self.chunk_at.len()
    }

    pub fn pin_one(&mut self, g: usize) {
        if self.pins[g] == 0 && self.is_mapped(g) {
            let id = self.chunk_at[g];
            self.add_busy(id);
        }
        self.pins[g] += 1;
    }

    pub fn unpin_one(&mut self, g: usize) {
        debug_assert!(self.pins[g] > 0, "granule {g} unpinned below zero");
        self.pins[g] -= 1;
        if self.pins[g] == 0 && self.is_mapped(g) {
            let id = self.chunk_at[g];
            self.drop_busy(id);
        }
    }

    pub fn pin(&mut self, ptr: u64, size: u64) {
        for g in self.granules(ptr, size) {
            self.pin_one(g);
        }
    }

    pub fn unpin(&mut self, ptr: u64, size: u64) {
        for g in self.granules(ptr, size) {
            self.unpin_one(g);
        }
    }

    /// A block outside the shared index was split at `at`: the granule holding the
    /// boundary now overlaps two such blocks.
    pub fn split_at(&mut self, at: u64) {
        if (at - self.base) % self.granule != 0 {
            let g = ((at - self.base) / self.granule) as usize;
            self.pin_one(g);
        }
    }

    /// Two blocks outside the shared index that meet at `at` became one: the inverse of
    /// [`Arena::split_at`].
    pub fn merge_at(&mut self, at: u64) {
        if (at - self.base) % self.granule != 0 {
            let g = ((at - self.base) / self.granule) as usize;
            self.unpin_one(g);
        }
    }

    /// Unmapped granules under `[ptr, ptr + size)`, ascending.
    pub fn unmapped(&self, ptr: u64, size: u64) -> Vec<usize> {
        self.granules(ptr, size)
            .filter(|&g| !self.is_mapped(g))
            .collect()
    }

    pub fn unmapped_count(&self, ptr: u64, size: u64) -> u64 {
        self.granules(ptr, size)
            .filter(|&g| !self.is_mapped(g))
            .count() as u64
    }

    pub fn all_mapped(&self, ptr: u64, size: u64) -> bool {
        self.granules(ptr, size).all(|g| self.is_mapped(g))
    }

    /// Where in the free block `[ptr, ptr + block)` a request of `size` bytes needs the
    /// fewest granules mapped: at its start, at its end, or at a granule boundary between
    /// (Note [arena placement] in `segments.rs`). Returns the unmapped granules and the offset
    /// from `ptr`; ties go to the start, then the end, then the lowest boundary.
    pub fn placement(&self, ptr: u64, block: u64, size: u64) -> (u64, u64) {
        let mut best = (self.unmapped_count(ptr, size), 0);
        if best.0 == 0 || block == size {
            return best;
        }
        let end = block - size;
        let at_end = self.unmapped_count(ptr + end, size);
        if at_end < best.0 {
            best = (at_end, end);
            if at_end == 0 {
                return best;
            }
        }
        let g = self.granule;
        let span = size.div_ceil(g) as usize;
        let first = (ptr - self.base).div_ceil(g) as usize;
        // Past `top` every window is wholly unmapped: no better than the start.
        let last = (((ptr + end - self.base) / g) as usize).min(self.top);
        if first > last {
            return best;
        }
        let unmapped = |k: usize| !self.is_mapped(k) as u64;
        let mut cost: u64 = (first..first + span).map(unmapped).sum();
        for k in first..=last {
            if k > first {
                cost = cost - unmapped(k - 1) + unmapped(k + span - 1);
            }
            if cost < best.0 {
                best = (cost, self.address(k) - ptr);
                if cost == 0 {
                    break;
                }
            }
        }
        best
    }

    /// Bytes of the free shared block `[ptr, ptr + size)` that lie in pinned granules (mapped,
    /// and not releasable while a block outside the shared index touches them). Mostly its
    /// end granules: a granule wholly inside one free shared block has no pin, unless a
    /// block drained by a device wait still holds it (Note [device waits]).
    ///
    /// Only granules below [`Arena::top`] are looked at: a pinned granule is mapped, and
    /// none is mapped from `top` on. The free block at the end of the arena spans the rest
    /// of its reserved range (1 TiB and more), and every statistics read asks about it.
    pub fn pinned_bytes(&self, ptr: u64, size: u64) -> u64 {
        let granules = self.granules(ptr, size);
        (*granules.start()..(*granules.end() + 1).min(self.top))
            .filter(|&g| self.pins[g] > 0)
            .map(|g| {
                let start = self.address(g).max(ptr);
                let end = (self.address(g) + self.granule).min(ptr + size);
                end - start
            })
            .sum()
    }

    /// Checks pins against what the blocks imply (`expected`, one count per granule), and
    /// that the chunks, the stealable and idle sets and the counters agree.
    pub fn check(&self, expected: &[u32]) -> core::result::Result<(), String> {
        let mut mapped = 0;
        for (g, &want) in expected.iter().enumerate().take(self.chunk_at.len()) {
            if self.pins[g] != want {
                return Err(format!(
                    "arena granule {g}: {} pins, blocks imply {want}",
                    self.pins[g]
                ));
            }
            mapped += self.is_mapped(g) as u64;
            if self.pins[g] > 0 && !self.is_mapped(g) {
                return Err(format!("arena granule {g}: in use but not mapped"));
            }
        }
        if mapped != self.mapped {
            return Err(format!(
                "arena: {mapped} granules mapped, counter says {}",
                self.mapped
            ));
        }
        let mut idle = 0;
        let mut stealable = 0;
        for (id, c) in self.chunks.iter().enumerate() {
            let id = id as u32;
            if c.handle == 0 {
                continue;
            }
            if c.at == NO_CHUNK {
                idle += c.len as u64;
                if !self.idle.contains(&(c.len, id)) {
                    return Err(format!("arena chunk {id}: held, unmapped, not idle"));
                }
                continue;
            }
            let range = c.at as usize..(c.at + c.len) as usize;
            if range.clone().any(|g| self.chunk_at[g] != id) {
                return Err(format!("arena chunk {id}: granule table disagrees"));
            }
            let busy = range.filter(|&g| self.pins[g] > 0).count() as u32 + c.exported as u32;
            let listed = self.stealable.contains(&(c.len, id));
            if busy != c.busy || listed != c.listed || (busy == 0 && !listed) {
                return Err(format!(
                    "arena chunk {id}: busy count or stealable set wrong"
                ));
            }
            if busy == 0 {
                stealable += c.len as u64;
            }
        }
        if idle != self.idle_granules {
            return Err(format!(
                "arena: {idle} idle granules, counter says {}",
                self.idle_granules
            ));
        }
        if stealable != self.stealable_granules {
            return Err(format!(
                "arena: {stealable} stealable granules, counter says {}",
                self.stealable_granules
            ));
        }
        if let Some(&(len, id)) = self.stealable.iter().find(|&&(len, id)| {
            let c = &self.chunks[id as usize];
            c.handle == 0 || c.at == NO_CHUNK || c.len != len
        }) {
            return Err(format!(
                "arena: stealable entry ({len}, {id}) of no mapped chunk"
            ));
        }
        Ok(())
    }

    /// The mapped parts of the arena, as (address, bytes) runs of adjacent mapped granules.
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for g in 0..self.top {
            if !self.is_mapped(g) {
                continue;
            }
            let at = self.address(g);
            match runs.last_mut() {
                Some((start, len)) if *start + *len == at => *len += self.granule,
                _ => runs.push((at, self.granule)),
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests;
