//! The runtime's face of the pinned pool ([`crate::pool::pinned`]): one pool for the
//! process, started on first use, and the calls the C API and the interposer make.
//!
//! Every call that has a current context makes sure that context has a device pool: the
//! pinned pool fences every device pool's context before reusing a block (Note [pinned
//! reuse]), so a context that allocates or frees pinned memory is always among them.

use super::Runtime;
use crate::backend::{ContextInfo, HostPtr, StreamHandle};
use crate::pool::pinned::{PinnedBlock, PinnedPool};
use crate::pool::BACKEND_OFF;
use crate::stats::CupoolHostStats;
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

static PINNED: spin::Once<PinnedPool> = spin::Once::new();

impl Runtime {
    fn pinned(&self) -> &'static PinnedPool {
        PINNED.call_once(|| PinnedPool::new(self.backend))
    }

    /// Size checks done before any driver call (so a bad request costs nothing).
    fn pinned_request(size: usize) -> Result<u64> {
        if size == 0 {
            return Err(CupoolStatus::CupoolErrorInvalidValue);
        }
        Ok(size as u64)
    }

    fn host_alloc_in(&self, ctx: ContextInfo, size: u64, stream: Option<u64>) -> Result<HostPtr> {
        let home = self.pool_of(ctx)?;
        self.pinned().alloc(home, size, stream)
    }

    /// Streamless allocation of `size` bytes of page-locked host memory: no work uses the
    /// block, the host may write it at once, and any stream of any context may copy from
    /// or to it. A new chunk is made in the calling thread's current context (device 0's
    /// primary context when it has none, as for [`Runtime::alloc`]).
    pub fn host_alloc(&self, size: usize) -> Result<HostPtr> {
        let size = Self::pinned_request(size)?;
        let ctx = self.backend.current_context().map_err(CupoolStatus::from)?;
        self.host_alloc_in(ctx, size, None)
    }

    /// [`Runtime::host_alloc`] only in a context the calling thread already has current;
    /// `Ok(None)` when it has none (for the interposer: the driver's own answer then).
    pub fn host_alloc_if_context_current(&self, size: usize) -> Result<Option<HostPtr>> {
        let size = Self::pinned_request(size)?;
        let Some(ctx) = self.existing_context()? else {
            return Ok(None);
        };
        self.host_alloc_in(ctx, size, None).map(Some)
    }

    /// Stream-ordered allocation on `stream` (of the current context): the block may be
    /// one freed on `stream` whose earlier work has not run yet, so work on `stream` may
    /// use it at once, and the host only once that work is done (Note [pinned reuse]).
    pub fn host_alloc_async(&self, size: usize, stream: StreamHandle) -> Result<HostPtr> {
        let size = Self::pinned_request(size)?;
        let ctx = self.backend.current_context().map_err(CupoolStatus::from)?;
        // The thread's remembered ids, as device allocations use (Note [stream id cache]).
        let sid = super::stream_ids::stream_id(self.backend, ctx.id, stream)
            .map_err(CupoolStatus::from)?;
        self.host_alloc_in(ctx, size, Some(sid.0))
    }

    /// The calling thread's current context, if any, gets a device pool, so the pinned
    /// pool's fences cover it; returns that context.
    fn fence_current_context(&self) -> Option<ContextInfo> {
        // At exit (and in a fork child) no driver call, not even this query.
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return None;
        }
        let ctx = self.backend.existing_context().ok().flatten()?;
        let _ = self.pool_of(ctx);
        Some(ctx)
    }

    /// Streamless free of a pinned block: reused only once a fence recorded after this call
    /// has completed in every context. Unknown or interior pointers:
    /// `CupoolErrorInvalidPointer`; a block freed already: `CupoolErrorDoubleFree`.
    pub fn host_free(&self, ptr: HostPtr) -> Result<()> {
        let pinned = PINNED
            .get()
            .ok_or(CupoolStatus::CupoolErrorInvalidPointer)?;
        self.fence_current_context();
        pinned.free(ptr, None)
    }

    /// Stream-ordered free on `stream` (of the current context): reusable by allocations
    /// on `stream` at once, by others after a fence. A block allocated on another stream
    /// is treated as a streamless free.
    pub fn host_free_async(&self, ptr: HostPtr, stream: StreamHandle) -> Result<()> {
        let pinned = PINNED
            .get()
            .ok_or(CupoolStatus::CupoolErrorInvalidPointer)?;
        if pinned.live_block_containing(ptr).map(|b| b.ptr) != Some(ptr) {
            // Checked before asking for the stream, so a bad pointer gets its own status.
            return pinned.free(ptr, None);
        }
        if BACKEND_OFF.load(Ordering::Relaxed) {
            // No driver call to name the stream: freed for everyone (never reused anyway).
            return pinned.free(ptr, None);
        }
        let sid = match self.fence_current_context() {
            // The stream is one of the current context's (Note [stream id cache]).
            Some(ctx) => super::stream_ids::stream_id(self.backend, ctx.id, stream),
            None => self.backend.stream_id(stream),
        };
        let sid = sid.map_err(CupoolStatus::from)?;
        pinned.free(ptr, Some(sid.0))
    }

    /// The live pinned block containing `ptr`, if the pool has started and holds one.
    pub fn host_block_containing(&self, ptr: HostPtr) -> Option<PinnedBlock> {
        PINNED.get()?.live_block_containing(ptr)
    }

    /// Whether `ptr` lies in pinned memory the pool holds (in use or cached).
    pub fn host_memory_holds(&self, ptr: HostPtr) -> bool {
        PINNED.get().is_some_and(|p| p.holds(ptr))
    }

    /// Statistics of the pinned pool (all zero before its first use).
    pub fn host_stats(&self) -> CupoolHostStats {
        PINNED
            .get()
            .map_or_else(CupoolHostStats::new, PinnedPool::stats)
    }

    /// Whether the pinned pool has started (the exit summary prints it only then).
    pub fn host_pool_started(&self) -> bool {
        PINNED.get().is_some()
    }

    pub fn host_reset_peak_stats(&self) {
        if let Some(p) = PINNED.get() {
            p.reset_peaks();
        }
    }

    /// Waits for pending pinned frees and gives every idle chunk back to the driver;
    /// returns the bytes released.
    pub fn host_empty_cache(&self) -> Result<u64> {
        Ok(PINNED.get().map_or(0, PinnedPool::empty_cache))
    }

    /// Checks the pinned pool's invariants (tests).
    pub fn host_check(&self) -> core::result::Result<(), String> {
        PINNED.get().map_or(Ok(()), PinnedPool::check)
    }
}
