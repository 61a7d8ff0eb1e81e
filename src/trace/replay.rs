//! Replay: drives the pool through a trace's allocations and frees, in trace order, on the
//! calling thread, and reports the footprint the pool reached (peak requested, allocated,
//! reserved), its driver calls and the time per operation.
//!
//! One thread, one order: a replay is deterministic on the host backend, which is what makes
//! it an instrument (the same trace gives the same peaks on every machine). The arena's
//! unmapping thread is simulated on trace time there (Note [simulated unmapper] in
//! `pool/vmm/unmapper.rs`), so its driver calls repeat exactly too. With
//! `per_thread` each thread of the trace replays on a worker thread of its own, still one
//! event at a time in trace order (Note [per-thread replay]). On the host backend the
//! replay runs in a context of its own, so replays in one process (tests) never share a
//! pool or statistics; on the cuda backend it runs in the calling thread's current context
//! (device 0's primary context when it has none).
//!
//! What the trace says and what the replay does:
//! - a streamless event (`cupool_alloc`/`cupool_free`, `cudaMalloc`/`cudaFree` under the
//!   preload) replays as [`Runtime::alloc`] / [`Runtime::free`]; any other as
//!   `alloc_async`/`free_async` on the replay stream that stands for the trace's stream
//!   (the legacy stream stays the legacy stream; every other stream, told apart by its id
//!   when the trace has one and by its handle otherwise, gets a stream of its own);
//! - a free on another stream than the allocation's is replayed as such (the pool counts it
//!   in `cross_stream_frees`);
//! - a call that failed in the traced program (`allocate failure`, or a cupool `Result`
//!   other than `ok`) is counted, not replayed;
//! - an allocation that runs out of memory in the replay (under a `memory_limit`, say) is
//!   counted, and its free later skipped;
//! - a free of a pointer that is not live, or an allocation at an address still live, is a
//!   bad trace: a [`TraceError`] at that event's position.

use crate::backend::{Backend, BackendError, ContextInfo, DevicePtr, StreamHandle};
use crate::runtime::Runtime;
use crate::stats::CupoolStats;
use crate::status::CupoolStatus;
use crate::trace::{Action, Position, Trace, TraceError, TraceEvent};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

mod json;
mod peak;
mod report;
mod workers;

use workers::{Op, Workers};

pub use peak::FootprintAtPeak;
pub use report::{DriverWork, OpTimes, ReplayReport, ReplaySample};

/// How to replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Replay only the first this many events (long traces in debug-build tests); the
    /// blocks still live after them are freed as at the end of any replay.
    pub max_events: Option<usize>,
    /// Points of the sampled series for plots (about this many; 0 for none).
    pub samples: usize,
    /// Events between two calls of the progress callback.
    pub progress_every: usize,
    /// Host backend only: the simulated device runs this many microseconds of trace time
    /// behind the program, so a fence completes that long after it was recorded (0: at
    /// once). A model of a GPU that is behind the CPU, for the frees that wait for fences.
    pub gpu_lag_us: u64,
    /// Host backend only: replay each thread of the trace on a thread of its own (still
    /// one event at a time, in trace order), so that what one thread's cache holds is out
    /// of another's reach, as in the traced program (Note [per-thread replay]).
    pub per_thread: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_events: None,
            samples: 2000,
            progress_every: 1 << 14,
            gpu_lag_us: 0,
            per_thread: false,
        }
    }
}

/// Replays `trace` through `rt` (see the module doc); `progress` is called with the number
/// of events done every `opts.progress_every` events and at the end.
pub fn replay(
    rt: &Runtime,
    trace: &Trace,
    opts: &ReplayOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<ReplayReport, TraceError> {
    crate::trace::io::check_consistency(trace)?;
    let backend = rt.backend();
    let _restore;
    let ctx = match rt.host_backend() {
        Some(host) => {
            let previous = backend.current_context().map_err(setup_error)?;
            let ctx = host.create_context(0);
            host.make_current(ctx);
            host.set_lag(ctx.id, opts.gpu_lag_us);
            _restore = RestoreContext(Some((host, previous)));
            ctx
        }
        None => {
            _restore = RestoreContext(None);
            backend.current_context().map_err(setup_error)?
        }
    };
    let mut r = Replayer {
        rt,
        backend,
        ctx,
        live: HashMap::new(),
        freed: HashSet::new(),
        streams: HashMap::new(),
        created: Vec::new(),
        peaks: [0; 3],
        series: Vec::new(),
        alloc_ns: Vec::new(),
        free_ns: Vec::new(),
        counts: Counts::default(),
        at_peak: None,
        workers: None,
        at_half: None,
    };
    let waited_before = rt.host_backend().map_or(0, |h| h.waited_us());
    let result = match rt.host_backend().filter(|_| opts.per_thread) {
        Some(host) => std::thread::scope(|scope| {
            r.workers = Some(Workers::start(scope, rt, host, ctx, trace));
            let result = r.run(trace, opts, progress);
            // Their senders gone, the workers flush their thread caches into the pool and
            // end; the scope joins them before the clean-up below.
            r.workers = None;
            result
        }),
        None if opts.per_thread => Err(TraceError::new(
            Position::File,
            "a per-thread replay needs the host backend".to_string(),
        )),
        None => r.run(trace, opts, progress),
    };
    // Before the cleanup's empty_cache releases the arena with its counters.
    let vmm = rt
        .context_pool(ctx)
        .map(|p| p.vmm_stats())
        .unwrap_or_default();
    let simulated_wait_us = rt
        .host_backend()
        .map_or(0, |h| h.waited_us().saturating_sub(waited_before));
    // Streams go only once nothing can be queued on them any more.
    let cleanup = r.clean_up();
    for &s in &r.created {
        // Nothing to do about a stream the driver will not destroy; the process ends soon.
        let _ = backend.destroy_stream(ctx.id, s);
    }
    let (wall_seconds, stats) = result?;
    // The run's last statistics are read after its last event, as `vmm` is.
    let second_half = r
        .at_half
        .map(|half| DriverWork::of(&vmm, &stats).since(&half));
    let (live_at_end, released, reserved_after) = cleanup?;
    let events = opts
        .max_events
        .map_or(trace.events.len(), |n| n.min(trace.events.len()));
    let [requested, allocated, reserved] = r.peaks;
    let ratio = |a: u64| (reserved > 0).then(|| a as f64 / reserved as f64);
    let c = r.counts;
    Ok(ReplayReport {
        backend: backend.name(),
        trace_events: trace.events.len(),
        events,
        ops: c.allocs + c.frees,
        allocs: c.allocs,
        frees: c.frees,
        prelude_allocs: c.prelude_allocs,
        trace_failures: c.trace_failures,
        ooms: c.ooms,
        skipped_frees: c.skipped_frees,
        skipped_empty: c.skipped_empty,
        streams: r.created.len(),
        peak_requested_bytes: requested,
        peak_allocated_bytes: allocated,
        peak_reserved_bytes: reserved,
        utilization: ratio(allocated),
        requested_utilization: ratio(requested),
        device_allocs: stats.device_allocs,
        device_frees: stats.device_frees,
        fences: stats.fences_recorded,
        fence_queries: stats.fence_queries,
        fence_device_waits: stats.fence_device_waits,
        cache_hits: stats.cache_hits,
        cache_misses: stats.cache_misses,
        cross_stream_frees: stats.cross_stream_frees,
        alloc_retries: stats.alloc_retries,
        alloc_time: op_times(&mut r.alloc_ns),
        free_time: op_times(&mut r.free_ns),
        wall_seconds,
        simulated_wait_us,
        granule_maps: vmm.maps,
        granule_unmaps: vmm.unmaps,
        map_calls: vmm.map_calls,
        unmap_calls: vmm.unmap_calls,
        second_half,
        reference: trace.reference,
        series: std::mem::take(&mut r.series),
        at_peak: r.at_peak,
        live_at_end,
        released_at_end_bytes: released,
        reserved_after_empty_cache: reserved_after,
    })
}

/// Gives the calling thread its context back when the replay ends, however it ends.
struct RestoreContext(Option<(&'static crate::backend::host::HostBackend, ContextInfo)>);

impl Drop for RestoreContext {
    fn drop(&mut self) {
        if let Some((host, previous)) = self.0 {
            host.make_current(previous);
        }
    }
}

fn setup_error(e: BackendError) -> TraceError {
    TraceError::new(
        Position::File,
        format!("cannot replay: the backend has no context to replay in ({e:?})"),
    )
}

#[derive(Copy, Clone, Debug, Default)]
struct Counts {
    allocs: u64,
    frees: u64,
    prelude_allocs: u64,
    trace_failures: u64,
    ooms: u64,
    skipped_frees: u64,
    skipped_empty: u64,
}

/// A block of the trace that is live now.
#[derive(Copy, Clone)]
struct LiveBlock {
    /// The replay's block, `None` when the replay ran out of memory for it.
    replayed: Option<DevicePtr>,
    /// Index of the event that allocated it (`usize::MAX` for the prelude).
    since: usize,
}

/// A trace's name for a stream: its unique id when the trace has ids, its handle otherwise.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
enum StreamKey {
    Id(u64),
    Handle(u64),
}

struct Replayer<'a> {
    rt: &'a Runtime,
    backend: &'static dyn Backend,
    ctx: ContextInfo,
    /// Trace address → the block standing for it.
    live: HashMap<u64, LiveBlock>,
    /// Trace addresses freed and not allocated again (to tell a double free apart).
    freed: HashSet<u64>,
    streams: HashMap<StreamKey, StreamHandle>,
    created: Vec<StreamHandle>,
    /// Highest requested, allocated and reserved bytes seen at any sample.
    peaks: [u64; 3],
    series: Vec<ReplaySample>,
    alloc_ns: Vec<u32>,
    free_ns: Vec<u32>,
    counts: Counts,
    /// See [`FootprintAtPeak`].
    at_peak: Option<FootprintAtPeak>,
    /// The worker threads of a per-thread replay (Note [per-thread replay]).
    workers: Option<Workers>,
    /// The driver work counted so far when the replay reached the trace's middle event.
    at_half: Option<DriverWork>,
}

/// Whether the traced program's call failed (then there is nothing to replay).
fn failed_in_trace(ev: &TraceEvent) -> bool {
    ev.action == Action::AllocateFailure
        || ev
            .result
            .as_deref()
            .is_some_and(|r| !r.is_empty() && !r.eq_ignore_ascii_case("ok"))
}

fn elapsed_ns(start: Instant) -> u32 {
    u32::try_from(start.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

fn op_times(ns: &mut [u32]) -> OpTimes {
    if ns.is_empty() {
        return OpTimes::default();
    }
    let mean_ns = ns.iter().map(|&t| t as f64).sum::<f64>() / ns.len() as f64;
    let mid = ns.len() / 2;
    let median_ns = *ns.select_nth_unstable(mid).1 as u64;
    OpTimes { median_ns, mean_ns }
}

impl Replayer<'_> {
    fn run(
        &mut self,
        trace: &Trace,
        opts: &ReplayOptions,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(f64, CupoolStats), TraceError> {
        let at = |i: usize| {
            trace.positions.get(i).copied().unwrap_or(Position::Entry {
                device: 0,
                index: i,
            })
        };
        for &(addr, size, stream) in &trace.prelude {
            self.prelude_block(addr, size, stream)?;
        }
        let pool = self
            .rt
            .context_pool(self.ctx)
            .map_err(|s| TraceError::new(Position::File, status_text(s)))?;
        let on_host = self.rt.host_backend().is_some();
        if on_host {
            // The same figures on every run: the arena's unmapper on trace time.
            pool.simulate_unmapper();
        }
        self.watch_peak(pool, 0);
        let events = &trace.events[..opts
            .max_events
            .map_or(trace.events.len(), |n| n.min(trace.events.len()))];
        let every = match opts.samples {
            0 => usize::MAX,
            n => events.len().div_ceil(n).max(1),
        };
        let progress_every = opts.progress_every.max(1);
        self.alloc_ns.reserve(events.len() / 2 + 1);
        self.free_ns.reserve(events.len() / 2 + 1);
        let start = Instant::now();
        // Trace time for the simulated lag: `Nanos` when the trace has it, else the time of
        // day, from the first event.
        let micros = |ev: &TraceEvent| ev.nanos.map_or(ev.time_us, |n| n / 1000);
        let first = events.first().map_or(0, micros);
        let lagging_host = self.rt.host_backend().filter(|_| opts.gpu_lag_us > 0);
        for (i, ev) in events.iter().enumerate() {
            let now_us = micros(ev).saturating_sub(first);
            if let Some(host) = lagging_host {
                host.set_time(self.ctx.id, now_us);
            }
            if on_host {
                pool.run_simulated_unmapper(now_us);
            }
            self.event(i, ev).map_err(|m| TraceError::new(at(i), m))?;
            self.watch_peak(pool, i + 1);
            if i + 1 == events.len() / 2 {
                let stats = self.rt.context_stats(self.ctx).map_err(status_text);
                let stats = stats.map_err(|m| TraceError::new(at(i), m))?;
                self.at_half = Some(DriverWork::of(&pool.vmm_stats(), &stats));
            }
            if (i + 1) % every == 0 {
                self.sample(i + 1, true)
                    .map_err(|m| TraceError::new(at(i), m))?;
            }
            if (i + 1) % progress_every == 0 {
                progress(i + 1);
            }
        }
        let wall = start.elapsed().as_secs_f64();
        progress(events.len());
        let stats = self
            .sample(events.len(), opts.samples > 0 && events.len() % every != 0)
            .map_err(|m| TraceError::new(Position::File, m))?;
        Ok((wall, stats))
    }

    /// Reads the pool's statistics, folds their peaks into the replay's, and (with
    /// `record`) adds a point to the series and restarts the peaks for the next one.
    fn sample(&mut self, op: usize, record: bool) -> Result<CupoolStats, String> {
        let s = self.rt.context_stats(self.ctx).map_err(status_text)?;
        let point = [
            s.requested_bytes.peak,
            s.allocated_bytes.peak,
            s.reserved_bytes.peak,
        ];
        for (peak, v) in self.peaks.iter_mut().zip(point) {
            *peak = (*peak).max(v);
        }
        if record {
            self.series.push(ReplaySample {
                op,
                requested_bytes: point[0],
                allocated_bytes: point[1],
                reserved_bytes: point[2],
            });
            self.rt
                .context_pool(self.ctx)
                .map_err(status_text)?
                .reset_peaks();
        }
        Ok(s)
    }

    fn stream(&mut self, handle: u64, id: Option<u64>) -> Result<StreamHandle, String> {
        // 0 and CU_STREAM_LEGACY (1) are the legacy default stream, in the replay too.
        if handle <= 1 {
            return Ok(0);
        }
        let key = id.map_or(StreamKey::Handle(handle), StreamKey::Id);
        if let Some(&s) = self.streams.get(&key) {
            return Ok(s);
        }
        let s = self
            .backend
            .create_stream(self.ctx.id)
            .map_err(|e| format!("cannot create a stream for the replay ({e:?})"))?;
        self.created.push(s);
        self.streams.insert(key, s);
        Ok(s)
    }

    fn prelude_block(&mut self, addr: u64, size: u64, stream: u64) -> Result<(), TraceError> {
        let bad = |m: String| TraceError::new(Position::File, m);
        if size == 0 {
            self.counts.skipped_empty += 1;
            return Ok(());
        }
        if self.live.contains_key(&addr) {
            return Err(bad(format!(
                "the blocks alive before the first event list {addr:#x} twice"
            )));
        }
        let s = self.stream(stream, None).map_err(bad)?;
        let replayed = match self.rt.alloc_async(size as usize, s) {
            Ok(p) => {
                self.counts.prelude_allocs += 1;
                Some(p)
            }
            Err(CupoolStatus::CupoolErrorOutOfMemory) => {
                self.counts.ooms += 1;
                None
            }
            Err(e) => {
                return Err(bad(format!(
                    "replaying the allocation of {size} bytes at {addr:#x} alive before the \
                     first event failed: {}",
                    e.as_str()
                )))
            }
        };
        self.live.insert(
            addr,
            LiveBlock {
                replayed,
                since: usize::MAX,
            },
        );
        Ok(())
    }

    fn event(&mut self, i: usize, ev: &TraceEvent) -> Result<(), String> {
        if failed_in_trace(ev) {
            self.counts.trace_failures += 1;
            return Ok(());
        }
        match ev.action {
            Action::Allocate => self.allocate(i, ev),
            Action::Free => self.free(ev),
            Action::AllocateFailure => Ok(()),
        }
    }

    fn allocate(&mut self, i: usize, ev: &TraceEvent) -> Result<(), String> {
        if ev.size == 0 {
            self.counts.skipped_empty += 1;
            if ev.ptr != 0 {
                self.live.insert(
                    ev.ptr,
                    LiveBlock {
                        replayed: None,
                        since: i,
                    },
                );
            }
            return Ok(());
        }
        if self.live.contains_key(&ev.ptr) {
            return Err(format!(
                "allocate returned {:#x}, which is still allocated (never freed since)",
                ev.ptr
            ));
        }
        let size = usize::try_from(ev.size).map_err(|_| format!("size {} too big", ev.size))?;
        let stream = if ev.streamless {
            None
        } else {
            Some(self.stream(ev.stream, ev.stream_id)?)
        };
        let (result, ns) = self.call(ev.thread, Op::Alloc { size, stream });
        self.alloc_ns.push(ns);
        let replayed = match result {
            Ok(p) => {
                self.counts.allocs += 1;
                Some(p)
            }
            Err(CupoolStatus::CupoolErrorOutOfMemory) => {
                self.counts.ooms += 1;
                None
            }
            Err(e) => {
                return Err(format!(
                    "replaying the allocation of {} bytes failed: {}",
                    ev.size,
                    e.as_str()
                ))
            }
        };
        self.freed.remove(&ev.ptr);
        self.live.insert(ev.ptr, LiveBlock { replayed, since: i });
        Ok(())
    }

    fn free(&mut self, ev: &TraceEvent) -> Result<(), String> {
        if ev.ptr == 0 {
            self.counts.skipped_empty += 1;
            return Ok(());
        }
        let Some(block) = self.live.remove(&ev.ptr) else {
            return Err(if self.freed.contains(&ev.ptr) {
                format!("double free of {:#x}", ev.ptr)
            } else {
                format!("free of {:#x}, which was never allocated", ev.ptr)
            });
        };
        self.freed.insert(ev.ptr);
        let Some(ptr) = block.replayed else {
            self.counts.skipped_frees += 1;
            return Ok(());
        };
        let stream = if ev.streamless {
            None
        } else {
            Some(self.stream(ev.stream, ev.stream_id)?)
        };
        let (result, ns) = self.call(ev.thread, Op::Free { ptr, stream });
        self.free_ns.push(ns);
        result
            .map_err(|e| format!("replaying the free of {:#x} failed: {}", ev.ptr, e.as_str()))?;
        self.counts.frees += 1;
        Ok(())
    }

    /// Frees every block still live (in allocation order), then gives the context's idle
    /// memory back: (blocks freed, bytes released, reserved bytes after).
    fn clean_up(&mut self) -> Result<(u64, u64, u64), TraceError> {
        let bad = |what: &str, e: CupoolStatus| {
            TraceError::new(
                Position::File,
                format!("after the replay, {what} failed: {}", e.as_str()),
            )
        };
        let mut live: Vec<LiveBlock> = self.live.drain().map(|(_, b)| b).collect();
        live.sort_by_key(|b| b.since);
        let mut freed = 0;
        for ptr in live.iter().filter_map(|b| b.replayed) {
            self.rt
                .free(ptr)
                .map_err(|e| bad("freeing a live block", e))?;
            freed += 1;
        }
        // This context's pool only: `Runtime::empty_cache` would also empty the pools of
        // other replays running in the process, and change their figures.
        let released = self
            .rt
            .empty_context_cache(self.ctx)
            .map_err(|e| bad("empty_cache", e))?;
        let pool = self
            .rt
            .context_pool(self.ctx)
            .map_err(|e| bad("finding the pool", e))?;
        Ok((freed, released, pool.reserved()))
    }
}

fn status_text(e: CupoolStatus) -> String {
    format!("reading the pool's statistics failed: {}", e.as_str())
}
