//! Giving memory back to the backend: idle segments (and the VMM arena's idle granules).

use super::block::{BlockIdx, Place, NIL};
use super::counters::{Level, ThreadCounters};
use super::fences::Advance;
use super::{DevicePool, ADDRESSES, BACKEND_OFF, BLOCKS};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

impl DevicePool {
    /// Gives every segment that is one free shared block back to the backend; returns the
    /// bytes released.
    pub fn release_idle_segments(&self, c: &ThreadCounters) -> u64 {
        if !self.may_order() {
            return 0;
        }
        let victims: Vec<(u64, u64)> = {
            let mut sh = self.shared.lock();
            let mut v = Vec::new();
            let heads: Vec<(u64, BlockIdx)> = sh.segments.iter().map(|(&b, &i)| (b, i)).collect();
            let arena_base = sh.arena.as_ref().map(|a| a.base);
            for (base, idx) in heads {
                if Some(base) == arena_base {
                    continue;
                }
                // SAFETY: pool lock held.
                unsafe {
                    let d = BLOCKS.get(idx).data();
                    if d.place == Place::FreeShared && d.seg_next == NIL && d.size == d.segment_size
                    {
                        let kind = d.kind;
                        sh.index(kind).remove(&BLOCKS, idx);
                        ADDRESSES.clear(base);
                        v.push((base, d.segment_size));
                        BLOCKS.release(idx);
                        sh.segments.remove(&base);
                    }
                }
            }
            let total: u64 = v.iter().map(|&(_, s)| s).sum();
            sh.reserved -= total;
            sh.slow.device_frees += v.len() as u64;
            v
        };
        let mut released = 0;
        for (ptr, size) in victims {
            crate::trace::record::segment_free(ptr, size, self.ctx.device);
            c.lower(Level::Cached, size);
            match self.backend.release(self.ctx.id, ptr, size) {
                Ok(()) => released += size,
                Err(e) => {
                    // The driver refused (shutting down, or a driver bug): the memory is
                    // gone from the pool either way; report it once.
                    crate::log::warn(&format!("cupool: releasing a segment failed: {e:?}"));
                    released += size;
                }
            }
        }
        released + self.release_arena(c)
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
