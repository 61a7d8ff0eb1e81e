//! The host backend's stand-in for page-locked host memory (`cuMemHostAlloc`): plain
//! anonymous mappings, with the calls counted and a budget and fault injection for tests.
//! Kept apart from the simulated device memory: its own table, counters and lock.

use super::pages::{map_device_memory, unmap_device_memory};
use super::HostBackend;
use crate::backend::{BackendError, BackendResult, HostPtr};
use crate::ptr_map::PtrMap;

/// What a test can observe about the simulated pinned memory.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPinnedCounters {
    /// Successful `host_alloc` / `host_free` calls so far.
    pub allocs: u64,
    pub frees: u64,
    /// Allocations alive now, and their bytes.
    pub live: u64,
    pub live_bytes: u64,
}

pub(super) struct HostPinned {
    /// Live allocations: address → bytes.
    live: PtrMap<u64>,
    live_bytes: u64,
    capacity: u64,
    allocs: u64,
    frees: u64,
    fail_next_alloc: Option<BackendError>,
}

impl HostPinned {
    pub(super) fn new() -> Self {
        HostPinned {
            live: PtrMap::default(),
            live_bytes: 0,
            capacity: u64::MAX,
            allocs: 0,
            frees: 0,
            fail_next_alloc: None,
        }
    }
}

impl HostBackend {
    pub(super) fn pinned_alloc(&self, bytes: u64) -> BackendResult<HostPtr> {
        if bytes == 0 {
            return Err(BackendError::InvalidValue);
        }
        let mut s = self.pinned.lock();
        if let Some(e) = s.fail_next_alloc.take() {
            return Err(e);
        }
        if bytes > s.capacity - s.live_bytes.min(s.capacity) {
            return Err(BackendError::OutOfMemory);
        }
        let p = map_device_memory(bytes).ok_or(BackendError::OutOfMemory)?;
        s.live.insert(p, bytes);
        s.live_bytes += bytes;
        s.allocs += 1;
        Ok(p)
    }

    pub(super) fn pinned_free(&self, ptr: HostPtr) -> BackendResult<()> {
        let mut s = self.pinned.lock();
        // Like `cuMemFreeHost`: only the start of a live allocation.
        let bytes = s.live.remove(&ptr).ok_or(BackendError::InvalidValue)?;
        s.live_bytes -= bytes;
        s.frees += 1;
        drop(s);
        unmap_device_memory(ptr, bytes);
        Ok(())
    }

    /// Most bytes of simulated pinned memory live at once (default: no limit); an
    /// allocation past it fails with out-of-memory.
    pub fn set_pinned_capacity(&self, bytes: u64) {
        self.pinned.lock().capacity = bytes;
    }

    /// The next pinned allocation fails with `e` (fault injection: `cuMemHostAlloc`).
    pub fn fail_next_pinned_alloc(&self, e: BackendError) {
        self.pinned.lock().fail_next_alloc = Some(e);
    }

    pub fn pinned_counters(&self) -> HostPinnedCounters {
        let s = self.pinned.lock();
        HostPinnedCounters {
            allocs: s.allocs,
            frees: s.frees,
            live: s.live.len() as u64,
            live_bytes: s.live_bytes,
        }
    }
}
