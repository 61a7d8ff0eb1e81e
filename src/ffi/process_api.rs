//! One pool per process, however many copies of cupool are loaded.
//!
//! A program may link `libcupool.so` (or `libcupool.a`) and also run under
//! `libcupool_preload.so`, which carries its own copy of this crate. Each copy has its own
//! statics, so without care there would be two pools, two sets of stats, and a block from
//! one freed into the other.
//!
//! Note [process API]: every copy exports `cupool_process_api_v1`, which returns a table of
//! that copy's own C entry points. On first use, each copy looks that symbol up through the
//! real `dlsym(RTLD_DEFAULT, ..)`, which searches the global scope in one fixed order
//! (executable, `LD_PRELOAD` libraries, then libraries in load order). Every copy therefore
//! finds the *same* definition: the copy that owns it runs its own pool, every other copy
//! forwards each call through the owner's table. The answer is cached in one atomic
//! pointer, so the cost on every call is one acquire load.
//!
//! The public `dlsym` may be the preload library's hook, so the lookup goes through glibc's
//! own `dlsym` ([`crate::dl`], Note [real dlsym]).

use super::ipc::CupoolIpcHandle;
use super::{CUstream_st, CupoolStatus};
use crate::stats::{CupoolHostStats, CupoolStats};
use core::ffi::{c_char, c_int, c_uint, c_void};
use core::ptr;
use core::sync::atomic::{AtomicPtr, Ordering};

/// Version 1 of the table of C entry points one copy of cupool offers the others. Later
/// versions only append fields; `size` tells a reader which ones exist.
#[repr(C)]
pub struct ProcessApiV1 {
    /// `size_of::<ProcessApiV1>()` of the copy that built the table.
    pub size: usize,
    pub alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> CupoolStatus,
    pub alloc_async:
        unsafe extern "C" fn(*mut *mut c_void, usize, *mut CUstream_st) -> CupoolStatus,
    pub free: unsafe extern "C" fn(*mut c_void) -> CupoolStatus,
    pub free_async: unsafe extern "C" fn(*mut c_void, *mut CUstream_st) -> CupoolStatus,
    pub get_stats: unsafe extern "C" fn(c_int, *mut CupoolStats) -> CupoolStatus,
    pub stats_json: unsafe extern "C" fn(c_int, *mut c_char, usize, *mut usize) -> CupoolStatus,
    pub reset_peak_stats: unsafe extern "C" fn(c_int) -> CupoolStatus,
    pub empty_cache: unsafe extern "C" fn(*mut usize) -> CupoolStatus,
    pub empty_cache_device: unsafe extern "C" fn(c_int, *mut usize) -> CupoolStatus,
    pub set_memory_limit: unsafe extern "C" fn(c_int, usize) -> CupoolStatus,
    pub get_memory_limit: unsafe extern "C" fn(c_int, *mut usize) -> CupoolStatus,
    pub config_set: unsafe extern "C" fn(*const c_char, *const c_char) -> CupoolStatus,
    pub config_get:
        unsafe extern "C" fn(*const c_char, *mut c_char, usize, *mut usize) -> CupoolStatus,
    pub interposition_active: unsafe extern "C" fn() -> c_int,
    pub set_interposition_active: unsafe extern "C" fn(c_int),
    pub trace_start: unsafe extern "C" fn(*const c_char) -> CupoolStatus,
    pub trace_stop: unsafe extern "C" fn() -> CupoolStatus,
    pub alloc_async_device:
        unsafe extern "C" fn(*mut *mut c_void, usize, c_int, *mut CUstream_st) -> CupoolStatus,
    pub mem_get_info: unsafe extern "C" fn(c_int, *mut usize, *mut usize) -> CupoolStatus,
    pub segment_of:
        unsafe extern "C" fn(*const c_void, *mut *mut c_void, *mut usize) -> CupoolStatus,
    pub segments_json: unsafe extern "C" fn(c_int, *mut c_char, usize, *mut usize) -> CupoolStatus,
    pub reserve: unsafe extern "C" fn(c_int, usize, *mut usize) -> CupoolStatus,
    pub capture_begin: unsafe extern "C" fn() -> CupoolStatus,
    pub capture_end: unsafe extern "C" fn() -> CupoolStatus,
    pub host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> CupoolStatus,
    pub host_alloc_async:
        unsafe extern "C" fn(*mut *mut c_void, usize, *mut CUstream_st) -> CupoolStatus,
    pub host_free: unsafe extern "C" fn(*mut c_void) -> CupoolStatus,
    pub host_free_async: unsafe extern "C" fn(*mut c_void, *mut CUstream_st) -> CupoolStatus,
    pub host_get_stats: unsafe extern "C" fn(*mut CupoolHostStats) -> CupoolStatus,
    pub host_stats_json: unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> CupoolStatus,
    pub host_reset_peak_stats: unsafe extern "C" fn() -> CupoolStatus,
    pub host_empty_cache: unsafe extern "C" fn(*mut usize) -> CupoolStatus,
    /// Appended: read only when `size` is at least [`SIZE_WITH_FREE_IN_ORDER`].
    pub free_in_allocation_order: Option<unsafe extern "C" fn(*mut c_void) -> CupoolStatus>,
    /// Appended with the IPC calls (an owner's table is never smaller than this copy's).
    pub ipc_get_handle:
        Option<unsafe extern "C" fn(*mut CupoolIpcHandle, *const c_void) -> CupoolStatus>,
    pub ipc_open_handle: Option<
        unsafe extern "C" fn(*mut *mut c_void, *const CupoolIpcHandle, c_uint) -> CupoolStatus,
    >,
    pub ipc_close_handle: Option<unsafe extern "C" fn(*mut c_void) -> CupoolStatus>,
    pub shareable_range:
        Option<unsafe extern "C" fn(*const c_void, *mut *mut c_void, *mut usize) -> CupoolStatus>,
    /// Appended with the footprint export.
    pub footprint_json:
        Option<unsafe extern "C" fn(c_int, *mut c_char, usize, *mut usize) -> CupoolStatus>,
}

/// The table's size once `free_in_allocation_order` was appended.
pub const SIZE_WITH_FREE_IN_ORDER: usize = core::mem::size_of::<ProcessApiV1>();

static OWN_API: ProcessApiV1 = ProcessApiV1 {
    size: core::mem::size_of::<ProcessApiV1>(),
    alloc: super::cupool_alloc,
    alloc_async: super::cupool_alloc_async,
    free: super::cupool_free,
    free_async: super::cupool_free_async,
    get_stats: super::cupool_get_stats,
    stats_json: super::cupool_stats_json,
    reset_peak_stats: super::cupool_reset_peak_stats,
    empty_cache: super::cupool_empty_cache,
    empty_cache_device: super::cupool_empty_cache_device,
    set_memory_limit: super::cupool_set_memory_limit,
    get_memory_limit: super::cupool_get_memory_limit,
    config_set: super::cupool_config_set,
    config_get: super::cupool_config_get,
    interposition_active: super::cupool_interposition_active,
    set_interposition_active: super::set_interposition_active_entry,
    trace_start: super::cupool_trace_start,
    trace_stop: super::cupool_trace_stop,
    alloc_async_device: super::device::cupool_alloc_async_device,
    mem_get_info: super::device::cupool_mem_get_info,
    segment_of: super::device::cupool_segment_of,
    segments_json: super::device::cupool_segments_json,
    reserve: super::device::cupool_reserve,
    capture_begin: super::capture::cupool_capture_begin,
    capture_end: super::capture::cupool_capture_end,
    host_alloc: super::pinned::cupool_host_alloc,
    host_alloc_async: super::pinned::cupool_host_alloc_async,
    host_free: super::pinned::cupool_host_free,
    host_free_async: super::pinned::cupool_host_free_async,
    host_get_stats: super::pinned::cupool_host_get_stats,
    host_stats_json: super::pinned::cupool_host_stats_json,
    host_reset_peak_stats: super::pinned::cupool_host_reset_peak_stats,
    host_empty_cache: super::pinned::cupool_host_empty_cache,
    free_in_allocation_order: Some(super::cupool_free_in_allocation_order),
    ipc_get_handle: Some(super::ipc::cupool_ipc_get_handle),
    ipc_open_handle: Some(super::ipc::cupool_ipc_open_handle),
    ipc_close_handle: Some(super::ipc::cupool_ipc_close_handle),
    shareable_range: Some(super::ipc::shareable_range),
    footprint_json: Some(super::device::cupool_footprint_json),
};

/// This copy's table, for the other copies of cupool in the process. Not in the header.
#[no_mangle]
pub extern "C" fn cupool_process_api_v1() -> *const ProcessApiV1 {
    &OWN_API
}

/// The table calls go to: null until resolved, then `&OWN_API` or another copy's table.
static OWNER_API: AtomicPtr<ProcessApiV1> = AtomicPtr::new(ptr::null_mut());

fn own_api() -> *mut ProcessApiV1 {
    ptr::addr_of!(OWN_API).cast_mut()
}

/// The table of the copy that owns the process's pool when that is another copy; `None`
/// when this copy owns it. One acquire load once resolved.
#[inline]
pub fn other_copy() -> Option<&'static ProcessApiV1> {
    let api = OWNER_API.load(Ordering::Acquire);
    if api == own_api() {
        None
    } else if api.is_null() {
        resolve_owner()
    } else {
        // SAFETY: a non-null value other than ours came from `find_owner`, which checked it;
        // libraries that export the table are never unloaded while their pool is in use.
        Some(unsafe { &*api })
    }
}

/// Whether calls made through this copy run in another copy's pool (for the preload crate,
/// whose hooks call the runtime directly).
pub fn forwards_to_other_copy() -> bool {
    other_copy().is_some()
}

#[cold]
#[inline(never)]
fn resolve_owner() -> Option<&'static ProcessApiV1> {
    let found = find_owner().unwrap_or_else(own_api);
    // Racing threads find the same owner (the global scope does not change order), so the
    // first store stands and later ones are equal.
    let _ = OWNER_API.compare_exchange(ptr::null_mut(), found, Ordering::AcqRel, Ordering::Acquire);
    let api = OWNER_API.load(Ordering::Acquire);
    if api == own_api() {
        None
    } else {
        // SAFETY: as in `other_copy`.
        Some(unsafe { &*api })
    }
}

type GetApi = extern "C" fn() -> *const ProcessApiV1;

/// The table of the first `cupool_process_api_v1` in the global scope when it is not ours.
fn find_owner() -> Option<*mut ProcessApiV1> {
    // SAFETY: glibc's own dlsym, called with a valid pseudo-handle and a C string.
    let symbol =
        unsafe { crate::dl::dlsym(crate::dl::RTLD_DEFAULT, c"cupool_process_api_v1".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: every copy of cupool exports this symbol with this signature.
    let get_api: GetApi = unsafe { core::mem::transmute::<*mut c_void, GetApi>(symbol) };
    let table = get_api();
    // Compare tables, not functions: `OWN_API` is not exported, so its address is this
    // copy's own, while our reference to an exported function may itself have been bound
    // to the other copy's definition by the dynamic linker.
    if table.is_null() || table == own_api().cast_const() {
        return None;
    }
    // SAFETY: the table is a static of the other copy.
    let size = unsafe { (*table).size };
    if size < core::mem::size_of::<ProcessApiV1>() {
        crate::log::error(
            "cupool: another copy of cupool in this process has an older process API; this copy keeps its own pool",
        );
        return None;
    }
    crate::log::debug("cupool: another copy of cupool owns this process's pool; forwarding to it");
    Some(table.cast_mut())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_copy_owns_its_pool() {
        // The test binary links this crate once, statically, without exporting its symbols
        // to the global scope: the lookup finds nothing else, so nothing is forwarded.
        assert!(other_copy().is_none());
        assert_eq!(OWNER_API.load(Ordering::Acquire), own_api());
    }
}
