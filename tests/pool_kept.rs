//! Note [thread fences] in `src/pool/thread_cache/kept.rs`, on the host backend: with
//! `thread_cache_streamless`, a thread keeps the small blocks it frees without a stream in
//! batches, and reuses a batch's blocks itself, with no pool lock, only once a context
//! fence recorded after the batch closed has completed. Those fences are shared by every
//! thread (Note [shared thread fences] in `src/pool/fence_clock.rs`).
//!
//! The option is on by default; a test binary of its own, since the option is process-wide. Each test has a context (so a
//! pool) of its own.

mod host_pool;

use cupool::pool::thread_cache::kept_held_sum;
use host_pool::{alloc_free_pairs, setup, setup_held};
use std::sync::Mutex;

static OPTIONS: Mutex<()> = Mutex::new(());

/// Runs `f` with `thread_cache_streamless` set to `value`, then sets the default back (also
/// when `f` fails).
fn with_option<T>(value: &str, f: impl FnOnce() -> T) -> T {
    struct Default;
    impl Drop for Default {
        fn drop(&mut self) {
            cupool::config::set("thread_cache_streamless", "true").unwrap();
        }
    }
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let _default = Default;
    cupool::config::set("thread_cache_streamless", value).unwrap();
    f()
}

fn with_kept<T>(f: impl FnOnce() -> T) -> T {
    with_option("true", f)
}

#[test]
fn a_streamless_loop_reuses_its_own_blocks_with_one_fence_per_batch() {
    // A batch closes once it holds a quarter of `fence_batch` (16 frees) or 512 KiB; in
    // this loop (four sizes, 83 KiB on average) any five frees in a row hold 512 KiB.
    const FREES_PER_BATCH: u64 = 5;
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
        assert!(
            fences <= 4000 / FREES_PER_BATCH + 4,
            "{fences} fences for 4000 frees"
        );
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
        // Fewer misses than the 16 in a row after which kept blocks go back to the pool
        // (Note [stale kept blocks]).
        let during: Vec<u64> = (0..8).map(|_| rt.alloc(4096).unwrap()).collect();
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
fn kept_blocks_wait_in_the_thread_and_the_option_off_sends_them_to_the_pool() {
    with_option("false", || {
        let (rt, _host, ctx) = setup();
        let p = rt.alloc(4096).unwrap();
        rt.free(p).unwrap();
        let pool = rt.context_pool(ctx).unwrap();
        assert!(
            pool.footprint().awaiting_fence >= 4096,
            "off: waits in the pool's fence queue"
        );
    });
    with_kept(|| {
        let (rt, _host, ctx) = setup();
        let p = rt.alloc(4096).unwrap();
        rt.free(p).unwrap();
        let pool = rt.context_pool(ctx).unwrap();
        assert_eq!(
            pool.footprint().awaiting_fence,
            0,
            "kept by the thread, not in the pool's queue"
        );
        assert_eq!(
            rt.context_stats(ctx).unwrap().pending_fence_bytes,
            4096,
            "and counted as waiting for a fence"
        );
        rt.flush_thread_cache();
        assert!(
            pool.footprint().awaiting_fence >= 4096,
            "back in the pool's queue once flushed"
        );
        assert!(rt.context_stats(ctx).unwrap().pending_fence_bytes >= 4096);
    });
}

/// Note [shared thread fences]: batches that threads close while earlier fences are still
/// running wait for a later shared fence instead of recording their own, so the number of
/// fences outstanding stays bounded whatever the number of threads; once the device
/// completes them, every thread reuses its own blocks.
#[test]
fn threads_share_their_batches_fences() {
    with_kept(|| {
        let (rt, host, ctx) = setup_held();
        let threads = 4;
        // Three full batches per thread, twelve in all.
        cupool::config::set("fence_batch", "16").unwrap();
        let per_thread = 48;
        let fences = host.counters().fences_recorded;
        let freed = std::sync::Barrier::new(threads + 1);
        let completed = std::sync::Barrier::new(threads + 1);
        let one_at_a_time = Mutex::new(());
        let reused_own = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let (freed, completed, one_at_a_time) = (&freed, &completed, &one_at_a_time);
                    s.spawn(move || {
                        host.make_current(ctx);
                        let mine: Vec<u64> =
                            (0..per_thread).map(|_| rt.alloc(4096).unwrap()).collect();
                        for &p in &mine {
                            rt.free(p).unwrap();
                        }
                        freed.wait();
                        completed.wait();
                        // One thread at a time: a thread that finds another bringing the
                        // fences forward does not wait for it (it takes the pool's path),
                        // which would make the count below depend on timing.
                        let turn = one_at_a_time.lock().unwrap();
                        let again: Vec<u64> =
                            (0..per_thread).map(|_| rt.alloc(4096).unwrap()).collect();
                        drop(turn);
                        let own = again.iter().filter(|p| mine.contains(p)).count();
                        for p in again {
                            rt.free(p).unwrap();
                        }
                        rt.flush_thread_cache();
                        own
                    })
                })
                .collect();
            freed.wait();
            let recorded = host.counters().fences_recorded - fences;
            cupool::config::set("fence_batch", "64").unwrap();
            let pending = rt.context_stats(ctx).unwrap().pending_fence_bytes;
            host.complete_all(ctx.id);
            host.set_manual_completion(ctx.id, false);
            // Checked once the workers are released (a failed check must not leave them
            // waiting at the barrier).
            completed.wait();
            let batches = threads * per_thread / 16;
            assert!(
                recorded as usize <= cupool::pool::fence_clock::MAX_IN_FLIGHT
                    && (recorded as usize) < batches,
                "{recorded} fences for {batches} closed batches"
            );
            assert_eq!(
                pending,
                (threads * per_thread * 4096) as u64,
                "every free is kept by its thread, waiting for a fence"
            );
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .collect::<Vec<_>>()
        });
        // The batch a thread still had open closes at its first miss, and the fence
        // recorded for it then may not be seen complete at once: that one allocation
        // takes the pool's path, the next ones the batch's blocks.
        assert!(
            reused_own.iter().all(|&own| own + 1 >= per_thread),
            "each thread reuses the blocks it kept once the shared fences completed: {reused_own:?}"
        );
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
    });
}

/// Note [stale kept blocks]: once a loop stops allocating the sizes a thread kept, the
/// kept blocks go back and merge, so the next loop's blocks fit where they did without
/// them: a 1 MiB loop after a 512 B loop needs one fence per two pairs (two 1 MiB blocks
/// take turns in the 2 MiB segment), not one per pair.
#[test]
fn kept_blocks_a_loop_stopped_using_go_back_to_the_pool() {
    with_kept(|| {
        let (rt, host, ctx) = setup();
        alloc_free_pairs(rt, 1000, 512);
        let pool = rt.context_pool(ctx).unwrap();
        assert!(pool.footprint().other > 0, "the 512 B blocks are kept");
        let fences = host.counters().fences_recorded;
        let pairs = 1000;
        alloc_free_pairs(rt, pairs, 1 << 20);
        let per_pair = (host.counters().fences_recorded - fences) as f64 / pairs as f64;
        assert!(per_pair <= 0.55, "{per_pair} fences per 1 MiB pair");
        assert_eq!(pool.footprint().other, 0, "the kept blocks went back");
        assert_eq!(
            rt.context_stats(ctx).unwrap().reserved_bytes.current,
            2 << 20
        );
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
    });
}

/// Bytes this thread keeps for `ctx`'s pool: blocks waiting for a fence, less those in the
/// pool's own fence queue.
fn kept_bytes(rt: &cupool::runtime::Runtime, ctx: cupool::backend::ContextInfo) -> u64 {
    let pending = rt.context_stats(ctx).unwrap().pending_fence_bytes;
    pending - rt.context_pool(ctx).unwrap().footprint().awaiting_fence
}

/// Frees `n` streamless 64 KiB blocks in a row (fences held: none is covered).
fn free_streamless_64k(rt: &cupool::runtime::Runtime, n: usize) {
    let blocks: Vec<u64> = (0..n).map(|_| rt.alloc(64 << 10).unwrap()).collect();
    for p in blocks {
        rt.free(p).unwrap();
    }
}

/// With fences held until now: lets the device finish, gives the kept blocks back and
/// empties the cache; nothing stays reserved.
fn give_everything_back(
    rt: &cupool::runtime::Runtime,
    host: &cupool::backend::host::HostBackend,
    ctx: cupool::backend::ContextInfo,
) {
    host.complete_all(ctx.id);
    host.set_manual_completion(ctx.id, false);
    rt.flush_thread_cache();
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
}

/// Note [kept bytes under contention]: alone, a thread keeps at most 2 MiB of streamless
/// frees waiting for their fence; the rest goes to the pool's queue.
#[test]
fn a_thread_alone_keeps_at_most_two_mib() {
    with_kept(|| {
        let (rt, host, ctx) = setup_held();
        free_streamless_64k(rt, 96);
        let kept = kept_bytes(rt, ctx);
        assert!(kept > 1 << 20 && kept <= 2 << 20, "kept {kept} bytes");
        assert!(!rt.context_pool(ctx).unwrap().thread_fences_crowded());
        give_everything_back(rt, host, ctx);
    });
}

/// A pool (fences held) on which `MANY_CLOSERS - 1` other threads, one after the other,
/// have each closed a batch, with role and closer times that outlast them; then the
/// calling thread frees `own` 64 KiB blocks without a stream, closing the batch that makes
/// the closers many.
fn crowded_by_many_closers(
    own: usize,
) -> (
    &'static cupool::runtime::Runtime,
    &'static cupool::backend::host::HostBackend,
    cupool::backend::ContextInfo,
    &'static cupool::pool::DevicePool,
) {
    let (rt, host, ctx) = setup_held();
    let pool = rt.context_pool(ctx).unwrap();
    // Times that outlast the other threads: what they did still counts.
    const LONG_NS: u64 = 60_000_000_000;
    pool.set_thread_fence_role_times(LONG_NS, LONG_NS, LONG_NS);
    for _ in 0..cupool::pool::fence_clock::MANY_CLOSERS - 1 {
        std::thread::spawn(move || {
            host.make_current(ctx);
            // Enough to close a batch: one more thread closing batches.
            free_streamless_64k(rt, 16);
        })
        .join()
        .unwrap();
        assert!(!pool.thread_fences_crowded(), "not many threads yet");
    }
    free_streamless_64k(rt, own);
    assert!(pool.thread_fences_crowded(), "many threads closed batches");
    (rt, host, ctx, pool)
}

/// Note [kept bytes under contention]: once many threads close batches on the shared
/// fences, one of them records for all (Note [fence recorder role]), and each keeps up to
/// 4 MiB, so that it does not run dry while its batches wait for the holder's fence.
#[test]
fn a_thread_keeps_more_while_many_share_the_fences() {
    with_kept(|| {
        let (rt, host, ctx, pool) = crowded_by_many_closers(96);
        let kept = kept_bytes(rt, ctx);
        assert!(kept > 3 << 20 && kept <= 4 << 20, "kept {kept} bytes");
        give_everything_back(rt, host, ctx);
        pool.check_invariants().unwrap();
    });
}

/// Note [kept bytes under contention]: among many threads a thread may keep 4 MiB, but its
/// batches keep the size they have when it is alone (closed early at 512 KiB, at 1 MiB at
/// most), so that more of them are in flight: a loop of 64 KiB pairs closes a batch, and
/// records a fence for it, every eight frees.
#[test]
fn among_many_threads_batches_keep_their_size() {
    with_kept(|| {
        let (rt, host, ctx, pool) = crowded_by_many_closers(16);
        // The device catches up and keeps up from now on.
        host.complete_all(ctx.id);
        host.set_manual_completion(ctx.id, false);
        let pairs = 640;
        let before = host.counters().fences_recorded;
        alloc_free_pairs(rt, pairs, 64 << 10);
        let fences = host.counters().fences_recorded - before;
        assert!(pool.thread_fences_crowded());
        let per_fence = pairs as f64 / fences as f64;
        assert!(
            (7.0..=9.0).contains(&per_fence),
            "{per_fence} pairs per fence ({fences} fences)"
        );
        give_everything_back(rt, host, ctx);
        pool.check_invariants().unwrap();
    });
}

/// Note [room beside stranded blocks] in `src/pool/alloc.rs`: a thread that stopped
/// allocating keeps what it kept, and no other thread can take it. The next thread's
/// streamless loop, in a pool full otherwise, used to give its one kept block back before
/// growing and get it back through a context fence: a fence a pair. It gets a segment
/// instead, and its batches share fences again.
#[test]
fn a_thread_that_stopped_leaves_the_next_room_to_keep() {
    with_kept(|| {
        let (rt, host, ctx) = setup();
        // This thread fills all but two 64 KiB places of the 2 MiB small segment, frees it
        // all without a stream and keeps it (1.875 MiB, under what a thread may keep). With
        // two places left, the next thread's pairs take one place, then fence its own two
        // blocks back: half a fence a pair, as on an H200 after such a loop.
        let mine: Vec<u64> = (0..30).map(|_| rt.alloc(64 << 10).unwrap()).collect();
        for p in mine {
            rt.free(p).unwrap();
        }
        assert_eq!(
            rt.context_pool(ctx).unwrap().footprint().other,
            30 << 16,
            "this thread keeps them"
        );
        let pool = rt.context_pool(ctx).unwrap().index;
        assert_eq!(kept_held_sum(pool), 30 << 16, "what threads hold, counted");
        let pairs = 4000;
        let fences = host.counters().fences_recorded;
        std::thread::scope(|s| {
            s.spawn(|| {
                host.make_current(ctx);
                alloc_free_pairs(rt, pairs, 64 << 10);
                rt.flush_thread_cache();
            })
            .join()
            .unwrap()
        });
        let per_pair = (host.counters().fences_recorded - fences) as f64 / pairs as f64;
        assert!(per_pair <= 0.25, "{per_pair} fences per pair");
        assert_eq!(
            rt.context_stats(ctx).unwrap().reserved_bytes.current,
            4 << 20,
            "one more small segment"
        );
        rt.flush_thread_cache();
        assert_eq!(
            kept_held_sum(pool),
            0,
            "both threads gave back what they kept"
        );
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
    });
}
