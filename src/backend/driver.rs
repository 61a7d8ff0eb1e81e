//! The CUDA driver's function table, loaded at run time.
//!
//! `libcuda.so.1` is opened with `dlopen` (no link-time dependency on any CUDA library), its
//! `cuGetProcAddress_v2` found with the *real* `dlsym`, and every other function asked of
//! `cuGetProcAddress_v2` by base name at an explicit version with flags 0, the way the CUDA
//! runtime does it. This always yields the driver's own functions:
//! - in the LD_PRELOAD library the public `dlsym` is our own hook, and the driver-level
//!   symbols (`cuMemAlloc_v2`, ...) may be our own exports; `cuGetProcAddress_v2` of the
//!   driver returns the driver's internal entry points, which nothing interposes;
//! - a versioned query picks the ABI variant we were written against (`cuMemAlloc@3020` is
//!   `cuMemAlloc_v2`), whatever the default for the bare name is.
//!
//! Why not cudarc's loader: it resolves every symbol through `libloading`, i.e. the public
//! `dlsym` (our own hook inside the preload library), and panics when the library or a
//! symbol is missing; neither is acceptable behind a C boundary. cudarc is used for types
//! only.
//!
//! Every function pointer returns the raw `CUresult` as a `u32`: the driver may return codes
//! newer than any Rust enum we compile against, and an unknown discriminant in a Rust enum is
//! undefined behaviour. A symbol the driver lacks is `None` and fails only the calls that
//! need it.

use core::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::cell::Cell;
use std::sync::OnceLock;

use cudarc::driver::sys::{CUcontext, CUdevice, CUdeviceptr, CUevent, CUstream};

use super::{BackendError, BackendResult};
use crate::log;

/// A raw `CUresult`.
pub type CuResult = u32;

/// `CUresult` codes the backend tells apart.
pub mod code {
    use super::CuResult;
    pub const SUCCESS: CuResult = 0;
    pub const INVALID_VALUE: CuResult = 1;
    pub const OUT_OF_MEMORY: CuResult = 2;
    pub const NOT_INITIALIZED: CuResult = 3;
    pub const DEINITIALIZED: CuResult = 4;
    pub const STUB_LIBRARY: CuResult = 34;
    pub const INSUFFICIENT_DRIVER: CuResult = 35;
    pub const CALL_REQUIRES_NEWER_DRIVER: CuResult = 36;
    pub const DEVICE_UNAVAILABLE: CuResult = 46;
    /// `CUDA_ERROR_NOT_SUPPORTED`: the device or platform lacks the feature (VMM).
    pub const NOT_SUPPORTED: CuResult = 801;
    pub const NO_DEVICE: CuResult = 100;
    pub const INVALID_DEVICE: CuResult = 101;
    pub const INVALID_HANDLE: CuResult = 400;
    pub const NOT_READY: CuResult = 600;
    pub const SYSTEM_NOT_READY: CuResult = 802;
    pub const SYSTEM_DRIVER_MISMATCH: CuResult = 803;
    pub const COMPAT_NOT_SUPPORTED_ON_DEVICE: CuResult = 804;
    pub const STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;
    pub const STREAM_CAPTURE_INVALIDATED: CuResult = 901;
    /// Last of the stream-capture family (`CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD`).
    pub const STREAM_CAPTURE_WRONG_THREAD: CuResult = 908;
    /// `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`: the legacy stream was asked about while a
    /// blocking stream of its context is capturing.
    pub const STREAM_CAPTURE_IMPLICIT: CuResult = 906;
    pub const UNKNOWN: CuResult = 999;
}

/// The error a failed driver call stands for.
pub fn error_from_code(code: CuResult) -> BackendError {
    match code {
        code::OUT_OF_MEMORY => BackendError::OutOfMemory,
        code::DEINITIALIZED => BackendError::ShuttingDown,
        code::STREAM_CAPTURE_UNSUPPORTED..=code::STREAM_CAPTURE_WRONG_THREAD => {
            BackendError::Capturing
        }
        code::INVALID_VALUE | code::INVALID_HANDLE | code::INVALID_DEVICE => {
            BackendError::InvalidValue
        }
        // No usable driver or device at all.
        code::NOT_INITIALIZED
        | code::STUB_LIBRARY
        | code::INSUFFICIENT_DRIVER
        | code::CALL_REQUIRES_NEWER_DRIVER
        | code::DEVICE_UNAVAILABLE
        | code::NO_DEVICE
        | code::SYSTEM_NOT_READY
        | code::SYSTEM_DRIVER_MISMATCH
        | code::COMPAT_NOT_SUPPORTED_ON_DEVICE
        | code::UNKNOWN => BackendError::Unavailable,
        other => BackendError::Driver(other),
    }
}

/// `Ok` for `CUDA_SUCCESS`, the mapped error otherwise.
#[inline]
pub fn check(code: CuResult) -> BackendResult<()> {
    if code == code::SUCCESS {
        Ok(())
    } else {
        Err(error_from_code(code))
    }
}

/// `Ok` on success, else the driver's own code unmapped (`BackendError::Driver`): for calls
/// whose failure the interposer hands back to the program as it came (legacy IPC).
pub fn check_exact(code: CuResult) -> BackendResult<()> {
    if code == code::SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver(code))
    }
}

/// The function, or `Unavailable` when this driver lacks it.
#[inline]
pub fn required<F: Copy>(f: Option<F>) -> BackendResult<F> {
    f.ok_or(BackendError::Unavailable)
}

pub type GetProcAddressV2Fn = unsafe extern "C" fn(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CuResult;
pub type GetProcAddressV1Fn = unsafe extern "C" fn(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CuResult;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct MemLocation {
    /// `CUmemLocationType` (`CU_MEM_LOCATION_TYPE_DEVICE` = 1).
    pub kind: c_int,
    /// The device ordinal for a device location.
    pub id: c_int,
}

/// `CUmemAllocationProp` (CUDA 10.2 and later; 32 bytes).
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MemAllocationProp {
    /// `CUmemAllocationType` (`CU_MEM_ALLOCATION_TYPE_PINNED` = 1).
    pub kind: c_int,
    /// `CUmemAllocationHandleType` bits (0: no shareable handle).
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    pub win32_handle_meta_data: *mut c_void,
    /// `allocFlags`: compressionType, gpuDirectRDMACapable, usage, `reserved[4]`.
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct MemAccessDesc {
    pub location: MemLocation,
    /// `CUmemAccess_flags` (`CU_MEM_ACCESS_FLAGS_PROT_READWRITE` = 3).
    pub flags: c_int,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value to `cuIpcOpenMemHandle`.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// The driver functions cupool calls. Each is the variant named in its comment.
pub struct DriverApi {
    /// `cuGetProcAddress_v2` (CUDA >= 12.0); `None` on older drivers.
    pub get_proc_address_v2: Option<GetProcAddressV2Fn>,
    /// `cuGetProcAddress` (the 4-argument v1, CUDA 11.3 to 12.x); used when v2 is absent.
    pub get_proc_address_v1: Option<GetProcAddressV1Fn>,
    pub init: Option<unsafe extern "C" fn(flags: c_uint) -> CuResult>,
    pub driver_get_version: Option<unsafe extern "C" fn(*mut c_int) -> CuResult>,
    pub get_error_name: Option<unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>,
    pub device_get: Option<unsafe extern "C" fn(*mut CUdevice, c_int) -> CuResult>,
    pub device_get_count: Option<unsafe extern "C" fn(*mut c_int) -> CuResult>,
    pub device_primary_ctx_retain:
        Option<unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CuResult>,
    pub ctx_get_current: Option<unsafe extern "C" fn(*mut CUcontext) -> CuResult>,
    pub ctx_set_current: Option<unsafe extern "C" fn(CUcontext) -> CuResult>,
    /// `cuCtxPushCurrent_v2`.
    pub ctx_push_current: Option<unsafe extern "C" fn(CUcontext) -> CuResult>,
    /// `cuCtxPopCurrent_v2`.
    pub ctx_pop_current: Option<unsafe extern "C" fn(*mut CUcontext) -> CuResult>,
    pub ctx_get_device: Option<unsafe extern "C" fn(*mut CUdevice) -> CuResult>,
    /// `cuMemAlloc_v2`.
    pub mem_alloc: Option<unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CuResult>,
    /// `cuMemFree_v2`.
    pub mem_free: Option<unsafe extern "C" fn(CUdeviceptr) -> CuResult>,
    /// `cuMemGetInfo_v2`.
    pub mem_get_info: Option<unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult>,
    /// `cuMemGetAddressRange_v2`.
    pub mem_get_address_range:
        Option<unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CuResult>,
    /// `cuStreamGetId` (CUDA >= 12.0).
    pub stream_get_id: Option<unsafe extern "C" fn(CUstream, *mut u64) -> CuResult>,
    /// `cuStreamIsCapturing` (CUDA >= 10.0); the status is a `CUstreamCaptureStatus`.
    pub stream_is_capturing: Option<unsafe extern "C" fn(CUstream, *mut c_int) -> CuResult>,
    pub event_create: Option<unsafe extern "C" fn(*mut CUevent, c_uint) -> CuResult>,
    pub event_record: Option<unsafe extern "C" fn(CUevent, CUstream) -> CuResult>,
    pub event_query: Option<unsafe extern "C" fn(CUevent) -> CuResult>,
    /// `cuStreamWaitEvent(stream, event, flags)`.
    pub stream_wait_event: Option<unsafe extern "C" fn(CUstream, CUevent, c_uint) -> CuResult>,
    pub event_synchronize: Option<unsafe extern "C" fn(CUevent) -> CuResult>,
    /// `cuEventDestroy_v2`.
    pub event_destroy: Option<unsafe extern "C" fn(CUevent) -> CuResult>,
    /// `cuCtxRecordEvent` (CUDA >= 12.5).
    pub ctx_record_event: Option<unsafe extern "C" fn(CUcontext, CUevent) -> CuResult>,
    /// `cuStreamCreate` (replay makes the streams a trace names).
    pub stream_create: Option<unsafe extern "C" fn(*mut CUstream, c_uint) -> CuResult>,
    /// `cuStreamDestroy_v2`.
    pub stream_destroy: Option<unsafe extern "C" fn(CUstream) -> CuResult>,
    /// `cuDeviceGetAttribute`.
    pub device_get_attribute: Option<unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CuResult>,
    /// `cuMemGetAllocationGranularity` (CUDA >= 10.2, as are the VMM functions below).
    pub mem_get_allocation_granularity:
        Option<unsafe extern "C" fn(*mut usize, *const MemAllocationProp, c_int) -> CuResult>,
    /// `cuMemAddressReserve(ptr, size, alignment, addr, flags)`.
    pub mem_address_reserve:
        Option<unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CuResult>,
    /// `cuMemAddressFree(ptr, size)`.
    pub mem_address_free: Option<unsafe extern "C" fn(CUdeviceptr, usize) -> CuResult>,
    /// `cuMemCreate(handle, size, prop, flags)`.
    pub mem_create:
        Option<unsafe extern "C" fn(*mut u64, usize, *const MemAllocationProp, u64) -> CuResult>,
    /// `cuMemRelease(handle)`.
    pub mem_release: Option<unsafe extern "C" fn(u64) -> CuResult>,
    /// `cuMemMap(ptr, size, offset, handle, flags)`.
    pub mem_map: Option<unsafe extern "C" fn(CUdeviceptr, usize, usize, u64, u64) -> CuResult>,
    /// `cuMemUnmap(ptr, size)`.
    pub mem_unmap: Option<unsafe extern "C" fn(CUdeviceptr, usize) -> CuResult>,
    /// `cuMemSetAccess(ptr, size, desc, count)`.
    pub mem_set_access:
        Option<unsafe extern "C" fn(CUdeviceptr, usize, *const MemAccessDesc, usize) -> CuResult>,
    /// `cuMemExportToShareableHandle(shareable, handle, handle_type, flags)` (IPC of
    /// arena blocks: a file descriptor for `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    pub mem_export_to_shareable_handle:
        Option<unsafe extern "C" fn(*mut c_void, u64, c_int, u64) -> CuResult>,
    /// `cuMemImportFromShareableHandle(handle, os_handle, handle_type)`.
    pub mem_import_from_shareable_handle:
        Option<unsafe extern "C" fn(*mut u64, *mut c_void, c_int) -> CuResult>,
    /// `cuIpcGetMemHandle(handle, dptr)`: legacy IPC of a driver allocation.
    pub ipc_get_mem_handle:
        Option<unsafe extern "C" fn(*mut IpcMemHandle, CUdeviceptr) -> CuResult>,
    /// `cuIpcOpenMemHandle_v2(pdptr, handle, flags)`; the handle goes by value.
    pub ipc_open_mem_handle:
        Option<unsafe extern "C" fn(*mut CUdeviceptr, IpcMemHandle, c_uint) -> CuResult>,
    /// `cuIpcCloseMemHandle(dptr)`.
    pub ipc_close_mem_handle: Option<unsafe extern "C" fn(CUdeviceptr) -> CuResult>,
    /// `cuMemHostAlloc(pp, bytesize, flags)`: page-locked host memory (the pinned pool's
    /// chunks).
    pub mem_host_alloc: Option<unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult>,
    /// `cuMemFreeHost(p)`.
    pub mem_free_host: Option<unsafe extern "C" fn(*mut c_void) -> CuResult>,
}

impl DriverApi {
    /// Looks `symbol` up in the driver at `cuda_version` with `flags`, through
    /// `cuGetProcAddress_v2` (or v1 on drivers older than 12.0). Null when the driver has
    /// no such function at that version.
    pub fn get_proc_address(&self, symbol: &CStr, cuda_version: c_int, flags: u64) -> *mut c_void {
        let mut pfn: *mut c_void = core::ptr::null_mut();
        let rc = if let Some(gpa) = self.get_proc_address_v2 {
            let mut status: c_int = 0;
            // SAFETY: the driver's cuGetProcAddress_v2 with valid out-pointers and a
            // NUL-terminated name.
            unsafe { gpa(symbol.as_ptr(), &mut pfn, cuda_version, flags, &mut status) }
        } else if let Some(gpa) = self.get_proc_address_v1 {
            // SAFETY: as above, for the 4-argument v1.
            unsafe { gpa(symbol.as_ptr(), &mut pfn, cuda_version, flags) }
        } else {
            return core::ptr::null_mut();
        };
        if rc == code::SUCCESS {
            pfn
        } else {
            core::ptr::null_mut()
        }
    }

    /// The driver's name for `code` (`"CUDA_ERROR_OUT_OF_MEMORY"`), or `"unknown CUresult"`
    /// when the driver does not know it.
    pub fn error_name(&self, code: CuResult) -> &'static str {
        let Some(f) = self.get_error_name else {
            return "unknown CUresult";
        };
        let mut name: *const c_char = core::ptr::null();
        // SAFETY: valid out-pointer; the driver returns a pointer to a static string.
        let rc = unsafe { f(code, &mut name) };
        if rc != code::SUCCESS || name.is_null() {
            return "unknown CUresult";
        }
        // SAFETY: the driver's error names are static, NUL-terminated ASCII.
        unsafe { CStr::from_ptr(name) }
            .to_str()
            .unwrap_or("unknown CUresult")
    }
}

/// Fills one table slot: the named function at `version`, flags 0, as the field's type.
macro_rules! resolve {
    ($gpa:expr, $name:literal, $version:expr) => {{
        let p = $gpa.get_proc_address($name, $version, 0);
        if p.is_null() {
            None
        } else {
            // SAFETY: the driver returned the function of that name and version, whose
            // signature is the field's type (CUDA's documented ABI).
            // The target type is inferred from the field the result is assigned to, where
            // it is written out.
            #[allow(clippy::missing_transmute_annotations)]
            Some(unsafe { core::mem::transmute::<*mut c_void, _>(p) })
        }
    }};
}

const LIBCUDA: &CStr = c"libcuda.so.1";

fn load() -> BackendResult<DriverApi> {
    // Never closed: the functions resolved from it are called until the process exits.
    let library = open_libcuda();
    if library.is_null() {
        log::info(&format!(
            "cupool: cannot load libcuda.so.1 ({}); the CUDA backend is unavailable",
            last_dl_error()
        ));
        return Err(BackendError::Unavailable);
    }
    // SAFETY: a live handle and NUL-terminated names; each symbol, when present, is
    // the driver's function of that name with the declared signature.
    let (gpa_v2, gpa_v1) = unsafe {
        let v2 = crate::dl::dlsym(library, c"cuGetProcAddress_v2".as_ptr());
        let v1 = crate::dl::dlsym(library, c"cuGetProcAddress".as_ptr());
        (
            (!v2.is_null()).then(|| core::mem::transmute::<*mut c_void, GetProcAddressV2Fn>(v2)),
            (!v1.is_null()).then(|| core::mem::transmute::<*mut c_void, GetProcAddressV1Fn>(v1)),
        )
    };
    if gpa_v2.is_none() && gpa_v1.is_none() {
        log::error(
            "cupool: libcuda.so.1 has no cuGetProcAddress (driver older than CUDA 11.3?); \
             the CUDA backend is unavailable",
        );
        return Err(BackendError::Unavailable);
    }
    let mut api = DriverApi {
        get_proc_address_v2: gpa_v2,
        get_proc_address_v1: gpa_v1,
        init: None,
        driver_get_version: None,
        get_error_name: None,
        device_get: None,
        device_get_count: None,
        device_primary_ctx_retain: None,
        ctx_get_current: None,
        ctx_set_current: None,
        ctx_push_current: None,
        ctx_pop_current: None,
        ctx_get_device: None,
        mem_alloc: None,
        mem_free: None,
        mem_get_info: None,
        mem_get_address_range: None,
        stream_get_id: None,
        stream_is_capturing: None,
        event_create: None,
        event_record: None,
        event_query: None,
        stream_wait_event: None,
        event_synchronize: None,
        event_destroy: None,
        ctx_record_event: None,
        stream_create: None,
        stream_destroy: None,
        device_get_attribute: None,
        mem_get_allocation_granularity: None,
        mem_address_reserve: None,
        mem_address_free: None,
        mem_create: None,
        mem_release: None,
        mem_map: None,
        mem_unmap: None,
        mem_set_access: None,
        mem_export_to_shareable_handle: None,
        mem_import_from_shareable_handle: None,
        ipc_get_mem_handle: None,
        ipc_open_mem_handle: None,
        ipc_close_mem_handle: None,
        mem_host_alloc: None,
        mem_free_host: None,
    };
    // The query version of each function is the first release whose variant we call.
    api.init = resolve!(api, c"cuInit", 2000);
    api.driver_get_version = resolve!(api, c"cuDriverGetVersion", 2020);
    api.get_error_name = resolve!(api, c"cuGetErrorName", 6000);
    api.device_get = resolve!(api, c"cuDeviceGet", 2000);
    api.device_get_count = resolve!(api, c"cuDeviceGetCount", 2000);
    api.device_primary_ctx_retain = resolve!(api, c"cuDevicePrimaryCtxRetain", 7000);
    api.ctx_get_current = resolve!(api, c"cuCtxGetCurrent", 4000);
    api.ctx_set_current = resolve!(api, c"cuCtxSetCurrent", 4000);
    api.ctx_push_current = resolve!(api, c"cuCtxPushCurrent", 4000);
    api.ctx_pop_current = resolve!(api, c"cuCtxPopCurrent", 4000);
    api.ctx_get_device = resolve!(api, c"cuCtxGetDevice", 2000);
    api.mem_alloc = resolve!(api, c"cuMemAlloc", 3020);
    api.mem_free = resolve!(api, c"cuMemFree", 3020);
    api.mem_get_info = resolve!(api, c"cuMemGetInfo", 3020);
    api.mem_get_address_range = resolve!(api, c"cuMemGetAddressRange", 3020);
    api.stream_get_id = resolve!(api, c"cuStreamGetId", 12000);
    api.stream_is_capturing = resolve!(api, c"cuStreamIsCapturing", 10000);
    api.event_create = resolve!(api, c"cuEventCreate", 2000);
    api.event_record = resolve!(api, c"cuEventRecord", 2000);
    api.event_query = resolve!(api, c"cuEventQuery", 2000);
    api.stream_wait_event = resolve!(api, c"cuStreamWaitEvent", 3020);
    api.event_synchronize = resolve!(api, c"cuEventSynchronize", 2000);
    api.event_destroy = resolve!(api, c"cuEventDestroy", 4000);
    api.ctx_record_event = resolve!(api, c"cuCtxRecordEvent", 12050);
    api.stream_create = resolve!(api, c"cuStreamCreate", 2000);
    api.stream_destroy = resolve!(api, c"cuStreamDestroy", 4000);
    api.device_get_attribute = resolve!(api, c"cuDeviceGetAttribute", 2000);
    api.mem_get_allocation_granularity = resolve!(api, c"cuMemGetAllocationGranularity", 10020);
    api.mem_address_reserve = resolve!(api, c"cuMemAddressReserve", 10020);
    api.mem_address_free = resolve!(api, c"cuMemAddressFree", 10020);
    api.mem_create = resolve!(api, c"cuMemCreate", 10020);
    api.mem_release = resolve!(api, c"cuMemRelease", 10020);
    api.mem_map = resolve!(api, c"cuMemMap", 10020);
    api.mem_unmap = resolve!(api, c"cuMemUnmap", 10020);
    api.mem_set_access = resolve!(api, c"cuMemSetAccess", 10020);
    api.mem_export_to_shareable_handle = resolve!(api, c"cuMemExportToShareableHandle", 10020);
    api.mem_import_from_shareable_handle = resolve!(api, c"cuMemImportFromShareableHandle", 10020);
    api.ipc_get_mem_handle = resolve!(api, c"cuIpcGetMemHandle", 4010);
    api.ipc_open_mem_handle = resolve!(api, c"cuIpcOpenMemHandle", 11000);
    api.ipc_close_mem_handle = resolve!(api, c"cuIpcCloseMemHandle", 4010);
    api.mem_host_alloc = resolve!(api, c"cuMemHostAlloc", 2020);
    api.mem_free_host = resolve!(api, c"cuMemFreeHost", 2000);
    Ok(api)
}

/// Opens `libcuda.so.1`, reusing the copy already loaded by the program if there is one.
fn open_libcuda() -> *mut c_void {
    // SAFETY: dlopen with a NUL-terminated name and valid flags.
    unsafe {
        let loaded = libc::dlopen(LIBCUDA.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if !loaded.is_null() {
            return loaded;
        }
        libc::dlopen(LIBCUDA.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL)
    }
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated thread-local message.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "no error text".to_owned()
    } else {
        // SAFETY: checked non-null above.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

static DRIVER: OnceLock<BackendResult<DriverApi>> = OnceLock::new();

thread_local! {
    /// Set while this thread loads the driver: a call back into [`driver`] from inside
    /// `dlopen` (a library constructor reaching a hook) must not wait for itself.
    static LOADING: Cell<bool> = const { Cell::new(false) };
}

/// The driver's function table, loaded on first use. A failed load is logged once and
/// answered with [`BackendError::Unavailable`] from then on.
pub fn driver() -> BackendResult<&'static DriverApi> {
    if let Some(loaded) = DRIVER.get() {
        return loaded.as_ref().map_err(|e| *e);
    }
    if LOADING.try_with(Cell::get).unwrap_or(true) {
        return Err(BackendError::Unavailable);
    }
    let _ = LOADING.try_with(|l| l.set(true));
    let loaded = DRIVER.get_or_init(load);
    let _ = LOADING.try_with(|l| l.set(false));
    loaded.as_ref().map_err(|e| *e)
}

/// The driver's own `cuGetProcAddress_v2`, if the driver loads and has it.
pub fn real_get_proc_address_v2() -> Option<GetProcAddressV2Fn> {
    driver().ok().and_then(|d| d.get_proc_address_v2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok() {
        assert_eq!(check(code::SUCCESS), Ok(()));
    }

    #[test]
    fn codes_map_to_the_backend_errors() {
        let cases = [
            (2, BackendError::OutOfMemory),
            (4, BackendError::ShuttingDown),
            (900, BackendError::Capturing),
            (901, BackendError::Capturing),
            (906, BackendError::Capturing),
            (908, BackendError::Capturing),
            (1, BackendError::InvalidValue),
            (400, BackendError::InvalidValue),
            (101, BackendError::InvalidValue),
            (3, BackendError::Unavailable),
            (34, BackendError::Unavailable),
            (35, BackendError::Unavailable),
            (100, BackendError::Unavailable),
            (999, BackendError::Unavailable),
            (600, BackendError::Driver(600)),
            (201, BackendError::Driver(201)),
            (909, BackendError::Driver(909)),
            (700, BackendError::Driver(700)),
            (123_456, BackendError::Driver(123_456)),
        ];
        for (code, expected) in cases {
            assert_eq!(error_from_code(code), expected, "CUresult {code}");
            assert_eq!(check(code), Err(expected), "CUresult {code}");
        }
    }

    #[test]
    fn missing_function_is_unavailable() {
        let missing: Option<unsafe extern "C" fn() -> CuResult> = None;
        assert_eq!(required(missing).err(), Some(BackendError::Unavailable));
    }
}
