//! Note [lone fences] in `src/pool/mod.rs`, on the host backend: a loop that frees a block
//! with a segment of its own without a stream and allocates it again pays one context
//! fence per reuse, until the pool holds a second copy and one fence covers two reuses.
//!
//! A test binary of its own: `fence_spare_max` is a process-wide option, so the tests that
//! change it run one at a time here, and never beside the tests of other files. Each test
//! has a context (so a pool) of its own.

mod host_pool;

use host_pool::{alloc_free_pairs, setup, setup_on};
use std::sync::Mutex;

/// Held by every test: some change `fence_spare_max`.
static OPTIONS: Mutex<()> = Mutex::new(());

/// Above `large_segment / 2` (10 MiB by default): a segment of its own.
const LARGE: usize = 32 << 20;

/// The ski-rental threshold of the pool (`SPARE_AFTER_LONE_FENCES`).
const STREAK: usize = 256;

fn with_spare_max<T>(value: &str, f: impl FnOnce() -> T) -> T {
    let before = cupool::config::get_text("fence_spare_max").unwrap();
    cupool::config::set("fence_spare_max", value).unwrap();
    let result = f();
    cupool::config::set("fence_spare_max", &before).unwrap();
    result
}

#[test]
fn a_loop_reusing_one_large_block_gets_a_second_copy_and_half_the_fences() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup();
    // The first pair allocates the block; each later one fences it alone to reuse it.
    let first = alloc_free_pairs(rt, STREAK + 1, LARGE);
    assert!(first.iter().all(|&p| p == first[0]), "one block, reused");
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        s.device_allocs, 1,
        "no second copy before {STREAK} lone fences"
    );
    assert_eq!(s.fences_recorded, STREAK as u64, "one fence per reuse");

    // The next miss grows the copy instead of fencing.
    let fences = host.counters().fences_recorded;
    let next = alloc_free_pairs(rt, 1, LARGE)[0];
    assert_ne!(next, first[0], "the second copy");
    assert_eq!(host.counters().fences_recorded, fences, "no fence for it");

    // From now on one fence makes both copies reusable.
    let before = rt.context_stats(ctx).unwrap();
    let steady = alloc_free_pairs(rt, 100, LARGE);
    let after = rt.context_stats(ctx).unwrap();
    assert_eq!(after.device_allocs, 2, "two copies, no more");
    assert_eq!(after.fences_recorded - before.fences_recorded, 50);
    let mut seen = steady.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), 2, "the two copies take turns");
    assert_eq!(after.num_ooms + after.alloc_retries, 0);

    // The copy is idle cache like any other.
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
}

#[test]
fn blocks_above_fence_spare_max_keep_one_copy() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup();
    with_spare_max("16M", || alloc_free_pairs(rt, 2 * STREAK, LARGE));
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 1);
    assert_eq!(
        s.fences_recorded,
        2 * STREAK as u64 - 1,
        "every reuse fenced"
    );
    rt.empty_context_cache(ctx).unwrap();
}

#[test]
fn fence_spare_max_zero_turns_second_copies_off() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup();
    with_spare_max("0", || alloc_free_pairs(rt, 2 * STREAK, LARGE));
    assert_eq!(rt.context_stats(ctx).unwrap().device_allocs, 1);
    rt.empty_context_cache(ctx).unwrap();
}

#[test]
fn a_second_copy_past_the_memory_limit_is_skipped_without_an_error() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup_on(1);
    rt.set_memory_limit(1, LARGE as u64).unwrap();
    let all = alloc_free_pairs(rt, 2 * STREAK + 10, LARGE);
    assert!(all.iter().all(|&p| p == all[0]));
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.device_allocs, 1);
    assert_eq!(
        s.num_ooms + s.alloc_retries,
        0,
        "a copy nobody needs is never worth a release-and-retry"
    );
    rt.set_memory_limit(1, 0).unwrap();
    rt.empty_context_cache(ctx).unwrap();
}

#[test]
fn fences_that_free_several_blocks_do_not_count_towards_a_copy() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup();
    // Two blocks live and freed together: each fence already serves two reuses.
    for _ in 0..2 * STREAK {
        let a = rt.alloc(LARGE).unwrap();
        let b = rt.alloc(LARGE).unwrap();
        rt.free(a).unwrap();
        rt.free(b).unwrap();
    }
    assert_eq!(rt.context_stats(ctx).unwrap().device_allocs, 2);
    rt.empty_context_cache(ctx).unwrap();
}

#[test]
fn small_blocks_never_get_a_copy() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup();
    // One 1 MiB block in a 2 MiB small segment: the other half serves every other reuse.
    alloc_free_pairs(rt, 2 * STREAK, 1 << 20);
    assert_eq!(rt.context_stats(ctx).unwrap().device_allocs, 1);
    rt.empty_context_cache(ctx).unwrap();
}
