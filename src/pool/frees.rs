//! Frees: a block given back on its stream (reusable by that stream at once) or without
//! one (reusable once a context fence covers it).

use super::block::{BlockIdx, Place, NIL};
use super::fence_clock::{Fence, FenceRecorder, Urge};
use super::fence_times::FenceCall;
use super::fences::Advance;
use super::{DevicePool, Shared, StreamRef, BACKEND_OFF, BLOCKS, STREAMLESS};
use crate::backend::EventHandle;
use crate::config::{self, Key};
use core::sync::atomic::Ordering;

impl DevicePool {
    /// A block freed on stream `s` (directly or flushed from a thread cache): `s` may take
    /// it at once, other streams once a context fence recorded after now completes.
    ///
    /// # Safety
    /// The caller owns every block in `blocks` (taken back from the program or from its
    /// thread cache), all of this pool.
    pub unsafe fn free_to_stream(&self, s: StreamRef, blocks: &[BlockIdx]) {
        // SAFETY: the caller's contract.
        unsafe { self.file_on_stream(s, blocks, None) }
    }

    /// [`DevicePool::free_to_stream`] for blocks freed when the clock read `freed_at`
    /// (parked blocks, Note [parked arena blocks]), or now (`None`). An older stamp is
    /// raised to the newest of the stream's age list: stamps grow along it, and the
    /// merged block's stamp must cover the stream's own neighbours it absorbs.
    ///
    /// # Safety
    /// As [`DevicePool::free_to_stream`].
    pub(super) unsafe fn file_on_stream(
        &self,
        s: StreamRef,
        blocks: &[BlockIdx],
        freed_at: Option<u64>,
    ) {
        let mut sh = self.shared.lock();
        let now = sh.clock;
        // Its free lists exist from here on (`sh.stream` below): its blocks may be parked.
        self.parked.note_stream(s.id);
        for &idx in blocks {
            let stamp = match freed_at {
                None => now,
                Some(e) => {
                    let newest = sh
                        .stream(s)
                        .age
                        .back()
                        .map_or(0, |t| BLOCKS.links(t).free_epoch);
                    e.max(newest).min(now)
                }
            };
            BLOCKS.get(idx).set_place(Place::FreeOnStream);
            let d = BLOCKS.get(idx).data();
            d.stream = s.id;
            d.requested = 0;
            BLOCKS.links(idx).free_epoch = stamp;
            let idx = self.merge_on_stream(&mut sh, s, idx);
            let kind = BLOCKS.get(idx).data().kind;
            let st = sh.stream(s);
            st.index(kind).insert(&BLOCKS, idx);
            st.age.push_back(&BLOCKS, idx);
        }
    }

    /// Merges a block just freed on stream `s` (in no list yet) with its free neighbours
    /// that `s` may use: blocks freed on `s` itself and shared ones. The result belongs to
    /// `s` until a fence covers it (its stamp is the newest), like any block freed on `s`.
    ///
    /// Note [merge on free]: without it, a segment freed piece by piece on a stream stays
    /// in pieces until the next fence drains them into the shared index, and a request
    /// as large as the segment misses and grows the pool while the memory sits there.
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index or FIFO).
    unsafe fn merge_on_stream(&self, sh: &mut Shared, s: StreamRef, idx: BlockIdx) -> BlockIdx {
        let mut idx = idx;
        let kind = BLOCKS.get(idx).data().kind;
        // A shared free block of the VMM arena may lie over unmapped granules, which a
        // block outside the shared index must never do (Note [vmm arena]): only the
        // stream's own pieces merge there.
        let arena = sh.arena.as_ref().map(|a| (a.base, a.size));
        let in_arena = |p: u64| arena.is_some_and(|(base, size)| p >= base && p - base < size);
        // Note [place is atomic]: the neighbour's place first; its other fields only once
        // it is known to be the pool's (free).
        let mergeable = |n: BlockIdx| {
            n != NIL && {
                match BLOCKS.get(n).place() {
                    Place::FreeShared => !in_arena(BLOCKS.get(n).data().ptr),
                    Place::FreeOnStream => BLOCKS.get(n).data().stream == s.id,
                    _ => false,
                }
            }
        };
        // Takes neighbour `n` out of its list before it merges into a block outside the
        // shared index that it meets at `junction`; in the VMM arena a shared neighbour's
        // granules become pinned, and the junction granule is counted once (Note [vmm
        // arena]).
        let take = |sh: &mut Shared, n: BlockIdx, junction: u64| {
            let shared = BLOCKS.get(n).place() == Place::FreeShared;
            // Copied out, not a reference held across the removals: they take `n`'s record
            // mutably themselves, and a `&mut BlockData` kept over that is invalidated
            // (undefined behaviour; Miri, Stacked Borrows, in `pool_host`).
            let (n_ptr, n_size) = {
                let nd = BLOCKS.get(n).data();
                (nd.ptr, nd.size)
            };
            if shared {
                sh.index(kind).remove(&BLOCKS, n);
            } else {
                let st = sh.stream(s);
                st.index(kind).remove(&BLOCKS, n);
                st.age.remove(&BLOCKS, n);
            }
            if let Some(a) = sh.arena.as_mut().filter(|a| a.contains(n_ptr)) {
                if shared {
                    a.pin(n_ptr, n_size);
                }
                a.merge_at(junction);
            }
        };
        let prev = BLOCKS.links(idx).seg_prev;
        if mergeable(prev) {
            take(sh, prev, BLOCKS.get(idx).data().ptr);
            let epoch = BLOCKS.links(idx).free_epoch;
            Self::absorb_next(sh, prev);
            BLOCKS.get(prev).set_place(Place::FreeOnStream);
            BLOCKS.get(prev).data().stream = s.id;
            BLOCKS.links(prev).free_epoch = epoch;
            idx = prev;
        }
        let next = BLOCKS.links(idx).seg_next;
        if mergeable(next) {
            take(sh, next, BLOCKS.get(next).data().ptr);
            Self::absorb_next(sh, idx);
        }
        idx
    }

    /// A block freed without a stream, or on a stream other than its own: reused only
    /// after a context fence recorded after now has completed.
    ///
    /// # Safety
    /// The caller owns `idx` (taken back from the program).
    pub unsafe fn free_to_fence(&self, idx: BlockIdx, cross_stream: bool) {
        let seal = {
            let mut sh = self.shared.lock();
            BLOCKS.get(idx).set_place(Place::AwaitingFence);
            BLOCKS.get(idx).data().requested = 0;
            BLOCKS.links(idx).free_epoch = sh.clock;
            sh.fence_queue.push_back(&BLOCKS, idx);
            sh.unsealed_fence_blocks += 1;
            if cross_stream {
                sh.slow.cross_stream += 1;
            }
            sh.unsealed_fence_blocks >= config::get(Key::FenceBatch).max(1)
        };
        if seal && self.may_order() {
            // Batch full: record one fence for all of them now, so they are reusable by the
            // time the next miss looks (recording costs ~0.2 µs; no wait).
            if let Ok(_ev) = self.events.try_lock() {
                self.reporting_stalls("sealing a batch of frees", || self.seal(Advance::Poll));
            }
        }
    }

    /// The ticket of a batch of blocks the calling thread kept after freeing them without a
    /// stream, taken when the batch closes: any shared thread fence numbered at least this
    /// covers the batch (Note [shared thread fences] in `fence_clock.rs`).
    #[inline]
    pub fn thread_fence_ticket(&self) -> u64 {
        self.fence_side.thread_clock.ticket()
    }

    /// Whether a completed shared thread fence covers ticket `need`, without a driver call.
    #[inline]
    pub fn thread_fence_covers(&self, need: u64) -> bool {
        self.fence_side.thread_clock.covers(need)
    }

    /// Brings the shared thread fences forward for ticket `need` (retires completed fences,
    /// records one if none covers `need` yet), unless another thread is doing so now or,
    /// with [`Urge::Ask`], holds the recorder role (Note [fence recorder role]). Returns
    /// whether `need` is covered.
    pub fn advance_thread_fences(&self, need: u64, urge: Urge) -> bool {
        self.fence_side
            .thread_clock
            .advance(need, urge, &ThreadFences(self))
    }

    /// Sets the shared thread fences' recorder role times and closer window (Note [fence
    /// recorder role]): for tests, which need times that outlast a thread's start.
    #[doc(hidden)]
    pub fn set_thread_fence_role_times(&self, idle_ns: u64, tenure_ns: u64, window_ns: u64) {
        self.fence_side
            .thread_clock
            .set_role_times(idle_ns, tenure_ns, window_ns);
    }

    /// Whether many threads' batches share the thread fences now (Note [kept bytes under
    /// contention] in `thread_cache/kept.rs`).
    pub fn thread_fences_crowded(&self) -> bool {
        self.fence_side.thread_clock.many_closers()
    }

    /// Blocks a thread kept after freeing them without a stream come back (Note [thread
    /// fences] in `thread_cache.rs`): with `covered` (their fence completed) to the shared
    /// index; otherwise to the fence queue, stamped now (a later fence than they need,
    /// which keeps the queue's stamps in order).
    ///
    /// # Safety
    /// The caller owns the blocks (they were in its thread cache) and gives them up.
    pub unsafe fn take_kept(&self, blocks: &[BlockIdx], covered: bool) {
        if blocks.is_empty() {
            return;
        }
        let mut sh = self.shared.lock();
        if covered {
            for &idx in blocks {
                self.insert_shared(&mut sh, idx);
            }
            return;
        }
        for &idx in blocks {
            BLOCKS.get(idx).set_place(Place::AwaitingFence);
            let d = BLOCKS.get(idx).data();
            d.requested = 0;
            d.stream = STREAMLESS;
            BLOCKS.links(idx).free_epoch = sh.clock;
            sh.fence_queue.push_back(&BLOCKS, idx);
            sh.unsealed_fence_blocks += 1;
        }
    }
}

/// The pool's backend as the shared thread fences see it.
struct ThreadFences<'a>(&'a DevicePool);

impl FenceRecorder for ThreadFences<'_> {
    /// `None` while a capture is active, after exit, or when the driver refuses (the
    /// batches then wait for a later fence, or for the pool).
    fn record(&self) -> Option<Fence> {
        let pool = self.0;
        if !pool.may_order() {
            return None;
        }
        // Note [capture exclusion].
        let _calls = pool.enter_ordering_calls()?;
        match pool.fence_call(FenceCall::Record, || {
            pool.backend.record_context_fence(pool.ctx.id)
        }) {
            Ok(ev) => Some(ev.0),
            Err(e) => {
                crate::log::debug(&format!("cupool: context fence failed: {e:?}"));
                None
            }
        }
    }

    /// Not after the backend is off (exit, fork child): no driver call then.
    fn completed(&self, fence: Fence) -> bool {
        let pool = self.0;
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return false;
        }
        pool.fence_call(FenceCall::Query, || {
            pool.backend
                .event_completed(pool.ctx.id, EventHandle(fence))
        })
        .unwrap_or(false)
    }

    fn recycle(&self, fence: Fence) {
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return;
        }
        self.0
            .backend
            .recycle_event(self.0.ctx.id, EventHandle(fence));
    }
}
