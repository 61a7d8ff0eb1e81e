//! The driver's virtual memory management calls behind the pool's arenas: granularity,
//! address reservations, physical handles, mapping and access grants, and peer access.

use core::ffi::c_int;
use core::ptr::null_mut;

use super::CudaBackend;
use crate::backend::driver::{
    check, code, error_from_code, required, MemAccessDesc, MemAllocationProp, MemLocation,
};
use crate::backend::{BackendError, BackendResult, ContextId, DevicePtr};
use crate::log;

/// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED`.
const ATTRIBUTE_VMM_SUPPORTED: c_int = 102;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
const MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const MEM_ACCESS_READWRITE: c_int = 3;

// Note [vmm peer access]: memory from `cuMemCreate` is reachable only by the devices
// `cuMemSetAccess` names, whatever `cuCtxEnablePeerAccess` says (that call covers
// `cuMemAlloc` memory only). The interposer reports each peer access a program enables
// ([`Backend::set_peer_access`]); every later map of the owner's context grants those
// devices read/write access along with the owner's own device, in the same
// `cuMemSetAccess`, and the pool grants them the granules mapped before.

/// The `CUresult` of a VMM call as an error: `CUDA_ERROR_NOT_SUPPORTED` means no virtual
/// memory management here ([`BackendError::Unavailable`]: the pool uses segments).
pub(super) fn vmm_check(rc: u32) -> BackendResult<()> {
    match rc {
        code::SUCCESS => Ok(()),
        code::NOT_SUPPORTED => Err(BackendError::Unavailable),
        other => Err(error_from_code(other)),
    }
}

/// A pinned device allocation on `device`, with the shareable handle types
/// `handle_types` requested (0: none).
fn pinned_on(device: i32, handle_types: c_int) -> MemAllocationProp {
    MemAllocationProp {
        kind: MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: handle_types,
        location: MemLocation {
            kind: MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32_handle_meta_data: null_mut(),
        alloc_flags: [0; 8],
    }
}

fn read_write(device: i32) -> MemAccessDesc {
    MemAccessDesc {
        location: MemLocation {
            kind: MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: MEM_ACCESS_READWRITE,
    }
}

impl CudaBackend {
    /// The owner's device and its recorded peers: who may access a mapping of `ctx`.
    fn access_list(&self, ctx: ContextId, own: i32) -> Vec<MemAccessDesc> {
        let mut list = vec![read_write(own)];
        if let Some((_, devices)) = self.peers.lock().iter().find(|(c, _)| *c == ctx) {
            list.extend(
                devices
                    .iter()
                    .filter(|&&d| d != own)
                    .map(|&d| read_write(d)),
            );
        }
        list
    }

    /// [`Backend::vmm_granularity`](crate::backend::Backend::vmm_granularity).
    pub(super) fn vmm_get_granularity(&self, ctx: ContextId) -> BackendResult<u64> {
        let attribute = required(self.api.device_get_attribute)?;
        let device_get = required(self.api.device_get)?;
        let granularity = required(self.api.mem_get_allocation_granularity)?;
        // The pool needs all of them; a driver with some only has no VMM for us.
        let api = self.api;
        if api.mem_address_reserve.is_none()
            || api.mem_address_free.is_none()
            || api.mem_create.is_none()
            || api.mem_release.is_none()
            || api.mem_map.is_none()
            || api.mem_unmap.is_none()
            || api.mem_set_access.is_none()
        {
            return Err(BackendError::Unavailable);
        }
        let device = self.device_of(ctx)?;
        self.with_context(ctx, || {
            let mut handle = 0;
            // SAFETY: valid out-pointer.
            check(unsafe { device_get(&mut handle, device) })?;
            let mut supported: c_int = 0;
            // SAFETY: valid out-pointer and a device handle from cuDeviceGet.
            vmm_check(unsafe { attribute(&mut supported, ATTRIBUTE_VMM_SUPPORTED, handle) })?;
            if supported == 0 {
                return Err(BackendError::Unavailable);
            }
            let prop = pinned_on(device, 0);
            let mut g: usize = 0;
            // SAFETY: valid out-pointer and property struct.
            vmm_check(unsafe { granularity(&mut g, &prop, MEM_ALLOC_GRANULARITY_MINIMUM) })?;
            if g == 0 || !g.is_power_of_two() {
                return Err(BackendError::Unavailable);
            }
            Ok(g as u64)
        })
    }

    /// [`Backend::reserve_range`](crate::backend::Backend::reserve_range).
    pub(super) fn vmm_reserve_range(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr> {
        let reserve = required(self.api.mem_address_reserve)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory)?;
        self.with_context(ctx, || {
            let mut ptr = 0;
            // SAFETY: valid out-pointer; alignment 0 is the granularity, no address hint.
            vmm_check(unsafe { reserve(&mut ptr, bytes, 0, 0, 0) })?;
            Ok(ptr)
        })
    }

    /// [`Backend::free_range`](crate::backend::Backend::free_range).
    pub(super) fn vmm_free_range(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> BackendResult<()> {
        let free = required(self.api.mem_address_free)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::InvalidValue)?;
        // SAFETY: a range from `reserve_range` with nothing mapped (the caller's contract).
        self.with_context(ctx, || vmm_check(unsafe { free(ptr, bytes) }))
    }

    /// [`Backend::create_physical`](crate::backend::Backend::create_physical).
    pub(super) fn vmm_create_physical(&self, ctx: ContextId, bytes: u64) -> BackendResult<u64> {
        let create = required(self.api.mem_create)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory)?;
        let device = self.device_of(ctx)?;
        self.with_context(ctx, || {
            let types = self.handle_types(device);
            let mut handle = 0u64;
            // SAFETY: valid out-pointer and property struct.
            let mut rc = unsafe { create(&mut handle, bytes, &pinned_on(device, types), 0) };
            if rc == code::NOT_SUPPORTED && types != 0 {
                // Exportable memory refused although the device says it has it: go on
                // without (Note [exportable memory]).
                self.not_exportable(device);
                // SAFETY: as above.
                rc = unsafe { create(&mut handle, bytes, &pinned_on(device, 0), 0) };
            }
            vmm_check(rc)?;
            if handle == 0 {
                // The pool takes 0 for "no memory"; never seen from a driver.
                if let Some(release) = self.api.mem_release {
                    // SAFETY: the handle the driver just returned.
                    let _ = unsafe { release(handle) };
                }
                return Err(BackendError::Driver(code::UNKNOWN));
            }
            Ok(handle)
        })
    }

    /// [`Backend::release_physical`](crate::backend::Backend::release_physical).
    pub(super) fn vmm_release_physical(&self, ctx: ContextId, handle: u64) -> BackendResult<()> {
        let release = required(self.api.mem_release)?;
        // SAFETY: a handle from `create_physical`, mapped nowhere (the caller's contract).
        self.with_context(ctx, || vmm_check(unsafe { release(handle) }))
    }

    /// [`Backend::map_physical`](crate::backend::Backend::map_physical).
    pub(super) fn vmm_map_physical(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
        handle: u64,
    ) -> BackendResult<()> {
        let map = required(self.api.mem_map)?;
        let unmap = required(self.api.mem_unmap)?;
        let set_access = required(self.api.mem_set_access)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::InvalidValue)?;
        let device = self.device_of(ctx)?;
        self.with_context(ctx, || {
            // SAFETY: a granule of `ctx`'s reservation and a handle of that size (the
            // caller's contract).
            vmm_check(unsafe { map(ptr, bytes, 0, handle, 0) })?;
            let access = self.access_list(ctx, device);
            // SAFETY: the range just mapped; `access` outlives the call.
            let granted =
                vmm_check(unsafe { set_access(ptr, bytes, access.as_ptr(), access.len()) });
            if let Err(e) = granted {
                // Undo the map, so that a failure leaves nothing behind.
                // SAFETY: the mapping made above.
                let rc = unsafe { unmap(ptr, bytes) };
                if rc != code::SUCCESS {
                    log::error(&format!(
                        "cupool: cuMemUnmap after a failed cuMemSetAccess failed ({})",
                        self.api.error_name(rc)
                    ));
                }
                return Err(e);
            }
            Ok(())
        })
    }

    /// [`Backend::unmap_physical`](crate::backend::Backend::unmap_physical).
    pub(super) fn vmm_unmap_physical(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
    ) -> BackendResult<()> {
        let unmap = required(self.api.mem_unmap)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::InvalidValue)?;
        // SAFETY: a range `map_physical` mapped (the caller's contract).
        self.with_context(ctx, || vmm_check(unsafe { unmap(ptr, bytes) }))
    }

    /// [`Backend::set_peer_access`](crate::backend::Backend::set_peer_access).
    pub(super) fn vmm_set_peer_access(&self, owner: ContextId, device: i32, enabled: bool) {
        let mut peers = self.peers.lock();
        let index = match peers.iter().position(|(c, _)| *c == owner) {
            Some(i) => i,
            None => {
                peers.push((owner, Vec::new()));
                peers.len() - 1
            }
        };
        let devices = &mut peers[index].1;
        devices.retain(|&d| d != device);
        if enabled {
            devices.push(device);
        }
    }

    /// [`Backend::grant_access`](crate::backend::Backend::grant_access).
    pub(super) fn vmm_grant_access(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
        device: i32,
    ) -> BackendResult<()> {
        let set_access = required(self.api.mem_set_access)?;
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::InvalidValue)?;
        let access = [read_write(device)];
        // SAFETY: a wholly mapped range of `ctx`'s reservation (the caller's contract).
        self.with_context(ctx, || {
            vmm_check(unsafe { set_access(ptr, bytes, access.as_ptr(), 1) })
        })
    }
}
