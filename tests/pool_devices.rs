//! Several devices in one process, on the host backend (two simulated devices): each
//! device's pool has its own blocks, limit, statistics and cache, a thread that switches
//! devices frees each block into the pool it came from, and one thread per device works
//! without touching the other's pool.
//!
//! A test binary of its own: limits and the host backend are process-wide, so the tests run
//! one at a time (`SERIAL`); each makes contexts (so pools) of its own.

mod host_pool;

use cupool::backend::ContextInfo;
use cupool::runtime::Runtime;
use cupool::CupoolStatus;
use host_pool::{setup_on, S1};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());
const MIB: u64 = 1 << 20;

fn allocated(rt: &Runtime, ctx: ContextInfo) -> u64 {
    rt.context_stats(ctx).unwrap().allocated_bytes.current
}

#[test]
fn a_thread_that_switches_devices_frees_each_block_into_its_own_pool() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, dev0) = setup_on(0);
    let a = rt.alloc_async((3 * MIB) as usize, S1).unwrap();
    let small = rt.alloc(4096).unwrap();
    let dev1 = host.create_context(1);
    host.make_current(dev1);
    let b = rt.alloc((5 * MIB) as usize).unwrap();
    assert_eq!(rt.lookup(a).unwrap().device, 0);
    assert_eq!(rt.lookup(b).unwrap().device, 1);
    assert_eq!(allocated(rt, dev0), 3 * MIB + 4096);
    assert_eq!(allocated(rt, dev1), 5 * MIB);
    // Device 1 is current: the blocks of device 0 still go back to device 0's pool.
    rt.free(a).unwrap();
    rt.free(small).unwrap();
    assert_eq!(allocated(rt, dev0), 0);
    assert_eq!(allocated(rt, dev1), 5 * MIB, "device 1's pool untouched");
    rt.free(b).unwrap();
    assert_eq!(allocated(rt, dev1), 0);
    for ctx in [dev0, dev1] {
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    }
}

#[test]
fn a_limit_and_empty_cache_on_one_device_leave_the_other_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, dev0) = setup_on(0);
    let dev1 = host.create_context(1);
    rt.set_memory_limit(0, 16 * MIB).unwrap();
    assert_eq!(
        rt.alloc((32 * MIB) as usize),
        Err(CupoolStatus::CupoolErrorOutOfMemory),
        "over device 0's limit"
    );
    host.make_current(dev1);
    let big = rt
        .alloc((32 * MIB) as usize)
        .expect("device 1 has no limit");
    rt.free(big).unwrap();
    host.complete_all(dev1.id);
    host.make_current(dev0);
    let p = rt.alloc((8 * MIB) as usize).unwrap();
    rt.free(p).unwrap();
    host.complete_all(dev0.id);
    rt.set_memory_limit(0, 0).unwrap();
    let cached1 = rt.context_stats(dev1).unwrap().reserved_bytes.current;
    assert!(cached1 >= 32 * MIB);
    rt.empty_cache(Some(0)).unwrap();
    assert_eq!(rt.context_stats(dev0).unwrap().reserved_bytes.current, 0);
    assert_eq!(
        rt.context_stats(dev1).unwrap().reserved_bytes.current,
        cached1,
        "empty_cache of device 0 keeps device 1's cache"
    );
    rt.empty_cache(Some(1)).unwrap();
    assert_eq!(rt.context_stats(dev1).unwrap().reserved_bytes.current, 0);
}

#[test]
fn one_thread_per_device_each_in_its_own_pool() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, _) = setup_on(0);
    let ctxs: Vec<ContextInfo> = (0..2).map(|d| host.create_context(d)).collect();
    std::thread::scope(|s| {
        for &ctx in &ctxs {
            s.spawn(move || {
                host.make_current(ctx);
                let mut live = Vec::new();
                for i in 0..2000u64 {
                    let size = 256 + (i * 7919) % (2 * MIB);
                    let p = if i % 2 == 0 {
                        rt.alloc(size as usize).unwrap()
                    } else {
                        rt.alloc_async(size as usize, S1).unwrap()
                    };
                    assert_eq!(rt.lookup(p).unwrap().device, ctx.device);
                    live.push((p, i % 2 == 0));
                    if live.len() > 16 {
                        let (q, streamless) = live.remove(0);
                        if streamless {
                            rt.free(q).unwrap();
                        } else {
                            rt.free_async(q, S1).unwrap();
                        }
                    }
                }
                for (q, streamless) in live {
                    if streamless {
                        rt.free(q).unwrap();
                    } else {
                        rt.free_async(q, S1).unwrap();
                    }
                }
                rt.flush_thread_cache();
            });
        }
    });
    for ctx in ctxs {
        let s = rt.context_stats(ctx).unwrap();
        assert_eq!(s.allocated_bytes.current, 0, "device {}", ctx.device);
        assert_eq!(
            s.num_allocs, 2000,
            "device {}: its own thread's blocks only",
            ctx.device
        );
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    }
}

/// A context on a device index the host backend does not have gets an error status from
/// every call (it used to panic on the per-device index inside the backend).
#[test]
fn a_context_on_a_device_the_backend_lacks_gets_errors_not_a_panic() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, dev0) = setup_on(0);
    let ghost = host.create_context(cupool::backend::host::HOST_DEVICES + 3);
    assert!(rt.backend().memory_info(ghost.id).is_err());
    host.make_current(ghost);
    assert!(rt.alloc(4096).is_err());
    assert!(rt.alloc((3 * MIB) as usize).is_err());
    assert!(rt.alloc_async(4096, S1).is_err());
    host.make_current(dev0);
    let p = rt.alloc(4096).expect("the real device still works");
    rt.free(p).unwrap();
}
