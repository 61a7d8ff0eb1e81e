//! Bookkeeping of the VMM arena (prototype, `vmm:on`): one reserved virtual address range
//! per pool that large blocks are carved from, and which of its granules are backed by
//! physical memory.
//!
//! Note [vmm arena]: the arena is a segment like the others (its blocks tile it, free
//! neighbours merge, best fit through the shared large index), except that it is huge (4×
//! the device's memory, at least 1 TiB) and only partly backed. Each granule (2 MiB, the
//! backend's granularity) is mapped or not; blocks do not own granules, so neighbouring
//! blocks share the granule at their boundary (no per-block rounding).
//! - A granule is **pinned** while any block overlapping it is not `FreeShared`
//!   (allocated, in a thread cache, on a stream's list, awaiting a fence): `pins[g]` counts
//!   those blocks. A pinned granule is always mapped and is never unmapped: work may still
//!   use it.
//! - A mapped granule with no pin lies wholly inside one free shared block (shared free
//!   neighbours merge), whose fence has completed: it is **stealable**. A block handed out
//!   over unmapped granules takes physical memory from the idle list, else unmaps a
//!   stealable granule and maps its memory where it is needed (stitching), else creates
//!   new physical memory within the limit. So the footprint follows the live bytes, not
//!   the history of sizes.
//! - Pins change only where a block crosses the shared boundary: taken from the shared
//!   index (the whole block is pinned before it is split, the remainder unpins itself when
//!   it goes back), given to it (`insert_shared` unpins the incoming block before merging),
//!   and when a block outside it is split (the boundary granule gains a pin).
//! - Reserved bytes are physical memory held (mapped plus idle granules).
//!
//! Mapping and unmapping happen with the pool's `events` mutex held (the lock held across
//! backend calls), never the spin lock, and never while a capture is active.

use super::block::{BlockData, BlockIdx, Place, SegmentKind};
use super::counters::{Level, ThreadCounters};
use super::size_class::ALIGNMENT;
use super::{address_map, DevicePool, Request, ADDRESSES, BACKEND_OFF, BLOCKS};
use crate::backend::BackendError;
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;
use std::collections::BTreeSet;
use std::ops::RangeInclusive;

/// The arena reserves this many bytes of address space per byte of device memory...
const ARENA_PER_DEVICE_BYTE: u64 = 4;
/// ...and at least this many (address space costs nothing until mapped).
const ARENA_MIN: u64 = 1 << 40;

pub struct Arena {
    pub base: u64,
    pub size: u64,
    pub granule: u64,
    /// Physical handle mapped at each granule, 0 when none.
    handles: Vec<u64>,
    /// Blocks not in the shared index overlapping each granule.
    pins: Vec<u32>,
    /// Granules mapped and not pinned.
    stealable: BTreeSet<u32>,
    /// Physical memory held but mapped nowhere.
    pub idle: Vec<u64>,
    /// Granules mapped now.
    pub mapped: u64,
    /// Most granules mapped at once since the arena was reserved or the peaks were reset.
    pub mapped_peak: u64,
    /// Counters: granule maps and unmaps done for this arena.
    pub maps: u64,
    pub unmaps: u64,
}

impl Arena {
    pub fn new(base: u64, size: u64, granule: u64) -> Self {
        let n = (size / granule) as usize;
        Arena {
            base,
            size,
            granule,
            handles: vec![0; n],
            pins: vec![0; n],
            stealable: BTreeSet::new(),
            idle: Vec::new(),
            mapped: 0,
            mapped_peak: 0,
            maps: 0,
            unmaps: 0,
        }
    }

    #[inline]
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr - self.base < self.size
    }

    /// Granules overlapping `[ptr, ptr + size)`.
    #[inline]
    pub fn granules(&self, ptr: u64, size: u64) -> RangeInclusive<usize> {
        let first = (ptr - self.base) / self.granule;
        let last = (ptr + size - 1 - self.base) / self.granule;
        first as usize..=last as usize
    }

    #[inline]
    pub fn address(&self, g: usize) -> u64 {
        self.base + g as u64 * self.granule
    }

    /// Physical memory held: mapped and idle granules.
    pub fn held(&self) -> u64 {
        self.mapped + self.idle.len() as u64
    }

    pub fn pin_one(&mut self, g: usize) {
        if self.pins[g] == 0 && self.handles[g] != 0 {
            self.stealable.remove(&(g as u32));
        }
        self.pins[g] += 1;
    }

    pub fn unpin_one(&mut self, g: usize) {
        debug_assert!(self.pins[g] > 0, "granule {g} unpinned below zero");
        self.pins[g] -= 1;
        if self.pins[g] == 0 && self.handles[g] != 0 {
            self.stealable.insert(g as u32);
        }
    }

    pub fn pin(&mut self, ptr: u64, size: u64) {
        for g in self.granules(ptr, size) {
            self.pin_one(g);
        }
    }

    pub fn unpin(&mut self, ptr: u64, size: u64) {
        for g in self.granules(ptr, size) {
            self.unpin_one(g);
        }
    }

    /// A block outside the shared index was split at `at`: the granule holding the
    /// boundary now overlaps two such blocks.
    pub fn split_at(&mut self, at: u64) {
        if (at - self.base) % self.granule != 0 {
            let g = ((at - self.base) / self.granule) as usize;
            self.pin_one(g);
        }
    }

    /// Two blocks outside the shared index that meet at `at` became one: the inverse of
    /// [`Arena::split_at`].
    pub fn merge_at(&mut self, at: u64) {
        if (at - self.base) % self.granule != 0 {
            let g = ((at - self.base) / self.granule) as usize;
            self.unpin_one(g);
        }
    }

    /// Unmapped granules under `[ptr, ptr + size)`.
    pub fn unmapped(&self, ptr: u64, size: u64) -> Vec<usize> {
        self.granules(ptr, size)
            .filter(|&g| self.handles[g] == 0)
            .collect()
    }

    pub fn unmapped_count(&self, ptr: u64, size: u64) -> u64 {
        self.granules(ptr, size)
            .filter(|&g| self.handles[g] == 0)
            .count() as u64
    }

    pub fn all_mapped(&self, ptr: u64, size: u64) -> bool {
        self.granules(ptr, size).all(|g| self.handles[g] != 0)
    }

    pub fn stealable_count(&self) -> usize {
        self.stealable.len()
    }

    /// Takes a stealable granule (the highest: far from where the arena carves first),
    /// marking it unmapped; returns it and its handle. The caller unmaps it.
    pub fn steal(&mut self) -> Option<(usize, u64)> {
        let g = self.stealable.pop_last()? as usize;
        let h = core::mem::replace(&mut self.handles[g], 0);
        self.mapped -= 1;
        Some((g, h))
    }

    /// Records that `handle` is now mapped at granule `g`.
    pub fn set_mapped(&mut self, g: usize, handle: u64) {
        debug_assert_eq!(self.handles[g], 0);
        self.handles[g] = handle;
        self.mapped += 1;
        self.mapped_peak = self.mapped_peak.max(self.mapped);
        if self.pins[g] == 0 {
            self.stealable.insert(g as u32);
        }
    }

    /// Bytes of the free shared block `[ptr, ptr + size)` that lie in pinned granules (mapped,
    /// and not releasable while a block outside the shared index touches them). Only its
    /// end granules can be pinned: a granule wholly inside one free shared block has no pin.
    pub fn pinned_ends(&self, ptr: u64, size: u64) -> u64 {
        let r = self.granules(ptr, size);
        let (first, last) = (*r.start(), *r.end());
        let overlap = |g: usize| {
            let start = self.address(g).max(ptr);
            let end = (self.address(g) + self.granule).min(ptr + size);
            end - start
        };
        let mut bytes = 0;
        if self.pins[first] > 0 {
            bytes += overlap(first);
        }
        if last != first && self.pins[last] > 0 {
            bytes += overlap(last);
        }
        bytes
    }

    /// Checks pins against what the blocks imply (`expected`, one count per granule), and
    /// that the stealable set and counters agree with the granule table.
    pub fn check(&self, expected: &[u32]) -> core::result::Result<(), String> {
        let mut mapped = 0;
        for (g, &want) in expected.iter().enumerate().take(self.handles.len()) {
            if self.pins[g] != want {
                return Err(format!(
                    "arena granule {g}: {} pins, blocks imply {want}",
                    self.pins[g]
                ));
            }
            let is_mapped = self.handles[g] != 0;
            mapped += is_mapped as u64;
            if self.pins[g] > 0 && !is_mapped {
                return Err(format!("arena granule {g}: in use but not mapped"));
            }
            if self.stealable.contains(&(g as u32)) != (is_mapped && self.pins[g] == 0) {
                return Err(format!("arena granule {g}: stealable set disagrees"));
            }
        }
        if mapped != self.mapped {
            return Err(format!(
                "arena: {} granules mapped, counter says {}",
                mapped, self.mapped
            ));
        }
        Ok(())
    }

    pub fn granule_count(&self) -> usize {
        self.handles.len()
    }

    /// The mapped parts of the arena, as (address, bytes) runs of adjacent mapped granules.
    pub fn mapped_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (g, &h) in self.handles.iter().enumerate() {
            if h == 0 {
                continue;
            }
            let at = self.address(g);
            match runs.last_mut() {
                Some((start, len)) if *start + *len == at => *len += self.granule,
                _ => runs.push((at, self.granule)),
            }
        }
        runs
    }
}

impl DevicePool {
    /// Reserves the arena if the pool has none; on a backend without virtual memory
    /// management, turns VMM off for this pool (large blocks use segments).
    pub(super) fn ensure_arena(&self) {
        if self.shared.lock().arena.is_some() || !self.may_order() {
            return;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if self.shared.lock().arena.is_some() {
            return;
        }
        let ctx = self.ctx.id;
        let reserved = (|| {
            let g = self.backend.vmm_granularity(ctx)?;
            let total = self.backend.memory_info(ctx)?.1;
            let size = total.saturating_mul(ARENA_PER_DEVICE_BYTE).max(ARENA_MIN);
            let size = size.div_ceil(g) * g;
            let base = self.backend.reserve_range(ctx, size)?;
            Ok::<_, BackendError>((base, size, g))
        })();
        let (base, size, g) = match reserved {
            Ok(r) => r,
            Err(e) => {
                crate::log::info(&format!(
                    "cupool: device {}: no virtual memory management ({e:?}); large blocks use segments",
                    self.ctx.device
                ));
                self.vmm.store(false, Ordering::Relaxed);
                return;
            }
        };
        let usable = base % g == 0
            && base % ALIGNMENT == 0
            && base + size <= address_map::ADDRESS_LIMIT
            && g % ALIGNMENT == 0;
        let record = if usable { BLOCKS.allocate() } else { None };
        let Some(idx) = record else {
            let _ = self.backend.free_range(ctx, base, size);
            crate::log::error("cupool: the reserved range cannot be tracked; VMM off");
            self.vmm.store(false, Ordering::Relaxed);
            return;
        };
        let mut sh = self.shared.lock();
        // SAFETY: the record is new and ours; pool lock held.
        unsafe {
            *BLOCKS.get(idx).data() = BlockData::segment_head(
                base,
                size,
                self.index,
                SegmentKind::Large,
                Place::FreeShared,
            );
            BLOCKS.get(idx).publish_free(base);
            ADDRESSES.set(base, idx);
            sh.segments.insert(base, idx);
            sh.large.insert(&BLOCKS, idx);
        }
        sh.arena = Some(Arena::new(base, size, g));
    }

    /// Carves a large block from the arena, creating physical memory if needed.
    pub(super) fn carve_arena(&self, c: &ThreadCounters, req: Request) -> Result<u64> {
        let taken = {
            let mut sh = self.shared.lock();
            // SAFETY: pool lock held.
            unsafe { self.take_shared(&mut sh, req) }
        };
        match taken {
            None => Err(CupoolStatus::CupoolErrorOutOfMemory),
            Some((idx, true)) => Ok(self.hand_out(c, idx, req)),
            Some((idx, false)) => self.map_or_put_back(c, idx, req, true),
        }
    }

    /// Maps every unmapped granule under the arena block `idx` (taken by the caller, so
    /// pinned): from idle physical memory, else by unmapping stealable granules, else (with
    /// `may_create`) with new physical memory within the limit. On failure what was mapped
    /// stays mapped (it is stealable once the caller puts the block back).
    pub(super) fn map_arena_block(
        &self,
        c: &ThreadCounters,
        idx: BlockIdx,
        may_create: bool,
    ) -> Result<()> {
        if self.capturing() {
            return Err(CupoolStatus::CupoolErrorStreamCapture);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return Err(CupoolStatus::CupoolErrorBackendUnavailable);
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let ctx = self.ctx.id;
        // SAFETY: the caller owns `idx`; its range does not change meanwhile.
        let (ptr, size) = unsafe {
            let d = BLOCKS.get(idx).data();
            (d.ptr, d.size)
        };
        // Plan under the pool lock; other threads map only with `events` held, so the
        // plan stays valid while the calls run.
        let (base, g, todo, mut handles, victims, create_n) = {
            let mut sh = self.shared.lock();
            let reserved = sh.reserved;
            let a = sh.arena.as_mut().expect("arena block without an arena");
            let todo = a.unmapped(ptr, size);
            if todo.is_empty() {
                return Ok(());
            }
            let n = todo.len();
            let from_idle = n.min(a.idle.len());
            let g = a.granule;
            let need = n - from_idle;
            let stealable = a.stealable_count();
            // Every stealable granule is taken before new memory is created: keeping some
            // back for reuse did not pay (docs/BENCHMARKS.md, rejected attempts); Note
            // [remap last] in the pool module is what keeps remaps down.
            let limit = self.limit();
            let fits = |create: usize| limit == 0 || reserved + create as u64 * g <= limit;
            let (from_steal, create_n) = if need <= stealable {
                (need, 0)
            } else if may_create && fits(need - stealable) {
                (stealable, need - stealable)
            } else {
                return Err(CupoolStatus::CupoolErrorOutOfMemory);
            };
            let create_n = create_n as u64;
            let handles = a.idle.split_off(a.idle.len() - from_idle);
            let victims: Vec<(usize, u64)> = (0..from_steal).map(|_| a.steal().unwrap()).collect();
            let base = a.base;
            // New memory counts against the limit from now on.
            sh.reserved += create_n * g;
            (base, g, todo, handles, victims, create_n)
        };
        let addr = |gr: usize| base + gr as u64 * g;
        let mut failed: Option<BackendError> = None;
        let mut still_mapped = Vec::new();
        for &(vg, h) in &victims {
            match self.backend.unmap_physical(ctx, addr(vg), g) {
                Ok(()) => handles.push(h),
                Err(e) => {
                    crate::log::warn(&format!("cupool: unmapping a granule failed: {e:?}"));
                    still_mapped.push((vg, h));
                }
            }
        }
        let mut created = 0;
        for _ in 0..create_n {
            match self.backend.create_physical(ctx, g) {
                Ok(h) => {
                    handles.push(h);
                    created += 1;
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut mapped = Vec::with_capacity(todo.len());
        if failed.is_none() {
            for &tg in &todo {
                let Some(h) = handles.pop() else {
                    failed = Some(BackendError::OutOfMemory);
                    break;
                };
                match self.backend.map_physical(ctx, addr(tg), g, h) {
                    Ok(()) => mapped.push((tg, h)),
                    Err(e) => {
                        handles.push(h);
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        let complete = mapped.len() == todo.len();
        {
            let mut sh = self.shared.lock();
            sh.reserved -= (create_n - created) * g;
            sh.reserved_peak = sh.reserved_peak.max(sh.reserved);
            sh.slow.device_allocs += created;
            let a = sh.arena.as_mut().unwrap();
            a.unmaps += (victims.len() - still_mapped.len()) as u64;
            a.maps += mapped.len() as u64;
            for (gr, h) in still_mapped.into_iter().chain(mapped) {
                a.set_mapped(gr, h);
            }
            a.idle.extend(handles);
        }
        if created > 0 && c.raise(Level::Cached, created * g, self.peak_epoch()).0 {
            self.update_peak(Level::Cached);
        }
        match (complete, failed) {
            (true, _) => Ok(()),
            (false, Some(BackendError::OutOfMemory)) | (false, None) => {
                Err(CupoolStatus::CupoolErrorOutOfMemory)
            }
            (false, Some(e)) => {
                crate::log::info(&format!("cupool: mapping a granule failed: {e:?}"));
                Err(e.into())
            }
        }
    }

    /// Unmaps every granule wholly inside a free shared block of the arena and releases
    /// all idle physical memory; frees the reservation when nothing is left in it.
    /// Returns the bytes released.
    pub(super) fn release_arena(&self, c: &ThreadCounters) -> u64 {
        if !self.may_order() || self.shared.lock().arena.is_none() {
            return 0;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let ctx = self.ctx.id;
        let Some((base, g, victims, idle)) = ({
            let mut sh = self.shared.lock();
            sh.arena.as_mut().map(|a| {
                let mut victims = Vec::new();
                while let Some(v) = a.steal() {
                    victims.push(v);
                }
                (a.base, a.granule, victims, core::mem::take(&mut a.idle))
            })
        }) else {
            return 0;
        };
        let mut to_release = idle;
        let mut still_mapped = Vec::new();
        let mut unmapped = 0;
        for (vg, h) in victims {
            match self.backend.unmap_physical(ctx, base + vg as u64 * g, g) {
                Ok(()) => {
                    to_release.push(h);
                    unmapped += 1;
                }
                Err(e) => {
                    crate::log::warn(&format!("cupool: unmapping a granule failed: {e:?}"));
                    still_mapped.push((vg, h));
                }
            }
        }
        for &h in &to_release {
            if let Err(e) = self.backend.release_physical(ctx, h) {
                // The memory is gone from the pool either way; report it.
                crate::log::warn(&format!("cupool: releasing a granule failed: {e:?}"));
            }
        }
        let released = to_release.len() as u64 * g;
        let free_range = {
            let mut sh = self.shared.lock();
            sh.reserved -= released;
            sh.slow.device_frees += to_release.len() as u64;
            let a = sh.arena.as_mut().unwrap();
            a.unmaps += unmapped;
            for (vg, h) in still_mapped {
                a.set_mapped(vg, h);
            }
            let (held, size) = (a.held(), a.size);
            // SAFETY: pool lock held.
            unsafe {
                let head = sh.segments.get(&base).copied();
                match head {
                    Some(idx)
                        if held == 0
                            && BLOCKS.get(idx).data().place == Place::FreeShared
                            && BLOCKS.get(idx).data().size == size =>
                    {
                        sh.large.remove(&BLOCKS, idx);
                        ADDRESSES.clear(base);
                        BLOCKS.release(idx);
                        sh.segments.remove(&base);
                        let a = sh.arena.take().unwrap();
                        sh.mapped_peak = sh.mapped_peak.max(a.mapped_peak * a.granule);
                        crate::log::info(&format!(
                            "cupool: device {}: VMM arena released ({} granule maps, {} unmaps)",
                            self.ctx.device, a.maps, a.unmaps
                        ));
                        Some(size)
                    }
                    _ => None,
                }
            }
        };
        if released > 0 {
            c.lower(Level::Cached, released);
        }
        if let Some(size) = free_range {
            if let Err(e) = self.backend.free_range(ctx, base, size) {
                crate::log::warn(&format!("cupool: freeing the arena's range failed: {e:?}"));
            }
        }
        released
    }

    /// Gives `device` access to every granule mapped now (Note [vmm peer access] in the
    /// CUDA backend: later maps grant it themselves once the backend has recorded the
    /// peer). Maps happen with `events` held, so none is missed. Returns the runs whose
    /// grant failed.
    pub fn grant_mapped_to(&self, device: i32) -> usize {
        if BACKEND_OFF.load(Ordering::Relaxed) || device == self.ctx.device {
            return 0;
        }
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let runs = match self.shared.lock().arena.as_ref() {
            Some(a) => a.mapped_runs(),
            None => return 0,
        };
        let mut failed = 0;
        for (ptr, bytes) in runs {
            if let Err(e) = self.backend.grant_access(self.ctx.id, ptr, bytes, device) {
                failed += 1;
                crate::log::warn(&format!(
                    "cupool: device {}: granting device {device} access to {bytes} bytes at {ptr:#x} failed: {e:?}",
                    self.ctx.device
                ));
            }
        }
        failed
    }

    /// VMM figures of this pool.
    pub fn vmm_stats(&self) -> VmmStats {
        let sh = self.shared.lock();
        let mut s = VmmStats {
            enabled: self.vmm.load(Ordering::Relaxed),
            ..VmmStats::default()
        };
        if let Some(a) = sh.arena.as_ref() {
            s.range_bytes = a.size;
            s.mapped_bytes = a.mapped * a.granule;
            s.idle_bytes = a.idle.len() as u64 * a.granule;
            s.maps = a.maps;
            s.unmaps = a.unmaps;
        }
        s
    }
}

/// VMM figures of one pool ([`super::DevicePool::vmm_stats`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct VmmStats {
    /// Whether the pool carves large blocks from an arena.
    pub enabled: bool,
    /// Bytes of the reserved virtual range (0 when none is reserved now).
    pub range_bytes: u64,
    pub mapped_bytes: u64,
    pub idle_bytes: u64,
    pub maps: u64,
    pub unmaps: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    #[test]
    fn pins_and_stealing() {
        let mut a = Arena::new(G * 10, 8 * G, G);
        // A block over granules 0..=1 (3 MiB), mapped.
        a.pin(a.base, 3 << 20);
        for g in a.unmapped(a.base, 3 << 20) {
            a.set_mapped(g, g as u64 + 1);
        }
        assert_eq!(a.mapped, 2);
        assert_eq!(a.stealable_count(), 0);
        // A neighbour sharing granule 1.
        a.pin(a.base + (3 << 20), 2 << 20);
        assert_eq!(a.unmapped(a.base + (3 << 20), 2 << 20), vec![2]);
        a.set_mapped(2, 100);
        // The first block goes back: granule 0 is stealable, 1 is still pinned.
        a.unpin(a.base, 3 << 20);
        assert_eq!(a.stealable_count(), 1);
        assert_eq!(a.steal(), Some((0, 1)));
        assert_eq!(a.mapped, 2);
        let mut expected = vec![0; 8];
        expected[1] = 1;
        expected[2] = 1;
        a.check(&expected).unwrap();
        a.split_at(a.base + (4 << 20)); // granule-aligned: no new pin
        a.split_at(a.base + (4 << 20) + 512);
        expected[2] = 2;
        a.check(&expected).unwrap();
    }
}
