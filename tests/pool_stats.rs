//! The fragmentation statistics (`inactive_split_bytes`, `pending_fence_bytes`, `segments`,
//! `granules`, `mapped_bytes`) on the host backend, from states built step by step. The VMM
//! arena's figures are checked in `pool_vmm.rs` (its tests change a process-wide option).
//!
//! Each test works in a context of its own, so its pool and statistics are private.

mod host_pool;

use host_pool::{setup, setup_held, S1};

const MIB: u64 = 1 << 20;

#[test]
fn a_split_segment_reports_its_free_remainder() {
    let (rt, _host, ctx) = setup();
    let a = rt.alloc_async(1000, S1).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.segments, 1, "one small segment");
    assert_eq!(s.reserved_bytes.current, 2 * MIB);
    assert_eq!(s.allocated_bytes.current, 1024);
    assert_eq!(
        s.inactive_split_bytes,
        2 * MIB - 1024,
        "the remainder split off the segment is free but not releasable"
    );
    assert_eq!(s.pending_fence_bytes, 0);
    assert_eq!((s.mapped_bytes.current, s.mapped_bytes.peak), (0, 0));
    assert_eq!(s.granules, 0, "no VMM arena");

    // A block over half the large segment size (20 MiB) gets a segment of its own.
    let b = rt.alloc_async(12 * MIB as usize, S1).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.segments, 2);
    assert_eq!(
        s.inactive_split_bytes,
        2 * MIB - 1024,
        "b fills its segment"
    );
    rt.free_async(b, S1).unwrap();
    rt.flush_thread_cache();
    rt.free_async(a, S1).unwrap();
    rt.flush_thread_cache();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(
        s.inactive_split_bytes, 0,
        "segments holding no block in use are not counted"
    );
    rt.empty_context_cache(ctx).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!((s.segments, s.inactive_split_bytes), (0, 0));
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}

#[test]
fn frees_waiting_for_a_fence_are_pending_until_it_completes() {
    let (rt, host, ctx) = setup_held();
    // Over half the large segment size (20 MiB): a segment of its own each.
    let a = rt.alloc(12 * MIB as usize).unwrap();
    let b = rt.alloc(14 * MIB as usize).unwrap();
    let keep = rt.alloc(16 * MIB as usize).unwrap();
    let c = rt.alloc_async(1000, S1).unwrap();
    assert_eq!(rt.context_stats(ctx).unwrap().pending_fence_bytes, 0);
    rt.free(a).unwrap();
    rt.free(b).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        s.pending_fence_bytes,
        26 * MIB,
        "streamless frees wait in the fence queue"
    );
    // A block freed on a stream sits in the thread cache (not counted) until flushed to
    // its stream's list, where it merges with the free rest of its small segment.
    rt.free_async(c, S1).unwrap();
    assert_eq!(rt.context_stats(ctx).unwrap().pending_fence_bytes, 26 * MIB);
    rt.flush_thread_cache();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        s.pending_fence_bytes,
        28 * MIB,
        "the stream's list counts too"
    );
    assert_eq!(
        s.inactive_split_bytes, 0,
        "every segment is either in use whole or free whole"
    );
    let report = rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    assert_eq!(
        s.pending_fence_bytes,
        report.awaiting_fence + report.on_stream
    );

    host.set_manual_completion(ctx.id, false);
    host.complete_all(ctx.id);
    // A miss polls the fences and moves what they cover to the shared index.
    let d = rt.alloc(12 * MIB as usize).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.pending_fence_bytes, 0, "every fence seen complete");
    rt.free(d).unwrap();
    rt.free(keep).unwrap();
    host.complete_all(ctx.id);
    rt.empty_context_cache(ctx).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!((s.pending_fence_bytes, s.segments), (0, 0));
}

#[test]
fn json_and_text_carry_the_new_fields() {
    let (rt, _host, ctx) = setup();
    let a = rt.alloc_async(1000, S1).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    let json = s.to_json();
    for key in [
        format!("\"inactive_split_bytes\":{}", s.inactive_split_bytes),
        format!("\"pending_fence_bytes\":{}", s.pending_fence_bytes),
        format!(
            "\"mapped_bytes\":{{\"current\":{},\"peak\":{}}}",
            s.mapped_bytes.current, s.mapped_bytes.peak
        ),
        format!("\"segments\":{}", s.segments),
        format!("\"granules\":{}", s.granules),
    ] {
        assert!(json.contains(&key), "{key} missing from {json}");
    }
    let text = s.to_text();
    for name in [
        "inactive_split_bytes",
        "pending_fence_bytes",
        "mapped_bytes",
        "segments",
        "granules",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "{name} missing from\n{text}"
        );
    }
    // The all-devices sum adds the gauges like the other figures.
    let mut sum = cupool::stats::CupoolStats::new();
    sum.accumulate(&s);
    sum.accumulate(&s);
    assert_eq!(sum.segments, 2 * s.segments);
    assert_eq!(sum.inactive_split_bytes, 2 * s.inactive_split_bytes);
    rt.free_async(a, S1).unwrap();
}
