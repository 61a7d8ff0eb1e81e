//! Calls that name a device instead of running in the calling thread's current context
//! (PyTorch's pluggable-allocator hooks pass the device of every allocation).
//!
//! Note [device of a call]: PyTorch asks for memory on device `d` with its device guard
//! set, so the calling thread's current context is normally `d`'s primary context and the
//! call runs there, exactly as `cupool_alloc_async` would. When it is not (a thread with
//! no current context yet, or one whose current context is on another device), the block
//! comes from `d`'s primary context. A real stream handle names its stream wherever it is
//! used, so the allocation stays stream-ordered; the default-stream handles (NULL,
//! `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) name a stream of whichever context is
//! current, which is not `d`'s here, so such an allocation is made streamless instead: the
//! block has no pending work and is safe on any stream of `d`, and its free is ordered by a
//! context fence (never by a stream id of another context).

use super::{trace_allocation, BlockInfo, Runtime, Seen};
use crate::backend::{names_a_default_stream, ContextInfo, DevicePtr, StreamHandle};
use crate::status::{CupoolStatus, Result};
use crate::trace::record;

impl Runtime {
    /// The context a call for `device` runs in, and whether `stream` names a stream there
    /// (Note [device of a call]).
    fn device_target(&self, device: i32, stream: StreamHandle) -> Result<(ContextInfo, bool)> {
        if device < 0 {
            return Err(CupoolStatus::CupoolErrorInvalidDevice);
        }
        if let Some(ctx) = self.existing_context()?.filter(|c| c.device == device) {
            return Ok((ctx, true));
        }
        self.check_device(Some(device))?;
        let ctx = self
            .backend
            .device_context(device)
            .map_err(|_| CupoolStatus::CupoolErrorInvalidDevice)?;
        Ok((ctx, !names_a_default_stream(stream)))
    }

    /// Stream-ordered allocation of `size` bytes on `device` and `stream` (Note [device of
    /// a call]); recorded in a running trace like [`Runtime::alloc_async`].
    pub fn alloc_async_on_device(
        &self,
        size: usize,
        device: i32,
        stream: StreamHandle,
    ) -> Result<DevicePtr> {
        let mut seen = Seen::device(device);
        let mut ordered = true;
        let result = (|| {
            let rounded = Self::rounded(size)?;
            let (ctx, on_stream) = self.device_target(device, stream)?;
            ordered = on_stream;
            let pool = self.pool_of(ctx)?;
            if on_stream {
                self.alloc_in_pool_on_stream(pool, rounded, size, stream, &mut seen)
            } else {
                Self::alloc_streamless(pool, rounded, size)
            }
        })();
        if record::active() {
            trace_allocation(result, size, seen, ordered.then_some(stream as u64));
        }
        result
    }

    /// `(free, total)` bytes of `device` as the driver (or the host backend) reports them.
    pub fn memory_info(&self, device: i32) -> Result<(u64, u64)> {
        self.check_device(Some(device))?;
        let ctx = self
            .backend
            .device_context(device)
            .map_err(|_| CupoolStatus::CupoolErrorInvalidDevice)?;
        self.backend.memory_info(ctx.id).map_err(CupoolStatus::from)
    }

    /// Keeps the segment of the live block at `ptr` from ever going back to the driver
    /// (the block was exported through CUDA IPC: Note [exported segments]). Returns the
    /// block, or `None` when `ptr` is not the start of a live pool block.
    pub fn keep_exported(&self, ptr: DevicePtr) -> Option<BlockInfo> {
        let block = self.lookup_containing(ptr).filter(|b| b.ptr == ptr)?;
        crate::pool::handover::pool_holding(ptr)?.keep_exported_segment(block.segment_base);
        Some(block)
    }

    /// The segment (driver allocation) that holds the live block containing `ptr`, as
    /// `(base, size)`.
    pub fn segment_of(&self, ptr: DevicePtr) -> Option<(DevicePtr, u64)> {
        self.lookup_containing(ptr)
            .map(|b| (b.segment_base, b.segment_size))
    }

    /// Makes the pool of `device` (`None`: the calling thread's current context) hold and
    /// keep `bytes` (Note [reserve at start] in `pool/reserve.rs`); returns the bytes taken now.
    pub fn reserve(&self, device: Option<i32>, bytes: u64) -> Result<u64> {
        let pool = match device {
            None => self.current_pool()?,
            Some(d) => self.pool_of(self.device_target(d, 0)?.0)?,
        };
        pool.reserve(
            crate::pool::thread_cache::thread_counters(pool.index),
            bytes,
        )
    }
}
