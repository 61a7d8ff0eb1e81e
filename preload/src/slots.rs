//! The driver functions whose real addresses the interposer keeps: for each, the exact name
//! libcuda exports and the function-pointer type of that export, in one list. It imports no
//! hook module, so every module can use it without a cycle.
//!
//! A hook reaches the real function with `real::get::<sig::MemAlloc>()`: the marker type
//! carries both the slot and its signature, so a slot cannot be called through the wrong
//! pointer type (the pairing is written once, below, next to the exported name). The
//! signatures' type names end in `Fn` so that a marker (`sig::MemFreeAsync`) never shadows
//! the type it carries.

use crate::cuda::{CuDevicePtr, CuHandle, CuResult};
use core::ffi::{c_char, c_int, c_uint, c_void};

/// A slot's marker type (in [`sig`]): which slot, and the real function's type.
pub trait RealFn {
    const SLOT: Slot;
    /// `unsafe extern "C" fn(...) -> CUresult` with the driver's exact signature.
    type Fn: Copy;
}

macro_rules! slots {
    ($( $(#[$doc:meta])* $slot:ident = $name:literal : $fn_type:ty; )*) => {
        /// A driver function whose real address the interposer keeps.
        #[derive(Copy, Clone, Debug, PartialEq, Eq)]
        #[repr(usize)]
        pub enum Slot {
            $( $(#[$doc])* $slot, )*
        }

        /// Number of [`Slot`]s.
        pub const SLOT_COUNT: usize = [$(Slot::$slot),*].len();

        impl Slot {
            /// Every slot, in index order.
            pub const ALL: [Slot; SLOT_COUNT] = [$(Slot::$slot),*];

            /// The name libcuda exports for this exact variant, NUL-terminated.
            pub const fn exported_name(self) -> &'static [u8] {
                match self {
                    $( Slot::$slot => concat!($name, "\0").as_bytes(), )*
                }
            }
        }

        /// One marker type per slot: `real::get::<sig::Slot>()`.
        pub mod sig {
            use super::*;
            $(
                #[doc = concat!("`", $name, "`.")]
                pub struct $slot;
                impl RealFn for $slot {
                    const SLOT: Slot = Slot::$slot;
                    type Fn = $fn_type;
                }
            )*
        }
    };
}

type BeginV1Fn = unsafe extern "C" fn(CuHandle) -> CuResult;
type BeginV2Fn = unsafe extern "C" fn(CuHandle, c_int) -> CuResult;
type BeginToGraphFn = unsafe extern "C" fn(
    CuHandle,
    CuHandle,
    *const c_void,
    *const c_void,
    usize,
    c_int,
) -> CuResult;
type EndFn = unsafe extern "C" fn(CuHandle, *mut CuHandle) -> CuResult;
/// `cuIpcOpenMemHandle` and its `_v2` (the same signature; the handle by value).
pub type IpcOpenFn =
    unsafe extern "C" fn(*mut CuDevicePtr, crate::cuda::CuIpcMemHandle, c_uint) -> CuResult;
/// `cuStreamDestroy`, `cuCtxDestroy` (each variant): one handle.
pub type HandleFn = unsafe extern "C" fn(CuHandle) -> CuResult;
/// `cuDevicePrimaryCtxReset` and its `_v2`: a device ordinal.
pub type DeviceFn = unsafe extern "C" fn(c_int) -> CuResult;
/// `cuMemFreeAsync` and its `_ptsz` variant.
pub type MemFreeAsyncFn = unsafe extern "C" fn(CuDevicePtr, CuHandle) -> CuResult;

slots! {
    MemAlloc = "cuMemAlloc_v2": unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult;
    MemFree = "cuMemFree_v2": unsafe extern "C" fn(CuDevicePtr) -> CuResult;
    MemGetInfo = "cuMemGetInfo_v2": unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
    MemGetAddressRange = "cuMemGetAddressRange_v2":
        unsafe extern "C" fn(*mut CuDevicePtr, *mut usize, CuDevicePtr) -> CuResult;
    IpcGetMemHandle = "cuIpcGetMemHandle":
        unsafe extern "C" fn(*mut c_void, CuDevicePtr) -> CuResult;
    IpcOpenMemHandle = "cuIpcOpenMemHandle": IpcOpenFn;
    IpcOpenMemHandleV2 = "cuIpcOpenMemHandle_v2": IpcOpenFn;
    IpcCloseMemHandle = "cuIpcCloseMemHandle": unsafe extern "C" fn(CuDevicePtr) -> CuResult;
    PointerGetAttribute = "cuPointerGetAttribute":
        unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult;
    PointerGetAttributes = "cuPointerGetAttributes":
        unsafe extern "C" fn(c_uint, *mut c_int, *mut *mut c_void, CuDevicePtr) -> CuResult;
    MemFreeAsync = "cuMemFreeAsync": MemFreeAsyncFn;
    MemFreeAsyncPtsz = "cuMemFreeAsync_ptsz": MemFreeAsyncFn;
    BeginCapture = "cuStreamBeginCapture": BeginV1Fn;
    BeginCapturePtsz = "cuStreamBeginCapture_ptsz": BeginV1Fn;
    BeginCaptureV2 = "cuStreamBeginCapture_v2": BeginV2Fn;
    BeginCaptureV2Ptsz = "cuStreamBeginCapture_v2_ptsz": BeginV2Fn;
    BeginCaptureToGraph = "cuStreamBeginCaptureToGraph": BeginToGraphFn;
    BeginCaptureToGraphPtsz = "cuStreamBeginCaptureToGraph_ptsz": BeginToGraphFn;
    EndCapture = "cuStreamEndCapture": EndFn;
    EndCapturePtsz = "cuStreamEndCapture_ptsz": EndFn;
    GetProcAddress = "cuGetProcAddress":
        unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> CuResult;
    GetProcAddressV2 = "cuGetProcAddress_v2":
        unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> CuResult;
    CtxEnablePeerAccess = "cuCtxEnablePeerAccess":
        unsafe extern "C" fn(CuHandle, c_uint) -> CuResult;
    CtxDisablePeerAccess = "cuCtxDisablePeerAccess": unsafe extern "C" fn(CuHandle) -> CuResult;
    StreamCreate = "cuStreamCreate": unsafe extern "C" fn(*mut CuHandle, c_uint) -> CuResult;
    StreamCreateWithPriority = "cuStreamCreateWithPriority":
        unsafe extern "C" fn(*mut CuHandle, c_uint, c_int) -> CuResult;
    GreenCtxStreamCreate = "cuGreenCtxStreamCreate":
        unsafe extern "C" fn(*mut CuHandle, CuHandle, c_uint, c_int) -> CuResult;
    StreamDestroyV1 = "cuStreamDestroy": HandleFn;
    StreamDestroy = "cuStreamDestroy_v2": HandleFn;
    CtxDestroy = "cuCtxDestroy_v2": HandleFn;
    PrimaryCtxResetV1 = "cuDevicePrimaryCtxReset": DeviceFn;
    PrimaryCtxReset = "cuDevicePrimaryCtxReset_v2": DeviceFn;
    MemHostAlloc = "cuMemHostAlloc":
        unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult;
    MemAllocHost = "cuMemAllocHost_v2": unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult;
    MemFreeHost = "cuMemFreeHost": unsafe extern "C" fn(*mut c_void) -> CuResult;
    /// Not hooked: the hooks use it to find the calling thread's context.
    CtxGetCurrent = "cuCtxGetCurrent": unsafe extern "C" fn(*mut CuHandle) -> CuResult;
}
