//! Giving memory back to the backend: idle segments (and the VMM arena's idle granules).

use super::block::{BlockIdx, Place, SegmentKind, NIL};
use super::counters::{Level, ThreadCounters};
use super::fences::Advance;
use super::{thread_cache, DevicePool, ADDRESSES, BACKEND_OFF, BLOCKS};
use crate::config::{self, Key};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

impl DevicePool {
    /// Note [exported segments]: a block exported through CUDA IPC may be mapped in
    /// another process for as long as that process likes, and the pool cannot know when it
    /// closes it. Giving the segment back to the driver (`cuMemFree`) while it is mapped
    /// elsewhere would let the driver hand the memory to someone else under the importer's
    /// feet, so the segment stays with the pool until the process ends; its blocks are
    /// reused as usual (as with `cudaFree` and a later `cudaMalloc` natively).
    pub fn keep_exported_segment(&self, segment_base: u64) {
        self.shared.lock().exported.insert(segment_base);
    }

    /// Gives every segment that is one free shared block back to the backend, and the VMM
    /// arena's idle memory; returns the bytes released.
    pub fn release_idle_segments(&self, c: &ThreadCounters) -> u64 {
        self.release_idle_until(c, 0)
    }

    /// Gives idle segments back, largest first, until reserved bytes are at most `target`;
    /// then, if still above, the VMM arena's idle memory. Never below the reserve (Note
    /// [reserve at start]): a segment whose release would go under it is kept. Returns the bytes
    /// released.
    fn release_idle_until(&self, c: &ThreadCounters, target: u64) -> u64 {
        if !self.may_order() {
            return 0;
        }
        self.file_all_parked();
        // Note [capture exclusion]: held until the releases are done.
        let Some(_calls) = self.enter_ordering_calls() else {
            return 0;
        };
        let floor = self.reserve_floor();
        let victims: Vec<(u64, u64, SegmentKind)> = {
            let mut sh = self.shared.lock();
            let arena_base = sh.arena.as_ref().map(|a| a.base);
            // Note [device waits]: while a block drained by a device wait has not been
            // seen idle, a free segment may still be in use by the device.
            let unconfirmed = sh.device_drained > sh.fence_done;
            let mut idle: Vec<(u64, BlockIdx, u64)> = if unconfirmed {
                Vec::new()
            } else {
                // SAFETY: pool lock held.
                unsafe {
                    sh.segments
                        .iter()
                        .filter(|&(&base, _)| Some(base) != arena_base)
                        .filter(|&(base, _)| !sh.exported.contains(base))
                        .filter_map(|(&base, &idx)| {
                            let l = BLOCKS.links(idx);
                            let whole = BLOCKS.get(idx).place() == Place::FreeShared
                                && l.seg_next == NIL
                                && BLOCKS.get(idx).data().size == l.segment_size;
                            whole.then_some((base, idx, l.segment_size))
                        })
                        .collect()
                }
            };
            idle.sort_unstable_by_key(|&(_, _, size)| core::cmp::Reverse(size));
            let mut v = Vec::new();
            let mut left = sh.reserved;
            for (base, idx, size) in idle {
                if left <= target {
                    break;
                }
                if left - size < floor {
                    continue;
                }
                left -= size;
                // SAFETY: pool lock held; `idx` is a free shared block in its index.
                let kind = unsafe {
                    let kind = BLOCKS.get(idx).data().kind;
                    sh.index(kind).remove(&BLOCKS, idx);
                    ADDRESSES.clear(base);
                    BLOCKS.release(idx);
                    kind
                };
                sh.segments.remove(&base);
                v.push((base, size, kind));
            }
            let total: u64 = v.iter().map(|&(_, s, _)| s).sum();
            sh.reserved -= total;
            sh.slow.device_frees += v.len() as u64;
            v
        };
        let mut released = 0;
        for (ptr, size, kind) in victims {
            match self.backend.release(self.ctx.id, ptr, size) {
                Ok(()) => {
                    crate::trace::record::segment_free(ptr, size, self.ctx.device);
                    c.lower(Level::Cached, size);
                    released += size;
                }
                Err(e) => {
                    crate::log::warn(&format!(
                        "cupool: the driver refused to free a segment ({e:?}); the pool keeps it and tries again at its next release"
                    ));
                    self.readopt_segment(ptr, size, kind);
                }
            }
        }
        if target == 0 || self.reserved() > target {
            released += self.release_arena(c);
        }
        released
    }

    /// Note [failed release]: a segment whose `cuMemFree` fails is still the driver's
    /// memory held by this process. Dropping it from the books (what the pool did before)
    /// leaked it for good; it is booked again instead, as one idle free block, and the next
    /// release tries again. Its driver free was counted already, so the count goes back.
    fn readopt_segment(&self, ptr: u64, size: u64, kind: SegmentKind) {
        let mut sh = self.shared.lock();
        let Some(idx) = sh.new_record() else {
            crate::log::error(
                "cupool: no block record left to keep a segment the driver did not free",
            );
            return;
        };
        // SAFETY: the record is new and ours; pool lock held.
        unsafe {
            BLOCKS.init_segment_head(idx, ptr, size, self.index, kind);
            BLOCKS.get(idx).set_place(Place::FreeShared);
            BLOCKS.get(idx).publish_free(ptr);
            ADDRESSES.set(ptr, idx);
            sh.segments.insert(ptr, idx);
            sh.reserved += size;
            sh.slow.device_frees -= 1;
            self.insert_shared(&mut sh, idx);
        }
    }

    /// Note [release bound]: before the pool grows by `size` bytes, keeps its reserved
    /// bytes under `release_above_percent` of its capacity (the memory limit, else the
    /// device's total) by giving idle cached memory back first, thread caches included.
    /// Returns the bytes released.
    pub(super) fn release_above_bound(
        &self,
        c: &ThreadCounters,
        size: u64,
        flush_own_cache: &mut dyn FnMut() -> bool,
    ) -> u64 {
        if !self.may_order() {
            return 0;
        }
        let Some(bound) = self.release_bound() else {
            return 0;
        };
        if self.reserved() + size <= bound {
            return 0;
        }
        flush_own_cache();
        thread_cache::request_flush_all();
        self.advance(Advance::Poll);
        self.release_idle_until(c, bound.saturating_sub(size))
    }

    /// The reserved bytes above which the pool gives idle memory back before it grows
    /// (Note [release bound]); `None` when `release_above_percent` is 0 or the capacity
    /// is unknown.
    pub(super) fn release_bound(&self) -> Option<u64> {
        let percent = config::get(Key::ReleaseAbovePercent).min(100);
        if percent == 0 {
            return None;
        }
        let capacity = match self.limit() {
            0 => self.device_total(),
            l => l,
        };
        (capacity > 0).then(|| capacity / 100 * percent)
    }

    /// The device's total memory, asked of the backend once.
    fn device_total(&self) -> u64 {
        match self.device_total.load(Ordering::Relaxed) {
            0 => {
                let total = self.backend.memory_info(self.ctx.id).map_or(0, |m| m.1);
                self.device_total.store(total, Ordering::Relaxed);
                total
            }
            t => t,
        }
    }

    /// Waits for pending frees, then releases every idle segment (`empty_cache`).
    pub fn empty_cache(&self, c: &ThreadCounters) -> Result<u64> {
        if self.capturing() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Ok(0);
        }
        self.advance(Advance::Wait);
        Ok(self.release_idle_segments(c))
    }
}
