//! Page-locked host memory for the pinned pool: `cuMemHostAlloc` / `cuMemFreeHost`.
//!
//! Chunks are allocated `PORTABLE | DEVICEMAP`: one cache serves every context, so a chunk
//! must be pinned for all of them (not only for the one current when it was made), and
//! mapped, so that a program that asked for `DEVICEMAP` (or calls
//! `cuMemHostGetDevicePointer`) gets what it expects from any block. On unified addressing
//! (every 64-bit platform CUDA supports now) every pinned allocation is mapped anyway.

use core::ffi::{c_uint, c_void};
use core::ptr::null_mut;

use super::CudaBackend;
use crate::backend::driver::{check, code, required};
use crate::backend::{BackendError, BackendResult, ContextId, HostPtr};

/// `CU_MEMHOSTALLOC_PORTABLE`.
pub const MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
/// `CU_MEMHOSTALLOC_DEVICEMAP`.
pub const MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;

impl CudaBackend {
    pub(super) fn pinned_alloc(&self, ctx: ContextId, bytes: u64) -> BackendResult<HostPtr> {
        let alloc = required(self.api.mem_host_alloc)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory)?;
        self.with_context(ctx, || {
            let mut p: *mut c_void = null_mut();
            // SAFETY: valid out-pointer; `ctx` is current.
            check(unsafe {
                alloc(
                    &mut p,
                    bytes,
                    MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP,
                )
            })?;
            if p.is_null() {
                // The pool takes 0 for "no memory"; never seen from a driver.
                return Err(BackendError::Driver(code::UNKNOWN));
            }
            Ok(p as usize as HostPtr)
        })
    }

    pub(super) fn pinned_free(&self, ctx: ContextId, ptr: HostPtr) -> BackendResult<()> {
        let free = required(self.api.mem_free_host)?;
        // SAFETY: `ptr` came from `pinned_alloc` (the caller's contract).
        self.with_context(ctx, || check(unsafe { free(ptr as usize as *mut c_void) }))
    }
}
