//! Reuse rules that depend on work still in flight, on the host backend with the simulated
//! device holding events until the test completes them: what waits for a fence, how many
//! queries a poll makes, how many fences stay outstanding.
//!
//! A test binary of its own: the tests in `pool_host.rs` call `empty_cache` and run out of
//! memory on purpose, and either waits for (so completes) every fence of every pool of the
//! device, which would complete this file's work in flight behind its back.

mod host_pool;

use cupool::backend::StreamHandle;
use host_pool::{alloc_free_pairs, setup, setup_held, S1, S2};

#[test]
fn a_poll_finds_the_newest_completed_fence_in_logarithmic_queries() {
    let (rt, host, ctx) = setup_held();
    let size = 12 << 20;
    // With all work held in flight, each allocation after the first records a fence for
    // the previous free and, finding it incomplete, grows.
    let blocks = alloc_free_pairs(rt, 33, size);
    let outstanding = host.in_flight(ctx.id);
    assert!(outstanding >= 32, "{outstanding} fences in flight");
    // The device has run the work before the first 10 fences only.
    host.complete_oldest(ctx.id, 10);
    let queried = host.queries(ctx.id);
    let reused = rt.alloc(size).unwrap();
    let queries = host.queries(ctx.id) - queried;
    assert!(
        blocks[..10].contains(&reused),
        "a block covered by a completed fence is reused"
    );
    // Newest first (1), then a binary search over ~33 fences (6): not one per fence.
    assert!(queries <= 8, "{queries} queries for {outstanding} fences");
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 33, "no segment was added for the reuse");
    host.complete_all(ctx.id);
    rt.free(reused).unwrap();
    host.set_manual_completion(ctx.id, false);
}

#[test]
fn fences_stop_being_recorded_while_the_device_is_far_behind() {
    let (rt, host, ctx) = setup_held();
    let size = 11 << 20;
    let blocks = alloc_free_pairs(rt, 80, size);
    let s = rt.context_stats(ctx).unwrap();
    let in_flight = host.in_flight(ctx.id);
    assert!(in_flight <= 64, "{in_flight} fences outstanding (cap 64)");
    assert_eq!(s.alloc_retries, 0);
    assert_eq!(s.fences_recorded, 64, "80 fence-bound frees, cap 64");
    // Once the device catches up, every block is reusable again: those freed after the
    // cap was reached are covered by the next fence.
    host.complete_all(ctx.id);
    host.set_manual_completion(ctx.id, false);
    let again: Vec<u64> = (0..80).map(|_| rt.alloc(size).unwrap()).collect();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 80, "all 80 blocks were reused");
    let mut sorted = again.clone();
    sorted.sort_unstable();
    let mut expected = blocks;
    expected.sort_unstable();
    assert_eq!(sorted, expected);
    for p in again {
        rt.free(p).unwrap();
    }
}

#[test]
fn another_stream_waits_for_the_free_event() {
    let (rt, host, ctx) = setup_held();
    // 30 MiB: a segment of its own, so the only way to avoid a new segment is reuse.
    let n = 30 << 20;
    let a = rt.alloc_async(n, S1).unwrap();
    rt.free_async(a, S1).unwrap();
    // The block sits in this thread's cache for S1; give it to the pool so that another
    // stream's miss can consider it.
    rt.flush_thread_cache();
    let b = rt.alloc_async(n, S2).unwrap();
    assert_ne!(
        a, b,
        "S2 must not get S1's block while S1's work may still use it"
    );
    assert!(
        host.in_flight(ctx.id) > 0,
        "the miss recorded an event on S1"
    );
    host.complete_all(ctx.id);
    // S2's next miss finds S1's event complete and takes S1's block.
    let c = rt.alloc_async(n, S2).unwrap();
    assert_eq!(c, a, "once its event completed, S1's block is shared");
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 2);
    rt.free_async(b, S2).unwrap();
    rt.free_async(c, S2).unwrap();
    host.set_manual_completion(ctx.id, false);
}

#[test]
fn streamless_free_is_reused_only_after_a_fence() {
    let (rt, host, ctx) = setup_held();
    // 30 MiB: each block is a segment of its own, so only reuse can avoid a new segment.
    let n = 30 << 20;
    let a = rt.alloc(n).unwrap();
    rt.free(a).unwrap();
    let b = rt.alloc(n).unwrap();
    assert_ne!(a, b, "a streamless free waits for a context fence");
    host.complete_all(ctx.id);
    rt.free(b).unwrap();
    let c = rt.alloc(n).unwrap();
    assert_eq!(c, a, "the block whose fence completed is reused");
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 2);
    host.complete_all(ctx.id);
    rt.free(c).unwrap();
    host.set_manual_completion(ctx.id, false);
}

#[test]
fn free_on_another_stream_is_fenced() {
    let (rt, host, ctx) = setup_held();
    let a = rt.alloc_async(8192, S1).unwrap();
    rt.free_async(a, S2).unwrap();
    let b = rt.alloc_async(8192, S2).unwrap();
    let c = rt.alloc_async(8192, S1).unwrap();
    assert!(
        b != a && c != a,
        "a block freed on a foreign stream waits for a fence"
    );
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.cross_stream_frees, 1);
    host.complete_all(ctx.id);
    rt.free_async(b, S2).unwrap();
    rt.free_async(c, S1).unwrap();
    host.set_manual_completion(ctx.id, false);
}

/// A stream destroyed and another created at the same handle: blocks freed on the first
/// must not go to the second while the first one's work may still run.
#[test]
fn a_reused_stream_handle_does_not_inherit_blocks() {
    let (rt, host, ctx) = setup_held();
    let h: StreamHandle = 0x7700;
    let n = 30 << 20;
    let a = rt.alloc_async(n, h).unwrap();
    host.destroy_stream(h); // the program destroys the stream; its work is still in flight
    rt.free_async(a, h).unwrap(); // freed with the (now reused) handle
    let b = rt.alloc_async(n, h).unwrap(); // the new stream at the same handle
    assert_ne!(
        a, b,
        "the new stream must not get a block the old one may still use"
    );
    rt.flush_thread_cache();
    let c = rt.alloc_async(n, h).unwrap(); // this miss records a fence covering `a`
    assert_ne!(a, c, "the fence has not completed yet");
    host.complete_all(ctx.id);
    let d = rt.alloc_async(n, h).unwrap();
    assert_eq!(
        d, a,
        "once a fence covers the old stream's work the block is shared"
    );
    for p in [b, c, d] {
        rt.free_async(p, h).unwrap();
    }
    host.set_manual_completion(ctx.id, false);
}

/// The API library alone sees no capture: the backend refuses the fence (the CUDA backend
/// asks `cuStreamIsCapturing` first), and the pool keeps the freed block waiting and grows,
/// instead of failing the allocation or handing out a block nothing ordered.
#[test]
fn a_fence_refused_during_an_unseen_capture_leaves_the_block_waiting() {
    let (rt, host, ctx) = setup();
    let n = 30 << 20;
    let a = rt.alloc(n).unwrap();
    rt.free(a).unwrap();
    host.set_capturing(ctx.id, true);
    let b = rt.alloc(n).unwrap();
    assert_ne!(a, b, "no fence, so no reuse");
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!((s.fences_recorded, s.num_ooms), (0, 0));
    host.set_capturing(ctx.id, false);
    rt.free(b).unwrap();
    let c = rt.alloc(n).unwrap();
    assert!(
        c == a || c == b,
        "after the capture, a fence makes the blocks reusable"
    );
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!((s.device_allocs, s.fences_recorded), (2, 1));
    rt.free(c).unwrap();
}
