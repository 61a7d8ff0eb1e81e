//! The few CUDA driver types and constants the hooks need, written locally: the preload
//! library must not depend on any CUDA header or library at build or load time.

use core::ffi::{c_int, c_void};

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdeviceptr` (the 64-bit `CUdeviceptr_v2`).
pub type CuDevicePtr = u64;
/// `CUstream`, `CUcontext`, `CUgraph`: opaque handles.
pub type CuHandle = *mut c_void;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CuResult = 901;
pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

/// `cuGetProcAddress` flag asking for the per-thread-default-stream (`_ptsz`) variants.
pub const CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM: u64 = 2;

/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: a `CUdeviceptr` is written.
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: a `size_t` is written.
pub const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;

/// `CU_STREAM_PER_THREAD`: what stream 0 means to a `_ptsz` entry point.
pub const CU_STREAM_PER_THREAD: usize = 2;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value to `cuIpcOpenMemHandle`.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CuIpcMemHandle {
    pub reserved: [u8; 64],
}
