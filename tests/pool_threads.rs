//! Short-lived threads (issue 14, lifecycle): 10 000 threads, in waves of 8 at once, each
//! allocating and freeing blocks (its thread cache fills) and exiting with them cached. What
//! their caches held goes back to the pool when they exit: nothing stays allocated, the
//! pool does not grow with the number of threads, and its invariants hold; with
//! `thread_cache_streamless` (the default: streamless frees kept per thread, Note [thread
//! fences]) and without it.

mod host_pool;

use host_pool::{setup, S1};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

const THREADS: usize = 10_000;
const WAVE: usize = 8;

#[test]
fn ten_thousand_threads_exit_with_full_caches_and_give_everything_back() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    threads_come_and_go();
}

#[test]
fn the_same_with_streamless_frees_going_to_the_pool() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    cupool::config::set("thread_cache_streamless", "false").unwrap();
    threads_come_and_go();
    cupool::config::set("thread_cache_streamless", "true").unwrap();
}

fn threads_come_and_go() {
    let (rt, host, ctx) = setup();
    let mut peak = 0;
    for wave in 0..THREADS / WAVE {
        // Joined through their handles: `pthread_join` returns once a thread has run its
        // thread-local destructors (where its cache goes back), whereas a scope's implicit
        // join returns when the closure has finished, before them.
        let handles: Vec<_> = (0..WAVE)
            .map(|t| {
                std::thread::spawn(move || {
                    host.make_current(ctx);
                    let seed = (wave * WAVE + t) as u64;
                    let mut live = Vec::new();
                    for i in 0..12u64 {
                        let n = 256 + (seed * 7919 + i * 104_729) % (256 << 10);
                        let p = if i % 2 == 0 {
                            rt.alloc(n as usize).unwrap()
                        } else {
                            rt.alloc_async(n as usize, S1).unwrap()
                        };
                        live.push((p, i % 2 == 0));
                    }
                    // Freed into this thread's cache; the thread then exits with them there.
                    for (p, streamless) in live {
                        if streamless {
                            rt.free(p).unwrap();
                        } else {
                            rt.free_async(p, S1).unwrap();
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        peak = peak.max(rt.context_stats(ctx).unwrap().reserved_bytes.current);
    }
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(s.num_allocs, THREADS as u64 * 12);
    assert_eq!(s.num_frees, THREADS as u64 * 12);
    // Every wave reuses what the waves before it gave back. One wave holds at most
    // 8 threads × 12 blocks of under 256 KiB (24 MiB) at once, so the pool never needs
    // more than that and some fragmentation, however many threads came and went (on the
    // host backend it settles at 8–16 MiB); a cache lost at each exit would pass it within
    // a few hundred threads.
    assert!(
        peak <= 32 << 20,
        "reserved reached {peak} over {THREADS} threads"
    );
    let pool = rt.context_pool(ctx).unwrap();
    let before = pool.check_invariants().unwrap();
    assert_eq!(
        before.thread_cache, 0,
        "every exited thread's cache came back"
    );
    host.complete_all(ctx.id);
    rt.empty_context_cache(ctx).unwrap();
    let report = pool.check_invariants().unwrap();
    assert_eq!(
        rt.context_stats(ctx).unwrap().reserved_bytes.current,
        0,
        "nothing held back by exited threads ({report:?})"
    );
}
