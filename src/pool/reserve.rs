//! Claiming memory ahead of need: the `reserve` option and `cupool_reserve`.
//!
//! Note [reserve at start]: a pool asked to reserve N bytes takes from the driver at once what it
//! lacks to hold N (one segment, or idle physical chunks of `vmm_chunk` in the VMM arena),
//! and from then on never releases below N: `empty_cache`, the release bound and the
//! out-of-memory retry skip segments and chunks whose release would take it under. So
//! the program's first allocations are cache hits instead of driver calls (no warm-up
//! tensor), and the memory is the program's before other processes take it. N 0 (the
//! default) ends the reserve; what was kept is then released like any idle cache.
//! - Segments: the reserve is one large segment, free and merged like any other; small
//!   blocks (under 1 MiB) keep their own small segments, so a reserve of all the free
//!   memory leaves them nothing.
//! - VMM arena: the chunks are created idle (held, not mapped); the first blocks that need
//!   granules map them (one `cuMemMap` per chunk, no `cuMemCreate`).

use super::block::{Place, SegmentKind};
use super::counters::{Level, ThreadCounters};
use super::size_policy::SEGMENT_GRANULE;
use super::thread_cache;
use super::{DevicePool, BACKEND_OFF};
use crate::backend::BackendError;
use crate::config::{self, Key, ReserveAmount};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

impl DevicePool {
    /// Bytes this pool keeps through releases (Note [reserve at start]).
    pub fn reserve_floor(&self) -> u64 {
        self.reserve_floor.load(Ordering::Relaxed)
    }

    /// Applies the `reserve` option to a pool just created (Note [reserve at start]). A reserve the
    /// driver cannot give is reported once and the pool goes on without it.
    pub(super) fn reserve_from_config(&self) {
        let Some(spec) = config::reserve() else {
            return;
        };
        if spec.device.is_some_and(|d| d as i32 != self.ctx.device) {
            return;
        }
        let bytes = match spec.amount {
            ReserveAmount::Bytes(b) => b,
            ReserveAmount::Fraction(f) => match self.backend.memory_info(self.ctx.id) {
                Ok((free, _)) => (free as f64 * f) as u64,
                Err(_) => 0,
            },
        };
        if bytes == 0 {
            return;
        }
        let c = thread_cache::thread_counters(self.index);
        if let Err(e) = self.reserve(c, bytes) {
            crate::log::error(&format!(
                "cupool: device {}: could not reserve {bytes} bytes ({}); going on without a reserve",
                self.ctx.device,
                e.as_str()
            ));
        }
    }

    /// Makes the pool hold at least `bytes` and keep them (Note [reserve at start]); returns the
    /// bytes taken from the driver now. Over the memory limit, or when the driver has not
    /// that much: `CUPOOL_ERROR_OUT_OF_MEMORY`, and the reserve is what it was.
    pub fn reserve(&self, c: &ThreadCounters, bytes: u64) -> Result<u64> {
        if self.capturing() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        let limit = self.limit();
        if limit != 0 && bytes > limit {
            return Err(CupoolStatus::CupoolErrorOutOfMemory);
        }
        let before = self.reserve_floor.swap(bytes, Ordering::Relaxed);
        let have = self.reserved();
        if bytes <= have {
            return Ok(0);
        }
        if self.vmm.load(Ordering::Relaxed) {
            self.ensure_arena();
        }
        let taken = if self.shared.lock().arena.is_some() {
            self.reserve_in_arena(c, bytes - have)
        } else {
            self.reserve_segment(c, bytes - have)
        };
        if taken.is_err() {
            self.reserve_floor.store(before, Ordering::Relaxed);
        }
        taken
    }

    /// One free segment of at least `need` bytes.
    fn reserve_segment(&self, c: &ThreadCounters, need: u64) -> Result<u64> {
        let size = need.div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE;
        let ptr = self
            .backend
            .allocate(self.ctx.id, size)
            .map_err(CupoolStatus::from)?;
        let idx = self.register_segment(c, ptr, size, SegmentKind::Large, Place::FreeShared)?;
        let mut sh = self.shared.lock();
        // SAFETY: a new free record, in no index yet; pool lock held.
        unsafe { self.insert_shared(&mut sh, idx) };
        Ok(size)
    }

    /// Idle physical chunks of up to `vmm_chunk` covering `need` bytes. On a driver
    /// failure the chunks made so far stay (they are the pool's like any idle memory).
    fn reserve_in_arena(&self, c: &ThreadCounters, need: u64) -> Result<u64> {
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let g = match self.shared.lock().arena.as_ref() {
            Some(a) => a.granule,
            None => return Err(CupoolStatus::CupoolErrorInternal),
        };
        let max_chunk = (config::get(Key::VmmChunk) / g).max(1);
        let mut left = need.div_ceil(g);
        let mut taken = 0;
        let mut failed: Option<BackendError> = None;
        while left > 0 {
            let len = left.min(max_chunk);
            let handle = match self.backend.create_physical(self.ctx.id, len * g) {
                Ok(h) => h,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            let mut sh = self.shared.lock();
            let a = sh
                .arena
                .as_mut()
                .expect("the arena outlives its events lock");
            let id = a.new_chunk(handle, len as u32);
            a.record_idle(id);
            sh.reserved += len * g;
            sh.reserved_peak = sh.reserved_peak.max(sh.reserved);
            sh.slow.device_allocs += 1;
            drop(sh);
            taken += len * g;
            left -= len;
        }
        if taken > 0 && c.raise(Level::Cached, taken, self.peak_epoch()).0 {
            self.update_peak(Level::Cached);
        }
        match failed {
            None => Ok(taken),
            Some(e) => Err(e.into()),
        }
    }
}
