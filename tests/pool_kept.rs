//! Note [thread fences] in `src/pool/thread_cache.rs`, on the host backend: with
//! `thread_cache_streamless`, a thread keeps the small blocks it frees without a stream in
//! batches, records one context fence per batch, and reuses a batch's blocks itself, with
//! no pool lock, only once that fence has completed.
//!
//! A test binary of its own: the option is process-wide. Each test has a context (so a
//! pool) of its own.

mod host_pool;

use host_pool::{setup, setup_held};
use std::sync::Mutex;

static OPTIONS: Mutex<()> = Mutex::new(());

fn with_kept<T>(f: impl FnOnce() -> T) -> T {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    cupool::config::set("thread_cache_streamless", "true").unwrap();
    let result = f();
    cupool::config::set("thread_cache_streamless", "false").unwrap();
    result
}

#[test]
fn a_streamless_loop_reuses_its_own_blocks_with_one_fence_per_batch() {
    with_kept(|| {
        let (rt, host, ctx) = setup();
        let sizes = [512, 4096, 65536, 262144];
        let mut live = [0u64; 4];
        let fences = host.counters().fences_recorded;
        for i in 0..4000 {
            let k = i % 4;
            if live[k] != 0 {
                rt.free(live[k]).unwrap();
            }
            live[k] = rt.alloc(sizes[k]).unwrap();
        }
        let fences = host.counters().fences_recorded - fences;
        let s = rt.context_stats(ctx).unwrap();
        // A batch closes at a miss once it holds a quarter of `fence_batch` (16).
        assert!(fences <= 4000 / 16 + 4, "{fences} fences for 4000 frees");
        assert_eq!(
            s.device_allocs, 1,
            "one small segment: no growth while blocks are kept"
        );
        for p in live {
            rt.free(p).unwrap();
        }
        rt.flush_thread_cache();
        rt.empty_context_cache(ctx).unwrap();
        let s = rt.context_stats(ctx).unwrap();
        assert_eq!(
            s.reserved_bytes.current, 0,
            "kept blocks went back before empty_cache"
        );
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    });
}

#[test]
fn a_kept_block_is_not_reused_before_its_fence_completes() {
    with_kept(|| {
        let (rt, host, ctx) = setup_held();
        // 16 frees fill a quarter batch; the next miss closes it with a fence that the
        // simulated device has not reached.
        let first: Vec<u64> = (0..16).map(|_| rt.alloc(4096).unwrap()).collect();
        for &p in &first {
            rt.free(p).unwrap();
        }
        let during: Vec<u64> = (0..16).map(|_| rt.alloc(4096).unwrap()).collect();
        for p in &during {
            assert!(
                !first.contains(p),
                "{p:#x} reused before its fence completed"
            );
        }
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
        // Once the device is done, the kept blocks are this thread's again.
        host.complete_all(ctx.id);
        let after = rt.alloc(4096).unwrap();
        assert!(
            first.contains(&after),
            "a kept block comes back once its fence completed"
        );
        host.set_manual_completion(ctx.id, false);
        for p in during.into_iter().chain([after]) {
            rt.free(p).unwrap();
        }
        rt.flush_thread_cache();
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
    });
}

#[test]
fn off_by_default_frees_go_to_the_pool_s_fence_queue() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, ctx) = setup();
    let p = rt.alloc(4096).unwrap();
    rt.free(p).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert!(
        s.pending_fence_bytes >= 4096,
        "waits in the pool: {}",
        s.pending_fence_bytes
    );
    drop(_g);
    with_kept(|| {
        let (rt, _host, ctx) = setup();
        let p = rt.alloc(4096).unwrap();
        rt.free(p).unwrap();
        let s = rt.context_stats(ctx).unwrap();
        assert_eq!(
            s.pending_fence_bytes, 0,
            "kept by the thread, not in the pool's queue"
        );
        rt.flush_thread_cache();
        let s = rt.context_stats(ctx).unwrap();
        assert!(
            s.pending_fence_bytes >= 4096,
            "back in the pool's queue once flushed"
        );
    });
}
