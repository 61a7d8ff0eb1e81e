//! Anonymous memory mappings at a chosen alignment: the host backend's simulated device
//! memory and reservations, and the pieces the pool's metadata is carved from.
//! Under Miri they hand out zeroed memory of the global allocator instead (Note [host pages
//! under Miri] in `backend/host/pages.rs`).

/// An anonymous private `MAP_NORESERVE` mapping of `bytes` with protection `prot`, starting
/// at a multiple of `align`: a mapping `align` longer, with the unaligned head and the tail
/// trimmed, so that exactly `[start, start + bytes)` (page-rounded) stays mapped.
#[cfg(not(miri))]
pub(crate) fn map_aligned(bytes: usize, align: usize, prot: libc::c_int) -> Option<u64> {
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

/// Under Miri (Note [host pages under Miri]): zeroed memory from the global allocator, its
/// provenance exposed for the integer pointers.
#[cfg(miri)]
pub(crate) fn map_aligned(bytes: usize, align: usize, _prot: libc::c_int) -> Option<u64> {
    let layout = std::alloc::Layout::from_size_align(bytes.max(1), align).ok()?;
    // SAFETY: a layout of non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    (!p.is_null()).then(|| p.expose_provenance() as u64)
}

/// Unmaps `bytes` at `ptr`, all of what [`map_aligned`] mapped there with `align`.
///
/// # Safety
/// `ptr` came from `map_aligned(bytes, align, _)`, and nothing uses it after this.
#[cfg(not(miri))]
pub(crate) unsafe fn unmap_aligned(ptr: u64, bytes: u64, _align: usize) {
    libc::munmap(ptr as *mut libc::c_void, bytes as usize);
}

#[cfg(miri)]
pub(crate) unsafe fn unmap_aligned(ptr: u64, bytes: u64, align: usize) {
    let layout = std::alloc::Layout::from_size_align(bytes.max(1) as usize, align).unwrap();
    std::alloc::dealloc(core::ptr::with_exposed_provenance_mut(ptr as usize), layout);
}
