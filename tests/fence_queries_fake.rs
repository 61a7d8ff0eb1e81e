//! The `fence_queries` statistics (device pools and the pinned pool) count the driver's
//! fence queries: on the CUDA backend over the fake libcuda (a TEST DOUBLE of the driver,
//! tests/fake_cuda), whose own call counter is the reference. Loops that free without a
//! stream and allocate the same size again, as the preload's `cudaMalloc`/`cudaFree` and
//! `cudaHostAlloc`/`cudaFreeHost` pairs do.
//!
//! Each test runs in a child process of this binary with the fake on its library path.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use fake_cuda::{in_child_with_fake, runtime_with_device0_current};

const MIB: usize = 1 << 20;
const PAIRS: u64 = 200;
const ENV: &[(&str, &str)] = &[("CUPOOL_CONF", "backend:cuda")];

/// Device blocks: 1 MiB (fenced by the pool's passes) and 4 KiB (kept by the thread, fenced
/// by the shared thread fences), freed without a stream.
#[test]
fn device_fence_queries_are_the_drivers() {
    in_child_with_fake("device_fence_queries_are_the_drivers", ENV, || {
        let (rt, fake) = runtime_with_device0_current();
        let before = rt.stats(None).unwrap();
        let driver = fake.counters().event_query;
        for size in [MIB, 4096] {
            for _ in 0..PAIRS {
                let p = rt.alloc(size).unwrap();
                rt.free(p).unwrap();
            }
        }
        let after = rt.stats(None).unwrap();
        let queries = after.fence_queries - before.fence_queries;
        assert!(queries > 0, "the loops ask their fences");
        assert_eq!(fake.counters().event_query - driver, queries);
        assert!(
            queries <= 2 * (after.fences_recorded - before.fences_recorded) + 2,
            "{queries} queries for {} fences",
            after.fences_recorded - before.fences_recorded
        );
    });
}

/// Pinned buffers of 1 MiB freed without a stream: one fence per free, asked at the next
/// allocation, and the loop reuses its chunks.
#[test]
fn pinned_fence_queries_are_the_drivers() {
    in_child_with_fake("pinned_fence_queries_are_the_drivers", ENV, || {
        let (rt, fake) = runtime_with_device0_current();
        let p = rt.host_alloc(MIB).unwrap();
        rt.host_free(p).unwrap();
        let before = rt.host_stats();
        let driver = fake.counters().event_query;
        for _ in 0..PAIRS {
            let p = rt.host_alloc(MIB).unwrap();
            rt.host_free(p).unwrap();
        }
        let after = rt.host_stats();
        let queries = after.fence_queries - before.fence_queries;
        assert!(queries > 0 && queries <= 2 * PAIRS, "{queries}");
        assert_eq!(fake.counters().event_query - driver, queries);
        assert_eq!(after.driver_allocs, before.driver_allocs, "no growth");
    });
}
