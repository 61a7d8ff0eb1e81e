//! Bookkeeping of the VMM arena: one reserved virtual address range per pool that large
//! blocks are carved from, which of its granules are backed by physical memory, and in
//! which chunks that memory was created. No driver calls here: `vmm.rs` makes them.
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
//! Note [chunks]: physical memory is created in **chunks** of one or more adjacent granules
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
//!
//! Note [exported chunks]: a block exported through CUDA IPC is mapped by its importer from
//! the chunks under it, which the importer reaches through their file descriptors (Note
//! [exportable memory] in the CUDA backend). Those chunks keep one extra busy count for
//! good: never stolen, re-cut or released, so that a descriptor handed out always names
//! the memory it named, as exported segments are kept (Note [exported segments]).

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
    /// (Note [placement] in `segments.rs`). Returns the unmapped granules and the offset
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
    /// and not releasable while a block outside the shared index touches them). Only its
    /// end granules can be pinned: a granule wholly inside one free shared block has no pin.
    pub fn pinned_ends(&self, ptr: u64, size: u64) -> u64 {
        let r = self.granules(ptr, size);
        let (first, last) = (*r.start(), *r.end());
        let overlap = |g: usize| {
            let start = self.address(g).max(ptr);
            let end = (self.address(g) + self.granule).min(ptr + size);
            end - start
        };
        let mut bytes = 0;
        if self.pins[first] > 0 {
            bytes += overlap(first);
        }
        if last != first && self.pins[last] > 0 {
            bytes += overlap(last);
        }
        bytes
    }

    fn take_set(&mut self, stolen: bool, key: (u32, u32)) -> Taken {
        let set = if stolen {
            &mut self.stealable
        } else {
            &mut self.idle
        };
        let removed = set.remove(&key);
        debug_assert!(removed);
        let (len, id) = key;
        if stolen {
            self.chunks[id as usize].listed = false;
            self.stealable_granules -= len as u64;
        }
        let c = self.chunks[id as usize];
        let was_at = if stolen {
            for g in c.at as usize..(c.at + c.len) as usize {
                self.chunk_at[g] = NO_CHUNK;
            }
            self.mapped -= len as u64;
            Some(c.at as usize)
        } else {
            self.idle_granules -= len as u64;
            None
        };
        self.chunks[id as usize].at = NO_CHUNK;
        Taken {
            id,
            handle: c.handle,
            len,
            was_at,
        }
    }

    /// The largest chunk of `set` of at most `len` granules.
    fn largest_up_to(set: &BTreeSet<(u32, u32)>, len: u32) -> Option<(u32, u32)> {
        set.range(..(len, u32::MAX)).next_back().copied()
    }

    /// The smallest chunk of `set` of more than `len` granules.
    fn smallest_above(set: &BTreeSet<(u32, u32)>, len: u32) -> Option<(u32, u32)> {
        set.range((len + 1, 0)..).next().copied()
    }

    /// Plans how to back the run of `len` unmapped granules from `at` (Note [chunks]):
    /// idle chunks that fit, stolen chunks that fit, a larger chunk re-cut, then (with
    /// `create` granules allowed) new memory. Chunks used are taken out of the bookkeeping
    /// at once (the caller gives each back with [`Arena::record_mapped`] or
    /// [`Arena::record_idle`]); `create` is lowered by what is planned. Returns `None`, with
    /// nothing taken, when the run cannot be backed.
    /// `max_chunk` is the most granules one new chunk gets.
    pub fn plan_run(
        &mut self,
        at: usize,
        len: usize,
        create: &mut u64,
        max_chunk: u32,
    ) -> Option<Vec<Step>> {
        let mut steps = Vec::new();
        let mut pos = at;
        let end = at + len;
        // Nothing is taken unless the whole run can be backed.
        if len as u64 > (self.idle_granules + self.stealable_granules).saturating_add(*create) {
            return None;
        }
        while pos < end {
            let want = (end - pos).min(u32::MAX as usize) as u32;
            let step = if let Some(k) = Self::largest_up_to(&self.idle, want) {
                Step::Map {
                    chunk: self.take_set(false, k),
                    at: pos,
                }
            } else if let Some(k) = self.stealable_up_to(want) {
                Step::Map {
                    chunk: self.take_set(true, k),
                    at: pos,
                }
            } else if let Some(k) = Self::smallest_above(&self.idle, want) {
                Step::Recut {
                    chunk: self.take_set(false, k),
                    len: want,
                    at: pos,
                }
            } else if let Some(k) = self.stealable_above(want) {
                Step::Recut {
                    chunk: self.take_set(true, k),
                    len: want,
                    at: pos,
                }
            } else {
                let len = want.min(max_chunk.max(1));
                // Checked above: what idle and stealable chunks do not cover fits `create`.
                *create -= len as u64;
                Step::Create { len, at: pos }
            };
            pos += match step {
                Step::Map { chunk, .. } => chunk.len as usize,
                Step::Recut { len, .. } | Step::Create { len, .. } => len as usize,
            };
            steps.push(step);
        }
        Some(steps)
    }

    /// Records a chunk (taken, or new with `id` from [`Arena::new_chunk`]) as mapped at `at`.
    pub fn record_mapped(&mut self, id: u32, at: usize) {
        let len = self.chunks[id as usize].len;
        let mut busy = 0;
        for g in at..at + len as usize {
            debug_assert_eq!(self.chunk_at[g], NO_CHUNK, "granule {g} mapped twice");
            self.chunk_at[g] = id;
            busy += (self.pins[g] > 0) as u32;
        }
        let c = &mut self.chunks[id as usize];
        c.at = at as u32;
        c.busy = busy;
        if busy == 0 {
            self.list_stealable(id);
        }
        self.mapped += len as u64;
        self.mapped_peak = self.mapped_peak.max(self.mapped);
        self.top = self.top.max(at + len as usize);
    }

    /// Records a chunk (taken, or new) as held but mapped nowhere.
    pub fn record_idle(&mut self, id: u32) {
        let c = &mut self.chunks[id as usize];
        c.at = NO_CHUNK;
        c.busy = 0;
        self.idle.insert((c.len, id));
        self.idle_granules += c.len as u64;
    }

    pub fn chunk_len(&self, id: u32) -> u32 {
        self.chunks[id as usize].len
    }

    /// Chunks mapped now, and chunks held (mapped or idle): one driver mapping and one
    /// driver handle each.
    pub fn chunk_counts(&self) -> (u64, u64) {
        let held = self.chunks.iter().filter(|c| c.handle != 0);
        let mapped = held.clone().filter(|c| c.at != NO_CHUNK).count() as u64;
        (mapped, held.count() as u64)
    }

    /// A new chunk record for `handle` of `len` granules (neither mapped nor idle yet).
    pub fn new_chunk(&mut self, handle: u64, len: u32) -> u32 {
        let c = Chunk {
            handle,
            len,
            at: NO_CHUNK,
            busy: 0,
            exported: false,
            shared_fd: -1,
            listed: false,
        };
        match self.unused_ids.pop() {
            Some(id) => {
                self.chunks[id as usize] = c;
                id
            }
            None => {
                self.chunks.push(c);
                (self.chunks.len() - 1) as u32
            }
        }
    }

    /// Forgets a taken chunk whose memory was released.
    pub fn drop_chunk(&mut self, id: u32) {
        self.chunks[id as usize].handle = 0;
        self.unused_ids.push(id);
    }

    /// Takes every stealable and idle chunk, for release.
    pub fn take_all_unused(&mut self) -> Vec<Taken> {
        self.take_unused(u64::MAX)
    }

    /// As [`Arena::take_all_unused`], but only chunks totalling at most `max_granules`
    /// (a chunk that would pass it is left where it is): what a release may take when the
    /// pool keeps a reserve.
    pub fn take_unused(&mut self, max_granules: u64) -> Vec<Taken> {
        let mut out = Vec::new();
        let mut left = max_granules;
        self.purge_stale_stealable();
        for stolen in [true, false] {
            let set = if stolen { &self.stealable } else { &self.idle };
            let cap = left.min(u32::MAX as u64) as u32;
            let fitting: Vec<(u32, u32)> = set.range(..=(cap, u32::MAX)).copied().collect();
            // Smallest first: each taken chunk lowers what the next may be.
            for k in fitting {
                if k.0 as u64 > left {
                    break;
                }
                left -= k.0 as u64;
                out.push(self.take_set(stolen, k));
            }
        }
        out
    }

    /// Marks every chunk under `[ptr, ptr + size)` (all mapped: a live block) exported,
    /// so that it stays where it is for good (Note [exported chunks]). Returns the address
    /// of the first chunk, and each chunk's id, handle, bytes and the descriptor it was
    /// exported as before (-1: not yet), in address order.
    pub fn export(&mut self, ptr: u64, size: u64) -> Option<(u64, Vec<ExportedChunk>)> {
        let mut out: Vec<ExportedChunk> = Vec::new();
        let mut first = None;
        let granules = self.granules(ptr, size);
        let mut g = *granules.start();
        while g <= *granules.end() {
            let id = self.chunk_at[g];
            if id == NO_CHUNK {
                return None;
            }
            if !self.chunks[id as usize].exported {
                // The extra count keeps the chunk busy for good: never stealable again.
                self.chunks[id as usize].exported = true;
                self.add_busy(id);
            }
            let c = &self.chunks[id as usize];
            first.get_or_insert(c.at as usize);
            out.push(ExportedChunk {
                id,
                handle: c.handle,
                bytes: c.len as u64 * self.granule,
                fd: c.shared_fd,
            });
            g = (c.at + c.len) as usize;
        }
        Some((self.address(first?), out))
    }

    /// Records the descriptor an exported chunk was exported as; false when it already
    /// had one (the caller closes the new one and uses [`Arena::shared_fd`]).
    pub fn set_shared_fd(&mut self, id: u32, fd: i32) -> bool {
        let c = &mut self.chunks[id as usize];
        debug_assert!(c.exported);
        if c.shared_fd >= 0 {
            return false;
        }
        c.shared_fd = fd;
        true
    }

    pub fn shared_fd(&self, id: u32) -> i32 {
        self.chunks[id as usize].shared_fd
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
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    fn arena() -> Arena {
        Arena::new(G * 10, 64 * G, G)
    }

    /// Backs `len` granules from `at` with one new chunk, as a map call would.
    fn map_new(a: &mut Arena, at: usize, len: u32, handle: u64) -> u32 {
        let id = a.new_chunk(handle, len);
        a.record_mapped(id, at);
        id
    }

    #[test]
    fn a_chunk_is_stealable_only_when_no_granule_is_pinned() {
        let mut a = arena();
        // A 5 MiB block over granules 0..=2, backed by one chunk.
        a.pin(a.base, 5 << 20);
        map_new(&mut a, 0, 3, 1);
        assert_eq!((a.mapped, a.held()), (3, 3));
        // Its neighbour shares granule 2, then the first block goes back.
        a.pin(a.base + (5 << 20), 1 << 20);
        a.unpin(a.base, 5 << 20);
        let mut create = 0;
        assert_eq!(
            a.plan_run(10, 3, &mut create, 4),
            None,
            "granule 2 is still pinned"
        );
        a.unpin(a.base + (5 << 20), 1 << 20);
        let steps = a
            .plan_run(10, 3, &mut create, 4)
            .expect("the chunk is free now");
        assert_eq!(steps.len(), 1);
        let Step::Map { chunk, at: 10 } = steps[0] else {
            panic!("{steps:?}");
        };
        assert_eq!((chunk.len, chunk.was_at), (3, Some(0)));
        assert_eq!(
            a.mapped, 0,
            "taken out of the books until the calls are made"
        );
        a.record_mapped(chunk.id, 10);
        a.check(&[0; 64]).unwrap();
    }

    #[test]
    fn runs_take_idle_then_stolen_then_recut_then_new_memory() {
        let mut a = arena();
        let idle = a.new_chunk(7, 2);
        a.record_idle(idle);
        map_new(&mut a, 0, 4, 8); // stealable: nothing pinned
                                  // 3 granules: the idle pair, then the 4-granule chunk is too big: re-cut to 1.
        let mut create = 0;
        let steps = a.plan_run(20, 3, &mut create, 4).unwrap();
        assert!(matches!(steps[0], Step::Map { chunk, at: 20 } if chunk.id == idle));
        assert!(
            matches!(steps[1], Step::Recut { chunk, len: 1, at: 22 } if chunk.was_at == Some(0)),
            "{steps:?}"
        );
        assert_eq!(a.held(), 0);
        // Nothing left to move: new memory, in chunks of at most `max_chunk`, within
        // `create`.
        let mut create = 5;
        assert_eq!(
            a.plan_run(30, 6, &mut create, 4),
            None,
            "over what may be created"
        );
        assert_eq!(create, 5, "nothing planned on failure");
        let mut create = 6;
        let steps = a.plan_run(30, 6, &mut create, 4).unwrap();
        assert_eq!(
            steps,
            vec![
                Step::Create { len: 4, at: 30 },
                Step::Create { len: 2, at: 34 }
            ]
        );
        assert_eq!(create, 0);
    }

    #[test]
    fn take_unused_stays_within_its_bound() {
        let mut a = arena();
        map_new(&mut a, 0, 4, 1); // stealable, 4 granules
        let idle = a.new_chunk(2, 3);
        a.record_idle(idle);
        let small = a.new_chunk(3, 1);
        a.record_idle(small);
        let taken = a.take_unused(4);
        let lens: Vec<u32> = taken.iter().map(|t| t.len).collect();
        assert_eq!(
            lens,
            vec![4],
            "the stealable chunk fills the bound; the idle ones stay"
        );
        assert_eq!(a.idle_granules(), 4);
        assert_eq!(
            a.take_unused(u64::MAX).len(),
            2,
            "no bound: everything unused"
        );
    }

    #[test]
    fn placement_prefers_mapped_windows_start_then_end() {
        let mut a = arena();
        // A free block over granules 0..8 whose granules 5..=7 are mapped.
        map_new(&mut a, 5, 3, 1);
        let block = 8 * G;
        assert_eq!(
            a.placement(a.base, block, 2 * G),
            (0, 6 * G),
            "the end before inside"
        );
        assert_eq!(
            a.placement(a.base, block, 3 * G),
            (0, 5 * G),
            "the block's end"
        );
        assert_eq!(
            a.placement(a.base, 10 * G, 2 * G),
            (0, 5 * G),
            "a window inside"
        );
        // Nothing mapped fits 4 granules: the window with the most mapped ones.
        assert_eq!(a.placement(a.base, block, 4 * G), (1, 4 * G));
        map_new(&mut a, 0, 2, 2);
        assert_eq!(
            a.placement(a.base, block, 2 * G),
            (0, 0),
            "the start wins ties"
        );
        // Unaligned: a block starting half way into granule 0.
        let p = a.base + G / 2;
        assert_eq!(a.placement(p, block - G, G), (0, 0));
        assert_eq!(a.unmapped(p, 3 * G), vec![2, 3]);
    }

    #[test]
    fn take_all_unused_leaves_only_pinned_memory() {
        let mut a = arena();
        a.pin(a.base, G);
        map_new(&mut a, 0, 2, 1); // pinned by the block on granule 0
        map_new(&mut a, 4, 2, 2); // free
        let idle = a.new_chunk(3, 1);
        a.record_idle(idle);
        let taken = a.take_all_unused();
        assert_eq!(taken.len(), 2);
        assert_eq!((a.mapped, a.held()), (2, 2));
        for t in taken {
            a.drop_chunk(t.id);
        }
        let mut expected = vec![0; 64];
        expected[0] = 1;
        a.check(&expected).unwrap();
        assert_eq!(a.chunk_counts(), (1, 1));
        assert_eq!(a.mapped_runs(), vec![(a.base, 2 * G)]);
    }
}
