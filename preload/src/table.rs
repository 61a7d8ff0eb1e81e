//! The one table of driver entry points the interposer knows: for each, the exact name
//! libcuda exports, the `cuGetProcAddress` query it answers (base name, version range,
//! stream flavour), and the hook that replaces it.
//!
//! Two users read it: the `dlsym` hook (exact exported name → hook) and the
//! `cuGetProcAddress` wrappers ((base name, version, flags) → hook). The exported names
//! and the real functions' types are in [`crate::slots`], which imports no hook.
//!
//! Imports: this table names every hook, so it imports the hook modules; no hook module
//! imports it, except [`crate::proc_address`]: `cuGetProcAddress` answers with hooks from
//! this table, and this table lists `cuGetProcAddress`'s own hook. That one cycle is
//! inherent (a lookup function that can return itself) and stays.
//!
//! Versions follow the driver's `PFN_*_v<version>` typedefs: a hook is handed out only for
//! the version range whose signature it has. `cuMemAlloc` asked at 2000 is the 32-bit v1
//! ABI and is left alone; at 3020 and later it is `cuMemAlloc_v2`, which we hook.

use crate::slots::Slot;
use core::ffi::{c_char, c_void};

/// Which `cuGetProcAddress` flags a variant answers.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamFlavour {
    /// The function takes no stream: any flags.
    Any,
    /// Legacy default stream: flags without `CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM`.
    Legacy,
    /// Per-thread default stream (`_ptsz`): flags with it.
    PerThread,
}

/// The `cuGetProcAddress(symbol, pfn, cudaVersion, flags)` queries a hook answers.
#[derive(Copy, Clone, Debug)]
pub struct ProcQuery {
    /// Base name, as the runtime asks for it (`cuMemAlloc`, not `cuMemAlloc_v2`), NUL-terminated.
    pub base: &'static [u8],
    /// First `cudaVersion` whose signature is this variant's.
    pub since: i32,
    /// First `cudaVersion` that gets a newer variant (`i32::MAX`: none).
    pub until: i32,
    pub flavour: StreamFlavour,
}

/// One hooked entry point.
pub struct Hook {
    pub slot: Slot,
    pub query: ProcQuery,
    /// Address of our replacement (same signature as the real variant).
    pub replacement: fn() -> *mut c_void,
}

const fn q(base: &'static [u8], since: i32, until: i32, flavour: StreamFlavour) -> ProcQuery {
    ProcQuery {
        base,
        since,
        until,
        flavour,
    }
}

macro_rules! addr {
    ($f:path) => {{
        fn address() -> *mut c_void {
            $f as *mut c_void
        }
        address
    }};
}

use crate::capture as cap;
use crate::ipc;
use crate::memory as mem;
use crate::peer;
use crate::pinned;
use crate::proc_address as gpa;
use crate::streams;
use StreamFlavour::{Any, Legacy, PerThread};

const NEWEST: i32 = i32::MAX;

/// Every hook. Versions: `cudaTypedefs.h` (`PFN_cuMemAlloc_v3020`, `PFN_cuStreamBeginCapture_v10010`,
/// `PFN_cuGetProcAddress_v12000`, `PFN_cuMemHostAlloc_v2020`, `PFN_cuMemAllocHost_v3020`,
/// `PFN_cuMemFreeHost_v2000`, ...).
pub static HOOKS: [Hook; 35] = [
    Hook {
        slot: Slot::MemAlloc,
        query: q(b"cuMemAlloc\0", 3020, NEWEST, Any),
        replacement: addr!(mem::cuMemAlloc_v2),
    },
    Hook {
        slot: Slot::MemFree,
        query: q(b"cuMemFree\0", 3020, NEWEST, Any),
        replacement: addr!(mem::cuMemFree_v2),
    },
    Hook {
        slot: Slot::MemHostAlloc,
        query: q(b"cuMemHostAlloc\0", 2020, NEWEST, Any),
        replacement: addr!(pinned::cuMemHostAlloc),
    },
    // `cuMemAllocHost`@2000 is the 32-bit-size v1 and is left alone, as `cuMemAlloc`'s.
    Hook {
        slot: Slot::MemAllocHost,
        query: q(b"cuMemAllocHost\0", 3020, NEWEST, Any),
        replacement: addr!(pinned::cuMemAllocHost_v2),
    },
    Hook {
        slot: Slot::MemFreeHost,
        query: q(b"cuMemFreeHost\0", 2000, NEWEST, Any),
        replacement: addr!(pinned::cuMemFreeHost),
    },
    Hook {
        slot: Slot::MemGetInfo,
        query: q(b"cuMemGetInfo\0", 3020, NEWEST, Any),
        replacement: addr!(mem::cuMemGetInfo_v2),
    },
    Hook {
        slot: Slot::MemGetAddressRange,
        query: q(b"cuMemGetAddressRange\0", 3020, NEWEST, Any),
        replacement: addr!(mem::cuMemGetAddressRange_v2),
    },
    Hook {
        slot: Slot::IpcGetMemHandle,
        query: q(b"cuIpcGetMemHandle\0", 4010, NEWEST, Any),
        replacement: addr!(ipc::cuIpcGetMemHandle),
    },
    Hook {
        slot: Slot::IpcOpenMemHandle,
        query: q(b"cuIpcOpenMemHandle\0", 4010, 11000, Any),
        replacement: addr!(ipc::cuIpcOpenMemHandle),
    },
    Hook {
        slot: Slot::IpcOpenMemHandleV2,
        query: q(b"cuIpcOpenMemHandle\0", 11000, NEWEST, Any),
        replacement: addr!(ipc::cuIpcOpenMemHandle_v2),
    },
    Hook {
        slot: Slot::IpcCloseMemHandle,
        query: q(b"cuIpcCloseMemHandle\0", 4010, NEWEST, Any),
        replacement: addr!(ipc::cuIpcCloseMemHandle),
    },
    Hook {
        slot: Slot::PointerGetAttribute,
        query: q(b"cuPointerGetAttribute\0", 4000, NEWEST, Any),
        replacement: addr!(mem::cuPointerGetAttribute),
    },
    Hook {
        slot: Slot::PointerGetAttributes,
        query: q(b"cuPointerGetAttributes\0", 7000, NEWEST, Any),
        replacement: addr!(mem::cuPointerGetAttributes),
    },
    Hook {
        slot: Slot::MemFreeAsync,
        query: q(b"cuMemFreeAsync\0", 11020, NEWEST, Legacy),
        replacement: addr!(mem::cuMemFreeAsync),
    },
    Hook {
        slot: Slot::MemFreeAsyncPtsz,
        query: q(b"cuMemFreeAsync\0", 11020, NEWEST, PerThread),
        replacement: addr!(mem::cuMemFreeAsync_ptsz),
    },
    Hook {
        slot: Slot::BeginCapture,
        query: q(b"cuStreamBeginCapture\0", 10000, 10010, Legacy),
        replacement: addr!(cap::cuStreamBeginCapture),
    },
    Hook {
        slot: Slot::BeginCapturePtsz,
        query: q(b"cuStreamBeginCapture\0", 10000, 10010, PerThread),
        replacement: addr!(cap::cuStreamBeginCapture_ptsz),
    },
    Hook {
        slot: Slot::BeginCaptureV2,
        query: q(b"cuStreamBeginCapture\0", 10010, NEWEST, Legacy),
        replacement: addr!(cap::cuStreamBeginCapture_v2),
    },
    Hook {
        slot: Slot::BeginCaptureV2Ptsz,
        query: q(b"cuStreamBeginCapture\0", 10010, NEWEST, PerThread),
        replacement: addr!(cap::cuStreamBeginCapture_v2_ptsz),
    },
    Hook {
        slot: Slot::BeginCaptureToGraph,
        query: q(b"cuStreamBeginCaptureToGraph\0", 12030, NEWEST, Legacy),
        replacement: addr!(cap::cuStreamBeginCaptureToGraph),
    },
    Hook {
        slot: Slot::BeginCaptureToGraphPtsz,
        query: q(b"cuStreamBeginCaptureToGraph\0", 12030, NEWEST, PerThread),
        replacement: addr!(cap::cuStreamBeginCaptureToGraph_ptsz),
    },
    Hook {
        slot: Slot::EndCapture,
        query: q(b"cuStreamEndCapture\0", 10000, NEWEST, Legacy),
        replacement: addr!(cap::cuStreamEndCapture),
    },
    Hook {
        slot: Slot::EndCapturePtsz,
        query: q(b"cuStreamEndCapture\0", 10000, NEWEST, PerThread),
        replacement: addr!(cap::cuStreamEndCapture_ptsz),
    },
    Hook {
        slot: Slot::GetProcAddress,
        query: q(b"cuGetProcAddress\0", 11030, 12000, Any),
        replacement: addr!(gpa::cuGetProcAddress),
    },
    Hook {
        slot: Slot::GetProcAddressV2,
        query: q(b"cuGetProcAddress\0", 12000, NEWEST, Any),
        replacement: addr!(gpa::cuGetProcAddress_v2),
    },
    Hook {
        slot: Slot::CtxEnablePeerAccess,
        query: q(b"cuCtxEnablePeerAccess\0", 4000, NEWEST, Any),
        replacement: addr!(peer::cuCtxEnablePeerAccess),
    },
    Hook {
        slot: Slot::CtxDisablePeerAccess,
        query: q(b"cuCtxDisablePeerAccess\0", 4000, NEWEST, Any),
        replacement: addr!(peer::cuCtxDisablePeerAccess),
    },
    Hook {
        slot: Slot::StreamCreate,
        query: q(b"cuStreamCreate\0", 2000, NEWEST, Any),
        replacement: addr!(streams::cuStreamCreate),
    },
    Hook {
        slot: Slot::StreamCreateWithPriority,
        query: q(b"cuStreamCreateWithPriority\0", 5050, NEWEST, Any),
        replacement: addr!(streams::cuStreamCreateWithPriority),
    },
    Hook {
        slot: Slot::GreenCtxStreamCreate,
        query: q(b"cuGreenCtxStreamCreate\0", 12050, NEWEST, Any),
        replacement: addr!(streams::cuGreenCtxStreamCreate),
    },
    Hook {
        slot: Slot::StreamDestroyV1,
        query: q(b"cuStreamDestroy\0", 2000, 4000, Any),
        replacement: addr!(streams::cuStreamDestroy),
    },
    Hook {
        slot: Slot::StreamDestroy,
        query: q(b"cuStreamDestroy\0", 4000, NEWEST, Any),
        replacement: addr!(streams::cuStreamDestroy_v2),
    },
    Hook {
        slot: Slot::CtxDestroy,
        query: q(b"cuCtxDestroy\0", 4000, NEWEST, Any),
        replacement: addr!(streams::cuCtxDestroy_v2),
    },
    Hook {
        slot: Slot::PrimaryCtxResetV1,
        query: q(b"cuDevicePrimaryCtxReset\0", 7000, 11000, Any),
        replacement: addr!(streams::cuDevicePrimaryCtxReset),
    },
    Hook {
        slot: Slot::PrimaryCtxReset,
        query: q(b"cuDevicePrimaryCtxReset\0", 11000, NEWEST, Any),
        replacement: addr!(streams::cuDevicePrimaryCtxReset_v2),
    },
];

/// Compares a NUL-terminated C string with a NUL-terminated byte literal without reading
/// past either terminator. No allocation, no `strlen`.
///
/// # Safety
/// `s` must be a valid NUL-terminated string.
#[inline]
pub unsafe fn c_str_eq(s: *const c_char, lit: &[u8]) -> bool {
    for (i, &want) in lit.iter().enumerate() {
        // SAFETY: every byte read is at or before `s`'s terminator: we stop at the first
        // mismatch, and a match on NUL ends the loop (the literal's last byte is NUL).
        let got = unsafe { *s.add(i) } as u8;
        if got != want {
            return false;
        }
        if want == 0 {
            return true;
        }
    }
    false
}

/// The hook whose exported name is exactly `name`. Cheap rejection first: every name we
/// answer starts with "cu" followed by an upper-case letter.
///
/// # Safety
/// `name` must be NULL or a valid NUL-terminated string.
#[inline]
pub unsafe fn hook_by_exported_name(name: *const c_char) -> Option<&'static Hook> {
    if name.is_null() {
        return None;
    }
    // SAFETY: `name` is NUL-terminated; each read stops at the first byte that is not the
    // expected one, so a NUL ends the check before reading further.
    unsafe {
        if *name as u8 != b'c'
            || *name.add(1) as u8 != b'u'
            || !(*name.add(2) as u8).is_ascii_uppercase()
        {
            return None;
        }
    }
    HOOKS
        .iter()
        // SAFETY: as above.
        .find(|h| unsafe { c_str_eq(name, h.slot.exported_name()) })
}

/// The hook that answers `cuGetProcAddress(symbol, _, cuda_version, flags)`, if any.
///
/// # Safety
/// `symbol` must be NULL or a valid NUL-terminated string.
pub unsafe fn hook_for_query(
    symbol: *const c_char,
    cuda_version: i32,
    flags: u64,
) -> Option<&'static Hook> {
    if symbol.is_null() {
        return None;
    }
    let per_thread = flags & crate::cuda::CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    HOOKS.iter().find(|h| {
        let q = &h.query;
        let flavour_ok = match q.flavour {
            StreamFlavour::Any => true,
            StreamFlavour::Legacy => !per_thread,
            StreamFlavour::PerThread => per_thread,
        };
        flavour_ok
            && q.since <= cuda_version
            && cuda_version < q.until
            // SAFETY: `symbol` is NUL-terminated; the base literal ends with NUL.
            && unsafe { c_str_eq(symbol, q.base) }
    })
}
