//! CUDA IPC of arena blocks, for the interposer's `cuIpc*` hooks: the exporter's side
//! (which chunks, as which descriptors) and the importer's (map them in a range of its
//! own). Note [exported chunks] in `pool/arena.rs` says what the exporter keeps.

use super::{BlockInfo, Runtime};
use crate::backend::{BackendResult, DevicePtr};

/// What the IPC calls answer: the interposer turns these into CUDA statuses.
pub use crate::backend::BackendError;
pub use crate::pool::export::ArenaExport;

impl Runtime {
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
        let Some(pool) = crate::pool::handover::pool_holding(ptr) else {
            return Ok(None);
        };
        Ok(pool
            .export_arena_block(block.ptr, block.size)?
            .map(|export| (block, export)))
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
