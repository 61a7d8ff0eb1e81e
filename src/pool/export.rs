//! CUDA IPC export of arena blocks: the chunks under a block, as file descriptors another
//! process can import (Note [exported chunks] in `arena.rs`, Note [exportable memory] in
//! the CUDA backend). Segments are kept by `keep_exported_segment` in `release.rs`.

use super::DevicePool;
use crate::backend::BackendError;

/// What an importer needs to map an exported arena block: the chunks under it in address
/// order, each a descriptor of this process and its bytes, and where the block starts
/// from the first chunk's start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaExport {
    pub offset: u64,
    pub chunks: Vec<(i32, u64)>,
}

impl DevicePool {
    /// Whether `ptr` lies in this pool's VMM arena (whose blocks are exported one by one,
    /// not by their segment).
    pub fn arena_contains(&self, ptr: u64) -> bool {
        let sh = self.shared.lock();
        sh.arena.as_ref().is_some_and(|a| a.contains(ptr))
    }

    /// Exports the arena block `[ptr, ptr + size)` (a live block of this pool). Its chunks
    /// stay mapped where they are for good; each is exported once, and its descriptor is
    /// kept open for the life of the process. `None` when `ptr` is not in the arena;
    /// `Unavailable` when the memory cannot be exported.
    pub fn export_arena_block(
        &self,
        ptr: u64,
        size: u64,
    ) -> Result<Option<ArenaExport>, BackendError> {
        let (first, chunks) = {
            let mut sh = self.shared.lock();
            let Some(arena) = sh.arena.as_mut().filter(|a| a.contains(ptr)) else {
                return Ok(None);
            };
            arena.export(ptr, size).ok_or(BackendError::Unavailable)?
        };
        let mut out = ArenaExport {
            offset: ptr - first,
            chunks: Vec::with_capacity(chunks.len()),
        };
        for chunk in chunks {
            let fd = if chunk.fd >= 0 {
                chunk.fd
            } else {
                let fd = self.backend.export_physical(self.ctx.id, chunk.handle)?;
                let mut sh = self.shared.lock();
                // The arena stays while it holds exported (mapped for good) chunks.
                let kept = sh.arena.as_mut().map(|a| a.set_shared_fd(chunk.id, fd));
                if kept == Some(true) {
                    fd
                } else {
                    // Another thread exported it meanwhile: its descriptor is the one.
                    // SAFETY: the descriptor just made, ours alone.
                    unsafe { libc::close(fd) };
                    let arena = sh.arena.as_ref().ok_or(BackendError::Unavailable)?;
                    arena.shared_fd(chunk.id)
                }
            };
            out.chunks.push((fd, chunk.bytes));
        }
        Ok(Some(out))
    }
}
