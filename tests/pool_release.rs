//! Note [release bound] in `src/pool/release.rs`, on the host backend: with
//! `release_above_percent`, a pool about to grow past that share of its capacity first
//! gives idle segments back, largest first, only as many as it must.
//!
//! A test binary of its own: the option and the host backend's capacity are process-wide,
//! so the tests run one at a time here. Each run of [`grow_through`] has a context (so a
//! pool) of its own.

mod host_pool;

use host_pool::setup_on;
use std::sync::Mutex;

static OPTIONS: Mutex<()> = Mutex::new(());

const MIB: u64 = 1 << 20;

fn with_percent<T>(value: &str, f: impl FnOnce() -> T) -> T {
    let before = cupool::config::get_text("release_above_percent").unwrap();
    cupool::config::set("release_above_percent", value).unwrap();
    let result = f();
    cupool::config::set("release_above_percent", &before).unwrap();
    result
}

/// Allocates and frees (without a stream) blocks of each size in turn, each above
/// `large_segment / 2`, so each gets a segment of its own that the next cannot reuse;
/// then allocates `last` and keeps it. Returns (reserved now, segments released).
fn grow_through(device: i32, sizes: &[u64], last: u64) -> (u64, u64) {
    let (rt, _host, ctx) = setup_on(device);
    for &n in sizes {
        let p = rt.alloc(n as usize).unwrap();
        rt.free(p).unwrap();
    }
    let kept = rt.alloc(last as usize).unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        s.num_ooms + s.alloc_retries,
        0,
        "no out-of-memory path taken"
    );
    rt.free(kept).unwrap();
    rt.empty_context_cache(ctx).unwrap();
    (s.reserved_bytes.current, s.device_frees)
}

#[test]
fn under_a_limit_idle_segments_go_back_before_the_pool_passes_the_bound() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let sizes = [12 * MIB, 14 * MIB];
    // Off: the idle 12 and 14 MiB segments stay; 42 MiB reserved.
    let (rt, _, _) = setup_on(0);
    rt.set_memory_limit(0, 64 * MIB).unwrap();
    rt.set_memory_limit(1, 64 * MIB).unwrap();
    let (reserved, released) = with_percent("0", || grow_through(0, &sizes, 16 * MIB));
    assert_eq!((reserved, released), (42 * MIB, 0));
    // At 50% of 64 MiB: growing by 16 MiB from 26 would pass 32; giving back the largest
    // idle segment (14 MiB) is enough.
    let (reserved, released) = with_percent("50", || grow_through(1, &sizes, 16 * MIB));
    assert_eq!((reserved, released), (28 * MIB, 1));
    rt.set_memory_limit(0, 0).unwrap();
    rt.set_memory_limit(1, 0).unwrap();
}

#[test]
fn without_a_limit_the_bound_is_a_share_of_the_device() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (_, host, _) = setup_on(0);
    host.set_capacity(100 * MIB);
    // 40% of 100 MiB: 34 MiB idle + 20 MiB would pass 40; releasing the 18 MiB segment
    // leaves 16 + 20.
    let (reserved, released) =
        with_percent("40", || grow_through(0, &[16 * MIB, 18 * MIB], 20 * MIB));
    host.set_capacity(cupool::backend::host::DEFAULT_CAPACITY);
    assert_eq!((reserved, released), (36 * MIB, 1));
}

#[test]
fn a_bound_the_live_bytes_already_pass_releases_everything_idle_and_still_grows() {
    let _g = OPTIONS.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _, _) = setup_on(1);
    rt.set_memory_limit(1, 64 * MIB).unwrap();
    // 1% of 64 MiB: every idle segment goes, the allocation itself still succeeds.
    let (reserved, released) =
        with_percent("1", || grow_through(1, &[12 * MIB, 14 * MIB], 16 * MIB));
    assert_eq!((reserved, released), (16 * MIB, 2));
    rt.set_memory_limit(1, 0).unwrap();
}
