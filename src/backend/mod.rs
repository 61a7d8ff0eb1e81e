//! Where device memory and ordering come from.
//!
//! The pool never calls CUDA: it talks to a [`Backend`]. Two implementations exist:
//! - [`cuda`]: the CUDA driver API, loaded at run time (no link-time dependency on any
//!   CUDA library), working in the calling thread's current context.
//! - [`host`]: host memory with simulated streams and events whose completion a test (or a
//!   replay) controls, so every pool test runs on a machine with no GPU.
//!
//! All handles cross this trait as plain integers so the pool stays free of CUDA types.

pub mod cuda;
pub mod driver;
pub mod host;

use crate::status::CupoolStatus;

/// A device address handed out by a backend (a `CUdeviceptr` for CUDA).
pub type DevicePtr = u64;

/// The address of page-locked host memory (what `cuMemHostAlloc` writes), as an integer.
pub type HostPtr = u64;

/// The raw value of a `CUstream` handle as the caller passed it (0 is the legacy default
/// stream, 2 the per-thread default stream). Handles can be reused after a stream is
/// destroyed, so the pool keys streams by [`StreamId`], never by handle.
pub type StreamHandle = usize;

/// Whether `stream` is NULL, `CU_STREAM_LEGACY` (1) or `CU_STREAM_PER_THREAD` (2): a handle
/// that stands for a default stream of the current context (per thread for the last), not
/// for a stream the program created, so no stream creation ever makes it name another.
#[inline]
pub fn names_a_default_stream(stream: StreamHandle) -> bool {
    stream <= 2
}

/// The identity of a context (for CUDA the `CUcontext` pointer value). Blocks never move
/// between contexts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContextId(pub u64);

/// A context together with the device it lives on.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ContextInfo {
    pub id: ContextId,
    /// Device ordinal, as `cudaSetDevice` counts it.
    pub device: i32,
}

/// A stream's unique, never reused identity (`cuStreamGetId` for CUDA).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

/// An event recorded by the backend; opaque to the pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct EventHandle(pub u64);

/// Why a backend call failed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BackendError {
    /// The device has no room for the request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The backend cannot work at all (no driver library, no device, init failed).
    Unavailable,
    /// The driver is shutting down (`CUDA_ERROR_DEINITIALIZED`): no more CUDA calls.
    ShuttingDown,
    /// A stream capture is in progress and the call would invalidate it.
    Capturing,
    /// The argument was rejected by the driver (`CUDA_ERROR_INVALID_VALUE`/`_HANDLE`).
    InvalidValue,
    /// Any other driver error, with its `CUresult` code.
    Driver(u32),
}

impl From<BackendError> for CupoolStatus {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::OutOfMemory => CupoolStatus::CupoolErrorOutOfMemory,
            BackendError::Unavailable => CupoolStatus::CupoolErrorBackendUnavailable,
            BackendError::ShuttingDown => CupoolStatus::CupoolErrorBackendUnavailable,
            BackendError::Capturing => CupoolStatus::CupoolErrorStreamCapture,
            BackendError::InvalidValue => CupoolStatus::CupoolErrorInvalidValue,
            BackendError::Driver(_) => CupoolStatus::CupoolErrorCuda,
        }
    }
}

pub type BackendResult<T> = core::result::Result<T, BackendError>;

/// The source of device memory, streams and events for one process.
///
/// Threading: every method may be called from any thread, concurrently. Methods that take a
/// [`ContextId`] make that context current for the duration of the call when the calling
/// thread has another one current (the pool may release memory of device 1 from a thread
/// working on device 0).
///
/// No method may call back into the pool.
pub trait Backend: Send + Sync + 'static {
    /// Short name for logs and stats ("cuda", "host").
    fn name(&self) -> &'static str;

    /// The calling thread's current context; when it has none, the primary context of
    /// device 0 is retained and made current, as the CUDA runtime does on first use.
    /// Called on every allocation: must be cheap (a thread-local read in the driver).
    fn current_context(&self) -> BackendResult<ContextInfo>;

    /// The calling thread's current context if it has one; never creates or changes one
    /// (the interposer must not make a context current on a program's behalf). As cheap
    /// as [`Backend::current_context`].
    fn existing_context(&self) -> BackendResult<Option<ContextInfo>>;

    /// The context of `device`'s primary context (retained on first use), for calls that
    /// name a device rather than run in the current context.
    fn device_context(&self, device: i32) -> BackendResult<ContextInfo>;

    /// Number of devices the backend can see.
    fn device_count(&self) -> BackendResult<i32>;

    /// The unique id of `stream` (which belongs to the current context).
    fn stream_id(&self, stream: StreamHandle) -> BackendResult<StreamId>;

    /// Creates a stream in `ctx` (non-blocking: it does not synchronise with the legacy
    /// default stream). Trace replay makes one per stream the trace names.
    fn create_stream(&self, ctx: ContextId) -> BackendResult<StreamHandle>;

    /// Destroys a stream made by [`Backend::create_stream`] in `ctx`.
    fn destroy_stream(&self, ctx: ContextId, stream: StreamHandle) -> BackendResult<()>;

    /// Allocates `bytes` of device memory in `ctx`.
    fn allocate(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr>;

    /// Gives an allocation made by [`Backend::allocate`] back to the driver.
    fn release(&self, ctx: ContextId, ptr: DevicePtr, bytes: u64) -> BackendResult<()>;

    /// Granularity of physical memory for [`Backend::create_physical`] and of mappings
    /// (`cuMemGetAllocationGranularity`, 2 MiB on current GPUs). Backends without virtual
    /// memory management answer [`BackendError::Unavailable`] (the default), and the pool
    /// keeps to plain segments.
    fn vmm_granularity(&self, _ctx: ContextId) -> BackendResult<u64> {
        Err(BackendError::Unavailable)
    }

    /// Reserves `bytes` of virtual address space with nothing mapped
    /// (`cuMemAddressReserve`); `bytes` is a multiple of the granularity.
    fn reserve_range(&self, _ctx: ContextId, _bytes: u64) -> BackendResult<DevicePtr> {
        Err(BackendError::Unavailable)
    }

    /// Frees a range from [`Backend::reserve_range`]; nothing may be mapped in it
    /// (`cuMemAddressFree`).
    fn free_range(&self, _ctx: ContextId, _ptr: DevicePtr, _bytes: u64) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Creates `bytes` (one granule) of physical memory and returns its handle, never 0
    /// (`cuMemCreate`).
    fn create_physical(&self, _ctx: ContextId, _bytes: u64) -> BackendResult<u64> {
        Err(BackendError::Unavailable)
    }

    /// Releases physical memory from [`Backend::create_physical`]; it is mapped nowhere
    /// (`cuMemRelease`).
    fn release_physical(&self, _ctx: ContextId, _handle: u64) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Maps the physical memory `handle` (of `bytes`) at `ptr`, inside a reserved range,
    /// and makes it readable and writable by the device, and by every device recorded with
    /// [`Backend::set_peer_access`] for `ctx` (`cuMemMap` + `cuMemSetAccess`). On failure
    /// nothing stays mapped.
    fn map_physical(
        &self,
        _ctx: ContextId,
        _ptr: DevicePtr,
        _bytes: u64,
        _handle: u64,
    ) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Unmaps what [`Backend::map_physical`] mapped at `ptr` (`cuMemUnmap`). No work may
    /// still use the range.
    fn unmap_physical(&self, _ctx: ContextId, _ptr: DevicePtr, _bytes: u64) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// A file descriptor for the physical memory `handle` (from
    /// [`Backend::create_physical`]) that another process can import
    /// (`cuMemExportToShareableHandle`, `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The
    /// caller owns the descriptor. [`BackendError::Unavailable`] when the device cannot
    /// export (memory created before, or on a device without POSIX handles).
    fn export_physical(&self, _ctx: ContextId, _handle: u64) -> BackendResult<i32> {
        Err(BackendError::Unavailable)
    }

    /// Imports physical memory another process exported with [`Backend::export_physical`]
    /// (`fd` is this process's descriptor; the caller still owns it)
    /// (`cuMemImportFromShareableHandle`). The handle is mapped with
    /// [`Backend::map_physical`] and released with [`Backend::release_physical`].
    fn import_physical(&self, _ctx: ContextId, _fd: i32) -> BackendResult<u64> {
        Err(BackendError::Unavailable)
    }

    /// The driver's legacy IPC handle (`cuIpcGetMemHandle`) of the allocation `ptr` lies
    /// in, asked in the calling thread's current context. The three legacy IPC calls fail
    /// with the driver's own code ([`BackendError::Driver`]), which the interposer returns
    /// to the program unchanged.
    fn ipc_get_handle(&self, _ptr: DevicePtr) -> BackendResult<[u8; 64]> {
        Err(BackendError::Unavailable)
    }

    /// Maps an allocation of another process by its legacy IPC handle in the calling
    /// thread's current context (`cuIpcOpenMemHandle_v2`; `flags` are the driver's).
    fn ipc_open(&self, _handle: [u8; 64], _flags: u32) -> BackendResult<DevicePtr> {
        Err(BackendError::Unavailable)
    }

    /// Unmaps what [`Backend::ipc_open`] mapped (`cuIpcCloseMemHandle`).
    fn ipc_close(&self, _ptr: DevicePtr) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Records that `device` may (`enabled`) or may no longer reach memory of the context
    /// `owner` (a program enabled or disabled peer access from a context of `device` to
    /// `owner`): every later [`Backend::map_physical`] in `owner` also grants `device`
    /// read/write access. Mappings made before are the caller's to grant
    /// ([`Backend::grant_access`]); disabling revokes nothing already granted.
    fn set_peer_access(&self, _owner: ContextId, _device: i32, _enabled: bool) {}

    /// Gives `device` read/write access to `[ptr, ptr + bytes)`, a range of `ctx`'s
    /// reservation that is wholly mapped (`cuMemSetAccess`).
    fn grant_access(
        &self,
        _ctx: ContextId,
        _ptr: DevicePtr,
        _bytes: u64,
        _device: i32,
    ) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Records a context fence: it completes when all work submitted to any stream of `ctx`
    /// before this call has completed (`cuCtxRecordEvent`). Fails with
    /// [`BackendError::Capturing`] instead of invalidating a capture when the backend can
    /// tell one is in progress.
    fn record_context_fence(&self, ctx: ContextId) -> BackendResult<EventHandle>;

    /// Makes the legacy default stream of `ctx` wait for `event` (`cuStreamWaitEvent` on
    /// `CU_STREAM_LEGACY`): every piece of work queued afterwards on the legacy stream or
    /// on any blocking stream of the context (per-thread default streams included) runs
    /// after the event has completed. Returns at once. The caller never asks during a
    /// capture (Note [device waits] in the pool).
    fn legacy_stream_wait(&self, _ctx: ContextId, _event: EventHandle) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// Makes `stream` (a non-blocking stream, which a legacy-stream wait does not order)
    /// wait for `event` (`cuStreamWaitEvent`): everything queued on it afterwards runs after
    /// the event has completed. Returns at once. Never asked during a capture.
    fn stream_wait(
        &self,
        _ctx: ContextId,
        _stream: StreamHandle,
        _event: EventHandle,
    ) -> BackendResult<()> {
        Err(BackendError::Unavailable)
    }

    /// The caller sees every stream capture of the process begin and end (the interposer
    /// hooks them) and never asks for a fence during one: a backend that probes the driver
    /// for captures before each fence may stop doing so.
    fn captures_reported_by_caller(&self) {}

    /// Whether the event has completed (`cuEventQuery`). Never blocks.
    fn event_completed(&self, ctx: ContextId, event: EventHandle) -> BackendResult<bool>;

    /// Blocks until the event has completed (`cuEventSynchronize`).
    fn wait_event(&self, ctx: ContextId, event: EventHandle) -> BackendResult<()>;

    /// Waits at most `bound` for the event to complete; whether it did. The default polls
    /// [`Backend::event_completed`] (a blocking `cuEventSynchronize` could not be bounded).
    fn wait_event_for(
        &self,
        ctx: ContextId,
        event: EventHandle,
        bound: core::time::Duration,
    ) -> BackendResult<bool> {
        let started = std::time::Instant::now();
        loop {
            if self.event_completed(ctx, event)? {
                return Ok(true);
            }
            if started.elapsed() >= bound {
                return Ok(false);
            }
            std::thread::yield_now();
        }
    }

    /// Returns an event the pool no longer needs (the backend may reuse it).
    fn recycle_event(&self, ctx: ContextId, event: EventHandle);

    /// `(free, total)` bytes of the device behind `ctx`, as the driver reports them.
    fn memory_info(&self, ctx: ContextId) -> BackendResult<(u64, u64)>;

    /// Allocates `bytes` of page-locked host memory with `ctx` current, usable by every
    /// context and mapped into the device address space
    /// (`cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP)`): a chunk of
    /// the pinned pool, which serves every context from one cache. Returns the host
    /// address, never 0, page aligned (2 MiB aligned from 2 MiB on for the host backend).
    fn host_alloc(&self, ctx: ContextId, bytes: u64) -> BackendResult<HostPtr>;

    /// Gives memory from [`Backend::host_alloc`] back (`cuMemFreeHost`), with `ctx` (the
    /// context it was allocated in) current. No work may still use it.
    fn host_free(&self, ctx: ContextId, ptr: HostPtr) -> BackendResult<()>;
}
