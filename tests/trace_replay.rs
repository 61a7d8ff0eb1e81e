//! Trace replay on the host backend: the figures it reports are the pool's own, computed
//! here by hand from the pool's rules for small traces (blocks are 512-byte multiples,
//! blocks of 1 MiB and less come from 2 MiB small segments).

use cupool::runtime::{runtime, Runtime};
use cupool::trace::replay::{replay, ReplayOptions, ReplayReport};
use cupool::trace::{Action, Position, Trace, TraceError, TraceEvent};

const SMALL_SEGMENT: u64 = 2 << 20;
const S1: u64 = 0x7f00_1000;
const S2: u64 = 0x7f00_2000;

/// The segment pool (`vmm:off`): the tests below check segment sizes.
fn rt() -> &'static Runtime {
    cupool::config::set("backend", "host").expect("host backend");
    cupool::config::set("vmm", "off").expect("vmm option");
    runtime().expect("runtime starts on the host backend")
}

fn alloc(ptr: u64, size: u64, stream: u64) -> TraceEvent {
    TraceEvent::rmm(1, 0, Action::Allocate, ptr, size, stream)
}

fn free(ptr: u64, size: u64, stream: u64) -> TraceEvent {
    TraceEvent::rmm(1, 0, Action::Free, ptr, size, stream)
}

fn streamless(mut ev: TraceEvent) -> TraceEvent {
    ev.streamless = true;
    ev
}

/// A trace whose event `i` came from CSV line `i + 2` (the header is line 1).
fn trace(events: Vec<TraceEvent>) -> Trace {
    Trace::from_events(events, Vec::new())
}

fn run(t: &Trace) -> Result<ReplayReport, TraceError> {
    replay(rt(), t, &ReplayOptions::default(), &mut |_| {})
}

#[test]
fn two_small_allocations_take_one_small_segment() {
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        alloc(0x2000, 1000, 0),
        free(0x1000, 1000, 0),
        free(0x2000, 1000, 0),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.peak_requested_bytes, 2000);
    assert_eq!(
        r.peak_allocated_bytes,
        2 * 1024,
        "1000 bytes round up to 1024"
    );
    assert_eq!(r.peak_reserved_bytes, SMALL_SEGMENT);
    assert_eq!(r.device_allocs, 1);
    assert_eq!((r.allocs, r.frees, r.ops), (2, 2, 4));
    let expected = 2048.0 / SMALL_SEGMENT as f64;
    assert!((r.utilization.unwrap() - expected).abs() < 1e-12);
    assert!((r.requested_utilization.unwrap() - 2000.0 / SMALL_SEGMENT as f64).abs() < 1e-12);
    assert_eq!(r.reserved_after_empty_cache, 0);
    assert_eq!(r.released_at_end_bytes, SMALL_SEGMENT);
    assert_eq!(r.alloc_time.median_ns > 0, r.alloc_time.mean_ns > 0.0);
}

#[test]
fn a_large_block_gets_its_size_and_a_large_segment() {
    // 3 MiB + 1 byte: above 1 MiB, at most half of a 20 MiB large segment.
    let size = (3 << 20) + 1;
    let t = trace(vec![alloc(0x10_0000, size, 0), free(0x10_0000, size, 0)]);
    let r = run(&t).unwrap();
    assert_eq!(r.peak_requested_bytes, size);
    assert_eq!(r.peak_allocated_bytes, (3 << 20) + 512);
    assert_eq!(r.peak_reserved_bytes, 20 << 20);
    assert_eq!(r.reserved_after_empty_cache, 0);
}

#[test]
fn streamless_and_stream_ordered_replays_differ_in_fences_not_in_peaks() {
    // 32 MiB: a segment of its own, so each reuse is of the block just freed.
    const SIZE: u64 = 32 << 20;
    let pattern = |wrap: fn(TraceEvent) -> TraceEvent, stream: u64| {
        trace(
            (0..8u64)
                .flat_map(|i| {
                    [
                        wrap(alloc(0x1000 + i, SIZE, stream)),
                        wrap(free(0x1000 + i, SIZE, stream)),
                    ]
                })
                .collect(),
        )
    };
    let ordered = run(&pattern(|e| e, S1)).unwrap();
    let unordered = run(&pattern(streamless, S1)).unwrap();
    // On one stream, a freed block is that stream's again at once: no fence.
    assert_eq!(ordered.fences, 0);
    assert_eq!(ordered.streams, 1);
    assert_eq!(ordered.cache_hits, 7);
    // Without a stream, each reuse waits for a context fence.
    assert_eq!(unordered.fences, 7, "{unordered:?}");
    // Each complete when asked (no simulated lag): one query each, and no device wait
    // (`fence_waits` is `host` without the preload).
    assert_eq!(unordered.fence_queries, 7, "{unordered:?}");
    assert_eq!(unordered.fence_device_waits, 0);
    assert_eq!((ordered.fence_queries, ordered.fence_device_waits), (0, 0));
    assert_eq!(unordered.streams, 0, "streamless events need no stream");
    for r in [&ordered, &unordered] {
        assert_eq!(r.peak_allocated_bytes, SIZE);
        assert_eq!(r.peak_reserved_bytes, SIZE);
        assert_eq!(r.device_allocs, 1);
        assert_eq!(r.ops, 16);
    }
}

#[test]
fn a_free_on_another_stream_is_counted_cross_stream() {
    let t = trace(vec![
        alloc(0x1000, 1000, S1),
        free(0x1000, 1000, S2),
        alloc(0x2000, 1000, S1),
        free(0x2000, 1000, S1),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.cross_stream_frees, 1);
    assert_eq!(r.streams, 2);
    assert_eq!(r.frees, 2);
}

#[test]
fn stream_ids_tell_apart_streams_that_reuse_a_handle() {
    let with_id = |mut e: TraceEvent, id: u64| {
        e.stream_id = Some(id);
        e
    };
    // One handle, two streams (the first destroyed, the second created at its address).
    let t = trace(vec![
        with_id(alloc(0x1000, 1000, S1), 7),
        with_id(free(0x1000, 1000, S1), 7),
        with_id(alloc(0x2000, 1000, S1), 8),
        with_id(free(0x2000, 1000, S1), 8),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.streams, 2);
    assert_eq!(r.cross_stream_frees, 0);
}

#[test]
fn the_legacy_stream_is_not_created() {
    let t = trace(vec![alloc(0x1000, 1000, 0), free(0x1000, 1000, 0)]);
    assert_eq!(run(&t).unwrap().streams, 0);
}

#[test]
fn prelude_blocks_are_allocated_before_the_first_event() {
    let mut t = trace(vec![
        alloc(0x2000, 1000, 0),
        free(0xa000, 5000, 0),
        free(0x2000, 1000, 0),
    ]);
    t.prelude = vec![(0xa000, 5000, 0)];
    let r = run(&t).unwrap();
    assert_eq!(r.prelude_allocs, 1);
    // Both blocks are live after the first event: 5120 + 1024 bytes.
    assert_eq!(r.peak_allocated_bytes, 5120 + 1024);
    assert_eq!(r.peak_requested_bytes, 6000);
    assert_eq!((r.allocs, r.frees), (1, 2));
}

#[test]
fn a_free_of_an_unknown_pointer_is_an_error_at_its_line() {
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        free(0x1000, 1000, 0),
        free(0xdead, 64, 0),
    ]);
    let err = run(&t).unwrap_err();
    assert_eq!(err.position, Position::Line(4));
    assert!(err.to_string().starts_with("line 4: "), "{err}");
    assert!(err.message.contains("0xdead"), "{err}");
}

#[test]
fn a_double_free_is_an_error_at_the_second_free() {
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        alloc(0x2000, 1000, 0),
        free(0x1000, 1000, 0),
        free(0x2000, 1000, 0),
        free(0x1000, 1000, 0),
    ]);
    let err = run(&t).unwrap_err();
    assert_eq!(err.position, Position::Line(6));
    assert!(err.message.contains("double free"), "{err}");
}

#[test]
fn an_allocation_at_a_live_address_is_an_error() {
    let t = trace(vec![alloc(0x1000, 1000, 0), alloc(0x1000, 1000, 0)]);
    assert_eq!(run(&t).unwrap_err().position, Position::Line(3));
}

#[test]
fn blocks_live_at_the_end_are_freed_and_the_cache_emptied() {
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        alloc(0x2000, 2 << 20, S1),
        alloc(0x3000, 64 << 20, 0),
        streamless(alloc(0x4000, 300, 0)),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.live_at_end, 4);
    assert_eq!(r.frees, 0);
    assert_eq!(r.reserved_after_empty_cache, 0);
    assert_eq!(r.released_at_end_bytes, r.peak_reserved_bytes);
    assert!(r.peak_reserved_bytes >= (64 << 20) + (2 << 20) + 1024 + 512);
}

#[test]
fn failed_calls_are_counted_and_replay_ooms_skip_their_free() {
    let huge = 1u64 << 46; // 64 TiB: no host device holds it.
    let mut failed_free = free(0x5000, 64, 0);
    failed_free.result = Some("invalid_pointer".to_string());
    let t = trace(vec![
        TraceEvent::rmm(1, 0, Action::AllocateFailure, 0, 1 << 40, 0),
        alloc(0x1000, huge, 0),
        alloc(0x2000, 1000, 0),
        failed_free,
        free(0x1000, huge, 0),
        free(0x2000, 1000, 0),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.trace_failures, 2);
    assert_eq!(r.ooms, 1);
    assert_eq!(r.skipped_frees, 1);
    assert_eq!((r.allocs, r.frees), (1, 1));
    assert_eq!(r.peak_allocated_bytes, 1024);
}

#[test]
fn two_replays_in_one_process_do_not_share_a_pool() {
    let t = trace(
        (0..50u64)
            .flat_map(|i| [alloc(0x1000 * (i + 1), 1000 + 37 * i, S1)])
            .chain((0..50u64).map(|i| free(0x1000 * (i + 1), 0, S1)))
            .collect(),
    );
    let first = run(&t).unwrap();
    let second = run(&t).unwrap();
    // A second replay sharing the first one's pool would find its segment cached.
    assert!(second.device_allocs > 0);
    let figures = |r: &ReplayReport| {
        (
            r.peak_requested_bytes,
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.device_allocs,
            r.device_frees,
            r.fences,
            r.cache_hits,
        )
    };
    assert_eq!(figures(&first), figures(&second));
    let requested: u64 = (0..50u64).map(|i| 1000 + 37 * i).sum();
    assert_eq!(first.peak_requested_bytes, requested);
}

#[test]
fn the_series_follows_the_trace_and_holds_the_peaks() {
    let n = 3000u64;
    let t = trace(
        (0..n)
            .flat_map(|i| {
                let p = 0x1000 * (i + 1);
                [alloc(p, 1 << 16, 0), free(p, 1 << 16, 0)]
            })
            .chain([alloc(0x1, 3 << 20, 0)])
            .collect(),
    );
    let opts = ReplayOptions {
        samples: 100,
        ..ReplayOptions::default()
    };
    let mut calls = Vec::new();
    let r = replay(rt(), &t, &opts, &mut |done| calls.push(done)).unwrap();
    // About 100 points: one every ceil(6001 / 100) = 61 events, and the last one.
    assert_eq!(r.series.len(), 6001 / 61 + 1);
    assert_eq!(r.series.last().unwrap().op, t.events.len());
    assert!(r.series.windows(2).all(|w| w[0].op < w[1].op));
    let max_reserved = r.series.iter().map(|s| s.reserved_bytes).max().unwrap();
    assert_eq!(max_reserved, r.peak_reserved_bytes);
    let max_allocated = r.series.iter().map(|s| s.allocated_bytes).max().unwrap();
    assert_eq!(max_allocated, r.peak_allocated_bytes);
    // The last event alone holds 3 MiB: the last point shows it.
    assert_eq!(r.series.last().unwrap().allocated_bytes, 3 << 20);
    assert_eq!(calls.last(), Some(&t.events.len()));
}

#[test]
fn max_events_replays_the_beginning_only() {
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        free(0x1000, 1000, 0),
        alloc(0x2000, 8 << 20, 0),
        free(0x2000, 8 << 20, 0),
    ]);
    let opts = ReplayOptions {
        max_events: Some(2),
        ..ReplayOptions::default()
    };
    let r = replay(rt(), &t, &opts, &mut |_| {}).unwrap();
    assert_eq!((r.events, r.trace_events, r.ops), (2, 4, 2));
    assert_eq!(r.peak_reserved_bytes, SMALL_SEGMENT);
}

#[test]
fn the_second_half_counts_only_the_driver_work_from_the_middle_event_on() {
    // Events 0-2 take a small segment and reuse it; events 3-5 free it and take a large
    // block's segment: one device allocation in each half.
    let t = trace(vec![
        alloc(0x1000, 1000, 0),
        free(0x1000, 1000, 0),
        alloc(0x1000, 1000, 0),
        free(0x1000, 1000, 0),
        alloc(0x2000, 30 << 20, 0),
        free(0x2000, 30 << 20, 0),
    ]);
    let r = run(&t).unwrap();
    assert_eq!(r.device_allocs, 2);
    let half = r
        .second_half
        .expect("a trace of six events has a second half");
    assert_eq!((half.device_allocs, half.device_frees), (1, 0));
    assert_eq!(
        (half.map_calls, half.unmap_calls),
        (0, 0),
        "vmm:off maps nothing"
    );
    assert_eq!(half.calls(), 1);
    assert!(
        r.to_json(false)
            .contains("\"second_half\":{\"driver_calls\":1,\"device_allocs\":1"),
        "{}",
        r.to_json(false)
    );
    let one = run(&trace(vec![alloc(0x1000, 1000, 0)])).unwrap();
    assert_eq!(one.second_half, None, "one event has no second half");
    assert!(one.to_json(false).contains("\"second_half\":null"));
}

#[test]
fn the_json_report_has_the_figures() {
    let t = trace(vec![alloc(0x1000, 1000, 0), free(0x1000, 1000, 0)]);
    let r = run(&t).unwrap();
    let json = r.to_json(true);
    for key in [
        "\"peak_requested_bytes\":1000",
        "\"peak_allocated_bytes\":1024",
        &format!("\"peak_reserved_bytes\":{SMALL_SEGMENT}"),
        "\"device_allocs\":1",
        "\"ops\":2",
        "\"ooms\":0",
        "\"fence_queries\":0",
        "\"fence_device_waits\":0",
        "\"utilization\":0.000488",
        "\"reference\":null",
        "\"series\":[[",
    ] {
        assert!(json.contains(key), "{key} missing from {json}");
    }
}

#[test]
fn an_empty_trace_replays_to_nothing() {
    let r = run(&trace(Vec::new())).unwrap();
    assert_eq!((r.ops, r.peak_reserved_bytes), (0, 0));
    assert_eq!(r.utilization, None);
    assert!(r.to_json(true).contains("\"utilization\":null"));
}

/// Note [per-thread replay]: a block one thread freed sits in that thread's cache, out of
/// another thread's reach; the per-thread replay shows what that costs, the one-thread
/// replay does not. The workers' caches go back to the pool when they end.
#[test]
fn a_per_thread_replay_keeps_each_threads_cache_its_own() {
    const MIB: u64 = 1 << 20;
    let on = |thread: u64, action, ptr| TraceEvent::rmm(thread, 0, action, ptr, 16 * MIB, S1);
    // Thread 1 frees a 16 MiB block (a segment of its own) on S1; thread 2 then wants 16 MiB
    // on S1.
    let t = trace(vec![
        on(1, Action::Allocate, 0x1000),
        on(1, Action::Free, 0x1000),
        on(2, Action::Allocate, 0x2000),
        on(2, Action::Free, 0x2000),
    ]);
    let one = run(&t).unwrap();
    assert_eq!(
        one.peak_reserved_bytes,
        16 * MIB,
        "the freed block served both"
    );
    let opts = ReplayOptions {
        per_thread: true,
        ..ReplayOptions::default()
    };
    let per = replay(rt(), &t, &opts, &mut |_| {}).unwrap();
    assert_eq!(
        per.peak_reserved_bytes,
        32 * MIB,
        "thread 2 could not reach the block in thread 1's cache"
    );
    assert_eq!((per.allocs, per.frees), (2, 2));
    assert_eq!(
        per.reserved_after_empty_cache, 0,
        "the workers' caches went back"
    );
    assert_eq!(per.released_at_end_bytes, 32 * MIB);
}
