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

use cupool::runtime::runtime;
use cupool::CupoolStatus;
use fake_cuda::{build_fake_libcuda, is_child, run_child, FakeCuda, VmmFn};

const OUT_OF_MEMORY: i32 = 2;
const LAUNCH_FAILED: i32 = 719;

fn in_child(test_name: &str, conf: &str, body: fn()) {
    if is_child() {
        body();
        return;
    }
    let dir = build_fake_libcuda();
    let seeds = std::env::var("CUPOOL_FAULT_SEEDS").unwrap_or_default();
    let (status, output) = run_child(
        test_name,
        Some(&dir),
        &[
            ("CUPOOL_CONF", conf),
            ("FAKE_CUDA_TOTAL_BYTES", "1073741824"),
            ("CUPOOL_FAULT_SEEDS", &seeds),
        ],
    );
    assert!(status.success(), "child {test_name} failed:\n{output}");
    assert!(
        output.contains("1 passed"),
        "child {test_name} did not run:\n{output}"
    );
    for line in output.lines().filter(|l| l.contains("faults injected")) {
        eprintln!("{line}");
    }
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Log-uniform between 256 B and 48 MiB.
    fn size(&mut self) -> u64 {
        let bits = 8 + self.below(18);
        (1u64 << bits) + self.below(1u64 << bits)
    }
}

fn holds(p: u64, n: u64, v: u8) -> bool {
    // SAFETY: the pool handed out at least n bytes at p (the fake's memory is host memory).
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, n.min(4096) as usize) };
    s.iter().all(|&b| b == v)
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
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut live: Vec<(u64, u64, usize, u8)> = Vec::new();
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
            if live.len() < 24 && (live.is_empty() || rng.below(3) != 0) {
                let n = rng.size();
                let stream = [0, s1, s2][rng.below(3) as usize];
                let r = if stream == 0 {
                    rt.alloc(n as usize)
                } else {
                    rt.alloc_async(n as usize, stream)
                };
                match r {
                    Ok(p) => {
                        let v = (step % 251) as u8 + 1;
                        // SAFETY: at least n bytes at p, host memory of the fake.
                        unsafe { std::ptr::write_bytes(p as *mut u8, v, n.min(4096) as usize) };
                        live.push((p, n, stream, v));
                    }
                    Err(e) => {
                        assert!(
                            matches!(
                                e,
                                CupoolStatus::CupoolErrorOutOfMemory
                                    | CupoolStatus::CupoolErrorCuda
                            ),
                            "seed {seed} step {step}: {e:?}"
                        );
                        failed += 1;
                    }
                }
            } else {
                let (p, n, stream, v) = live.swap_remove(rng.below(live.len() as u64) as usize);
                assert!(
                    holds(p, n, v),
                    "seed {seed} step {step}: block {p:#x} changed"
                );
                if stream == 0 || rng.below(4) == 0 {
                    rt.free(p).unwrap();
                } else {
                    rt.free_async(p, stream).unwrap();
                }
            }
            if step % 50 == 0 {
                rt.context_pool(ctx)
                    .unwrap()
                    .check_invariants()
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            }
        }
        for (p, n, _, v) in live.drain(..) {
            assert!(holds(p, n, v), "seed {seed}: block {p:#x} changed");
            rt.free(p).unwrap();
        }
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
