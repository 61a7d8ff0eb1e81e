//! Polling of context fences on the host backend, while the simulated device holds work
//! in flight: how many queries a poll makes and how many fences stay outstanding.
//!
//! A test binary of its own: the tests in `pool_host.rs` call `empty_cache` and run out of
//! memory on purpose, and either waits for every fence of every pool of the process.

use cupool::backend::host::HostBackend;
use cupool::backend::ContextInfo;
use cupool::runtime::{runtime, Runtime};

fn setup() -> (&'static Runtime, &'static HostBackend, ContextInfo) {
    cupool::config::set("backend", "host").expect("host backend");
    let rt = runtime().expect("runtime starts on the host backend");
    let host = rt.host_backend().expect("host backend in use");
    let ctx = host.create_context(0);
    host.make_current(ctx);
    (rt, host, ctx)
}

/// Allocates and frees `n` streamless blocks of a segment each while the device holds
/// all work in flight: every allocation after the first records a fence for the previous
/// free and, finding it incomplete, grows. Returns the blocks in free order.
fn fence_bound_blocks(rt: &Runtime, n: usize, size: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            let p = rt.alloc(size).unwrap();
            rt.free(p).unwrap();
            p
        })
        .collect()
}

#[test]
fn a_poll_finds_the_newest_completed_fence_in_logarithmic_queries() {
    let (rt, host, ctx) = setup();
    host.set_manual_completion(ctx.id, true);
    let size = 12 << 20;
    let blocks = fence_bound_blocks(rt, 33, size);
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
    let (rt, host, ctx) = setup();
    host.set_manual_completion(ctx.id, true);
    let size = 11 << 20;
    let blocks = fence_bound_blocks(rt, 80, size);
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
