//! `fence_waits:device` (Note [device waits]) on the host backend, with the simulated device
//! holding every fence in flight: a block freed without a stream is reused at once behind a
//! legacy-stream wait instead of growing the pool; its granules stay pinned (not moved, not
//! released) until the host sees its fence complete; a listed non-blocking stream waits at
//! its creation (only while drained blocks may be in use) and at every device wait, until
//! it is destroyed; a second context ends the mode, after which a miss grows again. One
//! process, one test: the mode is process-wide.

mod host_pool;

use cupool::pool::device_waits;
use cupool::pool::fence_times::FenceCall;

const MIB: usize = 1 << 20;

#[test]
fn a_fenced_block_is_reused_behind_a_device_wait_until_the_mode_ends() {
    cupool::config::set("fence_waits", "device").unwrap();
    let (rt, host, ctx) = host_pool::setup();
    cupool::config::set("vmm", "on").unwrap();
    host.set_manual_completion(ctx.id, true);
    assert!(device_waits::active());
    let pool = rt.context_pool(ctx).unwrap();
    let stats = || rt.context_stats(ctx).unwrap();

    // 64 MiB: a large block of the VMM arena; thread caches do not keep it.
    let n = 64 * MIB;
    let a = rt.alloc(n).unwrap();
    rt.free(a).unwrap();
    let reserved = stats().reserved_bytes.current;
    let waits = host.counters().device_waits;
    // The fence of that free is still in flight: with host waits the pool would take new
    // memory; here the legacy stream waits and the block comes back.
    for _ in 0..20 {
        let again = rt.alloc(n).unwrap();
        assert_eq!(again, a, "the freed block, reused at once");
        rt.free(again).unwrap();
    }
    let s = stats();
    assert_eq!(s.reserved_bytes.current, reserved, "no growth");
    assert!(host.in_flight(ctx.id) > 0, "fences still in flight");
    let made = host.counters().device_waits - waits;
    assert!(made >= 20, "{made} legacy-stream waits for 20 reuses");
    assert_eq!(s.fence_device_waits, host.counters().device_waits);
    assert_eq!(s.grow_waits, 0, "the program never waited");
    // Note [fence call times]: one call in eight of each kind was timed by this thread
    // (other tests' threads share the pool, so at least that many).
    let times = pool.fence_time_stats();
    let (record, query, wait) = (
        FenceCall::Record as usize,
        FenceCall::Query as usize,
        FenceCall::DeviceWait as usize,
    );
    assert!(times.sampled[wait] >= made / 8, "{times:?}, {made} waits");
    assert!(
        times.sampled[record] >= s.fences_recorded / 8 / 2,
        "{times:?}"
    );
    for k in [record, query, wait] {
        assert_eq!(
            times.estimated_ns[k] > 0,
            times.sampled[k] > 0,
            "a timed call adds time: {times:?}"
        );
    }

    // Drained but not seen idle: its granules are pinned, so not stealable and not
    // released by a release of idle memory.
    let b = rt.alloc(n).unwrap();
    assert_eq!(b, a);
    rt.free(b).unwrap();
    let c = rt.alloc(4 * MIB).unwrap(); // a pass drains `b` behind a device wait
    pool.check_invariants().unwrap();
    let now = rt.footprints(Some(0)).unwrap()[0].now;
    assert_eq!(
        now.arena_stealable, 0,
        "pinned until the fence is seen: {now:?}"
    );
    let unmaps = host.counters().vmm_unmaps;
    let released = pool.release_idle_segments(&cupool::pool::counters::ThreadCounters::new(true));
    assert_eq!(released, 0, "nothing released while the device may use it");
    assert_eq!(host.counters().vmm_unmaps, unmaps);

    // The device catches up; the next pass sees the fences complete and drops the pins.
    host.complete_all(ctx.id);
    rt.free(c).unwrap();
    let d = rt.alloc(4 * MIB).unwrap();
    pool.check_invariants().unwrap();
    let now = rt.footprints(Some(0)).unwrap()[0].now;
    assert!(
        now.arena_stealable + now.arena_hole_ends + now.arena_in_busy_chunks > 0,
        "the memory is free again and may move: {now:?}"
    );
    rt.free(d).unwrap();

    // Non-blocking streams (the preload's hooks call these). Once the fences are seen
    // complete (empty_cache waits for them), nothing drained is in flight: a new stream
    // needs no wait.
    host.complete_all(ctx.id);
    rt.empty_cache(Some(0)).unwrap();
    let first: cupool::backend::StreamHandle = 0x51;
    let waited = host.counters().stream_waits;
    device_waits::non_blocking_stream_created(first);
    assert_eq!(host.counters().stream_waits, waited, "nothing to wait for");
    assert_eq!(device_waits::non_blocking_streams(), 1);
    // Every device wait makes it wait too.
    let e = rt.alloc(n).unwrap();
    rt.free(e).unwrap();
    let (legacy, other) = (host.counters().device_waits, host.counters().stream_waits);
    for _ in 0..5 {
        let again = rt.alloc(n).unwrap();
        assert_eq!(again, e);
        rt.free(again).unwrap();
    }
    let legacy = host.counters().device_waits - legacy;
    assert!(legacy >= 5, "{legacy}");
    assert_eq!(
        host.counters().stream_waits - other,
        legacy,
        "one per device wait"
    );
    // Created while a drained block may be in use: it waits once, at creation.
    let f = rt.alloc(n).unwrap();
    assert_eq!(f, e);
    let second: cupool::backend::StreamHandle = 0x52;
    let other = host.counters().stream_waits;
    device_waits::non_blocking_stream_created(second);
    assert_eq!(
        host.counters().stream_waits - other,
        1,
        "covered at creation"
    );
    // Destroyed streams are not named again.
    device_waits::stream_destroyed(first);
    device_waits::stream_destroyed(second);
    assert_eq!(device_waits::non_blocking_streams(), 0);
    rt.free(f).unwrap();
    let (legacy, other) = (host.counters().device_waits, host.counters().stream_waits);
    let g = rt.alloc(n).unwrap();
    assert_eq!(g, e);
    assert!(host.counters().device_waits > legacy);
    assert_eq!(host.counters().stream_waits, other, "no stream listed");
    rt.free(g).unwrap();
    host.complete_all(ctx.id);

    // A second context with a pool ends the mode; blocks freed afterwards wait for their
    // fence on the host again, so a reuse while it is in flight grows the pool instead.
    let other = host.create_context(1);
    host.make_current(other);
    let o = rt.alloc(4096).unwrap();
    rt.free(o).unwrap();
    host.make_current(ctx);
    assert!(!device_waits::active() && device_waits::ended());
    let a = rt.alloc(n).unwrap();
    rt.free(a).unwrap();
    let waits = host.counters().device_waits;
    let grown = stats().reserved_bytes.current;
    let b = rt.alloc(n).unwrap();
    assert_ne!(b, a, "fenced on the host: not reused while in flight");
    assert_eq!(
        host.counters().device_waits,
        waits,
        "no device wait after the end"
    );
    assert!(stats().reserved_bytes.current > grown);
    host.complete_all(ctx.id);
    rt.free(b).unwrap();
    host.set_manual_completion(ctx.id, false);
    rt.empty_cache(Some(0)).unwrap();
    pool.check_invariants().unwrap();
    assert_eq!(stats().reserved_bytes.current, 0);
}
