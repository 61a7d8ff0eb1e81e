//! Host backend: host memory with simulated contexts, streams and events.
//!
//! It lets every pool test, the C API tests and users' own tests run on a machine with no
//! GPU (`CUPOOL_CONF=backend:host`). Memory is real host memory, mapped so that only the pages
//! a program writes cost RAM ([`map_device_memory`]): a program can read and write what it
//! allocates, and a trace replay of tens of GiB runs on a small machine. Time is simulated: an event completes when
//! the test says so (`complete_all`, `wait_event`) or at once when `host_auto_complete` is
//! on (the default). Streams get unique ids; destroying a handle and reusing it gives a new
//! id, as `cuStreamGetId` does.
//!
//! Here: the simulated devices, memory, streams and events (the [`Backend`] calls);
//! `controls`: what tests and the replay use to hold events in flight or run the device
//! behind; `faults`: injected failures; `pages`: the host mappings; `pinned`: page-locked
//! memory; `vmm`: the simulated virtual memory management (Note [host vmm]).

use super::{
    Backend, BackendError, BackendResult, ContextId, ContextInfo, DevicePtr, EventHandle, HostPtr,
    StreamHandle, StreamId,
};
use crate::config::{self, Key};
use crate::ptr_map::{IntMap, PtrMap};
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::cell::Cell;

mod controls;
mod faults;
mod pages;
mod pinned;
mod vmm;
use pages::{map_device_memory, release_address_space, reserve_address_space, unmap_device_memory};
pub use pinned::HostPinnedCounters;
use vmm::HostVmm;

/// Devices the host backend pretends to have.
pub const HOST_DEVICES: i32 = 2;
/// Simulated memory per device unless changed with [`HostBackend::set_capacity`].
pub const DEFAULT_CAPACITY: u64 = 8 << 30;
/// First id of contexts made with [`HostBackend::create_context`] (primary contexts are
/// `device + 1`).
const FIRST_EXTRA_CONTEXT: u64 = 1000;

/// Handles [`Backend::create_stream`] hands out: from here, `CREATED_STREAM_STEP` apart
/// (aligned like real `CUstream` pointers).
const FIRST_CREATED_STREAM: StreamHandle = 0x5eed_0000_0000;
const CREATED_STREAM_STEP: StreamHandle = 0x100;
static NEXT_CREATED_STREAM: AtomicUsize = AtomicUsize::new(FIRST_CREATED_STREAM);

thread_local! {
    static CURRENT: Cell<Option<ContextInfo>> = const { Cell::new(None) };
}

struct State {
    /// Live allocations: address → (bytes, device).
    allocations: PtrMap<(u64, i32)>,
    live_bytes: [u64; HOST_DEVICES as usize],
    capacity: u64,
    /// Stream handle → id; ids are never reused.
    streams: IntMap<StreamHandle, u64>,
    next_stream_id: u64,
    next_context: u64,
    contexts: PtrMap<i32>,
    /// Recorded events: id → (context, done). Ids grow in record order.
    events: PtrMap<(u64, bool)>,
    next_event: u64,
    /// Contexts whose events complete only when a test says so.
    manual: std::collections::HashSet<u64>,
    /// Contexts whose simulated device runs behind the program (trace replay): context →
    /// (lag, simulated now), in microseconds; an event recorded at `now` completes once the
    /// time reaches `now + lag`, or when the program waits for it.
    lagging: PtrMap<(u64, u64)>,
    /// When each event of a lagging context completes (simulated microseconds).
    due: PtrMap<u64>,
    /// Simulated microseconds the program spent waiting for lagging contexts' events.
    waited_us: u64,
    /// Contexts with a stream capture in progress that the pool was not told about.
    capturing: std::collections::HashSet<u64>,
    /// Counters tests read.
    pub allocs: u64,
    pub releases: u64,
    pub fences_recorded: u64,
    /// Waits of a legacy stream for an event (`legacy_stream_wait`).
    pub device_waits: u64,
    /// Waits of other streams for an event (`stream_wait`).
    pub stream_waits: u64,
    /// Completion queries answered, per context.
    queries: PtrMap<u64>,
    fail_next_alloc: Option<BackendError>,
    /// The next context fence (`cuEventRecord`) and the next completion query
    /// (`cuEventQuery`) fail with these (fault injection).
    fail_next_fence: Option<BackendError>,
    fail_next_query: Option<BackendError>,
    /// The next `release` (`cuMemFree`) fails with this, the memory staying allocated.
    fail_next_release: Option<BackendError>,
    /// Simulated virtual memory management (Note [host vmm]).
    vmm: HostVmm,
}

/// Granularity of the host backend's simulated physical memory (the H100's).
pub const HOST_VMM_GRANULE: u64 = 2 << 20;

/// What a test can observe about the backend.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCounters {
    pub allocs: u64,
    pub releases: u64,
    pub fences_recorded: u64,
    /// Legacy-stream waits for events (`cuStreamWaitEvent`).
    pub device_waits: u64,
    /// Waits of non-blocking streams for events (`cuStreamWaitEvent`).
    pub stream_waits: u64,
    pub live_bytes: u64,
    /// Simulated VMM: reservations, physical handles and mappings alive now.
    pub vmm_ranges: u64,
    pub vmm_handles: u64,
    pub vmm_mappings: u64,
    /// Simulated VMM calls made so far.
    pub vmm_creates: u64,
    pub vmm_releases: u64,
    pub vmm_maps: u64,
    pub vmm_unmaps: u64,
}

pub struct HostBackend {
    state: spin::Mutex<State>,
    /// Contexts with manual completion, a lag or a capture: while there is none, a context
    /// fence completes when recorded and is made without the state lock (Note [host
    /// fences]).
    special: AtomicUsize,
    /// Done fences made so far, in shards a thread each (by its fence number's thread
    /// part), so that threads fencing at once share no counter's line.
    done_fences: [crate::sync::LineApart<AtomicU64>; DONE_SHARDS],
    /// Simulated page-locked host memory (`pinned.rs`).
    pinned: spin::Mutex<pinned::HostPinned>,
}

/// Note [host fences]: with `host_auto_complete` and no context held in flight, lagging or
/// capturing, every context fence is complete the moment it is recorded. Such a fence is a
/// handle with [`DONE_EVENT`] set, kept nowhere, so the threads that fence their frees do
/// not all queue on the state lock (a simulation artifact a GPU does not have: its events
/// are per context); queries, waits and recycling answer it without the lock. Its number
/// is the thread's own ([`next_done_fence`]) and its count goes to the thread's shard: a
/// shared id counter and count made two more lines that fencing threads passed back and
/// forth: on two cores streamless pairs from two threads went from 25.0-29.8 to
/// 25.1-40.9 M/s without them, on the 16 cores of an H200 host from 76-82 to 76-89 M/s
/// (docs/BENCHMARKS.md, eighteenth session). Handles without the bit are the events of
/// the state's table.
const DONE_EVENT: u64 = 1 << 62;
/// Shards of [`HostBackend`]'s done-fence count.
const DONE_SHARDS: usize = 16;
/// A done fence's number: the thread's number above this bit, its own count below.
const DONE_THREAD_SHIFT: u32 = 36;
const DONE_THREAD_MASK: u64 = (1 << (62 - DONE_THREAD_SHIFT - 1)) - 1;

/// A number no other done fence has: the calling thread's number
/// ([`crate::thread_number::thread_number`]) and its own count, so that fencing threads
/// share no line.
fn next_done_fence() -> u64 {
    // Counts of threads whose thread-locals are being torn down, under the last number.
    static SPARE: AtomicU64 = AtomicU64::new(1);
    thread_local!(static COUNT: Cell<u64> = const { Cell::new(0) });
    let thread = crate::thread_number::thread_number();
    match COUNT.try_with(|c| {
        c.set(c.get() + 1);
        c.get()
    }) {
        // Masked below DONE_EVENT's bit (numbers repeat only after 2^25 threads).
        Ok(count) if thread != u64::MAX => {
            ((thread & DONE_THREAD_MASK) << DONE_THREAD_SHIFT) | count
        }
        _ => (DONE_THREAD_MASK << DONE_THREAD_SHIFT) | SPARE.fetch_add(1, Ordering::Relaxed),
    }
}

impl Default for HostBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl HostBackend {
    /// A stream's wait for `event`. The simulated device runs each context's work in
    /// record order, so a wait adds no order the simulation lacks: it is checked (no
    /// capture in progress, an event this backend recorded) and counted in `counter`.
    fn count_stream_wait(
        &self,
        ctx: ContextId,
        event: EventHandle,
        counter: fn(&mut State) -> &mut u64,
    ) -> BackendResult<()> {
        let mut s = self.state.lock();
        if s.capturing.contains(&ctx.0) {
            return Err(BackendError::Capturing);
        }
        if event.0 & DONE_EVENT == 0 && !s.events.contains_key(&event.0) {
            return Err(BackendError::InvalidValue);
        }
        *counter(&mut s) += 1;
        Ok(())
    }

    pub fn new() -> Self {
        HostBackend {
            special: AtomicUsize::new(0),
            done_fences: core::array::from_fn(|_| crate::sync::LineApart(AtomicU64::new(0))),
            pinned: spin::Mutex::new(pinned::HostPinned::new()),
            state: spin::Mutex::new(State {
                allocations: Default::default(),
                live_bytes: [0; HOST_DEVICES as usize],
                capacity: DEFAULT_CAPACITY,
                streams: Default::default(),
                next_stream_id: 16,
                next_context: FIRST_EXTRA_CONTEXT,
                contexts: Default::default(),
                events: Default::default(),
                next_event: 1,
                manual: std::collections::HashSet::new(),
                lagging: Default::default(),
                due: Default::default(),
                waited_us: 0,
                capturing: std::collections::HashSet::new(),
                allocs: 0,
                releases: 0,
                fences_recorded: 0,
                device_waits: 0,
                stream_waits: 0,
                queries: Default::default(),
                fail_next_alloc: None,
                fail_next_fence: None,
                fail_next_query: None,
                fail_next_release: None,
                vmm: HostVmm::default(),
            }),
        }
    }

    /// Simulated memory per device.
    pub fn set_capacity(&self, bytes: u64) {
        self.state.lock().capacity = bytes;
    }

    /// A new context on `device` (tests use one per test to get a private pool).
    pub fn create_context(&self, device: i32) -> ContextInfo {
        let mut s = self.state.lock();
        let id = s.next_context;
        s.next_context += 1;
        s.contexts.insert(id, device);
        ContextInfo {
            id: ContextId(id),
            device,
        }
    }

    /// Makes `ctx` the calling thread's current context.
    pub fn make_current(&self, ctx: ContextInfo) {
        CURRENT.with(|c| c.set(Some(ctx)));
    }

    /// Forgets a stream handle: the next use of the same handle names a new stream.
    pub fn destroy_stream(&self, handle: StreamHandle) {
        self.state.lock().streams.remove(&handle);
    }

    fn count_special(&self, s: &State) {
        // A pending injected fault turns the lock-free fences and queries off until it fires.
        let faults = s.fail_next_fence.is_some() as usize + s.fail_next_query.is_some() as usize;
        let n = s.manual.len() + s.lagging.len() + s.capturing.len() + faults;
        self.special.store(n, Ordering::Release);
    }

    fn device_of(&self, ctx: ContextId) -> BackendResult<i32> {
        if (1..=HOST_DEVICES as u64).contains(&ctx.0) {
            return Ok(ctx.0 as i32 - 1);
        }
        // A context made on a device this backend does not have (`create_context` takes
        // any index) is refused here, where every call that indexes per-device state
        // starts, rather than panicking on the index.
        self.state
            .lock()
            .contexts
            .get(&ctx.0)
            .copied()
            .filter(|d| (0..HOST_DEVICES).contains(d))
            .ok_or(BackendError::InvalidValue)
    }

    fn record_locked(s: &mut State, ctx: ContextId, auto: bool) -> EventHandle {
        let ev = s.next_event;
        s.next_event += 1;
        let mut done = auto && !s.manual.contains(&ctx.0);
        if let Some(&(lag, now)) = s.lagging.get(&ctx.0) {
            done = false;
            s.due.insert(ev, now + lag);
        }
        s.events.insert(ev, (ctx.0, done));
        EventHandle(ev)
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn current_context(&self) -> BackendResult<ContextInfo> {
        Ok(CURRENT
            .try_with(|c| c.get())
            .ok()
            .flatten()
            .unwrap_or(ContextInfo {
                id: ContextId(1),
                device: 0,
            }))
    }

    /// A host thread always has a context (device 0's unless a test made another current).
    fn existing_context(&self) -> BackendResult<Option<ContextInfo>> {
        self.current_context().map(Some)
    }

    fn device_context(&self, device: i32) -> BackendResult<ContextInfo> {
        if !(0..HOST_DEVICES).contains(&device) {
            return Err(BackendError::InvalidValue);
        }
        Ok(ContextInfo {
            id: ContextId(device as u64 + 1),
            device,
        })
    }

    fn device_count(&self) -> BackendResult<i32> {
        Ok(HOST_DEVICES)
    }

    fn stream_id(&self, stream: StreamHandle) -> BackendResult<StreamId> {
        let mut s = self.state.lock();
        if let Some(&id) = s.streams.get(&stream) {
            return Ok(StreamId(id));
        }
        let id = s.next_stream_id;
        s.next_stream_id += 1;
        s.streams.insert(stream, id);
        Ok(StreamId(id))
    }

    /// A handle no stream of the process has used, in a range of its own (far from the
    /// small made-up handles tests pass), with a new id.
    fn create_stream(&self, ctx: ContextId) -> BackendResult<StreamHandle> {
        self.device_of(ctx)?;
        let mut s = self.state.lock();
        loop {
            let handle = NEXT_CREATED_STREAM.fetch_add(CREATED_STREAM_STEP, Ordering::Relaxed);
            if s.streams.contains_key(&handle) {
                continue;
            }
            let id = s.next_stream_id;
            s.next_stream_id += 1;
            s.streams.insert(handle, id);
            return Ok(handle);
        }
    }

    fn destroy_stream(&self, _ctx: ContextId, stream: StreamHandle) -> BackendResult<()> {
        match self.state.lock().streams.remove(&stream) {
            Some(_) => Ok(()),
            None => Err(BackendError::InvalidValue),
        }
    }

    fn allocate(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr> {
        let device = self.device_of(ctx)?;
        let mut s = self.state.lock();
        if let Some(e) = s.fail_next_alloc.take() {
            return Err(e);
        }
        if s.live_bytes[device as usize] + bytes > s.capacity {
            return Err(BackendError::OutOfMemory);
        }
        let Some(p) = map_device_memory(bytes) else {
            return Err(BackendError::OutOfMemory);
        };
        s.allocations.insert(p, (bytes, device));
        s.live_bytes[device as usize] += bytes;
        s.allocs += 1;
        Ok(p)
    }

    fn release(&self, _ctx: ContextId, ptr: DevicePtr, _bytes: u64) -> BackendResult<()> {
        let mut s = self.state.lock();
        if let Some(e) = s.fail_next_release.take() {
            return Err(e);
        }
        let Some((bytes, device)) = s.allocations.remove(&ptr) else {
            return Err(BackendError::InvalidValue);
        };
        s.live_bytes[device as usize] -= bytes;
        s.releases += 1;
        drop(s);
        unmap_device_memory(ptr, bytes);
        Ok(())
    }

    fn vmm_granularity(&self, ctx: ContextId) -> BackendResult<u64> {
        self.device_of(ctx)?;
        Ok(HOST_VMM_GRANULE)
    }

    fn reserve_range(&self, ctx: ContextId, bytes: u64) -> BackendResult<DevicePtr> {
        let device = self.device_of(ctx)?;
        if bytes == 0 || bytes % HOST_VMM_GRANULE != 0 {
            return Err(BackendError::InvalidValue);
        }
        let base = reserve_address_space(bytes).ok_or(BackendError::OutOfMemory)?;
        self.state.lock().vmm.ranges.insert(base, (bytes, device));
        Ok(base)
    }

    fn free_range(&self, _ctx: ContextId, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        self.state.lock().vmm.forget_range(ptr, bytes)?;
        // SAFETY: the reservation was made by reserve_address_space with this size and
        // removed from the table once.
        unsafe { release_address_space(ptr, bytes) };
        Ok(())
    }

    fn create_physical(&self, ctx: ContextId, bytes: u64) -> BackendResult<u64> {
        let device = self.device_of(ctx)?;
        if bytes == 0 || bytes % HOST_VMM_GRANULE != 0 {
            return Err(BackendError::InvalidValue);
        }
        let s = &mut *self.state.lock();
        let capacity = s.capacity;
        s.vmm
            .create(device, bytes, &mut s.live_bytes[device as usize], capacity)
    }

    fn release_physical(&self, _ctx: ContextId, handle: u64) -> BackendResult<()> {
        let s = &mut *self.state.lock();
        s.vmm.release(handle, &mut s.live_bytes)
    }

    fn map_physical(
        &self,
        _ctx: ContextId,
        ptr: DevicePtr,
        bytes: u64,
        handle: u64,
    ) -> BackendResult<()> {
        self.state.lock().vmm.map(ptr, bytes, handle)
    }

    fn unmap_physical(&self, _ctx: ContextId, ptr: DevicePtr, bytes: u64) -> BackendResult<()> {
        self.state.lock().vmm.unmap(ptr, bytes)
    }

    fn record_context_fence(&self, ctx: ContextId) -> BackendResult<EventHandle> {
        // One lock for the check, the record and the count (threads that fence their own
        // batches of frees call this concurrently).
        let auto = config::get_bool(Key::HostAutoComplete);
        if auto && self.special.load(Ordering::Acquire) == 0 {
            // Note [host fences].
            let id = next_done_fence();
            self.done_fences[(id >> DONE_THREAD_SHIFT) as usize % DONE_SHARDS]
                .fetch_add(1, Ordering::Relaxed);
            return Ok(EventHandle(DONE_EVENT | id));
        }
        let mut s = self.state.lock();
        if let Some(e) = s.fail_next_fence.take() {
            self.count_special(&s);
            return Err(e);
        }
        if s.capturing.contains(&ctx.0) {
            return Err(BackendError::Capturing);
        }
        let ev = Self::record_locked(&mut s, ctx, auto);
        s.fences_recorded += 1;
        Ok(ev)
    }

    fn legacy_stream_wait(&self, ctx: ContextId, event: EventHandle) -> BackendResult<()> {
        self.count_stream_wait(ctx, event, |s| &mut s.device_waits)
    }

    fn stream_wait(
        &self,
        ctx: ContextId,
        _stream: StreamHandle,
        event: EventHandle,
    ) -> BackendResult<()> {
        self.count_stream_wait(ctx, event, |s| &mut s.stream_waits)
    }

    fn event_completed(&self, _ctx: ContextId, event: EventHandle) -> BackendResult<bool> {
        if event.0 & DONE_EVENT != 0 && self.special.load(Ordering::Acquire) == 0 {
            return Ok(true);
        }
        let mut s = self.state.lock();
        if let Some(e) = s.fail_next_query.take() {
            self.count_special(&s);
            return Err(e);
        }
        if event.0 & DONE_EVENT != 0 {
            return Ok(true);
        }
        let &(ctx, done) = s.events.get(&event.0).ok_or(BackendError::InvalidValue)?;
        *s.queries.entry(ctx).or_default() += 1;
        Ok(done)
    }

    fn wait_event(&self, _ctx: ContextId, event: EventHandle) -> BackendResult<()> {
        // Waiting means the simulated device ran the context's work up to this event.
        if event.0 & DONE_EVENT != 0 {
            return Ok(());
        }
        let mut s = self.state.lock();
        let ctx = s.events.get(&event.0).ok_or(BackendError::InvalidValue)?.0;
        let State {
            events,
            due,
            lagging,
            waited_us,
            ..
        } = &mut *s;
        if let Some(&(_, now)) = lagging.get(&ctx) {
            // The program stalls until the device reaches the event.
            let until = due.get(&event.0).copied().unwrap_or(now);
            *waited_us += until.saturating_sub(now);
        }
        for (id, (c, done)) in events.iter_mut() {
            if *c == ctx && *id <= event.0 {
                *done = true;
            }
        }
        Ok(())
    }

    /// A lagging context (replay) waits as [`HostBackend::wait_event`] does, however long
    /// (no real time passes in a simulation; [`HostBackend::waited_us`] adds it up); in
    /// other contexts a test holds events in flight by hand, so the answer is the event's
    /// state now.
    fn wait_event_for(
        &self,
        ctx: ContextId,
        event: EventHandle,
        _bound: core::time::Duration,
    ) -> BackendResult<bool> {
        if event.0 & DONE_EVENT != 0 {
            return Ok(true);
        }
        let owner = {
            let s = self.state.lock();
            s.events.get(&event.0).ok_or(BackendError::InvalidValue)?.0
        };
        if self.state.lock().lagging.contains_key(&owner) {
            self.wait_event(ctx, event)?;
            return Ok(true);
        }
        self.event_completed(ctx, event)
    }

    fn recycle_event(&self, _ctx: ContextId, event: EventHandle) {
        if event.0 & DONE_EVENT != 0 {
            return;
        }
        let mut s = self.state.lock();
        s.events.remove(&event.0);
        s.due.remove(&event.0);
    }

    fn memory_info(&self, ctx: ContextId) -> BackendResult<(u64, u64)> {
        let device = self.device_of(ctx)?;
        let s = self.state.lock();
        Ok((s.capacity - s.live_bytes[device as usize], s.capacity))
    }

    fn host_alloc(&self, ctx: ContextId, bytes: u64) -> BackendResult<HostPtr> {
        self.device_of(ctx)?;
        self.pinned_alloc(bytes)
    }

    fn host_free(&self, _ctx: ContextId, ptr: HostPtr) -> BackendResult<()> {
        self.pinned_free(ptr)
    }
}

#[cfg(test)]
mod tests;
