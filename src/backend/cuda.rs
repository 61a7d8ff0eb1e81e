//! The CUDA backend: device memory, streams and events from the CUDA driver API, in the
//! calling thread's current context (see [`Backend`] for each method's contract).
//!
//! Every driver function comes from [`driver()`], loaded at run time; a missing library or
//! function is [`BackendError::Unavailable`], never a panic. No lock is held across a driver
//! call, and the hot path ([`Backend::current_context`]) is one `cuCtxGetCurrent` plus a
//! lock-free table lookup.
//!
//! Note [context fences and capture]: a context fence is `cuCtxRecordEvent`, which covers
//! every stream of the context, non-blocking and per-thread ones included. While any stream
//! of the context is capturing, the driver refuses it *and invalidates that capture*. The
//! backend cannot see every capture (the driver has no "is any stream of this context
//! capturing" query), so it asks the one question the driver answers without side effects:
//! `cuStreamIsCapturing` on the legacy stream returns `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`
//! while a *blocking* stream of the current context is capturing. Then the fence is refused
//! with [`BackendError::Capturing`] before the driver is asked. A capture on a non-blocking
//! stream is not visible that way: the fence then fails with `Capturing` too, but the
//! capture has been invalidated; callers that can see captures begin (the preload's hooks)
//! must not fence during one.

use core::ffi::c_int;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{CUcontext, CUdeviceptr, CUevent, CUstream};

use super::driver::{check, check_exact, code, driver, required, DriverApi, IpcMemHandle};
use super::{
    Backend, BackendError, BackendResult, ContextId, ContextInfo, DevicePtr, EventHandle, HostPtr,
    StreamHandle, StreamId,
};
use crate::log;
use std::sync::atomic::{AtomicU64, AtomicU8};

mod pinned;
mod shareable;
mod tables;
mod vmm;

use tables::{ContextTable, IdleEvents};
use vmm::vmm_check;

/// `CU_EVENT_DISABLE_TIMING`: fences and stream events are never timed, which makes them
/// cheaper to record and query.
const EVENT_DISABLE_TIMING: u32 = 2;
/// `CU_STREAM_LEGACY`: the legacy default stream whatever the caller's default-stream mode.
const STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_NON_BLOCKING`: a created stream does not wait for the legacy stream.
const STREAM_NON_BLOCKING: u32 = 0x1;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_STATUS_NONE: c_int = 0;

/// Devices whose primary context is cached; higher ordinals are retained on each request.
const MAX_DEVICES: usize = 64;
/// Contexts whose device is cached; further contexts ask the driver each time.
const CONTEXT_SLOTS: usize = 64;
/// Idle events kept per context; more are destroyed when given back.
const MAX_IDLE_EVENTS: usize = 4096;

/// The CUDA driver backend.
pub struct CudaBackend {
    api: &'static DriverApi,
    initialized: AtomicBool,
    contexts: ContextTable,
    /// Retained primary context of each device (`CUcontext` as an integer; 0 = not yet).
    primary: [AtomicU64; MAX_DEVICES],
    /// Whether each device's physical memory is created exportable (Note [exportable
    /// memory] in `shareable.rs`).
    exportable: [AtomicU8; MAX_DEVICES],
    events: spin::Mutex<IdleEvents>,
    fence_fallback_logged: AtomicBool,
    /// Set when the caller reports every capture (see
    /// [`Backend::captures_reported_by_caller`]): fences skip the driver probe for one.
    captures_reported: AtomicBool,
    /// Devices granted access to every mapping of a context (Note [vmm peer access] in `vmm.rs`).
    peers: spin::Mutex<Vec<(ContextId, Vec<i32>)>>,
}

impl CudaBackend {
    /// Loads the driver. Fails with [`BackendError::Unavailable`] when `libcuda.so.1` cannot
    /// be loaded or lacks the functions nothing works without. Makes no driver call: the
    /// driver is initialised on first use.
    pub fn new() -> BackendResult<CudaBackend> {
        let api = driver()?;
        let essential = [
            ("cuInit", api.init.is_some()),
            ("cuCtxGetCurrent", api.ctx_get_current.is_some()),
            ("cuMemAlloc_v2", api.mem_alloc.is_some()),
            ("cuMemFree_v2", api.mem_free.is_some()),
        ];
        if let Some((name, _)) = essential.iter().find(|(_, present)| !present) {
            log::error(&format!(
                "cupool: the CUDA driver has no {name}; the CUDA backend is unavailable"
            ));
            return Err(BackendError::Unavailable);
        }
        Ok(CudaBackend {
            api,
            initialized: AtomicBool::new(false),
            contexts: ContextTable::new(),
            primary: core::array::from_fn(|_| AtomicU64::new(0)),
            exportable: core::array::from_fn(|_| AtomicU8::new(shareable::UNKNOWN)),
            events: spin::Mutex::new(IdleEvents::default()),
            fence_fallback_logged: AtomicBool::new(false),
            captures_reported: AtomicBool::new(false),
            peers: spin::Mutex::new(Vec::new()),
        })
    }

    /// The device ordinal of `ctx` (cached; asked of the driver with `ctx` current once).
    fn device_of(&self, ctx: ContextId) -> BackendResult<i32> {
        if let Some(d) = self.contexts.device_of(ctx.0 as usize as CUcontext) {
            return Ok(d);
        }
        self.with_context(ctx, || {
            let current = self.raw_current()?;
            self.describe_current(current).map(|i| i.device)
        })
    }

    /// `cuInit(0)`, once.
    fn ensure_init(&self) -> BackendResult<()> {
        if self.initialized.load(Ordering::Acquire) {
            return Ok(());
        }
        let init = required(self.api.init)?;
        // SAFETY: cuInit takes a flags word (0).
        check(unsafe { init(0) })?;
        self.initialized.store(true, Ordering::Release);
        Ok(())
    }

    /// The calling thread's current context (null when none), initialising the driver when
    /// it says it is not yet.
    fn raw_current(&self) -> BackendResult<CUcontext> {
        let get = required(self.api.ctx_get_current)?;
        let mut ctx: CUcontext = null_mut();
        // SAFETY: valid out-pointer.
        let mut rc = unsafe { get(&mut ctx) };
        if rc == code::NOT_INITIALIZED {
            self.ensure_init()?;
            // SAFETY: as above.
            rc = unsafe { get(&mut ctx) };
        }
        check(rc)?;
        Ok(ctx)
    }

    /// Describes `ctx`, which is current on this thread.
    fn describe_current(&self, ctx: CUcontext) -> BackendResult<ContextInfo> {
        let id = ContextId(ctx as usize as u64);
        if let Some(device) = self.contexts.device_of(ctx) {
            return Ok(ContextInfo { id, device });
        }
        let get_device = required(self.api.ctx_get_device)?;
        let mut device: c_int = 0;
        // SAFETY: valid out-pointer; `ctx` is current.
        check(unsafe { get_device(&mut device) })?;
        self.contexts.insert(ctx, device);
        Ok(ContextInfo { id, device })
    }

    /// Runs `f` with `ctx` current on this thread: pushed for the call when another
    /// context (or none) is current, popped after.
    fn with_context<T>(
        &self,
        ctx: ContextId,
        f: impl FnOnce() -> BackendResult<T>,
    ) -> BackendResult<T> {
        let target = ctx.0 as usize as CUcontext;
        if target.is_null() {
            return Err(BackendError::InvalidValue);
        }
        if self.raw_current()? == target {
            return f();
        }
        let push = required(self.api.ctx_push_current)?;
        let pop = required(self.api.ctx_pop_current)?;
        // SAFETY: `target` is a context handle the backend handed out.
        check(unsafe { push(target) })?;
        let result = f();
        let mut popped: CUcontext = null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { pop(&mut popped) };
        if rc != code::SUCCESS {
            // The call itself is done (an allocation must not be lost); the thread keeps an
            // extra context on its stack, which is all that can go wrong here.
            log::error(&format!(
                "cupool: cuCtxPopCurrent failed ({}) after a call in another context",
                self.api.error_name(rc)
            ));
        }
        result
    }

    /// An idle event of `ctx` (which is current), or a new one.
    fn take_event(&self, ctx: ContextId) -> BackendResult<CUevent> {
        if let Some(ev) = self.events.lock().take(ctx) {
            return Ok(ev as usize as CUevent);
        }
        let create = required(self.api.event_create)?;
        let mut ev: CUevent = null_mut();
        // SAFETY: valid out-pointer; the event belongs to the current context, `ctx`.
        check(unsafe { create(&mut ev, EVENT_DISABLE_TIMING) })?;
        Ok(ev)
    }

    fn give_back_event(&self, ctx: ContextId, ev: CUevent) {
        if self.events.lock().put(ctx, ev as usize as u64) {
            return;
        }
        if let Some(destroy) = self.api.event_destroy {
            // SAFETY: an event created by this backend and no longer used by anyone.
            let rc = unsafe { destroy(ev) };
            if rc != code::SUCCESS {
                log::debug(&format!(
                    "cupool: cuEventDestroy failed ({})",
                    self.api.error_name(rc)
                ));
            }
        }
    }

    /// Whether a capture on a blocking stream of the current context is in progress, as far
    /// as the driver can tell without side effects (see Note [context fences and capture]).
    fn blocking_capture_in_progress(&self) -> bool {
        if self.captures_reported.load(Ordering::Relaxed) {
            return false;
        }
        let Some(is_capturing) = self.api.stream_is_capturing else {
            return false;
        };
        let mut status: c_int = CAPTURE_STATUS_NONE;
        // SAFETY: the legacy stream handle and a valid out-pointer.
        let rc = unsafe { is_capturing(STREAM_LEGACY as CUstream, &mut status) };
        rc == code::STREAM_CAPTURE_IMPLICIT
            || (rc == code::SUCCESS && status != CAPTURE_STATUS_NONE)
    }

    /// Records `ev` as a context fence of the current context `ctx`.
    fn record_fence_event(&self, ctx: ContextId, ev: CUevent) -> BackendResult<()> {
        if let Some(record) = self.api.ctx_record_event {
            // SAFETY: `ctx` is a live context and `ev` one of its events.
            return check(unsafe { record(ctx.0 as usize as CUcontext, ev) });
        }
        // Drivers before 12.5 have no cuCtxRecordEvent. The legacy stream waits for every
        // blocking stream of the context, but not for non-blocking or per-thread streams.
        if !self.fence_fallback_logged.swap(true, Ordering::Relaxed) {
            log::warn(
                "cupool: the CUDA driver has no cuCtxRecordEvent (before 12.5): context \
                 fences are recorded on the legacy stream and do not cover non-blocking \
                 streams",
            );
        }
        let record = required(self.api.event_record)?;
        // SAFETY: `ev` belongs to the current context; the legacy stream handle is valid.
        check(unsafe { record(ev, STREAM_LEGACY as CUstream) })
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn current_context(&self) -> BackendResult<ContextInfo> {
        let ctx = self.raw_current()?;
        if !ctx.is_null() {
            return self.describe_current(ctx);
        }
        // As the CUDA runtime does on first use: device 0's primary context.
        let info = self.device_context(0)?;
        let set = required(self.api.ctx_set_current)?;
        // SAFETY: a retained primary context.
        check(unsafe { set(info.id.0 as usize as CUcontext) })?;
        Ok(info)
    }

    fn existing_context(&self) -> BackendResult<Option<ContextInfo>> {
        let get = required(self.api.ctx_get_current)?;
        let mut ctx: CUcontext = null_mut();
        // SAFETY: valid out-pointer. Unlike `raw_current`, a driver that is not initialised
        // is left so (no cuInit on the program's behalf): it simply has no context.
        let rc = unsafe { get(&mut ctx) };
        if rc == code::NOT_INITIALIZED || ctx.is_null() {
            return Ok(None);
        }
        check(rc)?;
        self.describe_current(ctx).map(Some)
    }

    fn device_context(&self, device: i32) -> BackendResult<ContextInfo> {
        if device < 0 {
            return Err(BackendError::InvalidValue);
        }
        let cached = self.primary.get(device as usize);
        if let Some(ctx) = cached
            .map(|c| c.load(Ordering::Acquire))
            .filter(|&c| c != 0)
        {
            return Ok(ContextInfo {
                id: ContextId(ctx),
                device,
            });
        }
        self.ensure_init()?;
        let device_get = required(self.api.device_get)?;
        let retain = required(self.api.device_primary_ctx_retain)?;
        let mut handle = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { device_get(&mut handle, device) })?;
        let mut ctx: CUcontext = null_mut();
        // SAFETY: valid out-pointer and a device handle from cuDeviceGet.
        check(unsafe { retain(&mut ctx, handle) })?;
        if ctx.is_null() {
            return Err(BackendError::Driver(code::UNKNOWN));
        }
        // Two threads may both retain: the primary context is the same, its count one
        // higher, and it is never released (it lives until the process exits).
        if let Some(slot) = cached {
            slot.store(ctx as usize as u64, Ordering::Release);
        }
        self.contexts.insert(ctx, device);
        Ok(ContextInfo {
            id: ContextId(ctx as usize as u64),
            device,
        })
    }

    fn device_count(&self) -> BackendResult<i32> {
        self.ensure_init()?;
        let count = required(self.api.device_get_count)?;
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { count(&mut n) })?;
        Ok(n)
    }

    fn stream_id(&self, stream: StreamHandle) -> BackendResult<StreamId> {
        let get_id = required(self.api.stream_get_id)?;
        let mut id: u64 = 0;
        // SAFETY: the caller's stream handle (0 and 2 name the default streams, which the
        // driver knows) and a valid out-pointer.
        check(unsafe { get_id(stream as CUstream, &mut id) })?;
        Ok(StreamId(id))
    }

    fn create_stream(&self, ctx: ContextId) -> BackendResult<StreamHandle> {
        let create = required(self.api.stream_create)?;
        self.with_context(ctx, || {
            let mut stream: CUstream = null_mut();
            // SAFETY: valid out-pointer; the stream belongs to `ctx`, which is current.
            check(unsafe { create(&mut stream, STREAM_NON_BLOCKING) })?;
            Ok(stream as StreamHandle)
        })
    }

    fn destroy_stream(&self, ctx: ContextId, stream: StreamHandle) -> BackendResult<()> {
        let destroy = required(self.api.stream_destroy)?;
        // SAFETY: a stream `create_stream` made in `ctx` (the caller's contract); work
        // still queued on it completes before the driver frees it.
        self.with_context(ctx, || check(unsafe { destroy(stream as CUstream) }))
    }

    fn allocate(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr> {
        let bytes = usize::try_from(bytes).map_err(|_| BackendError::OutOfMemory)?;
        let alloc = required(self.api.mem_alloc)?;
        self.with_context(ctx, || {
            let mut ptr = 0;
            // SAFETY: valid out-pointer; `ctx` is current.
            check(unsafe { alloc(&mut ptr, bytes) })?;
            Ok(ptr)
        })
    }

    fn release(&self, ctx: ContextId, ptr: DevicePtr, _bytes: u64) -> BackendResult<()> {
        let free = required(self.api.mem_free)?;
        // SAFETY: `ptr` came from `allocate` in `ctx` (the caller's contract).
        self.with_context(ctx, || check(unsafe { free(ptr) }))
    }

    fn vmm_granularity(&self, ctx: ContextId) -> BackendResult<u64> {
        self.vmm_get_granularity(ctx)
    }

    fn reserve_range(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr> {
        self.vmm_reserve_range(ctx, bytes)
    }

    fn free_range(&self, ctx: ContextId, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        self.vmm_free_range(ctx, ptr, bytes)
    }

    fn create_physical(&self, ctx: ContextId, bytes: u64) -> BackendResult<u64> {
        self.vmm_create_physical(ctx, bytes)
    }

    fn export_physical(&self, ctx: ContextId, handle: u64) -> BackendResult<i32> {
        self.export_fd(ctx, handle)
    }

    fn import_physical(&self, ctx: ContextId, fd: i32) -> BackendResult<u64> {
        self.import_fd(ctx, fd)
    }

    fn release_physical(&self, ctx: ContextId, handle: u64) -> BackendResult<()> {
        self.vmm_release_physical(ctx, handle)
    }

    fn map_physical(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
        handle: u64,
    ) -> BackendResult<()> {
        self.vmm_map_physical(ctx, ptr, bytes, handle)
    }

    fn unmap_physical(&self, ctx: ContextId, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        self.vmm_unmap_physical(ctx, ptr, bytes)
    }

    fn ipc_get_handle(&self, ptr: DevicePtr) -> BackendResult<[u8; 64]> {
        let get = required(self.api.ipc_get_mem_handle)?;
        let mut handle = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: a valid out-parameter; the driver checks the pointer.
        check_exact(unsafe { get(&mut handle, ptr) })?;
        Ok(handle.reserved)
    }

    fn ipc_open(&self, handle: [u8; 64], flags: u32) -> BackendResult<DevicePtr> {
        let open = required(self.api.ipc_open_mem_handle)?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: a valid out-parameter; the driver checks the handle.
        check_exact(unsafe { open(&mut ptr, IpcMemHandle { reserved: handle }, flags) })?;
        Ok(ptr)
    }

    fn ipc_close(&self, ptr: DevicePtr) -> BackendResult<()> {
        let close = required(self.api.ipc_close_mem_handle)?;
        // SAFETY: the driver checks the pointer.
        check_exact(unsafe { close(ptr) })
    }

    fn set_peer_access(&self, owner: ContextId, device: i32, enabled: bool) {
        self.vmm_set_peer_access(owner, device, enabled)
    }

    fn grant_access(
        &self,
        ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
        device: i32,
    ) -> BackendResult<()> {
        self.vmm_grant_access(ctx, ptr, bytes, device)
    }

    fn record_context_fence(&self, ctx: ContextId) -> BackendResult<EventHandle> {
        self.with_context(ctx, || {
            if self.blocking_capture_in_progress() {
                return Err(BackendError::Capturing);
            }
            let ev = self.take_event(ctx)?;
            match self.record_fence_event(ctx, ev) {
                Ok(()) => Ok(EventHandle(ev as usize as u64)),
                Err(e) => {
                    self.give_back_event(ctx, ev);
                    Err(e)
                }
            }
        })
    }

    fn legacy_stream_wait(&self, ctx: ContextId, event: EventHandle) -> BackendResult<()> {
        // The legacy stream handle is valid in every context.
        self.stream_wait(ctx, STREAM_LEGACY as StreamHandle, event)
    }

    fn stream_wait(
        &self,
        ctx: ContextId,
        stream: StreamHandle,
        event: EventHandle,
    ) -> BackendResult<()> {
        let wait = required(self.api.stream_wait_event)?;
        self.with_context(ctx, || {
            // SAFETY: an event this backend recorded; the stream is the legacy one or one
            // the caller keeps alive (Note [device waits]: it is destroyed only outside a
            // pass's waits).
            check(unsafe { wait(stream as CUstream, event.0 as usize as CUevent, 0) })
        })
    }

    fn captures_reported_by_caller(&self) {
        self.captures_reported.store(true, Ordering::Relaxed);
    }

    fn event_completed(&self, _ctx: ContextId, event: EventHandle) -> BackendResult<bool> {
        let query = required(self.api.event_query)?;
        // SAFETY: an event this backend recorded.
        match unsafe { query(event.0 as usize as CUevent) } {
            code::SUCCESS => Ok(true),
            code::NOT_READY => Ok(false),
            rc => Err(super::driver::error_from_code(rc)),
        }
    }

    fn wait_event(&self, _ctx: ContextId, event: EventHandle) -> BackendResult<()> {
        let sync = required(self.api.event_synchronize)?;
        // SAFETY: an event this backend recorded.
        check(unsafe { sync(event.0 as usize as CUevent) })
    }

    fn recycle_event(&self, ctx: ContextId, event: EventHandle) {
        if event.0 != 0 {
            self.give_back_event(ctx, event.0 as usize as CUevent);
        }
    }

    fn memory_info(&self, ctx: ContextId) -> BackendResult<(u64, u64)> {
        let info = required(self.api.mem_get_info)?;
        self.with_context(ctx, || {
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers; `ctx` is current.
            check(unsafe { info(&mut free, &mut total) })?;
            Ok((free as u64, total as u64))
        })
    }

    fn host_alloc(&self, ctx: ContextId, bytes: u64) -> BackendResult<HostPtr> {
        self.pinned_alloc(ctx, bytes)
    }

    fn host_free(&self, ctx: ContextId, ptr: HostPtr) -> BackendResult<()> {
        self.pinned_free(ctx, ptr)
    }
}
