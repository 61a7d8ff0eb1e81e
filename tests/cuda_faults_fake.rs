//! Issue 14's random fault sequences on the CUDA backend over the fake libcuda (a TEST
//! DOUBLE of the driver, tests/fake_cuda), with segments and with `vmm:on`: `cuMemAlloc`,
//! `cuMemCreate` and `cuMemMap` fail with out-of-memory or another driver error at random
//! points among allocations and frees of random sizes (streamless and on two streams the
//! backend created), while events complete only after a random number of queries (a device
//! that is behind). After every call the status is one a CUDA user expects, live blocks
//! keep their bytes, and the pool's invariants hold; at the end the driver holds nothing:
//! no memory, no physical handle, no mapping, no reservation.
//!
//! Each test runs in a child process of this binary with the fake on its library path
//! (fresh driver and pool state), as in `cuda_vmm_fake.rs`. `CUPOOL_FAULT_SEEDS=N` runs N
//! sequences per mode instead of 3.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;
mod random_ops;

use cupool::runtime::runtime;
use cupool::CupoolStatus;
use fake_cuda::{in_child_with_fake, FakeCuda, VmmFn};
use random_ops::{check_every_50, Live, Rng};

const OUT_OF_MEMORY: i32 = 2;
const LAUNCH_FAILED: i32 = 719;

fn in_child(test_name: &str, conf: &str, body: fn()) {
    let seeds = std::env::var("CUPOOL_FAULT_SEEDS").unwrap_or_default();
    let env = [
        ("CUPOOL_CONF", conf),
        ("FAKE_CUDA_TOTAL_BYTES", "1073741824"),
        ("CUPOOL_FAULT_SEEDS", &seeds),
    ];
    in_child_with_fake(test_name, &env, body);
}

fn sequences(vmm: bool) {
    let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
    let rt = runtime().expect("the runtime starts on the cuda backend");
    let backend = rt.backend();
    let ctx = backend.device_context(0).expect("primary context");
    let s1 = backend.create_stream(ctx.id).unwrap();
    let s2 = backend.create_stream(ctx.id).unwrap();
    let runs: u64 = std::env::var("CUPOOL_FAULT_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let (mut injected, mut failed) = (0u32, 0u32);
    for seed in 1..=runs {
        let mut rng = Rng::for_seed(seed);
        let mut live = Live::default();
        for step in 0..1000u32 {
            if rng.below(10) == 0 {
                let code = if rng.below(2) == 0 {
                    OUT_OF_MEMORY
                } else {
                    LAUNCH_FAILED
                };
                match rng.below(if vmm { 3 } else { 1 }) {
                    0 => fake.fail_next_alloc(code),
                    1 => fake.fail_vmm(VmmFn::Create, 1, 1, code),
                    _ => fake.fail_vmm(VmmFn::Map, 1, 1, code),
                }
                injected += 1;
            }
            if rng.below(25) == 0 {
                fake.set_event_latency(rng.below(4) as i32);
            }
            if let Err(e) = live.step(rt, &mut rng, [s1, s2], seed, step) {
                assert!(
                    matches!(
                        e,
                        CupoolStatus::CupoolErrorOutOfMemory | CupoolStatus::CupoolErrorCuda
                    ),
                    "seed {seed} step {step}: {e:?}"
                );
                failed += 1;
            }
            check_every_50(rt, ctx, seed, step);
        }
        live.free_all(rt, seed);
        // Faults armed and not fired are cancelled; the device catches up.
        fake.fail_next_alloc(0);
        fake.fail_vmm(VmmFn::Create, 1, 0, 0);
        fake.fail_vmm(VmmFn::Map, 1, 0, 0);
        fake.set_event_latency(0);
        rt.flush_thread_cache();
        rt.empty_cache(None).unwrap();
        let s = rt.stats(None).unwrap();
        assert_eq!(s.allocated_bytes.current, 0, "seed {seed}");
        assert_eq!(
            s.reserved_bytes.current, 0,
            "seed {seed}: everything went back"
        );
        let c = fake.counters();
        assert_eq!(c.live_bytes, 0, "seed {seed}: {c:?}");
        assert_eq!(
            (c.vmm_handles, c.vmm_mappings, c.vmm_reservations),
            (0, 0, 0),
            "seed {seed}: {c:?}"
        );
    }
    assert!(injected > 0);
    eprintln!("{runs} sequences (vmm {vmm}): {injected} faults injected, {failed} calls failed");
}

#[test]
fn segments_survive_injected_driver_failures_on_the_fake_driver() {
    in_child(
        "segments_survive_injected_driver_failures_on_the_fake_driver",
        "backend:cuda",
        || sequences(false),
    );
}

#[test]
fn the_vmm_arena_survives_injected_driver_failures_on_the_fake_driver() {
    in_child(
        "the_vmm_arena_survives_injected_driver_failures_on_the_fake_driver",
        "backend:cuda,vmm:on",
        || sequences(true),
    );
}
