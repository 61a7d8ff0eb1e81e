//! Segments and the blocks they are cut into: growing the pool by a segment, splitting a
//! block, merging free neighbours into the shared index, and finding a block by address.

use super::block::{BlockIdx, BlockLinks, Place, SegmentKind, NIL};
use super::counters::{Level, ThreadCounters};
use super::size_class::ALIGNMENT;
use super::size_policy::{split_min, SEGMENT_GRANULE};
use super::{address_map, DevicePool, Request, Shared, ADDRESSES, BACKEND_OFF, BLOCKS};
use crate::backend::BackendError;
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

/// Fitting free blocks of the arena compared for the fewest unmapped granules.
const VMM_FIT_PROBES: usize = 64;

impl DevicePool {
    /// Takes a free block of at least `req.size` from the shared index and splits it to
    /// size; returns it and whether every granule under it is mapped (always, outside the
    /// VMM arena).
    ///
    /// # Safety
    /// Pool lock held.
    pub(super) unsafe fn take_shared(
        &self,
        sh: &mut Shared,
        req: Request,
    ) -> Option<(BlockIdx, bool)> {
        let Request { size, kind, .. } = req;
        let (mut idx, offset) = match sh.arena.as_ref() {
            // Note [arena placement]: among the fitting blocks, the placement needing the fewest
            // granules mapped (a remap costs tens of µs on a GPU).
            Some(a) if kind == SegmentKind::Large => {
                sh.large.find_cheapest(&BLOCKS, size, VMM_FIT_PROBES, |i| {
                    let d = BLOCKS.get(i).data();
                    if a.contains(d.ptr) {
                        a.placement(d.ptr, d.size, size)
                    } else {
                        (0, 0)
                    }
                })?
            }
            _ => (sh.index(kind).find(&BLOCKS, size)?, 0),
        };
        sh.index(kind).remove(&BLOCKS, idx);
        // Taken: a remainder split off below must not merge back into it.
        BLOCKS.get(idx).set_place(Place::Allocated);
        if offset > 0 {
            // The request goes further in: the free part before it stays in the index.
            if let Some(rest) = self.split(sh, idx, offset, kind, Place::Allocated, false) {
                self.insert_shared_as(sh, idx, false);
                idx = rest;
            }
        }
        let d = BLOCKS.get(idx).data();
        let in_arena = sh.in_arena(idx);
        if in_arena {
            // Note [vmm arena]: only the part handed out is pinned (a free block may be the
            // arena's whole tail); the remainder goes back unpinned. In the arena a block
            // is split unless it fits exactly.
            sh.arena.as_mut().unwrap().pin(d.ptr, size);
            if let Some(rest) = self.split(sh, idx, size, kind, Place::FreeShared, false) {
                self.insert_shared_as(sh, rest, false);
            }
        } else if let Some(rest) = self.split(sh, idx, size, kind, Place::FreeShared, true) {
            self.insert_shared(sh, rest);
        }
        let mapped = !in_arena || sh.arena.as_ref().unwrap().all_mapped(d.ptr, d.size);
        Some((idx, mapped))
    }

    /// Splits `idx` so that it is `size` bytes long, when the remainder is worth keeping;
    /// returns the remainder's record (same stream and stamp as `idx`, in `rest_place`; the
    /// caller puts it in the matching index).
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index).
    pub(super) unsafe fn split(
        &self,
        sh: &mut Shared,
        idx: BlockIdx,
        size: u64,
        kind: SegmentKind,
        rest_place: Place,
        pinned_whole: bool,
    ) -> Option<BlockIdx> {
        let d = BLOCKS.get(idx).data();
        let rest_size = d.size - size;
        let in_arena = sh.in_arena(idx);
        let min = split_min(kind, in_arena);
        if rest_size < min {
            return None;
        }
        if in_arena && pinned_whole {
            // The block is pinned (outside the shared index): the granule at the cut now
            // overlaps two such blocks (Note [vmm arena]).
            sh.arena.as_mut().unwrap().split_at(d.ptr + size);
        }
        let rest = sh.new_record()?;
        let r = BLOCKS.get(rest).data();
        *r = *d;
        r.ptr = d.ptr + size;
        r.size = rest_size;
        r.requested = 0;
        BLOCKS.get(rest).set_place(rest_place);
        let dl = BLOCKS.links(idx);
        *BLOCKS.links(rest) = BlockLinks {
            free_epoch: dl.free_epoch,
            seg_prev: idx,
            seg_next: dl.seg_next,
            ..BlockLinks::UNLINKED
        };
        if dl.seg_next != NIL {
            BLOCKS.links(dl.seg_next).seg_prev = rest;
        }
        dl.seg_next = rest;
        d.size = size;
        BLOCKS.get(rest).publish_free(r.ptr);
        ADDRESSES.set(r.ptr, rest);
        Some(rest)
    }

    /// Puts a free block in the shared index, merging it with free neighbours.
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller (in no index or FIFO).
    pub(super) unsafe fn insert_shared(&self, sh: &mut Shared, idx: BlockIdx) {
        self.insert_shared_as(sh, idx, true)
    }

    /// [`DevicePool::insert_shared`]; `pinned` says whether the block's granules are
    /// pinned (an arena block coming from outside the shared index), so that it unpins
    /// them.
    ///
    /// # Safety
    /// As for [`DevicePool::insert_shared`].
    unsafe fn insert_shared_as(&self, sh: &mut Shared, idx: BlockIdx, pinned: bool) {
        let mut idx = idx;
        let d = BLOCKS.get(idx).data();
        if let Some(a) = sh.arena.as_mut().filter(|a| pinned && a.contains(d.ptr)) {
            a.unpin(d.ptr, d.size);
        }
        let kind = d.kind;
        let prev = BLOCKS.links(idx).seg_prev;
        if prev != NIL && BLOCKS.get(prev).place() == Place::FreeShared {
            sh.index(kind).remove(&BLOCKS, prev);
            Self::absorb_next(sh, prev);
            idx = prev;
        }
        let next = BLOCKS.links(idx).seg_next;
        if next != NIL && BLOCKS.get(next).place() == Place::FreeShared {
            sh.index(kind).remove(&BLOCKS, next);
            Self::absorb_next(sh, idx);
        }
        BLOCKS.get(idx).set_place(Place::FreeShared);
        let d = BLOCKS.get(idx).data();
        d.stream = 0;
        d.requested = 0;
        sh.index(kind).insert(&BLOCKS, idx);
    }

    /// Merges `idx`'s next neighbour into `idx` and frees the neighbour's record.
    ///
    /// # Safety
    /// Pool lock held; both blocks are owned by the caller.
    pub(super) unsafe fn absorb_next(sh: &mut Shared, idx: BlockIdx) {
        let l = BLOCKS.links(idx);
        let next = l.seg_next;
        let after = BLOCKS.links(next).seg_next;
        let n = *BLOCKS.get(next).data();
        BLOCKS.get(idx).data().size += n.size;
        l.seg_next = after;
        if after != NIL {
            BLOCKS.links(after).seg_prev = idx;
        }
        ADDRESSES.clear(n.ptr);
        sh.drop_record(next);
    }

    /// Gets a new segment from the backend (no lock held during the call) and carves the
    /// block from it.
    pub(super) fn grow_and_carve(&self, c: &ThreadCounters, req: Request) -> Result<u64> {
        // Note [growth during another thread's capture]: `cuMemAlloc` on the capturing
        // thread would break its capture (the interposer then hands the request to the
        // driver unchanged, where CUDA's own rule applies), but on any other thread it is
        // allowed and leaves thread-local and relaxed captures alone, as a program's own
        // `cudaMalloc` does. So only the capturing thread is refused. The arena, whose
        // maps are excluded by every capture of the context (Note [capture exclusion]),
        // is skipped meanwhile: the block gets a segment of its own. Before this, through
        // the API library every miss of every thread failed with
        // `CUPOOL_ERROR_STREAM_CAPTURE` while any thread captured (`gpu/stress.cu`: 1.6 M
        // failed allocations in 120 s with a capture every ~256 operations per thread).
        let capturing = self.capturing();
        if capturing && super::capture::this_thread_captures() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        if req.kind == SegmentKind::Large && !capturing && self.shared.lock().arena.is_some() {
            // A capture that another thread begins between the check above and the
            // arena's maps makes them refuse (Note [capture exclusion]): that thread's
            // capture leaves this one's growth alone, so the block gets a segment as
            // during any capture. `gpu/stress.cu` with `vmm:on` through the API saw one
            // `CUPOOL_ERROR_STREAM_CAPTURE` in 2 M allocations before this.
            match self.carve_arena(c, req) {
                Err(CupoolStatus::CupoolErrorStreamCapture)
                    if !super::capture::this_thread_captures() => {}
                result => return result,
            }
        }
        // The usual segment first; for a large block that does not fit (memory limit or
        // driver OOM), a segment of just the block's size.
        let standard = self.segment_size_for(req.size, req.kind);
        let minimal = match req.kind {
            SegmentKind::Small => standard,
            SegmentKind::Large => req.size.div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE,
        };
        let candidates: &[u64] = if minimal < standard {
            &[standard, minimal]
        } else {
            &[standard]
        };
        for &seg_size in candidates {
            let limit = self.limit();
            if limit != 0 && self.reserved() + seg_size > limit {
                continue;
            }
            match self.backend.allocate(self.ctx.id, seg_size) {
                Ok(ptr) => return self.adopt_segment(c, ptr, seg_size, req),
                Err(BackendError::OutOfMemory) => {}
                Err(e) => {
                    crate::log::info(&format!("cupool: segment allocation failed: {e:?}"));
                    return Err(e.into());
                }
            }
        }
        Err(CupoolStatus::CupoolErrorOutOfMemory)
    }

    fn adopt_segment(
        &self,
        c: &ThreadCounters,
        ptr: u64,
        seg_size: u64,
        req: Request,
    ) -> Result<u64> {
        let Request { size, kind, .. } = req;
        let idx = self.register_segment(c, ptr, seg_size, kind, Place::Allocated)?;
        let mut sh = self.shared.lock();
        // SAFETY: the record is ours (about to be handed out); pool lock held.
        unsafe {
            if let Some(rest) = self.split(&mut sh, idx, size, kind, Place::FreeShared, true) {
                self.insert_shared(&mut sh, rest);
            }
        }
        drop(sh);
        Ok(self.hand_out(c, idx, req))
    }

    /// Books a segment the backend just gave (`ptr`, `seg_size` bytes) as one block in
    /// `place`: reserved bytes, the address map, the segment list, the counters and the
    /// trace. The caller puts the block where `place` says. On failure the segment goes
    /// back to the backend.
    pub(super) fn register_segment(
        &self,
        c: &ThreadCounters,
        ptr: u64,
        seg_size: u64,
        kind: SegmentKind,
        place: Place,
    ) -> Result<BlockIdx> {
        if ptr % ALIGNMENT != 0 || ptr >= address_map::ADDRESS_LIMIT {
            // Never seen from CUDA; refuse rather than hand out memory we cannot track.
            let _ = self.backend.release(self.ctx.id, ptr, seg_size);
            crate::log::error("cupool: backend returned an address the pool cannot track");
            return Err(CupoolStatus::CupoolErrorInternal);
        }
        let Some(idx) = BLOCKS.allocate() else {
            let _ = self.backend.release(self.ctx.id, ptr, seg_size);
            return Err(CupoolStatus::CupoolErrorOutOfMemory);
        };
        let mut sh = self.shared.lock();
        // SAFETY: the record is new and ours; pool lock held.
        unsafe {
            BLOCKS.init_segment_head(idx, ptr, seg_size, self.index, kind);
            BLOCKS.get(idx).set_place(place);
            BLOCKS.get(idx).publish_free(ptr);
            ADDRESSES.set(ptr, idx);
        }
        sh.segments.insert(ptr, idx);
        sh.reserved += seg_size;
        sh.reserved_peak = sh.reserved_peak.max(sh.reserved);
        sh.slow.device_allocs += 1;
        drop(sh);
        if c.raise(Level::Cached, seg_size, self.peak_epoch()).0 {
            self.update_peak(Level::Cached);
        }
        crate::trace::record::segment_alloc(ptr, seg_size, self.ctx.device);
        Ok(idx)
    }

    /// The block of this pool that contains `ptr`, and its segment.
    pub fn find_containing(&self, ptr: u64) -> Option<Containing> {
        let sh = self.shared.lock();
        let (&base, &head) = sh.segments.range(..=ptr).next_back()?;
        // SAFETY: pool lock held; records of this pool are only changed under it (an
        // allocated block's fields are read-only while allocated).
        unsafe {
            let seg_size = BLOCKS.links(head).segment_size;
            if ptr >= base + seg_size {
                return None;
            }
            let mut idx = head;
            while idx != NIL {
                let d = BLOCKS.get(idx).data();
                if ptr >= d.ptr && ptr < d.ptr + d.size {
                    return Some(Containing {
                        idx,
                        block_ptr: d.ptr,
                        segment_base: base,
                        segment_size: seg_size,
                    });
                }
                idx = BLOCKS.links(idx).seg_next;
            }
        }
        None
    }
}

/// A block found by address, with the segment it belongs to
/// ([`DevicePool::find_containing`]).
#[derive(Copy, Clone, Debug)]
pub struct Containing {
    pub idx: BlockIdx,
    /// Start of the block (read under the pool lock).
    pub block_ptr: u64,
    pub segment_base: u64,
    pub segment_size: u64,
}
