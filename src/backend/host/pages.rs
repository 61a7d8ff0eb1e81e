//! Host memory standing in for device memory: mappings that cost nothing until touched,
//! and `PROT_NONE` reservations for the simulated VMM arena (Note [host vmm]).
//!
//! Note [host pages under Miri]: Miri runs `mmap` only as whole `MAP_PRIVATE|MAP_ANONYMOUS`
//! mappings (no `MAP_NORESERVE`, no partial `munmap`, no `mprotect` or `madvise`). Under Miri
//! the same functions take zeroed memory from the global allocator (what an anonymous
//! mapping gives) and expose its provenance, so tests that write patterns through the
//! integer device pointers address a live allocation; a granule's map and unmap only zero
//! it (as `MADV_DONTNEED` does). The pool itself never dereferences device memory: what
//! Miri checks (its records, maps, indexes and locks) is the code every build runs.

use super::HOST_VMM_GRANULE;
use crate::os_memory::{map_aligned, unmap_aligned};

/// Segments of 2 MiB and more are 2 MiB aligned, as the driver aligns them; smaller ones
/// page aligned (the pool needs 512).
fn device_memory_align(bytes: usize) -> usize {
    const HUGE: usize = 2 << 20;
    if bytes >= HUGE {
        HUGE
    } else {
        4096
    }
}

/// Simulated device memory: an anonymous private mapping with `MAP_NORESERVE`, so a page
/// costs host memory only once something writes to it. Tests that write into their blocks
/// get real memory; a replay of a trace that reserved tens of GiB on a GPU touches none of
/// it and runs on a small machine.
pub(super) fn map_device_memory(bytes: u64) -> Option<u64> {
    let bytes = usize::try_from(bytes).ok()?;
    map_aligned(
        bytes,
        device_memory_align(bytes),
        libc::PROT_READ | libc::PROT_WRITE,
    )
}

/// A `PROT_NONE` reservation of `bytes` (a multiple of [`HOST_VMM_GRANULE`]) aligned to
/// the granule.
pub(super) fn reserve_address_space(bytes: u64) -> Option<u64> {
    let bytes = usize::try_from(bytes).ok()?;
    map_aligned(bytes, HOST_VMM_GRANULE as usize, libc::PROT_NONE)
}

/// Unmaps what [`map_device_memory`] mapped.
pub(super) fn unmap_device_memory(ptr: u64, bytes: u64) {
    // SAFETY: `ptr` came from map_device_memory with this size and was removed from the
    // allocation table once, so nothing maps it twice or uses it after this.
    unsafe { unmap_aligned(ptr, bytes, device_memory_align(bytes as usize)) };
}

/// Gives back a reservation that [`reserve_address_space`] made.
///
/// # Safety
/// `ptr` came from `reserve_address_space(bytes)` and was removed from the reservation
/// table once; nothing is mapped in it any more.
pub(super) unsafe fn release_address_space(ptr: u64, bytes: u64) {
    unmap_aligned(ptr, bytes, HOST_VMM_GRANULE as usize);
}

/// Makes `bytes` at `ptr`, inside a reservation, readable and writable (a granule's map);
/// false when the host refuses.
///
/// # Safety
/// The range lies inside a reservation of ours and nothing is mapped there.
pub(super) unsafe fn map_granules(ptr: u64, bytes: u64) -> bool {
    #[cfg(not(miri))]
    {
        libc::mprotect(
            ptr as *mut libc::c_void,
            bytes as usize,
            libc::PROT_READ | libc::PROT_WRITE,
        ) == 0
    }
    #[cfg(miri)]
    {
        let _ = (ptr, bytes);
        true
    }
}

/// Drops the pages of `bytes` at `ptr` (a granule's unmap): they read as zeros when mapped
/// again, and are inaccessible until then; the address space stays reserved.
///
/// # Safety
/// The range was mapped by [`map_granules`] inside a reservation of ours, and nothing uses
/// its memory any more.
pub(super) unsafe fn unmap_granules(ptr: u64, bytes: u64) {
    #[cfg(not(miri))]
    {
        libc::madvise(
            ptr as *mut libc::c_void,
            bytes as usize,
            libc::MADV_DONTNEED,
        );
        libc::mprotect(ptr as *mut libc::c_void, bytes as usize, libc::PROT_NONE);
    }
    #[cfg(miri)]
    {
        core::ptr::write_bytes(
            core::ptr::with_exposed_provenance_mut::<u8>(ptr as usize),
            0,
            bytes as usize,
        );
    }
}
