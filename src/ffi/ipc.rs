//! CUDA IPC of pool blocks through the C API: what a program that links cupool (or
//! PyTorch's allocator shim) calls where it would call `cudaIpcGetMemHandle`,
//! `cudaIpcOpenMemHandle` and `cudaIpcCloseMemHandle`, whose driver handles cannot
//! describe a block that shares its driver allocation or lives in the VMM arena (Note [ipc
//! registry] in `runtime/ipc`). Same three steps as every export (see [`super`]).

use super::{guard, process_api, required, to_c_pointer, write_range_of};
use crate::backend::BackendError;
use crate::runtime::{runtime, Runtime};
use crate::status::CupoolStatus::{self, *};
use core::ffi::{c_uint, c_void};

/// An IPC handle: 64 bytes, laid out as CUDA's `cudaIpcMemHandle_t` / `CUipcMemHandle`, so
/// that it can travel wherever those do.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CupoolIpcHandle {
    pub reserved: [u8; 64],
}

/// Writes to `*handle_out` an IPC handle for the block that contains `ptr`, which another
/// process opens with `cupool_ipc_open_handle` at the block's start (an interior pointer
/// names its whole block, as CUDA's handles name their whole allocation).
///
/// - A block that is a whole driver allocation: the driver's own handle, which any
///   process opens, with cupool or with `cudaIpcOpenMemHandle`.
/// - A block that shares its driver allocation, or a block of the VMM arena (`vmm:on`): a
///   cupool handle, which only a process with cupool opens (this API, or
///   `cudaIpcOpenMemHandle` under `libcupool_preload.so`); CUDA refuses it elsewhere, so
///   it never maps the wrong bytes. The importer can reach the block's whole driver
///   allocation (neighbours included), or for an arena block its chunks only. An arena
///   export needs `/dev/shm` and, in the importer, `pidfd_getfd` on the exporter.
/// - A pointer that is no pool block: the driver's `cuIpcGetMemHandle`.
///
/// An exported block's memory stays with the process until it exits, even after the
/// block is freed and `cupool_empty_cache`. NULL `handle_out`:
/// `CUPOOL_ERROR_INVALID_VALUE`; the driver's refusal: `CUPOOL_ERROR_INVALID_VALUE` for a
/// pointer or handle it does not know, `CUPOOL_ERROR_CUDA` otherwise (the same for the two
/// calls below); memory that cannot be exported, or no CUDA backend (the host backend has
/// no IPC): `CUPOOL_ERROR_BACKEND_UNAVAILABLE`.
///
/// # Safety
/// `handle_out` is NULL or valid for writing one `cupool_ipc_handle`.
#[no_mangle]
pub unsafe extern "C" fn cupool_ipc_get_handle(
    handle_out: *mut CupoolIpcHandle,
    ptr: *const c_void,
) -> CupoolStatus {
    if let Some(f) = process_api::other_copy().and_then(|api| api.ipc_get_handle) {
        return f(handle_out, ptr);
    }
    guard(|| {
        let out = required(handle_out)?;
        let reserved = runtime()?
            .ipc_handle(ptr as usize as u64)
            .map_err(status_of)?;
        out.write(CupoolIpcHandle { reserved });
        Ok(())
    })
}

/// Maps the memory `handle` names (from `cupool_ipc_get_handle` in another process, or a
/// driver handle from `cudaIpcGetMemHandle`) into the calling thread's current context and
/// writes its start to `*ptr_out`. `flags` are `cudaIpcOpenMemHandle`'s
/// (`cudaIpcMemLazyEnablePeerAccess` = 1); they apply to driver allocations. A cupool
/// handle opened again gives the same pointer (each open is counted); a driver handle is
/// the driver's to open, once per context. Close each open with `cupool_ipc_close_handle`.
///
/// NULL `ptr_out` or `handle`: `CUPOOL_ERROR_INVALID_VALUE`, as for a cupool handle whose
/// exporter has exited or that it did not make; the system's refusal to hand over the
/// exporter's memory descriptors: `CUPOOL_ERROR_BACKEND_UNAVAILABLE`.
///
/// # Safety
/// `ptr_out` is NULL or valid for writing one pointer; `handle` is NULL or valid for
/// reading one `cupool_ipc_handle`.
#[no_mangle]
pub unsafe extern "C" fn cupool_ipc_open_handle(
    ptr_out: *mut *mut c_void,
    handle: *const CupoolIpcHandle,
    flags: c_uint,
) -> CupoolStatus {
    if let Some(f) = process_api::other_copy().and_then(|api| api.ipc_open_handle) {
        return f(ptr_out, handle, flags);
    }
    guard(|| {
        let out = required(ptr_out)?;
        let handle = required(handle.cast_mut())?.read();
        let ptr = runtime()?
            .ipc_open(&handle.reserved, flags)
            .map_err(status_of)?;
        out.write(to_c_pointer(ptr)?);
        Ok(())
    })
}

/// Unmaps what `cupool_ipc_open_handle` mapped at `ptr` once every open of its handle is
/// closed. A pointer it did not hand out goes to the driver's `cuIpcCloseMemHandle`; NULL:
/// `CUPOOL_ERROR_INVALID_VALUE`.
///
/// # Safety
/// Any `ptr` value may be passed.
#[no_mangle]
pub unsafe extern "C" fn cupool_ipc_close_handle(ptr: *mut c_void) -> CupoolStatus {
    if let Some(f) = process_api::other_copy().and_then(|api| api.ipc_close_handle) {
        return f(ptr);
    }
    guard(|| {
        if ptr.is_null() {
            return Err(CupoolErrorInvalidValue);
        }
        runtime()?
            .ipc_close(ptr as usize as u64)
            .map_err(status_of)?;
        Ok(())
    })
}

/// The status for a failed IPC step: the driver's refusal of a pointer or handle it does not
/// know (`CUDA_ERROR_INVALID_VALUE`, `CUDA_ERROR_INVALID_HANDLE`) is an invalid value here,
/// any other driver failure `CUPOOL_ERROR_CUDA`.
fn status_of(e: BackendError) -> CupoolStatus {
    const INVALID_VALUE: u32 = 1;
    const INVALID_HANDLE: u32 = 400;
    match e {
        BackendError::Driver(INVALID_VALUE | INVALID_HANDLE) => CupoolErrorInvalidValue,
        e => e.into(),
    }
}

/// What an IPC handle of the live block containing `ptr` maps (Runtime::shareable_range),
/// for the PyTorch hook `cupool_torch_base_allocation`; through the process API, so that it
/// answers from the copy of cupool that owns the pool. Not in the header.
///
/// # Safety
/// Any `ptr`; `base_out` and `size_out` are NULL or valid for a write.
pub(super) unsafe extern "C" fn shareable_range(
    ptr: *const c_void,
    base_out: *mut *mut c_void,
    size_out: *mut usize,
) -> CupoolStatus {
    if let Some(f) = process_api::other_copy().and_then(|api| api.shareable_range) {
        return f(ptr, base_out, size_out);
    }
    write_range_of(ptr, base_out, size_out, Runtime::shareable_range)
}
