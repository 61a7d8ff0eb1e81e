//! The host backend's simulated virtual memory management: reservations, physical
//! handles and mappings, each call checked as strictly as the driver checks it (Note [host
//! vmm]).

use super::pages::{map_granules, unmap_granules};
use super::HOST_VMM_GRANULE;
use crate::backend::{BackendError, BackendResult, DevicePtr};
use crate::ptr_map::PtrMap;

/// Note [host vmm]: a reservation is an anonymous `PROT_NONE`, `MAP_NORESERVE` mapping
/// (address space only); mapping a granule makes its pages readable and writable
/// (`mprotect`), unmapping drops its pages (`madvise(MADV_DONTNEED)`) and makes them
/// inaccessible again, so a program touching unmapped pool memory faults as on a GPU.
/// Physical granules are counted against the device's capacity like allocations. The
/// contents of a granule do not follow it to a new address (no program may rely on the
/// contents of memory it freed). A handle may be mapped at several places at once, as the
/// driver allows (Note [unmaps off the launching thread]); each place has pages of its own
/// here. Every call is checked strictly (a mapping over part of another, a handle released
/// while mapped, a range freed with mappings in it are errors), so the pool's tests catch
/// misuse the driver would also reject.
#[derive(Default)]
pub(super) struct HostVmm {
    /// Reservation base → (bytes, device).
    pub(super) ranges: PtrMap<(u64, i32)>,
    /// Physical handle → (device, bytes, the places it is mapped at).
    pub(super) handles: PtrMap<(i32, u64, u32)>,
    /// Mapped address → (handle, bytes).
    pub(super) mappings: PtrMap<(u64, u64)>,
    pub(super) next_handle: u64,
    pub(super) creates: u64,
    pub(super) releases: u64,
    pub(super) maps: u64,
    pub(super) unmaps: u64,
    pub(super) fail_next_create: Option<BackendError>,
}

impl HostVmm {
    /// Takes the reservation at `ptr` of `bytes` out of the table; the caller gives its
    /// address space back. A range of another size, or with mappings in it, is refused.
    pub(super) fn forget_range(&mut self, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        match self.ranges.get(&ptr) {
            Some(&(b, _)) if b == bytes => {}
            _ => return Err(BackendError::InvalidValue),
        }
        if self.mappings.keys().any(|&a| a >= ptr && a < ptr + bytes) {
            return Err(BackendError::InvalidValue);
        }
        self.ranges.remove(&ptr);
        Ok(())
    }

    /// A physical handle of `bytes` on `device`, counted in the device's `live` bytes
    /// against `capacity`.
    pub(super) fn create(
        &mut self,
        device: i32,
        bytes: u64,
        live: &mut u64,
        capacity: u64,
    ) -> BackendResult<u64> {
        if let Some(e) = self.fail_next_create.take() {
            return Err(e);
        }
        if *live + bytes > capacity {
            return Err(BackendError::OutOfMemory);
        }
        *live += bytes;
        self.next_handle += 1;
        let h = self.next_handle;
        self.handles.insert(h, (device, bytes, 0));
        self.creates += 1;
        Ok(h)
    }

    /// Releases an unmapped handle; its bytes leave its device's count in `live_bytes`.
    pub(super) fn release(&mut self, handle: u64, live_bytes: &mut [u64]) -> BackendResult<()> {
        match self.handles.get(&handle) {
            Some(&(device, bytes, 0)) => {
                self.handles.remove(&handle);
                live_bytes[device as usize] -= bytes;
                self.releases += 1;
                Ok(())
            }
            _ => Err(BackendError::InvalidValue),
        }
    }

    /// Maps the whole of `handle` (`bytes`) at `ptr`, granule aligned inside a reservation,
    /// where no part of any mapping lies.
    pub(super) fn map(&mut self, ptr: DevicePtr, bytes: u64, handle: u64) -> BackendResult<()> {
        let inside = self
            .ranges
            .iter()
            .any(|(&b, &(n, _))| ptr >= b && ptr + bytes <= b + n);
        let ok = inside
            && ptr % HOST_VMM_GRANULE == 0
            && !self
                .mappings
                .iter()
                .any(|(&at, &(_, n))| at < ptr + bytes && ptr < at + n)
            && matches!(self.handles.get(&handle), Some(&(_, b, _)) if b == bytes);
        if !ok {
            return Err(BackendError::InvalidValue);
        }
        // SAFETY: the granule lies inside a reservation of ours and nothing is mapped there.
        if !unsafe { map_granules(ptr, bytes) } {
            return Err(BackendError::OutOfMemory);
        }
        self.handles.get_mut(&handle).unwrap().2 += 1;
        self.mappings.insert(ptr, (handle, bytes));
        self.maps += 1;
        Ok(())
    }

    /// Unmaps the mapping at `ptr`, which must be `bytes` long.
    pub(super) fn unmap(&mut self, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        match self.mappings.get(&ptr) {
            Some(&(_, b)) if b == bytes => {}
            _ => return Err(BackendError::InvalidValue),
        }
        let (handle, _) = self.mappings.remove(&ptr).unwrap();
        if let Some(h) = self.handles.get_mut(&handle) {
            h.2 -= 1;
        }
        self.unmaps += 1;
        // SAFETY: the granule was mapped by map inside a reservation of ours; its pages are
        // dropped and made inaccessible, the address space stays reserved.
        unsafe { unmap_granules(ptr, bytes) };
        Ok(())
    }
}
