//! The slow allocation path: a request that missed the thread cache, fitted from the
//! stream's own frees, the shared index, fenced frees, or a new segment.

use super::block::{BlockIdx, Place, SegmentKind};
use super::counters::ThreadCounters;
use super::fences::Advance;
use super::thread_cache;
use super::{DevicePool, Request, StreamRef, BLOCKS, STREAMLESS};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

/// Streamless allocations served by fencing the calling thread's own kept blocks, since
/// its kept blocks last served it, after which it gets a segment (Note [room beside
/// stranded blocks]).
const ROOM_AFTER_OWN_FENCES: u64 = 4;

impl DevicePool {
    /// Allocates a block that missed the thread cache. `flush_own_cache` gives the calling
    /// thread's cached blocks of this pool back; it is called before the pool grows and
    /// before the out-of-memory retry, so blocks the thread holds are not left out, and
    /// returns whether some of them went to the fence queue. `keeps_streamless`: the
    /// calling thread keeps blocks of this size that it frees without a stream (Note
    /// [thread fences]).
    pub fn alloc_slow(
        &self,
        c: &ThreadCounters,
        size: u64,
        requested: u64,
        stream: Option<StreamRef>,
        keeps_streamless: bool,
        flush_own_cache: &mut dyn FnMut() -> bool,
    ) -> Result<u64> {
        let own_fence_streak = if keeps_streamless {
            c.own_fence_streak()
        } else {
            0
        };
        // Note [parked arena blocks]: every fit below sees the parked blocks, merged with
        // their neighbours as at their free.
        self.file_all_parked();
        let req = Request {
            size,
            requested,
            kind: Self::kind_for(size),
            stream,
        };
        if req.kind == SegmentKind::Large && self.vmm.load(Ordering::Relaxed) {
            self.ensure_arena();
        }
        // Note [remap last]: in the VMM arena a large request always "fits" its unmapped
        // tail, so a first fit that needs granules mapped would remap (tens of µs per
        // driver call on a GPU) while frees waiting for a fence could serve it as they
        // are. Fits that need no mapping come first: before and after a fence pass and
        // after this thread's cache is flushed. Then a fit that maps memory the arena
        // already holds (idle or stealable chunks), then the wait for fences, then new
        // memory. Waiting before remapping stalled the CPU until the device caught up:
        // on the GPU, step time 1.26× PyTorch's against 1.15× with the remap first
        // (docs/BENCHMARKS.md).
        // Note [poll before fitting]: in the VMM arena, a large request fitted while
        // blocks freed without a stream still wait for their fence lands in another hole
        // (any mapped window fits), and the next request of the old size then needs memory
        // moved. When those frees could cover the request, their fences are polled first
        // (one event query; they are usually done), so the request can reuse their place.
        // Host replays, `vmm:on`, map + unmap calls: `gpt_train.cupool` 2017 + 1304 to
        // 1190 + 490 (94.9% to 97.4%), `conv_train.cupool` 1137 + 788 to 421 + 95
        // (docs/BENCHMARKS.md).
        if req.kind == SegmentKind::Large && self.streamless_frees_pending(size) {
            self.advance(Advance::Poll);
        }
        if let Some(ptr) = self.try_fit(c, req, false) {
            return Ok(ptr);
        }
        if self.may_order() {
            if self.spare_due(req) {
                // On failure (limit, driver OOM) the fence below serves the request, and
                // the streak starts again: no release-and-retry for a copy nobody needs.
                if let Ok(ptr) = self.grow(c, req) {
                    self.shared.lock().slow.misses += 1;
                    return Ok(ptr);
                }
            }
            let moved = self.advance(Advance::Poll);
            let fitted = if moved > 0 {
                self.try_fit(c, req, false)
            } else {
                None
            };
            self.note_fence_pass(req, moved, fitted.is_some());
            if let Some(ptr) = fitted {
                return Ok(ptr);
            }
        }
        if own_fence_streak >= ROOM_AFTER_OWN_FENCES && self.room_beside_stranded(c) {
            if let Ok(ptr) = self.grow(c, req) {
                self.shared.lock().slow.misses += 1;
                c.set_own_fence_streak(0);
                return Ok(ptr);
            }
        }
        // Blocks this thread's cache holds are invisible to the search above (the cache
        // is searched by the request's class only): give them back before growing.
        let fenced_flush = flush_own_cache();
        let stealable = req.kind == SegmentKind::Large && self.arena_active();
        if (stealable || fenced_flush) && self.may_order() {
            // Note [vmm arena]: the flushed blocks' granules can be stolen once fenced; and
            // the small blocks the thread kept after freeing them without a stream (Note
            // [thread fences]) merge with their neighbours once fenced: without this pass
            // a small request grew a segment beside them (`streamless_behind`, 95.14% →
            // 94.77% with `thread_cache_streamless`).
            self.advance(Advance::Poll);
        }
        if let Some(ptr) = self.try_fit(c, req, false) {
            if keeps_streamless && fenced_flush {
                c.set_own_fence_streak(own_fence_streak + 1);
            }
            return Ok(ptr);
        }
        if req.kind == SegmentKind::Large && self.arena_active() {
            // Note [remap last]: memory the arena holds, moved by a few driver calls (Note
            // [arena chunks]), before a wait for the device to catch up.
            if let Some(ptr) = self.try_fit(c, req, true) {
                return Ok(ptr);
            }
        }
        if let Some(ptr) = self.wait_before_growing(c, req) {
            return Ok(ptr);
        }
        if let Some(ptr) = self.try_fit(c, req, true) {
            return Ok(ptr);
        }
        self.shared.lock().slow.misses += 1;
        self.release_above_bound(c, size, flush_own_cache);
        match self.grow(c, req) {
            Ok(ptr) => return Ok(ptr),
            Err(CupoolStatus::CupoolErrorOutOfMemory) => {}
            Err(e) => return Err(e),
        }
        // Out of memory: give back what the pool can, then try once more.
        self.shared.lock().slow.retries += 1;
        crate::log::info(&format!(
            "cupool: device {} out of memory for {size} bytes; waiting for pending frees and releasing cached memory",
            self.ctx.device
        ));
        flush_own_cache();
        // Other threads give theirs back at their next call.
        thread_cache::request_flush_all();
        if self.may_order() {
            self.advance(Advance::Wait);
            if let Some(ptr) = self.try_fit(c, req, true) {
                return Ok(ptr);
            }
            self.release_idle_segments(c);
            if req.kind == SegmentKind::Large && self.vmm.load(Ordering::Relaxed) {
                // The release may have given the whole arena back: a large block still
                // comes from one (a new reservation), not from a plain segment.
                self.ensure_arena();
            }
        }
        let result = self.grow(c, req);
        if result == Err(CupoolStatus::CupoolErrorOutOfMemory) {
            self.shared.lock().slow.ooms += 1;
            crate::log::info(&format!(
                "cupool: device {} out of memory: {size} bytes requested",
                self.ctx.device
            ));
        }
        result
    }

    /// Takes memory from the driver for the request ([`DevicePool::grow_and_carve`]) and,
    /// when that leaves reserved bytes higher than ever, keeps where they are (Note
    /// [footprint at peak]).
    fn grow(&self, c: &ThreadCounters, req: Request) -> Result<u64> {
        let result = self.grow_and_carve(c, req);
        if result.is_ok() {
            self.watch_peak_footprint();
        }
        result
    }

    /// Whether blocks freed without a stream, waiting for their fence, add up to `size`
    /// bytes in a pool with a VMM arena (Note [poll before fitting]).
    fn streamless_frees_pending(&self, size: u64) -> bool {
        if !self.arena_active() || !self.may_order() {
            return false;
        }
        self.shared.lock().fence_queue.bytes >= size
    }

    /// Whether a streamless request of a thread that keeps blocks of its size (so a small
    /// block: `keeps_streamless` in [`DevicePool::alloc_slow`]) should get a new segment
    /// rather than this thread's own kept blocks back through a fence: Note [room beside
    /// stranded blocks].
    ///
    /// Note [room beside stranded blocks]: a thread keeps up to 2 MiB of its streamless
    /// frees (Note [thread fences]) and only it can take them back. A thread that stops
    /// allocating (it waits on a join, sleeps, or does other work) leaves what it kept where
    /// no other thread can reach it. When the pool was full otherwise, the next thread's
    /// streamless loop found no room, gave its one or two kept blocks back to the pool
    /// before growing, and got them back through a context fence: one fence a pair, where
    /// it needs one for every batch. A main thread that ran 20 000 streamless pairs with 10
    /// blocks live, then a new thread's 64 KiB pairs, on the host backend: 300 ns and 1.0
    /// fence a pair, against 45 ns and 0.125 without the main thread's loop (on an H200,
    /// with two free places, the loop alternated: one place, then a fence, 0.5 a pair). So
    /// once [`ROOM_AFTER_OWN_FENCES`] streamless allocations were served by fencing its own
    /// blocks since its kept blocks last served it, a thread that holds less than a
    /// closable batch, while other threads hold at least that much, gets a small segment
    /// instead: the room those threads keep, given to this one, which the per-thread bound
    /// on kept bytes allows already.
    ///
    /// Why the count: granted at the first such allocation, the room was also given to
    /// threads that found the pool full for a moment (8 threads at a time, each freeing
    /// six blocks of random sizes and exiting, `tests/pool_threads.rs`), where fencing what
    /// others had given back would have served them: the pool grew from 8-10 MiB to 16-36
    /// MiB over 10 000 threads instead of staying there (6-14 MiB with the count). Counted
    /// only in a row, it never fired on the H200's alternating loop. A thread alone never
    /// meets the condition, so one thread's footprint (every replay, also `--per-thread`)
    /// is unchanged. Measured on an H200 in docs/BENCHMARKS.md (twentieth session). Not
    /// while `release_above_percent` is set (Note [release bound]): that pool gives idle
    /// memory back before it grows, which this path would skip.
    fn room_beside_stranded(&self, c: &ThreadCounters) -> bool {
        if self.release_bound().is_some() {
            return false;
        }
        let closable = thread_cache::KEPT_CLOSABLE_BYTES as i64;
        let own = c.kept_held();
        own < closable && thread_cache::kept_held_sum(self.index) - own >= closable
    }

    /// Takes a fitting free block the caller may use, from its stream's own frees first,
    /// then from the shared index. With `remap` false, a block of the VMM arena that is not
    /// wholly mapped is left where it is (Note [remap last]).
    pub(super) fn try_fit(&self, c: &ThreadCounters, req: Request, remap: bool) -> Option<u64> {
        let Request { size, kind, .. } = req;
        let mut sh = self.shared.lock();
        // SAFETY: pool lock held for every record touched below.
        unsafe {
            // The stream's own block unless the shared index has a smaller fit that needs
            // no mapping: in the VMM arena a smaller shared fit may lie over unmapped
            // granules, while the stream's own frees are always mapped (pinned).
            let own_pos = req.stream.and_then(|s| sh.stream_pos.get(&s.id).copied());
            let own = own_pos.and_then(|pos| sh.streams[pos].index(kind).find(&BLOCKS, size));
            if let (Some(pos), Some(own)) = (own_pos, own) {
                let shared = sh.index(kind).find(&BLOCKS, size);
                let size_of = |i: BlockIdx| BLOCKS.get(i).data().size;
                if shared.is_some_and(|g| size_of(g) < size_of(own)) {
                    let (idx, mapped) = self.take_shared(&mut sh, req)?;
                    if mapped {
                        drop(sh);
                        return Some(self.hand_out(c, idx, req));
                    }
                    self.insert_shared(&mut sh, idx);
                }
                let st = &mut sh.streams[pos];
                st.index(kind).remove(&BLOCKS, own);
                BLOCKS.get(own).set_place(Place::Allocated);
                match self.split(&mut sh, own, size, kind, Place::FreeOnStream, true) {
                    Some(rest) => {
                        let st = &mut sh.streams[pos];
                        st.age.replace(&BLOCKS, own, rest);
                        st.index(kind).insert(&BLOCKS, rest);
                    }
                    None => sh.streams[pos].age.remove(&BLOCKS, own),
                }
                drop(sh);
                return Some(self.hand_out(c, own, req));
            }
            let (idx, mapped) = self.take_shared(&mut sh, req)?;
            if !mapped && !remap {
                self.insert_shared(&mut sh, idx);
                return None;
            }
            drop(sh);
            if !mapped {
                return self.map_or_put_back(c, idx, req, false).ok();
            }
            Some(self.hand_out(c, idx, req))
        }
    }

    /// Maps the granules under the arena block `idx` (taken and pinned by the caller) and
    /// hands it out; when that fails, puts the block back in the shared index.
    pub(super) fn map_or_put_back(
        &self,
        c: &ThreadCounters,
        idx: BlockIdx,
        req: Request,
        may_create: bool,
    ) -> Result<u64> {
        match self.map_arena_block(c, idx, may_create) {
            Ok(()) => Ok(self.hand_out(c, idx, req)),
            Err(e) => {
                let mut sh = self.shared.lock();
                // SAFETY: pool lock held; the block is ours, in no index.
                unsafe { self.insert_shared(&mut sh, idx) };
                Err(e)
            }
        }
    }

    /// Marks `idx` as handed to the program and does its bookkeeping.
    pub(super) fn hand_out(&self, c: &ThreadCounters, idx: BlockIdx, req: Request) -> u64 {
        let b = BLOCKS.get(idx);
        // SAFETY: the caller took `idx` out of every list; nobody else refers to it.
        b.set_place(Place::Allocated);
        let d = unsafe { b.data() };
        d.requested = req.requested;
        d.stream = req.stream.map_or(STREAMLESS, |s| s.id);
        d.handle = req.stream.map_or(0, |s| s.handle as u64);
        let (ptr, size) = (d.ptr, d.size);
        self.note_allocated(c, size, req.requested);
        b.publish_allocated(ptr);
        ptr
    }
}
