//! Physical memory other processes can import: what CUDA IPC of an arena block needs.
//!
//! Note [exportable memory]: legacy IPC (`cuIpcGetMemHandle`) does not work on memory from
//! `cuMemCreate`. Such memory travels as a shareable handle instead, here a POSIX file
//! descriptor (`cuMemExportToShareableHandle`), and only when it was created asking for
//! that handle type. So every chunk is created exportable on devices that say they support
//! POSIX handles (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`), as
//! PyTorch's expandable segments do; nothing is exported until a program asks. A device
//! that refuses the handle type at `cuMemCreate` despite the attribute is remembered and
//! gets plain memory from then on (its blocks then cannot be exported).

use core::ffi::{c_int, c_void};
use core::sync::atomic::Ordering;

use super::{vmm_check, CudaBackend, MAX_DEVICES};
use crate::backend::driver::{check, required};
use crate::backend::{BackendError, BackendResult, ContextId};

/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`.
const ATTRIBUTE_POSIX_FD_SUPPORTED: c_int = 103;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub(super) const HANDLE_TYPE_POSIX_FD: c_int = 1;

/// States of `CudaBackend::exportable`.
pub(super) const UNKNOWN: u8 = 0;
const NO: u8 = 1;
const YES: u8 = 2;

impl CudaBackend {
    /// The handle types to request when creating memory on `device` (asks the driver the
    /// first time).
    pub(super) fn handle_types(&self, device: i32) -> c_int {
        let Some(slot) = usize::try_from(device)
            .ok()
            .and_then(|d| self.exportable.get(d))
        else {
            return 0;
        };
        let state = match slot.load(Ordering::Relaxed) {
            UNKNOWN => {
                let s = if self.posix_fd_supported(device) {
                    YES
                } else {
                    NO
                };
                slot.store(s, Ordering::Relaxed);
                s
            }
            s => s,
        };
        if state == YES {
            HANDLE_TYPE_POSIX_FD
        } else {
            0
        }
    }

    pub(super) fn not_exportable(&self, device: i32) {
        if let Some(slot) = usize::try_from(device)
            .ok()
            .filter(|&d| d < MAX_DEVICES)
            .and_then(|d| self.exportable.get(d))
        {
            slot.store(NO, Ordering::Relaxed);
        }
    }

    fn posix_fd_supported(&self, device: i32) -> bool {
        let (Some(device_get), Some(attribute)) =
            (self.api.device_get, self.api.device_get_attribute)
        else {
            return false;
        };
        if self.api.mem_export_to_shareable_handle.is_none()
            || self.api.mem_import_from_shareable_handle.is_none()
        {
            return false;
        }
        let mut handle = 0;
        // SAFETY: valid out-pointer.
        if check(unsafe { device_get(&mut handle, device) }).is_err() {
            return false;
        }
        let mut supported: c_int = 0;
        // SAFETY: valid out-pointer and a device handle from cuDeviceGet.
        let rc = unsafe { attribute(&mut supported, ATTRIBUTE_POSIX_FD_SUPPORTED, handle) };
        check(rc).is_ok() && supported != 0
    }

    pub(super) fn export_fd(&self, ctx: ContextId, handle: u64) -> BackendResult<i32> {
        let export = required(self.api.mem_export_to_shareable_handle)?;
        let device = self.device_of(ctx)?;
        if self.handle_types(device) == 0 {
            return Err(BackendError::Unavailable);
        }
        self.with_context(ctx, || {
            let mut fd: c_int = -1;
            // SAFETY: an int out-parameter, as the POSIX handle type takes; a handle from
            // create_physical (the caller's contract).
            vmm_check(unsafe {
                export(
                    (&mut fd as *mut c_int).cast::<c_void>(),
                    handle,
                    HANDLE_TYPE_POSIX_FD,
                    0,
                )
            })?;
            if fd < 0 {
                return Err(BackendError::InvalidValue);
            }
            Ok(fd)
        })
    }

    pub(super) fn import_fd(&self, ctx: ContextId, fd: i32) -> BackendResult<u64> {
        let import = required(self.api.mem_import_from_shareable_handle)?;
        if fd < 0 {
            return Err(BackendError::InvalidValue);
        }
        self.with_context(ctx, || {
            let mut handle = 0u64;
            // SAFETY: valid out-pointer; the POSIX handle type takes the descriptor's value
            // in the pointer argument.
            vmm_check(unsafe {
                import(
                    &mut handle,
                    fd as usize as *mut c_void,
                    HANDLE_TYPE_POSIX_FD,
                )
            })?;
            Ok(handle)
        })
    }
}
