//! Recording (`CUPOOL_TRACE`, `cupool_trace_start`/`_stop`) on the host backend: what the
//! trace holds, both file formats, the driver file, thread exit, fork, and a crash.
//!
//! Tracing is process-wide, so every test here takes [`TRACE_LOCK`] and they run one after
//! the other (this binary holds all the recording tests for that reason).

mod host_pool;

use cupool::backend::StreamHandle;
use cupool::runtime::Runtime;
use cupool::trace::io::read_trace;
use cupool::trace::record::{self, BUFFER_RECORDS};
use cupool::trace::{Action, Trace, TraceEvent};
use cupool::CupoolStatus;
use host_pool::{setup, setup_on, S1, S2};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

static TRACE_LOCK: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    TRACE_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh directory for one test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cupool-trace-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn start(path: &Path) {
    record::start(path.to_str().unwrap()).expect("trace starts");
}

fn read(path: &Path) -> Trace {
    read_trace(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn gettid() -> u64 {
    // SAFETY: no arguments.
    unsafe { libc::syscall(libc::SYS_gettid) as u64 }
}

fn stream_id(rt: &Runtime, s: StreamHandle) -> u64 {
    rt.backend().stream_id(s).unwrap().0
}

/// The driver file's rows: (action, pointer, size, device).
fn driver_rows(path: &Path) -> Vec<(String, u64, u64, i32)> {
    let bytes = std::fs::read(path).unwrap();
    let text = if path.extension().is_some_and(|e| e == "zst") {
        String::from_utf8(zstd::stream::decode_all(&bytes[..]).unwrap()).unwrap()
    } else {
        String::from_utf8(bytes).unwrap()
    };
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(cupool::trace::rmm_csv::DRIVER_HEADER),
        "{}",
        path.display()
    );
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 7, "driver row {l}");
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
            (
                f[2].to_string(),
                hex(f[3]),
                f[4].parse().unwrap(),
                f[5].parse().unwrap(),
            )
        })
        .collect()
}

fn check_event(
    ev: &TraceEvent,
    action: Action,
    size: u64,
    stream: Option<(StreamHandle, Option<u64>)>,
    result: Option<&str>,
) {
    assert_eq!(ev.action, action, "{ev:?}");
    assert_eq!(ev.size, size, "{ev:?}");
    assert_eq!(ev.result.as_deref(), result, "{ev:?}");
    assert_eq!(ev.streamless, stream.is_none(), "{ev:?}");
    assert_eq!(ev.stream, stream.map_or(0, |s| s.0 as u64), "{ev:?}");
    assert_eq!(ev.stream_id, stream.and_then(|s| s.1), "{ev:?}");
    assert!(ev.nanos.is_some(), "{ev:?}");
}

/// One sequence of calls of every kind, checked row by row, in `path`'s format.
fn record_and_check_sequence(path: &Path) {
    let (rt, _host, ctx) = setup_on(1);
    let (id1, id2) = (stream_id(rt, S1), stream_id(rt, S2));
    start(path);
    let a = rt.alloc_async(1000, S1).unwrap();
    rt.free_async(a, S1).unwrap();
    let b = rt.alloc(3000).unwrap();
    let c = rt.alloc_async(5 << 20, S2).unwrap();
    rt.free(b).unwrap();
    assert_eq!(rt.free(b), Err(CupoolStatus::CupoolErrorDoubleFree));
    assert_eq!(
        rt.free_async(0xdead_0000, S1),
        Err(CupoolStatus::CupoolErrorInvalidPointer)
    );
    // More than the simulated device holds (8 GiB): out of memory after the retry.
    assert_eq!(
        rt.alloc(16 << 30),
        Err(CupoolStatus::CupoolErrorOutOfMemory)
    );
    rt.free_async(c, S1).unwrap(); // another stream than the allocation's
    rt.empty_cache(Some(ctx.device)).unwrap();
    record::stop();

    let trace = read(path);
    let ev = &trace.events;
    assert_eq!(ev.len(), 9, "{ev:#?}");
    check_event(&ev[0], Action::Allocate, 1000, Some((S1, Some(id1))), None);
    check_event(&ev[1], Action::Free, 1000, Some((S1, Some(id1))), None);
    check_event(&ev[2], Action::Allocate, 3000, None, None);
    check_event(
        &ev[3],
        Action::Allocate,
        5 << 20,
        Some((S2, Some(id2))),
        None,
    );
    check_event(&ev[4], Action::Free, 3000, None, None);
    check_event(&ev[5], Action::Free, 0, None, Some("double_free"));
    check_event(
        &ev[6],
        Action::Free,
        0,
        Some((S1, None)),
        Some("invalid_pointer"),
    );
    check_event(
        &ev[7],
        Action::AllocateFailure,
        16 << 30,
        None,
        Some("out_of_memory"),
    );
    check_event(&ev[8], Action::Free, 5 << 20, Some((S1, Some(id1))), None);
    assert_eq!([ev[0].ptr, ev[1].ptr, ev[2].ptr, ev[3].ptr], [a, a, b, c]);
    assert_eq!(
        [ev[4].ptr, ev[5].ptr, ev[6].ptr, ev[7].ptr],
        [b, b, 0xdead_0000, 0]
    );
    assert_eq!(ev[0].rounded, Some(1024));
    assert_eq!(ev[2].rounded, Some(3072));
    assert_eq!(ev[3].rounded, Some(5 << 20));
    assert_eq!(
        ev[7].rounded,
        Some(16 << 30),
        "a failure has the rounded request"
    );
    assert_eq!(ev[5].rounded, None, "a failed free knows no block");
    let tid = gettid();
    for (i, e) in ev.iter().enumerate() {
        assert_eq!(e.thread, tid, "row {i}");
        let known_device = e.result.is_none() || e.action == Action::AllocateFailure;
        assert_eq!(e.device, known_device.then_some(1), "row {i}: {e:?}");
    }
    let nanos: Vec<u64> = ev.iter().map(|e| e.nanos.unwrap()).collect();
    assert!(nanos.windows(2).all(|w| w[0] <= w[1]), "{nanos:?}");
    // The time of day is RMM's and agrees with Nanos.
    let span_us = ev[8].time_us as i64 - ev[0].time_us as i64;
    let nanos_us = ((nanos[8] - nanos[0]) / 1000) as i64;
    assert!(
        (span_us - nanos_us).abs() <= 1,
        "{span_us} µs vs {nanos_us} µs"
    );

    // Driver file: the two segments the calls above needed, then both given back.
    let driver = driver_rows(Path::new(&record::driver_path(path.to_str().unwrap())));
    let allocs: Vec<_> = driver.iter().filter(|r| r.0 == "segment_alloc").collect();
    let frees: Vec<_> = driver.iter().filter(|r| r.0 == "segment_free").collect();
    assert_eq!(allocs.len(), 2, "{driver:?}");
    assert_eq!(frees.len(), 2, "{driver:?}");
    assert!(allocs.iter().all(|r| r.3 == 1), "device 1: {driver:?}");
    for block in [a, c] {
        assert!(
            allocs.iter().any(|r| (r.1..r.1 + r.2).contains(&block)),
            "no segment_alloc holds {block:#x}: {driver:?}"
        );
    }
    let mut alloc_set: Vec<_> = allocs.iter().map(|r| (r.1, r.2)).collect();
    let mut free_set: Vec<_> = frees.iter().map(|r| (r.1, r.2)).collect();
    alloc_set.sort_unstable();
    free_set.sort_unstable();
    assert_eq!(alloc_set, free_set);
}

#[test]
fn plain_csv_holds_every_call_and_the_driver_file_the_segments() {
    let _g = serial();
    let dir = temp_dir("plain");
    let path = dir.join("run.csv");
    record_and_check_sequence(&path);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with(&format!("{}\n", cupool::trace::rmm_csv::header())));
    assert!(dir.join("run.driver.csv").exists());
}

#[test]
fn zstd_trace_is_one_frame_per_flush() {
    let _g = serial();
    let dir = temp_dir("zstd");
    let path = dir.join("run.csv.zst");
    record_and_check_sequence(&path);
    assert!(dir.join("run.driver.csv.zst").exists());

    // Enough calls to fill a thread buffer several times: each flush is a frame.
    let (rt, _host, _ctx) = setup();
    start(&path);
    let pairs = 2 * BUFFER_RECORDS + 10;
    for _ in 0..pairs {
        let p = rt.alloc_async(4096, S1).unwrap();
        rt.free_async(p, S1).unwrap();
    }
    record::stop();
    // Every frame decodes on its own: the header's, one per full buffer, the rest's.
    let bytes = std::fs::read(&path).unwrap();
    let mut rows_per_frame = Vec::new();
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        let n = zstd::zstd_safe::find_frame_compressed_size(rest).expect("a whole frame");
        let text = zstd::stream::decode_all(&rest[..n]).expect("a frame decodes alone");
        rows_per_frame.push(text.iter().filter(|&&b| b == b'\n').count());
        rest = &rest[n..];
    }
    assert_eq!(rows_per_frame[0], 1, "the header's own frame");
    assert_eq!(rows_per_frame.iter().sum::<usize>(), 1 + 2 * pairs);
    let full = rows_per_frame
        .iter()
        .filter(|&&n| n == BUFFER_RECORDS)
        .count();
    assert!(full >= 3, "a frame per full buffer: {rows_per_frame:?}");
    assert!(rows_per_frame.len() <= full + 3, "{rows_per_frame:?}");
    let trace = read(&path);
    assert_eq!(trace.events.len(), 2 * pairs);
    assert!(trace.events.iter().all(|e| e.size == 4096 && !e.streamless));
}

#[test]
fn the_vmm_arenas_maps_and_unmaps_are_in_the_driver_file() {
    let _g = serial();
    let dir = temp_dir("vmm");
    let path = dir.join("v.csv");
    let (rt, _host, ctx) = setup_on(1);
    cupool::config::set("vmm", "on").unwrap();
    start(&path);
    let p = rt.alloc(24 << 20).unwrap();
    rt.free(p).unwrap();
    rt.empty_cache(Some(ctx.device)).unwrap();
    record::stop();
    cupool::config::set("vmm", "off").unwrap();
    let driver = driver_rows(Path::new(&record::driver_path(path.to_str().unwrap())));
    let bytes_of = |word: &str| -> u64 {
        driver
            .iter()
            .filter(|r| r.0 == word && r.3 == 1)
            .map(|r| r.2)
            .sum()
    };
    // The block's granules were mapped (in chunks of `vmm_chunk`) and unmapped again by
    // `empty_cache`; the range they were mapped at covers the block.
    assert!(bytes_of("map") >= 24 << 20, "{driver:?}");
    assert_eq!(bytes_of("unmap"), bytes_of("map"), "{driver:?}");
    let maps: Vec<_> = driver.iter().filter(|r| r.0 == "map").collect();
    let lo = maps.iter().map(|r| r.1).min().unwrap();
    let hi = maps.iter().map(|r| r.1 + r.2).max().unwrap();
    assert!(
        lo <= p && p + (24 << 20) <= hi,
        "{p:#x} in {lo:#x}..{hi:#x}"
    );
}

#[test]
fn a_thread_writes_its_events_when_it_exits() {
    let _g = serial();
    let dir = temp_dir("thread");
    let path = dir.join("t.csv");
    let (rt, host, ctx) = setup();
    start(&path);
    let tid = std::thread::spawn(move || {
        host.make_current(ctx);
        for _ in 0..10 {
            let p = rt.alloc(100).unwrap();
            rt.free(p).unwrap();
        }
        gettid()
    })
    .join()
    .unwrap();
    // Still tracing: the thread handed its buffer over when it exited; the rows are in the
    // file once that is written (by the writer thread, or here, now).
    record::write_pending();
    let trace = read(&path);
    assert_eq!(trace.events.len(), 20, "{:#?}", trace.events);
    assert!(trace.events.iter().all(|e| e.thread == tid && e.streamless));
    record::stop();
    assert_eq!(read(&path).events.len(), 20);
}

#[test]
fn threads_keep_their_order_and_stop_merges_by_time() {
    let _g = serial();
    let dir = temp_dir("threads");
    let path = dir.join("m.csv");
    let (rt, host, ctx) = setup();
    start(&path);
    let per_thread = BUFFER_RECORDS / 2 + 7;
    let workers: Vec<_> = (0..3)
        .map(|t| {
            std::thread::spawn(move || {
                host.make_current(ctx);
                let stream = 0x7000 + t;
                for i in 0..per_thread {
                    let p = rt.alloc_async(512 * (i % 4 + 1), stream).unwrap();
                    rt.free_async(p, stream).unwrap();
                }
                gettid()
            })
        })
        .collect();
    let tids: Vec<u64> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    record::stop();
    let trace = read(&path);
    assert_eq!(trace.events.len(), 3 * 2 * per_thread);
    for tid in tids {
        let mine: Vec<&TraceEvent> = trace.events.iter().filter(|e| e.thread == tid).collect();
        assert_eq!(mine.len(), 2 * per_thread);
        for (i, pair) in mine.chunks(2).enumerate() {
            assert_eq!(pair[0].action, Action::Allocate);
            assert_eq!(pair[1].action, Action::Free);
            assert_eq!(pair[0].ptr, pair[1].ptr);
            assert_eq!(pair[0].size as usize, 512 * (i % 4 + 1));
        }
    }
}

#[test]
fn a_fork_child_never_writes_to_the_parents_trace() {
    let _g = serial();
    let dir = temp_dir("fork");
    let path = dir.join("f.csv");
    let (rt, _host, _ctx) = setup();
    start(&path);
    // Full buffers for the writer thread, which may be writing (holding its locks) when
    // the process forks: the child must not wait for it.
    let busy = 4 * BUFFER_RECORDS;
    for _ in 0..busy / 2 {
        let p = rt.alloc(777).unwrap();
        rt.free(p).unwrap();
    }
    let before = rt.alloc(1000).unwrap();
    // SAFETY: the child only calls the pool (no lock another thread could hold: the other
    // tests wait on TRACE_LOCK, and this test's thread is the only one using the pool) and
    // then exits, running the exit handlers.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        for _ in 0..2 * BUFFER_RECORDS {
            if let Ok(p) = rt.alloc(1000) {
                let _ = rt.free(p);
            }
        }
        let _ = rt.free(before);
        // SAFETY: ends the child; runs the exit handlers (the recorder's must not write).
        unsafe { libc::exit(0) };
    }
    wait_for(child, Duration::from_secs(30));
    rt.free(before).unwrap();
    record::stop();
    let trace = read(&path);
    assert_eq!(trace.events.len(), busy + 2);
    assert!(trace.events.iter().all(|e| e.thread == gettid()));
    let mine: Vec<_> = trace.events.iter().filter(|e| e.size != 777).collect();
    assert_eq!(mine.len(), 2, "{mine:#?}");
    assert!(mine.iter().all(|e| e.ptr == before));
}

/// Waits for `pid` to exit with status 0, failing the test after `limit`.
fn wait_for(pid: libc::pid_t, limit: Duration) {
    let started = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: our own child; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            assert!(
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                "child status {status:#x}"
            );
            return;
        }
        if started.elapsed() > limit {
            // SAFETY: our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the fork child did not exit within {limit:?} (deadlock at exit?)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

const CRASH_CHILD_ENV: &str = "CUPOOL_TEST_CRASH_CHILD";
const CRASH_PAIRS: usize = 3 * BUFFER_RECORDS / 2 + 100;

/// Not a test of its own: the body of the child process of
/// [`what_was_written_survives_a_kill`], which runs this binary again with `CUPOOL_TRACE`
/// set, so the trace starts from the environment when the pool starts.
#[test]
fn crash_child_helper() {
    if std::env::var_os(CRASH_CHILD_ENV).is_none() {
        return;
    }
    let (rt, _host, _ctx) = setup();
    assert!(record::active(), "CUPOOL_TRACE started a trace");
    for _ in 0..CRASH_PAIRS {
        let p = rt.alloc_async(2048, S1).unwrap();
        rt.free_async(p, S1).unwrap();
    }
    // The three full buffers are handed over; make sure they are written before the kill.
    record::write_pending();
    println!("READY");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn what_was_written_survives_a_kill() {
    let _g = serial();
    let dir = temp_dir("crash");
    for name in ["k.csv", "k.csv.zst"] {
        let path = dir.join(name);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crash_child_helper",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_CHILD_ENV, "1")
            .env("CUPOOL_TRACE", &path)
            .env_remove("CUPOOL_CONF")
            .env_remove(IO_ERROR_CHILD_ENV)
            .env_remove(EXIT_CHILD_ENV)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let ready = stdout
            .lines()
            .map_while(Result::ok)
            .any(|l| l.contains("READY"));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(ready, "the child never got ready");
        let trace = read(&path);
        let driver = driver_rows(Path::new(&record::driver_path(path.to_str().unwrap())));
        // Three full buffers were written (the segment's record went to the driver file);
        // the rest died with the process.
        assert_eq!(driver.len(), 1, "{name}: {driver:?}");
        assert_eq!(
            trace.events.len() + driver.len(),
            3 * BUFFER_RECORDS,
            "{name}"
        );
        assert!(trace.events.iter().all(|e| e.size == 2048));
    }
}

#[test]
fn start_and_stop_rules() {
    let _g = serial();
    let dir = temp_dir("rules");
    let (rt, _host, _ctx) = setup();
    assert_eq!(
        record::start(""),
        Err(CupoolStatus::CupoolErrorInvalidValue)
    );
    let missing = dir.join("no/such/dir/x.csv");
    assert_eq!(
        record::start(missing.to_str().unwrap()),
        Err(CupoolStatus::CupoolErrorIo)
    );
    assert!(!record::active());
    // Stop without a trace: nothing to do.
    record::stop();

    // Starting again stops the first trace, which keeps what it recorded.
    let first = dir.join("first.csv");
    let second = dir.join("second-%p.csv");
    start(&first);
    let p = rt.alloc(100).unwrap();
    start(&second);
    rt.free(p).unwrap();
    record::stop();
    assert_eq!(read(&first).events.len(), 1);
    let second = dir.join(format!("second-{}.csv", std::process::id()));
    let events = read(&second).events;
    assert_eq!(events.len(), 1, "%p is the process id");
    assert_eq!(events[0].action, Action::Free);

    // Nothing is recorded after stop.
    let p = rt.alloc(100).unwrap();
    rt.free(p).unwrap();
    assert_eq!(read(&second).events.len(), 1);
}

#[test]
fn the_c_entry_points_check_their_arguments() {
    let _g = serial();
    let dir = temp_dir("ffi");
    use cupool::ffi::{cupool_trace_start, cupool_trace_stop};
    // SAFETY: NULL and NUL-terminated strings.
    unsafe {
        assert_eq!(
            cupool_trace_start(core::ptr::null()),
            CupoolStatus::CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_trace_start(c"".as_ptr()),
            CupoolStatus::CupoolErrorInvalidValue
        );
        let not_utf8 = [0xffu8, 0xfe, b'x', 0];
        assert_eq!(
            cupool_trace_start(not_utf8.as_ptr().cast()),
            CupoolStatus::CupoolErrorInvalidValue
        );
        let path = std::ffi::CString::new(dir.join("c.csv").to_str().unwrap()).unwrap();
        assert_eq!(cupool_trace_start(path.as_ptr()), CupoolStatus::CupoolOk);
    }
    assert!(record::active());
    assert_eq!(cupool_trace_stop(), CupoolStatus::CupoolOk);
    assert_eq!(cupool_trace_stop(), CupoolStatus::CupoolOk);
    assert!(!record::active());
}

#[test]
fn a_recorded_run_replays_to_the_same_peaks() {
    let _g = serial();
    let dir = temp_dir("round-trip");
    let path = dir.join("rt.csv.zst");
    let (rt, _host, ctx) = setup();
    start(&path);
    let mut live = Vec::new();
    for i in 0..400usize {
        let size = 1000 + (i * 7919) % (3 << 20);
        let stream = [S1, S2][i % 2];
        live.push((rt.alloc_async(size, stream).unwrap(), stream));
        if i % 3 == 0 {
            live.push((rt.alloc(size / 2 + 1).unwrap(), 0));
        }
        if live.len() > 24 {
            let (p, s) = live.remove(i % live.len());
            if s == 0 {
                rt.free(p).unwrap();
            } else {
                rt.free_async(p, [S1, S2][i % 3 % 2]).unwrap();
            }
        }
    }
    let (p, _) = live[0];
    assert!(
        rt.free(p).is_ok() && rt.free(p).is_err(),
        "a failed free in the trace"
    );
    record::stop();
    let recorded = rt.context_stats(ctx).unwrap();

    let trace = read(&path);
    let opts = cupool::trace::replay::ReplayOptions::default();
    // On a thread of its own, whose cache holds nothing of the recorded run.
    let report = std::thread::scope(|s| {
        s.spawn(|| cupool::trace::replay::replay(rt, &trace, &opts, &mut |_| {}))
            .join()
            .unwrap()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.trace_failures, 1);
    assert_eq!(report.peak_requested_bytes, recorded.requested_bytes.peak);
    assert_eq!(report.peak_allocated_bytes, recorded.allocated_bytes.peak);
    assert_eq!(report.peak_reserved_bytes, recorded.reserved_bytes.peak);
    assert_eq!(report.device_allocs, recorded.device_allocs);
}

const IO_ERROR_CHILD_ENV: &str = "CUPOOL_TEST_IO_ERROR_CHILD";

/// Not a test of its own: the body of the child of [`a_write_error_stops_the_trace_only`].
#[test]
fn io_error_child_helper() {
    let Some(path) = std::env::var_os(IO_ERROR_CHILD_ENV) else {
        return;
    };
    // Files may not grow past 16 KiB: the header fits, the first full buffer does not.
    // SAFETY: plain libc calls with valid arguments.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let limit = libc::rlimit {
            rlim_cur: 16 << 10,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let (rt, _host, _ctx) = setup();
    start(Path::new(&path));
    for _ in 0..2 * BUFFER_RECORDS {
        let p = rt
            .alloc_async(2048, S1)
            .expect("recording never fails a call");
        rt.free_async(p, S1).expect("recording never fails a call");
    }
    // The writer thread met the error, or this thread does now.
    record::write_pending();
    assert!(!record::active(), "the write error stopped the trace");
    println!("CHILD OK");
}

#[test]
fn a_write_error_stops_the_trace_only() {
    let _g = serial();
    let dir = temp_dir("io-error");
    let path = dir.join("big.csv");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "io_error_child_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IO_ERROR_CHILD_ENV, &path)
        .env_remove("CUPOOL_CONF")
        .env_remove("CUPOOL_TRACE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("CHILD OK"), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("tracing stopped"))
        .collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {stderr}");
    assert!(lines[0].contains(path.to_str().unwrap()), "{}", lines[0]);
    // The chunk that did not fit was cut off again: the file is whole (just the header).
    assert!(read(&path).events.is_empty());
}

#[test]
fn the_writer_thread_writes_full_buffers_while_the_program_runs() {
    let _g = serial();
    let dir = temp_dir("writer");
    let path = dir.join("w.csv.zst");
    let (rt, _host, _ctx) = setup();
    start(&path);
    // More batches than may wait for the writer: the allocating thread then writes the
    // oldest itself, and nothing is lost either way.
    let pairs = (record::MAX_QUEUED + 8) * BUFFER_RECORDS / 2;
    for _ in 0..pairs {
        let p = rt.alloc_async(4096, S1).unwrap();
        rt.free_async(p, S1).unwrap();
    }
    // No stop, no write_pending: the writer thread gets every full buffer into the file.
    // (2 * pairs is a whole number of buffers; the driver file's records, a segment or
    // two, keep as many rows in the last, partly filled buffer.)
    let started = Instant::now();
    let mut written = 0;
    while started.elapsed() < Duration::from_secs(60) {
        // The file may end in a frame being written: count only when it reads whole.
        written = read_trace(&path).map_or(written, |t| t.events.len());
        if written + 8 >= 2 * pairs {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        written + 8 >= 2 * pairs,
        "the writer thread wrote {written} of {} rows",
        2 * pairs
    );
    record::stop();
    let trace = read(&path);
    assert_eq!(trace.events.len(), 2 * pairs);
    for (i, pair) in trace.events.chunks(2).enumerate() {
        assert_eq!(pair[0].action, Action::Allocate, "pair {i}");
        assert_eq!(pair[1].action, Action::Free, "pair {i}");
        assert_eq!(pair[0].ptr, pair[1].ptr, "pair {i}");
    }
}

const EXIT_CHILD_ENV: &str = "CUPOOL_TEST_EXIT_CHILD";
const EXIT_PAIRS: usize = 20 * BUFFER_RECORDS + 123;

/// Not a test of its own: the body of the child of [`exit_writes_everything`].
#[test]
fn exit_child_helper() {
    if std::env::var_os(EXIT_CHILD_ENV).is_none() {
        return;
    }
    let (rt, host, ctx) = setup();
    assert!(record::active(), "CUPOOL_TRACE started a trace");
    // A second thread whose buffer is still partly filled at the exit.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        host.make_current(ctx);
        let p = rt.alloc(333).unwrap();
        rt.free(p).unwrap();
        tx.send(()).unwrap();
        std::thread::sleep(Duration::from_secs(3600));
    });
    rx.recv().unwrap();
    for _ in 0..EXIT_PAIRS {
        let p = rt.alloc_async(2048, S1).unwrap();
        rt.free_async(p, S1).unwrap();
    }
    // Batches are queued, the writer thread is likely writing one: exit now.
    std::process::exit(0);
}

#[test]
fn exit_writes_everything() {
    let _g = serial();
    let dir = temp_dir("exit");
    for name in ["e.csv", "e.csv.zst"] {
        let path = dir.join(name);
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "exit_child_helper",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(EXIT_CHILD_ENV, "1")
            .env("CUPOOL_TRACE", &path)
            .env_remove("CUPOOL_CONF")
            .env_remove(IO_ERROR_CHILD_ENV)
            .env_remove(CRASH_CHILD_ENV)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let trace = read(&path);
        assert_eq!(trace.events.len(), 2 * EXIT_PAIRS + 2, "{name}");
        assert_eq!(trace.events.iter().filter(|e| e.size == 333).count(), 2);
    }
}
