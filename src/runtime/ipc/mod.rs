//! CUDA IPC of pool blocks: handles for blocks the driver's own handle cannot describe,
//! opening and closing them. The C API (`cupool_ipc_*`) and the interposer's `cuIpc*`
//! hooks both answer through these.
//!
//! Note [ipc registry]: the driver gives every pointer of an allocation the allocation's
//! handle, and the importer maps the allocation's base. A block carved out of a larger
//! segment therefore cannot travel in the driver's handle alone: its offset must go with
//! it, and the 64 bytes of `CUipcMemHandle` are the driver's. So the exporter puts the
//! segment's real handle, the block's offset and size in a record of its **registry**, a
//! file `/dev/shm/cupool-ipc-<uid>-<pid>` (mode 0600, one 128-byte record per export,
//! removed at exit), and gives the program a handle of its own: `cupoolIP`, its pid, the
//! record's index, a nonce, the offset and the size. An importer under cupool recognises
//! the tag, reads the record, opens the real handle (once per segment, counted) and
//! returns the segment's mapping plus the offset; closing that pointer closes the
//! segment's mapping when its last block is closed. An importer without cupool hands the
//! tagged handle to the driver, which does not know it and fails: it never maps the wrong
//! bytes. A block that is a whole segment exports the driver's own handle, which any
//! importer can open.
//!
//! What an importer can reach: the whole segment of the block (2 MiB for blocks up to
//! 1 MiB, 20 MiB up to 10 MiB), neighbours included, as with any legacy IPC mapping of a
//! sub-allocating allocator. The exporter keeps exported segments for good (Note
//! [exported segments] in `cupool::pool`). Blocks of the VMM arena (`vmm:on`) travel
//! differently, as their chunks' file descriptors (Note [ipc of arena blocks] in
//! `arena.rs`), and an importer reaches only those chunks.
//!
//! The code lived in the interposer until the C API needed it: PyTorch's pluggable
//! allocator (`cupool.torch.enable()`) shares tensors through it without the interposer.

mod arena;
mod registry;
mod segment;

use super::{BlockInfo, Runtime};
use crate::backend::{BackendResult, DevicePtr};

/// What the IPC calls answer: the interposer turns these into CUDA statuses.
pub use crate::backend::BackendError;
pub use crate::pool::export::ArenaExport;

/// Whether `handle` is one cupool made (Note [ipc registry]); any other handle is the
/// driver's.
pub fn is_cupool_handle(handle: &[u8; 64]) -> bool {
    registry::Tagged::read(handle).is_some()
}

impl Runtime {
    /// An IPC handle for the pool block that contains `ptr`, which another process opens
    /// with [`Runtime::ipc_open`] (or, under the interposer, `cuIpcOpenMemHandle`) at
    /// the block's start: the driver's own handle for a block that is a whole segment, a
    /// cupool handle otherwise (Note [ipc registry]). `Ok(None)`: not in a pool block.
    pub fn ipc_handle_of_block(&self, ptr: DevicePtr) -> BackendResult<Option<[u8; 64]>> {
        let Some(block) = self.lookup_containing(ptr) else {
            return Ok(None);
        };
        if let Some(export) = Self::export_arena(&block)? {
            return arena::export(&block, &export).map(Some);
        }
        let segment = self.backend.ipc_get_handle(block.segment_base)?;
        self.keep_exported(block.ptr);
        if block.ptr == block.segment_base && block.size >= block.segment_size {
            return Ok(Some(segment));
        }
        segment::export(&block, segment).map(Some)
    }

    /// What an IPC handle of the live block containing `ptr` maps, as `(start, bytes)`:
    /// the block's driver allocation (segment), or the block itself in the VMM arena
    /// (exported chunk by chunk). PyTorch's `getBaseAllocation` asks this.
    pub fn shareable_range(&self, ptr: DevicePtr) -> Option<(DevicePtr, u64)> {
        let block = self.lookup_containing(ptr)?;
        let pool = crate::pool::handover::pool_holding(block.ptr)?;
        Some(if pool.arena_contains(block.ptr) {
            (block.ptr, block.size)
        } else {
            (block.segment_base, block.segment_size)
        })
    }

    /// An IPC handle for `ptr`: [`Runtime::ipc_handle_of_block`] for a pool block, the
    /// driver's `cuIpcGetMemHandle` for any other pointer.
    pub fn ipc_handle(&self, ptr: DevicePtr) -> BackendResult<[u8; 64]> {
        match self.ipc_handle_of_block(ptr)? {
            Some(handle) => Ok(handle),
            None => self.backend.ipc_get_handle(ptr),
        }
    }

    /// Opens a handle cupool made (Note [ipc registry]) in the calling thread's current
    /// context; `Ok(None)` for any other handle (the driver's to open). `flags` are
    /// `cuIpcOpenMemHandle`'s, used for segments.
    pub fn ipc_open_cupool_handle(
        &self,
        handle: &[u8; 64],
        flags: u32,
    ) -> BackendResult<Option<DevicePtr>> {
        let Some(t) = registry::Tagged::read(handle) else {
            return Ok(None);
        };
        match t.kind {
            registry::Kind::Arena => arena::open(self, &t).map(Some),
            registry::Kind::Segment => segment::open(self, &t, flags).map(Some),
        }
    }

    /// Opens any IPC handle: cupool's, or the driver's through `cuIpcOpenMemHandle`.
    pub fn ipc_open(&self, handle: &[u8; 64], flags: u32) -> BackendResult<DevicePtr> {
        match self.ipc_open_cupool_handle(handle, flags)? {
            Some(ptr) => Ok(ptr),
            None => self.backend.ipc_open(*handle, flags),
        }
    }

    /// Closes a pointer [`Runtime::ipc_open_cupool_handle`] handed out; `None` for any
    /// other pointer (the driver's to close).
    pub fn ipc_close_cupool_pointer(&self, ptr: DevicePtr) -> Option<BackendResult<()>> {
        arena::close(self, ptr).or_else(|| segment::close(self, ptr))
    }

    /// Closes a pointer [`Runtime::ipc_open`] handed out.
    pub fn ipc_close(&self, ptr: DevicePtr) -> BackendResult<()> {
        match self.ipc_close_cupool_pointer(ptr) {
            Some(result) => result,
            None => self.backend.ipc_close(ptr),
        }
    }

    /// Exports the live block starting at `ptr` when it lies in a VMM arena. `Ok(None)`:
    /// not the start of a live block, or not an arena block (the caller exports its
    /// segment instead).
    pub fn export_arena_block(
        &self,
        ptr: DevicePtr,
    ) -> BackendResult<Option<(BlockInfo, ArenaExport)>> {
        let Some(block) = self.lookup_containing(ptr).filter(|b| b.ptr == ptr) else {
            return Ok(None);
        };
        Ok(Self::export_arena(&block)?.map(|export| (block, export)))
    }

    /// [`Runtime::export_arena_block`] of a block already looked up.
    fn export_arena(block: &BlockInfo) -> BackendResult<Option<ArenaExport>> {
        match crate::pool::handover::pool_holding(block.ptr) {
            Some(pool) => pool.export_arena_block(block.ptr, block.size),
            None => Ok(None),
        }
    }

    /// Maps memory another process exported: `chunks` are this process's descriptors of
    /// it and their bytes, in address order. They are mapped back to back in a new range
    /// of the calling thread's current context, readable and writable by its device (and
    /// the peers recorded for it). Returns the range's start and the imported handles,
    /// for [`Runtime::close_imported`]; nothing is left behind on failure. The
    /// descriptors stay the caller's.
    pub fn import_chunks(&self, chunks: &[(i32, u64)]) -> BackendResult<Imported> {
        let ctx = self.backend.current_context()?.id;
        let total = chunks
            .iter()
            .try_fold(0u64, |t, &(_, bytes)| t.checked_add(bytes))
            .filter(|&t| t > 0)
            .ok_or(BackendError::InvalidValue)?;
        let base = self.backend.reserve_range(ctx, total)?;
        let mut imported = Imported {
            base,
            bytes: total,
            chunks: Vec::with_capacity(chunks.len()),
        };
        let mut at = base;
        for &(fd, bytes) in chunks {
            let mapped = self.backend.import_physical(ctx, fd).and_then(|handle| {
                self.backend
                    .map_physical(ctx, at, bytes, handle)
                    .inspect_err(|_| {
                        let _ = self.backend.release_physical(ctx, handle);
                    })
                    .map(|()| handle)
            });
            match mapped {
                Ok(handle) => imported.chunks.push((handle, bytes)),
                Err(e) => {
                    let _ = self.close_imported(&imported);
                    return Err(e);
                }
            }
            at += bytes;
        }
        Ok(imported)
    }

    /// Unmaps and releases what [`Runtime::import_chunks`] mapped, and frees its range.
    pub fn close_imported(&self, imported: &Imported) -> BackendResult<()> {
        let ctx = self.backend.current_context()?.id;
        let mut at = imported.base;
        let mut result = Ok(());
        for &(handle, bytes) in &imported.chunks {
            let unmapped = self.backend.unmap_physical(ctx, at, bytes);
            let released = unmapped.and_then(|()| self.backend.release_physical(ctx, handle));
            result = result.and(released);
            at += bytes;
        }
        result.and(self.backend.free_range(ctx, imported.base, imported.bytes))
    }
}

/// Memory mapped by [`Runtime::import_chunks`]: where, and each chunk's handle and bytes.
#[derive(Debug)]
pub struct Imported {
    pub base: DevicePtr,
    /// Bytes of the range reserved at `base`.
    pub bytes: u64,
    pub chunks: Vec<(u64, u64)>,
}
