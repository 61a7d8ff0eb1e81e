//! Arena blocks parked for their stream: reuse of a VMM arena block without the pool's
//! lists.
//!
//! Note [parked arena blocks]: arena blocks bypass thread caches (Note [arena blocks bypass
//! thread caches] in `mod.rs`), so a stream-ordered pair of one large size took the pool
//! lock four times and walked the stream's index, the shared index, the age list and the
//! arena's records (the free's merge; the allocation's arena check, fence check, fit and
//! split): on the host backend a 64 MiB pair cost 104 ns against 56 ns for a 512-byte
//! thread-cache hit, on the GPU 137–304 ns against 70–209 ns, and CuPy's `cupy.empty` +
//! `del` of 64 MiB was level with CuPy's own pool where smaller sizes were below it
//! (docs/BENCHMARKS.md).
//!
//! Now a large block freed on its own stream goes into one of [`PARK_SLOTS`] slots of its
//! pool, picked by the stream's id, with one swap; a block parked there before (freed
//! earlier) is filed at once, so that each stream's blocks reach its age list in the order
//! they were freed. The stream's next large request swaps the slot empty and, when the
//! block is exactly the request's rounded size on the same stream and the slow path would
//! hand out that very block ([`DevicePool::slow_path_hands_out`](crate::pool::DevicePool::slow_path_hands_out), one short look under the
//! pool lock), hands it out: no index, no split, no merge. Otherwise the block is filed as
//! its free would have filed it ([`DevicePool::free_to_stream`](crate::pool::DevicePool::free_to_stream)) and the request goes the
//! slow way. The 64 MiB pair: 55 ns on the host backend, on the GPU level with the
//! thread-cache hit.
//!
//! What a thread cache could not give, and this does: any thread may empty every slot. The
//! pool does so before anything that must see all of its free memory: every slow
//! allocation, every fence sealed, every release, the statistics and the footprint. So a
//! parked block is out of the pool's lists only between its free and the next of those,
//! and it lies exactly where its free would have put it when they look. Host replays of
//! the corpus and of the seeded traces, at both lags, are identical to before: every
//! utilization, peak and driver call (docs/BENCHMARKS.md). Two rules were needed for that
//! and are written where they live: the order of filing ([`ParkSlots::park`]) and parking
//! only for streams the pool already has lists for ([`ParkSlots::may_park`]). A parked
//! block stays pinned in the arena, as a block freed on its stream is, and counts as
//! cached.
//!
//! Stamping: a parked block is stamped with the pool's clock as its free read it, from a
//! copy stored by each fence's seal before the fence is recorded (`FenceSide::clock`), so
//! that filing it late does not delay its drain. Why a copy read without the lock is safe:
//! the program's work before the free was queued through the driver before the free; if a
//! fence's record came first in the driver, then the seal's store (made before that
//! record) happens before the free's read, which then sees the clock past that fence, and
//! the fence does not cover the block; otherwise the fence was recorded after that work and
//! covers it. Filed, the stamp is raised to the newest of the stream's age list, which must
//! grow along the list and cover the neighbours the block merges with. Tested in
//! `tests/pool_parked.rs` (a fence recorded before the park does not free the block).
//!
//! Ownership moves with the slot's word: the parking thread writes the record, then
//! publishes it with the swap (release); whoever swaps the word out (acquire) owns the
//! record. Model-checked in `tests/loom_lockfree.rs`.

use super::block::{BlockIdx, NIL};
use crate::sync::{AtomicU32, AtomicU64, LineApart};
use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};

/// Slots per pool. Streams whose ids share a slot take turns in it.
pub const PARK_SLOTS: usize = 8;

/// The parking slots of one pool (Note [parked arena blocks]).
pub struct ParkSlots {
    /// Each on a line of its own: streams driven by different threads do not share one.
    slots: [LineApart<Slot>; PARK_SLOTS],
}

struct Slot {
    /// The parked block, [`NIL`] for none.
    block: AtomicU32,
    /// The stream of this slot the pool has free lists for ([`ParkSlots::note_stream`]).
    known: AtomicU64,
}

impl Default for ParkSlots {
    fn default() -> Self {
        Self::new()
    }
}

impl ParkSlots {
    pub fn new() -> Self {
        ParkSlots {
            slots: core::array::from_fn(|_| {
                LineApart(Slot {
                    block: AtomicU32::new(NIL),
                    known: AtomicU64::new(u64::MAX),
                })
            }),
        }
    }

    /// The slot of the stream with id `stream_id` (ids are small sequential integers: a
    /// multiplication spreads them, as in `stream_ids.rs`).
    fn slot(&self, stream_id: u64) -> &Slot {
        let i = (stream_id.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 61) as usize % PARK_SLOTS;
        &self.slots[i].0
    }

    /// Records, under the pool lock, that the pool has free lists for stream `stream_id`
    /// (they are never dropped).
    pub fn note_stream(&self, stream_id: u64) {
        let known = &self.slot(stream_id).known;
        if known.load(Relaxed) != stream_id {
            known.store(stream_id, Relaxed);
        }
    }

    /// Whether blocks of stream `stream_id` may be parked: the pool has its free lists
    /// already. Filing a block of a stream the pool did not know would create its lists
    /// later than its free did, and the order of the pool's streams is the order fence
    /// passes drain them in (seeded `multistream` replays moved by up to 0.4 points).
    pub fn may_park(&self, stream_id: u64) -> bool {
        self.slot(stream_id).known.load(Relaxed) == stream_id
    }

    /// Parks `idx`, whose record the caller has written, for stream `stream_id`. Returns
    /// the block parked there before, now the caller's: it was freed earlier, so the caller
    /// files it at once, and the blocks of one stream reach its age list in the order they
    /// were freed (filing the newer one first changed the corpus's replays:
    /// `multistream` 95.21% to 94.41%).
    pub fn park(&self, stream_id: u64, idx: BlockIdx) -> Option<BlockIdx> {
        match self.slot(stream_id).block.swap(idx, AcqRel) {
            NIL => None,
            earlier => Some(earlier),
        }
    }

    /// Empties the slot of `stream_id`: the block parked there (now the caller's), if any.
    /// A slot seen empty costs a load and no write.
    #[inline]
    pub fn take(&self, stream_id: u64) -> Option<BlockIdx> {
        Self::take_slot(&self.slot(stream_id).block)
    }

    fn take_slot(slot: &AtomicU32) -> Option<BlockIdx> {
        if slot.load(Relaxed) == NIL {
            return None;
        }
        match slot.swap(NIL, Acquire) {
            NIL => None,
            idx => Some(idx),
        }
    }

    /// Empties every slot, calling `file` with each block found (now the caller's).
    pub fn take_all(&self, mut file: impl FnMut(BlockIdx)) {
        for s in &self.slots {
            if let Some(idx) = Self::take_slot(&s.0.block) {
                file(idx);
            }
        }
    }
}

/// The pool's side: filing parked blocks and the checks before a hit (not built under the
/// model checker, which sees the slots alone).
#[cfg(not(loom))]
mod pool_side {
    use super::super::block::{BlockIdx, Place, NIL};
    use super::super::{DevicePool, StreamRef, BLOCKS};
    use crate::backend::StreamHandle;
    use core::sync::atomic::Ordering::Acquire;

    impl DevicePool {
        /// Files the parked block `idx` as its free would have (Note [parked arena blocks]).
        ///
        /// # Safety
        /// The caller owns `idx`: it took it out of its slot.
        pub(in crate::pool) unsafe fn file_parked(&self, idx: BlockIdx) {
            // SAFETY: the caller's contract.
            let d = unsafe { BLOCKS.get(idx).data() };
            let s = StreamRef {
                id: d.stream,
                handle: d.handle as StreamHandle,
            };
            // SAFETY: owned by the caller, in no list.
            unsafe { self.file_on_stream(s, &[idx], Some(BLOCKS.links(idx).free_epoch)) };
        }

        /// The pool's clock as a block parked now is stamped with (Note [parked arena
        /// blocks]).
        pub(in crate::pool) fn clock_for_parking(&self) -> u64 {
            self.fence_side.clock.load(Acquire)
        }

        /// Whether the slow path would hand out the parked block `idx` (exactly `size`
        /// bytes, of stream `stream_id`) itself, with nothing else done first: a hit must
        /// leave the pool as the slow path would (Note [parked arena blocks]). Not so when
        /// - the block has a neighbour freed on the same stream: filed, it merges with it,
        ///   and the fit cuts the request from the merged block or takes a smaller shared
        ///   one. Handing the block out anyway changed where blocks lie (host replays:
        ///   `gpt_train.torch` 97.73% to 97.36%, `conv_train.torch` 1 254 to 1 936 map
        ///   calls);
        /// - frees waiting for a fence could cover the request: the slow path polls the
        ///   fences first (Note [poll before fitting] in `alloc.rs`), which moves blocks
        ///   (seeded `multistream` replays changed by up to 0.6 points without this).
        ///
        /// Under the pool lock: a neighbour's split or merge rewrites the block's links.
        pub(in crate::pool) fn slow_path_hands_out(
            &self,
            idx: BlockIdx,
            stream_id: u64,
            size: u64,
        ) -> bool {
            let sh = self.shared.lock();
            if sh.fence_queue.bytes >= size && self.may_order() {
                return false;
            }
            let on_stream = |n: BlockIdx| {
                n != NIL
                    && BLOCKS.get(n).place() == Place::FreeOnStream
                    // SAFETY: pool lock held; the neighbour is the pool's (free).
                    && unsafe { BLOCKS.get(n).data() }.stream == stream_id
            };
            // SAFETY: pool lock held; the caller owns `idx`.
            let l = unsafe { BLOCKS.links(idx) };
            !(on_stream(l.seg_prev) || on_stream(l.seg_next))
        }

        /// Files every parked block, before work that must see all of the pool's free memory.
        pub(in crate::pool) fn file_all_parked(&self) {
            // SAFETY: each block was swapped out of its slot: the caller's now.
            self.parked.take_all(|idx| unsafe { self.file_parked(idx) });
        }
    }
}
