//! Note [reserve at start] in `src/pool/reserve.rs`, on the host backend: the `reserve` option and
//! `Runtime::reserve` (`cupool_reserve`) take memory at once, the first allocations come
//! from it without a driver call, releases keep it, and 0 ends it.
//!
//! A test binary of its own: the option and the host backend's capacity are process-wide,
//! so the tests run one at a time (`SERIAL`); each uses contexts (so pools) of its own.

mod host_pool;

use cupool::backend::ContextInfo;
use cupool::runtime::Runtime;
use cupool::CupoolStatus;
use host_pool::setup_on;
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());
const MIB: u64 = 1 << 20;

fn with_option<T>(key: &str, value: &str, f: impl FnOnce() -> T) -> T {
    let before = cupool::config::get_text(key).unwrap();
    cupool::config::set(key, value).unwrap();
    let result = f();
    cupool::config::set(key, &before).unwrap();
    result
}

fn reserved(rt: &Runtime, ctx: ContextInfo) -> u64 {
    rt.context_stats(ctx).unwrap().reserved_bytes.current
}

#[test]
fn the_option_claims_memory_at_start_and_releases_keep_it() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    with_option("reserve", "64M", || {
        let (rt, _, ctx) = setup_on(0);
        // The pool starts with its first allocation: the reserve comes first.
        let a = rt.alloc_async((20 * MIB) as usize, host_pool::S1).unwrap();
        let after_first = rt.context_stats(ctx).unwrap();
        assert_eq!(after_first.reserved_bytes.current, 64 * MIB);
        assert_eq!(after_first.device_allocs, 1, "one segment: the reserve");
        let b = rt.alloc_async((30 * MIB) as usize, host_pool::S1).unwrap();
        let c = rt.alloc((10 * MIB) as usize).unwrap();
        assert_eq!(
            rt.context_stats(ctx).unwrap().device_allocs,
            1,
            "later blocks come from the reserve too"
        );
        for p in [a, b] {
            rt.free_async(p, host_pool::S1).unwrap();
        }
        rt.free(c).unwrap();
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(reserved(rt, ctx), 64 * MIB, "empty_cache keeps the reserve");
        // 0 ends it: the next release gives it back.
        assert_eq!(rt.reserve(None, 0), Ok(0));
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(reserved(rt, ctx), 0);
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    });
}

#[test]
fn a_reserve_for_one_device_leaves_the_others_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    with_option("reserve", "1=32M", || {
        let (rt, _, ctx0) = setup_on(0);
        let p = rt.alloc((4 * MIB) as usize).unwrap();
        assert_eq!(rt.context_stats(ctx0).unwrap().device_allocs, 1);
        assert!(reserved(rt, ctx0) < 32 * MIB, "device 0 has no reserve");
        rt.free(p).unwrap();
        let (rt, _, ctx1) = setup_on(1);
        let q = rt.alloc((4 * MIB) as usize).unwrap();
        assert_eq!(reserved(rt, ctx1), 32 * MIB, "device 1 has its reserve");
        rt.free(q).unwrap();
        for ctx in [ctx0, ctx1] {
            rt.context_pool(ctx)
                .unwrap()
                .reserve(
                    cupool::pool::thread_cache::thread_counters(
                        rt.context_pool(ctx).unwrap().index,
                    ),
                    0,
                )
                .unwrap();
            rt.empty_context_cache(ctx).unwrap();
            assert_eq!(reserved(rt, ctx), 0);
        }
    });
}

#[test]
fn a_fraction_is_of_the_free_memory_when_the_pool_starts() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (_, host, _) = setup_on(0);
    host.set_capacity(1024 * MIB);
    let got = with_option("reserve", "0.25", || {
        let (rt, _, ctx) = setup_on(0);
        let p = rt.alloc((2 * MIB) as usize).unwrap();
        let got = reserved(rt, ctx);
        rt.free(p).unwrap();
        rt.reserve(None, 0).unwrap();
        rt.empty_context_cache(ctx).unwrap();
        got
    });
    host.set_capacity(cupool::backend::host::DEFAULT_CAPACITY);
    // A quarter of the free memory (the whole simulated device, less what other pools of
    // this process hold), rounded up to the 2 MiB segment granule.
    assert!((200 * MIB..=256 * MIB).contains(&got), "{got}");
}

#[test]
fn cupool_reserve_grows_now_and_refuses_past_the_limit() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _, ctx) = setup_on(0);
    let p = rt.alloc((6 * MIB) as usize).unwrap();
    let before = reserved(rt, ctx);
    assert_eq!(rt.reserve(None, 48 * MIB), Ok(48 * MIB - before));
    assert_eq!(reserved(rt, ctx), 48 * MIB);
    assert_eq!(
        rt.reserve(None, 40 * MIB),
        Ok(0),
        "already held: nothing taken"
    );
    let pool = rt.context_pool(ctx).unwrap();
    assert_eq!(pool.reserve_floor(), 40 * MIB);
    rt.set_memory_limit(0, 64 * MIB).unwrap();
    assert_eq!(
        rt.reserve(None, 80 * MIB),
        Err(CupoolStatus::CupoolErrorOutOfMemory)
    );
    assert_eq!(
        pool.reserve_floor(),
        40 * MIB,
        "a refused reserve changes nothing"
    );
    rt.set_memory_limit(0, 0).unwrap();
    assert_eq!(
        rt.reserve(Some(7), MIB),
        Err(CupoolStatus::CupoolErrorInvalidDevice)
    );
    rt.free(p).unwrap();
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(
        reserved(rt, ctx),
        48 * MIB,
        "the whole reserve segment stays (40 MiB floor)"
    );
    rt.reserve(None, 0).unwrap();
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(reserved(rt, ctx), 0);
}

#[test]
fn with_vmm_the_reserve_is_idle_physical_memory_that_blocks_map() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    with_option("vmm", "on", || {
        let (rt, host, ctx) = setup_on(0);
        // `setup_on` picks segments; the pool is created at the reserve below.
        cupool::config::set("vmm", "on").unwrap();
        assert_eq!(rt.reserve(None, 32 * MIB), Ok(32 * MIB));
        let pool = rt.context_pool(ctx).unwrap();
        assert_eq!(pool.vmm_stats().idle_bytes, 32 * MIB);
        let p = rt.alloc((20 * MIB) as usize).unwrap();
        // The block maps reserved memory (a chunk may be re-cut to fit: released and
        // created again at the same total), so the pool holds no more than before.
        assert_eq!(reserved(rt, ctx), 32 * MIB, "no new memory");
        assert!(pool.vmm_stats().mapped_bytes >= 20 * MIB);
        rt.free(p).unwrap();
        host.complete_all(ctx.id);
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(reserved(rt, ctx), 32 * MIB, "empty_cache keeps the reserve");
        rt.reserve(None, 0).unwrap();
        rt.empty_context_cache(ctx).unwrap();
        assert_eq!(reserved(rt, ctx), 0);
        let c = host.counters();
        assert_eq!(
            (c.vmm_handles, c.vmm_mappings),
            (0, 0),
            "everything released"
        );
        pool.check_invariants().unwrap();
    });
}
