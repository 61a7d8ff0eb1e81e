//! The process-wide allocator: configuration, backend, one pool per context, lifecycle.
//!
//! CONTRACT (used by `ffi` and by the preload crate). Bodies are being filled in.

use crate::backend::{Backend, ContextId, DevicePtr, StreamHandle};
use crate::stats::CupoolStats;
use crate::status::{CupoolStatus, Result};

/// What the pool knows about one live block (for address-range, IPC and attribute queries).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Start of the block handed to the program.
    pub ptr: DevicePtr,
    /// Size of the block after rounding.
    pub size: u64,
    /// Size the program asked for.
    pub requested: u64,
    pub device: i32,
    pub context: ContextId,
    /// The driver allocation (segment) the block was carved from.
    pub segment_base: DevicePtr,
    pub segment_size: u64,
}

/// The process's allocator.
pub struct Runtime {
    _private: (),
}

/// The runtime, started on first use (config read, backend chosen). Fails with
/// `CupoolErrorBackendUnavailable` when the configured backend cannot start; the reason is
/// printed once on stderr.
pub fn runtime() -> Result<&'static Runtime> {
    Err(CupoolStatus::CupoolErrorInternal)
}

/// The runtime if it has already started; never starts it.
pub fn runtime_if_started() -> Option<&'static Runtime> {
    None
}

/// Marks the process as a fork child of a process whose pool was live: every later call
/// is refused (the child must never touch the parent's pool or its device memory).
pub fn mark_fork_child() {}

/// Whether this process is such a fork child.
pub fn is_fork_child() -> bool {
    false
}

/// Marks the process as exiting: from now on no CUDA call is made (frees of pool blocks
/// only update metadata; nothing is given back to the driver).
pub fn mark_exiting() {}

impl Runtime {
    pub fn backend(&self) -> &dyn Backend {
        unimplemented!()
    }

    /// Streamless allocation in the calling thread's current context: the block is safe to
    /// use from any stream (no pending work on it).
    pub fn alloc(&self, _size: usize) -> Result<DevicePtr> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Stream-ordered allocation: the block may be used by `stream` at once.
    pub fn alloc_async(&self, _size: usize, _stream: StreamHandle) -> Result<DevicePtr> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Streamless free: reused only after a context fence recorded after this call completes.
    pub fn free(&self, _ptr: DevicePtr) -> Result<()> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Stream-ordered free on `stream`.
    pub fn free_async(&self, _ptr: DevicePtr, _stream: StreamHandle) -> Result<()> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// The live block that starts exactly at `ptr`.
    pub fn lookup(&self, _ptr: DevicePtr) -> Option<BlockInfo> {
        None
    }

    /// The live block that contains `ptr` (interior pointers included).
    pub fn lookup_containing(&self, _ptr: DevicePtr) -> Option<BlockInfo> {
        None
    }

    /// Statistics of `device`, or of all devices summed for `None`.
    pub fn stats(&self, _device: Option<i32>) -> Result<CupoolStats> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    pub fn reset_peak_stats(&self, _device: Option<i32>) -> Result<()> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Gives idle cached memory of `device` (all devices for `None`) back to the driver;
    /// returns the bytes released.
    pub fn empty_cache(&self, _device: Option<i32>) -> Result<u64> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Per-device cap on reserved bytes; 0 removes it.
    pub fn set_memory_limit(&self, _device: i32, _bytes: u64) -> Result<()> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    pub fn memory_limit(&self, _device: i32) -> Result<u64> {
        Err(CupoolStatus::CupoolErrorInternal)
    }

    /// Bytes cached in `ctx`'s pool that no program block uses (what `cuMemGetInfo` adds
    /// back to "free" under the preload).
    pub fn idle_cached_bytes(&self, _ctx: ContextId) -> u64 {
        0
    }

    /// A stream capture began in `ctx`: until the matching end, no fence, synchronisation
    /// or release is made there, and a miss fails with `CupoolErrorStreamCapture`.
    pub fn capture_begin(&self, _ctx: ContextId) {}

    pub fn capture_end(&self, _ctx: ContextId) {}
}
