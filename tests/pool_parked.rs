//! Parked arena blocks (Note [parked arena blocks] in `src/pool/parked.rs`) on the host
//! backend: a large block freed on its stream is handed to that stream's next request of
//! its size without the pool's lists, by any thread, and wherever the pool must see all of
//! its free memory the block is back in its lists, as its free would have put it.
//!
//! The host backend's VMM counters are process-wide, so the tests of this binary run one
//! at a time (`SERIAL`) and each leaves nothing behind.

mod host_pool;

use cupool::pool::InvariantReport;
use cupool::runtime::Runtime;
use host_pool::{empty_and_check_nothing_left, setup_vmm, S1, S2};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());
const MIB: usize = 1 << 20;

fn places(rt: &Runtime, ctx: cupool::backend::ContextInfo) -> InvariantReport {
    rt.context_pool(ctx).unwrap().check_invariants().unwrap()
}

/// A fresh pool on the VMM arena that has free lists for S1 and S2 (a block of a stream it
/// has none for is filed, not parked), holding no memory.
fn setup_with_streams() -> (
    &'static Runtime,
    &'static cupool::backend::host::HostBackend,
    cupool::backend::ContextInfo,
) {
    let (rt, host, ctx) = setup_vmm(true);
    for s in [S1, S2] {
        let p = rt.alloc_async(2 * MIB, s).unwrap();
        rt.free_async(p, s).unwrap();
        assert_eq!(
            places(rt, ctx).parked,
            0,
            "the first block of a stream is filed"
        );
    }
    host.complete_all(ctx.id);
    rt.empty_cache(Some(0)).unwrap();
    assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
    (rt, host, ctx)
}

type Host = cupool::backend::host::HostBackend;
type Ctx = cupool::backend::ContextInfo;

/// Frees `p`, `bytes` long, on S1 and checks that it was parked, not filed.
fn park_on_s1(rt: &Runtime, ctx: Ctx, p: u64, bytes: usize) {
    rt.free_async(p, S1).unwrap();
    assert_eq!(places(rt, ctx).parked, bytes as u64, "parked, not filed");
}

/// Runs one test case on a pool from [`setup_with_streams`], with the device behind
/// (fences complete only when the test completes them) when `held`, and checks at the end
/// that everything goes back.
fn case(held: bool, body: impl FnOnce(&'static Runtime, &'static Host, Ctx)) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_with_streams();
    host.set_manual_completion(ctx.id, held);
    body(rt, host, ctx);
    host.set_manual_completion(ctx.id, false);
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn a_block_freed_on_its_stream_serves_its_next_request_of_that_size() {
    case(true, |rt, host, ctx| {
        let a = rt.alloc_async(64 * MIB, S1).unwrap();
        rt.free_async(a, S1).unwrap();
        let r = places(rt, ctx);
        assert_eq!(r.parked, 64 * MIB as u64, "parked, in no list");
        assert_eq!(r.on_stream, 0);
        let maps = host.counters().vmm_maps;
        let b = rt.alloc_async(64 * MIB, S1).unwrap();
        assert_eq!(b, a, "the parked block itself");
        assert_eq!(host.counters().vmm_maps, maps, "no mapping");
        assert_eq!(places(rt, ctx).parked, 0);
        // Another thread takes it too: the slots are the pool's, not a thread's.
        rt.free_async(b, S1).unwrap();
        let c = std::thread::scope(|s| {
            s.spawn(|| {
                host.make_current(ctx);
                let c = rt.alloc_async(64 * MIB, S1).unwrap();
                rt.flush_thread_cache();
                c
            })
            .join()
            .unwrap()
        });
        assert_eq!(c, a, "served on another thread");
        rt.free_async(c, S1).unwrap();
    });
}

#[test]
fn a_parked_block_goes_to_no_other_stream_and_is_filed_by_the_slow_path() {
    case(true, |rt, _host, ctx| {
        // The device is behind (held): the block freed on S1 may still be in use by S1's work.
        let a = rt.alloc_async(16 * MIB, S1).unwrap();
        park_on_s1(rt, ctx, a, 16 * MIB);
        let b = rt.alloc_async(16 * MIB, S2).unwrap();
        assert_ne!(b, a, "another stream never gets it before a fence");
        let r = places(rt, ctx);
        assert_eq!(r.parked, 0, "filed by the slow path");
        assert_eq!(
            r.on_stream,
            16 * MIB as u64,
            "on its stream's list, as its free put it"
        );
        // A request of another size on S1 is cut from it, as from any block freed on S1.
        let c = rt.alloc_async(8 * MIB, S1).unwrap();
        assert_eq!(c, a);
        for (p, s) in [(b, S2), (c, S1)] {
            rt.free_async(p, s).unwrap();
        }
    });
}

#[test]
fn blocks_of_one_stream_reach_its_list_in_the_order_they_were_freed() {
    case(true, |rt, _host, ctx| {
        let a = rt.alloc_async(6 * MIB, S1).unwrap();
        let spacer = rt.alloc(4 * MIB).unwrap();
        let b = rt.alloc_async(10 * MIB, S1).unwrap();
        rt.free_async(a, S1).unwrap();
        rt.free_async(b, S1).unwrap();
        let r = places(rt, ctx);
        assert_eq!(r.parked, 10 * MIB as u64, "the newer one is parked");
        assert_eq!(r.on_stream, 6 * MIB as u64, "the older one filed at once");
        let b2 = rt.alloc_async(10 * MIB, S1).unwrap();
        assert_eq!(b2, b);
        let a2 = rt.alloc_async(6 * MIB, S1).unwrap();
        assert_eq!(a2, a);
        for p in [a2, b2] {
            rt.free_async(p, S1).unwrap();
        }
        rt.free(spacer).unwrap();
    });
}

#[test]
fn a_parked_block_with_a_free_neighbour_on_its_stream_goes_the_slow_way() {
    case(false, |rt, host, ctx| {
        // A free shared block of exactly 8 MiB, mapped, away from the others.
        let c = rt.alloc(8 * MIB).unwrap();
        let spacer = rt.alloc(4 * MIB).unwrap();
        let a = rt.alloc_async(8 * MIB, S1).unwrap();
        let b = rt.alloc_async(8 * MIB, S1).unwrap();
        let spacer2 = rt.alloc(4 * MIB).unwrap();
        assert_eq!(b, a + 8 * MIB as u64, "neighbours");
        rt.free(c).unwrap();
        // A small request's miss polls the fences: `c` moves to the shared index.
        let small = rt.alloc(4096).unwrap();
        assert_eq!(places(rt, ctx).awaiting_fence, 0, "c is shared");
        host.set_manual_completion(ctx.id, true);
        rt.free_async(b, S1).unwrap();
        park_on_s1(rt, ctx, a, 8 * MIB);
        // Filed, `a` would merge with `b` into 16 MiB, and the fit takes the smaller shared
        // block that needs no mapping: what the pool did before blocks were parked.
        let maps = host.counters().vmm_maps;
        let p = rt.alloc_async(8 * MIB, S1).unwrap();
        assert_eq!(p, c, "the shared exact fit, not the parked block");
        assert_eq!(host.counters().vmm_maps, maps);
        let r = places(rt, ctx);
        assert_eq!(
            (r.parked, r.on_stream),
            (0, 16 * MIB as u64),
            "merged on S1"
        );
        rt.free_async(p, S1).unwrap();
        for q in [spacer, spacer2, small] {
            rt.free(q).unwrap();
        }
    });
}

#[test]
fn statistics_fences_and_empty_cache_see_parked_blocks() {
    case(false, |rt, _host, ctx| {
        let a = rt.alloc_async(32 * MIB, S1).unwrap();
        park_on_s1(rt, ctx, a, 32 * MIB);
        // The statistics count it among the free blocks of its stream.
        let s = rt.context_stats(ctx).unwrap();
        assert_eq!(s.cached_bytes.current, 32 * MIB as u64);
        assert_eq!(places(rt, ctx).parked, 0, "filed for the statistics");
        // Parked again, then a fence pass (empty_cache waits for the device) drains it, and
        // the release gives everything back.
        let b = rt.alloc_async(32 * MIB, S1).unwrap();
        assert_eq!(b, a);
        park_on_s1(rt, ctx, b, 32 * MIB);
    });
}

#[test]
fn a_fence_recorded_before_a_block_was_parked_does_not_free_it_for_other_streams() {
    case(true, |rt, host, ctx| {
        let a = rt.alloc_async(16 * MIB, S1).unwrap();
        let x = rt.alloc(4 * MIB).unwrap();
        rt.free(x).unwrap();
        // A miss records a fence that covers `x`'s free, and the clock moves past it.
        let y = rt.alloc(8 * MIB).unwrap();
        let fences = rt.context_stats(ctx).unwrap().fences_recorded;
        assert!(fences > 0, "a fence was recorded");
        park_on_s1(rt, ctx, a, 16 * MIB);
        // That fence completes; S1's work after it (up to the free of `a`) may still run.
        host.complete_all(ctx.id);
        let b = rt.alloc_async(16 * MIB, S2).unwrap();
        assert_ne!(
            b, a,
            "`a` is stamped after the completed fence: not S2's yet"
        );
        assert_eq!(places(rt, ctx).on_stream, 16 * MIB as u64, "still S1's");
        rt.free_async(b, S2).unwrap();
        rt.free(y).unwrap();
    });
}
