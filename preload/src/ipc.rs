//! CUDA IPC of pool blocks: `cuIpcGetMemHandle`, `cuIpcOpenMemHandle(_v2)`,
//! `cuIpcCloseMemHandle` (what `cudaIpcGetMemHandle`, `cudaIpcOpenMemHandle` and
//! `cudaIpcCloseMemHandle` become). The library answers for pool blocks and for the
//! handles it made (Note [ipc registry] in `cupool::runtime::ipc`, which the C API's
//! `cupool_ipc_*` calls share); everything else goes to the driver unchanged.

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::{sig, IpcOpenFn, RealFn};
use core::ffi::{c_uint, c_void};
use cupool::runtime::ipc::{is_cupool_handle, BackendError};

const NO_DRIVER: CuResult = CUDA_ERROR_NOT_INITIALIZED;
const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
const CUDA_ERROR_DEINITIALIZED: CuResult = 4;

/// The CUDA status for a failed pool or driver step.
fn code_of(e: BackendError) -> CuResult {
    match e {
        BackendError::OutOfMemory => CUDA_ERROR_OUT_OF_MEMORY,
        BackendError::Unavailable => CUDA_ERROR_NOT_SUPPORTED,
        BackendError::ShuttingDown => CUDA_ERROR_DEINITIALIZED,
        BackendError::Capturing => CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        BackendError::InvalidValue => CUDA_ERROR_INVALID_VALUE,
        BackendError::Driver(code) => code as CuResult,
    }
}

// ---- cuIpcGetMemHandle ---------------------------------------------------------------

/// `cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)` (Note [ipc registry]).
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut c_void, dptr: CuDevicePtr) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcGetMemHandle", || unsafe {
        get_mem_handle(handle, dptr)
    })
}

unsafe fn get_mem_handle(handle: *mut c_void, dptr: CuDevicePtr) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::IpcGetMemHandle>() else {
        return NO_DRIVER;
    };
    let (Some(rt), false) = (lifecycle::runtime_if_started(), handle.is_null()) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(handle, dptr) };
    };
    match rt.ipc_handle_of_block(dptr) {
        Ok(Some(h)) => {
            // SAFETY: the caller's out-parameter, non-NULL.
            unsafe {
                handle
                    .cast::<CuIpcMemHandle>()
                    .write_unaligned(CuIpcMemHandle { reserved: h })
            };
            CUDA_SUCCESS
        }
        // No pool block: the driver's answer.
        // SAFETY: forwarded unchanged.
        Ok(None) => unsafe { real(handle, dptr) },
        Err(e) => code_of(e),
    }
}

// ---- cuIpcOpenMemHandle(_v2), cuIpcCloseMemHandle ------------------------------------

/// `cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcOpenMemHandle", || unsafe {
        open_mem_handle::<sig::IpcOpenMemHandle>(pdptr, handle, flags)
    })
}

/// `cuIpcOpenMemHandle_v2`: the same signature.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcOpenMemHandle_v2", || unsafe {
        open_mem_handle::<sig::IpcOpenMemHandleV2>(pdptr, handle, flags)
    })
}

unsafe fn open_mem_handle<S: RealFn<Fn = IpcOpenFn>>(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    let Some(real) = real::get::<S>() else {
        return NO_DRIVER;
    };
    if pdptr.is_null() || lifecycle::pass_through() || !is_cupool_handle(&handle.reserved) {
        // SAFETY: forwarded unchanged.
        return unsafe { real(pdptr, handle, flags) };
    }
    let Some(rt) = lifecycle::runtime() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    match rt.ipc_open_cupool_handle(&handle.reserved, flags) {
        Ok(Some(ptr)) => {
            // SAFETY: non-NULL out-parameter supplied by the caller.
            unsafe { *pdptr = ptr };
            CUDA_SUCCESS
        }
        // SAFETY: forwarded unchanged (not reached: the handle is cupool's).
        Ok(None) => unsafe { real(pdptr, handle, flags) },
        Err(e) => code_of(e),
    }
}

/// `cuIpcCloseMemHandle(CUdeviceptr dptr)`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CuDevicePtr) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcCloseMemHandle", || unsafe {
        let Some(real) = real::get::<sig::IpcCloseMemHandle>() else {
            return NO_DRIVER;
        };
        let closed =
            lifecycle::runtime_if_started().and_then(|rt| rt.ipc_close_cupool_pointer(dptr));
        match closed {
            Some(Ok(())) => CUDA_SUCCESS,
            Some(Err(e)) => code_of(e),
            None => real(dptr),
        }
    })
}

const _: () = assert!(core::mem::size_of::<CuIpcMemHandle>() == 64);
