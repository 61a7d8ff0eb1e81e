//! The process-wide allocator: configuration, backend, one pool per context, lifecycle.
//!
//! Used by the C boundary (`ffi`) and by the LD_PRELOAD interposer crate. Every method
//! returns a status; none panics on bad input.
//!
//! Here: starting the runtime, allocation paths, lookups, statistics and limits; `frees`:
//! the free paths; `captures`: stream captures and peer access reported by the interposer
//! and the C API; the other submodules as their names say.

use crate::backend::host::HostBackend;
use crate::backend::{Backend, ContextId, ContextInfo, DevicePtr, StreamHandle};
use crate::config::{self, Key};
use crate::pool::handover::{self};
use crate::pool::size_class::{round_size, MAX_SIZE};
use crate::pool::thread_cache::{self, with_thread};
use crate::pool::{self, DevicePool, StreamRef};
use crate::stats::CupoolStats;
use crate::status::{CupoolStatus, Result};
use crate::trace::record;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

mod captures;
mod frees;
pub mod ipc;
mod layout;
pub mod legacy_order;
mod lifecycle;
mod on_device;
mod pinned;
pub mod stream_ids;
mod tracing;

pub use lifecycle::{
    claim_stats_at_exit, is_fork_child, mark_exiting, mark_fork_child, stats_at_exit_requested,
    write_stats_at_exit,
};
use lifecycle::{on_exit, on_fork_child, print_stats_at_exit, STATS_AT_EXIT_CLAIMED};
use tracing::{trace_allocation, Seen};

pub use layout::{
    footprints_json, to_json as segments_json, BlockView, DeviceFootprint, SegmentView,
};

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

/// Per-device limits set through the API (they override `memory_limit` from the config).
const MAX_DEVICES: usize = 64;
static DEVICE_LIMITS: [AtomicU64; MAX_DEVICES] =
    [const { AtomicU64::new(pool::LIMIT_FROM_CONFIG) }; MAX_DEVICES];

static FORK_CHILD: AtomicBool = AtomicBool::new(false);
/// Set by the interposer when it loads: its hooks see every capture of the process, so
/// the pool, whoever starts it, need not ask the driver (Note [captures seen by hooks]).
static INTERPOSER_REPORTS_CAPTURES: AtomicBool = AtomicBool::new(false);
static RUNTIME: spin::Once<core::result::Result<Runtime, CupoolStatus>> = spin::Once::new();

/// The process's allocator.
pub struct Runtime {
    backend: &'static dyn Backend,
    host: Option<&'static HostBackend>,
}

/// The runtime, started on first use (config read, backend chosen). Fails with
/// `CupoolErrorBackendUnavailable` when the configured backend cannot start; the reason is
/// printed once on stderr.
pub fn runtime() -> Result<&'static Runtime> {
    if FORK_CHILD.load(Ordering::Relaxed) {
        return Err(CupoolStatus::CupoolErrorBackendUnavailable);
    }
    match RUNTIME.call_once(start) {
        Ok(r) => Ok(r),
        Err(e) => Err(*e),
    }
}

/// The runtime if it has already started; never starts it.
pub fn runtime_if_started() -> Option<&'static Runtime> {
    match RUNTIME.get() {
        Some(Ok(r)) if !FORK_CHILD.load(Ordering::Relaxed) => Some(r),
        _ => None,
    }
}

fn start() -> core::result::Result<Runtime, CupoolStatus> {
    config::ensure_loaded();
    config::freeze();
    // SAFETY: registering plain extern "C" functions that never unwind.
    // Not under Miri, which has neither `atexit` nor `pthread_atfork` (FFI); its tests
    // neither fork nor rely on exit handlers.
    #[cfg(not(miri))]
    unsafe {
        // Exit: from here on no CUDA call (handlers run in reverse order of registration,
        // so this one runs before the teardown of a CUDA runtime initialised earlier).
        libc::atexit(on_exit);
        // A fork child must never touch the parent's pool (its device memory is not the
        // child's; CUDA itself refuses to work in such a child).
        libc::pthread_atfork(None, None, Some(on_fork_child));
        if stats_at_exit_requested() && !STATS_AT_EXIT_CLAIMED.load(Ordering::Relaxed) {
            libc::atexit(print_stats_at_exit);
        }
    }
    crate::trace::record::start_from_env();
    legacy_order::begin_from_config();
    crate::pool::device_waits::begin_from_config(stream_ids::creations_seen());
    let backend_name = config::BACKENDS
        .get(config::get(Key::Backend) as usize)
        .copied()
        .unwrap_or("cuda");
    if backend_name == "host" {
        let host: &'static HostBackend = Box::leak(Box::new(HostBackend::new()));
        crate::log::info("cupool: using the host backend (host memory, simulated streams)");
        return Ok(Runtime {
            backend: host,
            host: Some(host),
        });
    }
    match crate::backend::cuda::CudaBackend::new() {
        Ok(b) => {
            if INTERPOSER_REPORTS_CAPTURES.load(Ordering::Relaxed) {
                b.captures_reported_by_caller();
            }
            Ok(Runtime {
                backend: Box::leak(Box::new(b)),
                host: None,
            })
        }
        Err(e) => {
            crate::log::error(&format!(
                "cupool: the CUDA backend is unavailable ({e:?}): no usable libcuda.so.1 or device; \
                 set CUPOOL_CONF=backend:host to run on host memory"
            ));
            Err(CupoolStatus::CupoolErrorBackendUnavailable)
        }
    }
}

/// Gives this thread's cached blocks of `pool` back to it (before the pool grows or
/// retries after running out of memory; the pool asks other threads itself on OOM);
/// returns whether some went to the pool's fence queue.
fn flush_own_cache(cache: Option<&mut thread_cache::ThreadCache>, pool: u16) -> bool {
    cache.is_some_and(|cache| cache.flush_pool(pool))
}

fn limit_for(device: i32) -> u64 {
    match DEVICE_LIMITS
        .get(device as usize)
        .map_or(pool::LIMIT_FROM_CONFIG, |a| a.load(Ordering::Relaxed))
    {
        pool::LIMIT_FROM_CONFIG => config::get(Key::MemoryLimit),
        l => l,
    }
}

impl Runtime {
    pub fn backend(&self) -> &'static dyn Backend {
        self.backend
    }

    /// The host backend, when it is the one in use (tests drive its simulated time).
    pub fn host_backend(&self) -> Option<&'static HostBackend> {
        self.host
    }

    #[inline]
    fn pool_of(&self, ctx: ContextInfo) -> Result<&'static DevicePool> {
        pool::pool_for(ctx, self.backend, || {
            DEVICE_LIMITS
                .get(ctx.device as usize)
                .map_or(pool::LIMIT_FROM_CONFIG, |a| a.load(Ordering::Relaxed))
        })
    }

    /// The pool of the calling thread's current context.
    #[inline]
    fn current_pool(&self) -> Result<&'static DevicePool> {
        let ctx = self.backend.current_context().map_err(CupoolStatus::from)?;
        self.pool_of(ctx)
    }

    fn rounded(size: usize) -> Result<u64> {
        if size == 0 {
            return Err(CupoolStatus::CupoolErrorInvalidValue);
        }
        // A request no device can hold is out of memory, as cudaMalloc reports it.
        if size as u64 > MAX_SIZE {
            return Err(CupoolStatus::CupoolErrorOutOfMemory);
        }
        round_size(size as u64).ok_or(CupoolStatus::CupoolErrorOutOfMemory)
    }

    /// Streamless allocation in the calling thread's current context: the block is safe to
    /// use from any stream (no pending work on it).
    pub fn alloc(&self, size: usize) -> Result<DevicePtr> {
        let mut device = record::NO_DEVICE;
        let result = (|| {
            let rounded = Self::rounded(size)?;
            let pool = self.current_pool()?;
            device = pool.ctx.device;
            self.alloc_without_stream(pool, rounded, size)
        })();
        if record::active() {
            trace_allocation(result, size, Seen::device(device), None);
        }
        result
    }

    /// The calling thread's current context, if it has one (none is made for it).
    fn existing_context(&self) -> Result<Option<ContextInfo>> {
        self.backend.existing_context().map_err(CupoolStatus::from)
    }

    /// Streamless allocation only in a context the calling thread already has current;
    /// `Ok(None)` when it has none. For the interposer: a program's `cuMemAlloc` without a
    /// current context must get the driver's own answer, not a context made for it.
    pub fn alloc_if_context_current(&self, size: usize) -> Result<Option<DevicePtr>> {
        let Some(ctx) = self.existing_context()? else {
            return Ok(None);
        };
        let result = Self::rounded(size)
            .and_then(|rounded| self.alloc_without_stream(self.pool_of(ctx)?, rounded, size));
        if record::active() {
            trace_allocation(result, size, Seen::device(ctx.device), None);
        }
        result.map(Some)
    }

    /// A streamless allocation: on the legacy stream while legacy order holds (Note
    /// [legacy order]), else from what no stream's work can still touch.
    #[inline]
    fn alloc_without_stream(
        &self,
        pool: &'static DevicePool,
        rounded: u64,
        size: usize,
    ) -> Result<DevicePtr> {
        if legacy_order::active() {
            let s = legacy_order::legacy_stream(self.backend, pool)?;
            let mut seen = Seen::NOTHING;
            return Self::alloc_in_pool_on(pool, rounded, size, s, &mut seen);
        }
        Self::alloc_streamless(pool, rounded, size)
    }

    fn alloc_streamless(pool: &'static DevicePool, rounded: u64, size: usize) -> Result<DevicePtr> {
        with_thread(|ts, mut cache| {
            let mut keeps = false;
            if let Some(cache) = cache.as_deref_mut() {
                let c = ts.counters(pool.index);
                if let Some(ptr) = pool.alloc_kept(cache, c, rounded, size as u64) {
                    return Ok(ptr);
                }
                keeps = cache.keeps_streamless(rounded);
            }
            pool.alloc_slow(
                ts.counters(pool.index),
                rounded,
                size as u64,
                None,
                keeps,
                &mut || flush_own_cache(cache.as_deref_mut(), pool.index),
            )
        })
    }

    /// Stream-ordered allocation: the block may be used by `stream` at once.
    #[inline]
    pub fn alloc_async(&self, size: usize, stream: StreamHandle) -> Result<DevicePtr> {
        let mut seen = Seen::NOTHING;
        let result = self.alloc_on_stream(size, stream, &mut seen);
        if record::active() {
            trace_allocation(result, size, seen, Some(stream as u64));
        }
        result
    }

    /// [`Runtime::alloc_async`]; `seen` receives what the call learnt, for the trace.
    #[inline(always)]
    fn alloc_on_stream(
        &self,
        size: usize,
        stream: StreamHandle,
        seen: &mut Seen,
    ) -> Result<DevicePtr> {
        let rounded = Self::rounded(size)?;
        let pool = self.current_pool()?;
        self.alloc_in_pool_on_stream(pool, rounded, size, stream, seen)
    }

    /// The rest of [`Runtime::alloc_on_stream`], in a pool already chosen (`stream` belongs
    /// to its context).
    #[inline(always)]
    fn alloc_in_pool_on_stream(
        &self,
        pool: &'static DevicePool,
        rounded: u64,
        size: usize,
        stream: StreamHandle,
        seen: &mut Seen,
    ) -> Result<DevicePtr> {
        seen.device = pool.ctx.device;
        legacy_order::note_stream(stream);
        let sid =
            stream_ids::stream_id(self.backend, pool.ctx.id, stream).map_err(CupoolStatus::from)?;
        seen.stream_id = sid.0;
        let s = StreamRef {
            id: sid.0,
            handle: stream,
        };
        Self::alloc_in_pool_on(pool, rounded, size, s, seen)
    }

    /// The rest of [`Runtime::alloc_in_pool_on_stream`], the stream identified.
    #[inline(always)]
    fn alloc_in_pool_on(
        pool: &'static DevicePool,
        rounded: u64,
        size: usize,
        s: StreamRef,
        seen: &mut Seen,
    ) -> Result<DevicePtr> {
        with_thread(|ts, mut cache| {
            let c = ts.counters(pool.index);
            // The cache is asked even for arena blocks, which it never holds: its call
            // honours a pending flush request (`thread_cache::FLUSH_EPOCH`).
            let hit = cache
                .as_deref_mut()
                .and_then(|cache| pool.alloc_cached(cache, c, rounded, size as u64, s))
                .or_else(|| {
                    // Note [parked arena blocks].
                    pool.vmm_large(rounded)
                        .then(|| pool.alloc_parked(c, rounded, size as u64, s))
                        .flatten()
                });
            if let Some((ptr, block)) = hit {
                seen.block = block;
                return Ok(ptr);
            }
            pool.alloc_slow(c, rounded, size as u64, Some(s), false, &mut || {
                flush_own_cache(cache.as_deref_mut(), pool.index)
            })
        })
    }

    /// What the pool knows about the live block found by `find_containing`, checked
    /// through its tag (a block freed meanwhile is not reported).
    fn info_of(pool: &DevicePool, found: pool::Containing) -> Option<BlockInfo> {
        let d = handover::live_record(&found)?;
        Some(BlockInfo {
            ptr: d.ptr,
            size: d.size,
            requested: d.requested,
            device: pool.ctx.device,
            context: pool.ctx.id,
            segment_base: found.segment_base,
            segment_size: found.segment_size,
        })
    }

    /// The live block that starts exactly at `ptr`.
    pub fn lookup(&self, ptr: DevicePtr) -> Option<BlockInfo> {
        let pool = handover::pool_holding(ptr)?;
        let found = pool.find_containing(ptr)?;
        (found.block_ptr == ptr)
            .then(|| Self::info_of(pool, found))
            .flatten()
    }

    /// The live block that contains `ptr` (interior pointers included).
    pub fn lookup_containing(&self, ptr: DevicePtr) -> Option<BlockInfo> {
        pool::all_pools().find_map(|p| Some(Self::info_of(p, p.find_containing(ptr)?)))?
    }

    fn check_device(&self, device: Option<i32>) -> Result<()> {
        if let Some(d) = device {
            let n = self.backend.device_count().map_err(CupoolStatus::from)?;
            if d < 0 || d >= n || d as usize >= MAX_DEVICES {
                return Err(CupoolStatus::CupoolErrorInvalidDevice);
            }
        }
        Ok(())
    }

    fn pools_of(device: Option<i32>) -> impl Iterator<Item = &'static DevicePool> {
        pool::all_pools().filter(move |p| device.is_none_or(|d| p.ctx.device == d))
    }

    /// Statistics of `device`, or of all devices summed for `None`.
    pub fn stats(&self, device: Option<i32>) -> Result<CupoolStats> {
        self.check_device(device)?;
        let mut total = CupoolStats::new();
        for p in Self::pools_of(device) {
            total.accumulate(&p.stats());
        }
        Ok(total)
    }

    /// Statistics of the pool of one context (tests use private contexts).
    pub fn context_stats(&self, ctx: ContextInfo) -> Result<CupoolStats> {
        Ok(self.pool_of(ctx)?.stats())
    }

    /// The pool of one context (tests: invariant checks).
    pub fn context_pool(&self, ctx: ContextInfo) -> Result<&'static DevicePool> {
        self.pool_of(ctx)
    }

    pub fn reset_peak_stats(&self, device: Option<i32>) -> Result<()> {
        self.check_device(device)?;
        for p in Self::pools_of(device) {
            p.reset_peaks();
        }
        Ok(())
    }

    /// Gives idle cached memory of `device` (all devices for `None`) back to the driver;
    /// returns the bytes released. Blocks freed moments ago are waited for; blocks held
    /// in other threads' caches go back at those threads' next call.
    pub fn empty_cache(&self, device: Option<i32>) -> Result<u64> {
        self.check_device(device)?;
        thread_cache::request_flush_all();
        with_thread(|ts, cache| {
            if let Some(cache) = cache {
                cache.flush_all();
            }
            let mut released = 0;
            for p in Self::pools_of(device) {
                released += p.empty_cache(ts.counters(p.index))?;
            }
            Ok(released)
        })
    }

    /// [`Runtime::empty_cache`] for the pool of one context only (tests and replays that
    /// share a process): the calling thread's cached blocks of that pool go back first;
    /// other threads' caches and other pools are left alone.
    pub fn empty_context_cache(&self, ctx: ContextInfo) -> Result<u64> {
        let pool = self.pool_of(ctx)?;
        with_thread(|ts, cache| {
            if let Some(cache) = cache {
                cache.flush_pool(pool.index);
            }
            pool.empty_cache(ts.counters(pool.index))
        })
    }

    /// Per-device cap on reserved bytes; 0 removes it.
    pub fn set_memory_limit(&self, device: i32, bytes: u64) -> Result<()> {
        self.check_device(Some(device))?;
        DEVICE_LIMITS[device as usize].store(bytes, Ordering::Relaxed);
        for p in Self::pools_of(Some(device)) {
            p.set_limit(bytes);
        }
        Ok(())
    }

    pub fn memory_limit(&self, device: i32) -> Result<u64> {
        self.check_device(Some(device))?;
        Ok(limit_for(device))
    }

    /// Bytes cached in `ctx`'s pool that no program block uses (what `cuMemGetInfo` adds
    /// back to "free" under the preload).
    pub fn idle_cached_bytes(&self, ctx: ContextId) -> u64 {
        pool::all_pools()
            .find(|p| p.ctx.id == ctx)
            .map_or(0, |p| p.idle_bytes())
    }
}
