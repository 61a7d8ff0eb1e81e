//! Host memory standing in for device memory: mappings that cost nothing until touched,
//! and `PROT_NONE` reservations for the simulated VMM arena (Note [host vmm]).

use super::HOST_VMM_GRANULE;

/// Simulated device memory: an anonymous private mapping with `MAP_NORESERVE`, so a page
/// costs host memory only once something writes to it. Tests that write into their blocks
/// get real memory; a replay of a trace that reserved tens of GiB on a GPU touches none of
/// it and runs on a small machine. Segments of 2 MiB and more are 2 MiB aligned, as the
/// driver aligns them; smaller ones page aligned (the pool needs 512).
pub(super) fn map_device_memory(bytes: u64) -> Option<u64> {
    const HUGE: usize = 2 << 20;
    let bytes = usize::try_from(bytes).ok()?;
    let align = if bytes >= HUGE { HUGE } else { 4096 };
    map_aligned(bytes, align, libc::PROT_READ | libc::PROT_WRITE)
}

/// A `PROT_NONE` reservation of `bytes` (a multiple of [`HOST_VMM_GRANULE`]) aligned to
/// the granule.
pub(super) fn reserve_address_space(bytes: u64) -> Option<u64> {
    let bytes = usize::try_from(bytes).ok()?;
    map_aligned(bytes, HOST_VMM_GRANULE as usize, libc::PROT_NONE)
}

/// An anonymous private `MAP_NORESERVE` mapping of `bytes` with protection `prot`, starting
/// at a multiple of `align`: a mapping `align` longer, with the unaligned head and the tail
/// trimmed, so that exactly `[start, start + bytes)` (page-rounded) stays mapped.
fn map_aligned(bytes: usize, align: usize, prot: libc::c_int) -> Option<u64> {
    let span = bytes.checked_add(align)?;
    // SAFETY: a fresh anonymous mapping; nothing else refers to it.
    let base = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            span,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as usize;
    let start = base.next_multiple_of(align);
    let end = (start + bytes).next_multiple_of(4096);
    // SAFETY: both ranges lie inside the mapping made above and are page aligned.
    unsafe {
        if start > base {
            libc::munmap(base as *mut libc::c_void, start - base);
        }
        if base + span > end {
            libc::munmap(end as *mut libc::c_void, base + span - end);
        }
    }
    Some(start as u64)
}

/// Unmaps what [`map_device_memory`] mapped.
pub(super) fn unmap_device_memory(ptr: u64, bytes: u64) {
    // SAFETY: `ptr` came from map_device_memory with this size and was removed from the
    // allocation table once, so nothing maps it twice or uses it after this.
    unsafe { libc::munmap(ptr as *mut libc::c_void, bytes as usize) };
}
