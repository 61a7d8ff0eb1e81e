//! The pinned pool on the CUDA backend, against the fake libcuda test double
//! (tests/fake_cuda): which driver calls it makes (none for a cached pair), with which
//! flags, how driver errors map to statuses, fences in every context, and that nothing
//! leaks. Each check runs in a child process whose `LD_LIBRARY_PATH` points at the fake.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use cupool::backend::cuda::CudaBackend;
use cupool::backend::{Backend, BackendError};
use cupool::CupoolStatus;
use fake_cuda::{in_child_with_fake, FakeCuda};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const PORTABLE_DEVICEMAP: u32 = 3;

#[test]
fn backend_allocates_portable_mapped_pinned_memory() {
    in_child_with_fake(
        "backend_allocates_portable_mapped_pinned_memory",
        &[],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let backend = CudaBackend::new().expect("the backend loads the fake driver");
            let ctx = backend.current_context().unwrap();
            let p = backend.host_alloc(ctx.id, 2 * MIB as u64).expect("2 MiB");
            assert_eq!(fake.host_flags(p), Some(PORTABLE_DEVICEMAP));
            assert_eq!(fake.counters().host_live_bytes, 2 * MIB as u64);
            assert_eq!(fake.counters().live_bytes, 0, "not device memory");
            assert_eq!(backend.host_free(ctx.id, p), Ok(()));
            assert_eq!(
                backend.host_free(ctx.id, p),
                Err(BackendError::InvalidValue),
                "the driver refuses a pointer it no longer owns"
            );
            for (code, expected) in [
                (2, BackendError::OutOfMemory),
                (4, BackendError::ShuttingDown),
                (719, BackendError::Driver(719)),
            ] {
                fake.fail_next_host_alloc(code);
                assert_eq!(backend.host_alloc(ctx.id, 4096), Err(expected), "{code}");
            }
            let c = fake.counters();
            assert_eq!((c.host_alloc, c.host_free, c.host_live_bytes), (1, 1, 0));
        },
    );
}

#[test]
fn cached_pairs_make_no_driver_allocation_and_nothing_leaks() {
    in_child_with_fake(
        "cached_pairs_make_no_driver_allocation_and_nothing_leaks",
        &[("CUPOOL_CONF", "backend:cuda")],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let rt = cupool::runtime::runtime().expect("the runtime starts on the fake");
            let sizes = [4 * KIB, 100 * KIB, MIB, 3 * MIB, 64 * MIB];
            // Warm: one chunk per size class.
            for &n in &sizes {
                let p = rt.host_alloc(n).unwrap();
                assert_eq!(fake.host_flags(p), Some(PORTABLE_DEVICEMAP), "{n}");
                rt.host_free(p).unwrap();
            }
            let warm = fake.counters();
            assert!(warm.host_alloc >= 1 && warm.host_alloc <= sizes.len() as u64);
            // Streamless pairs: a fence per free, no allocation.
            for i in 0..1000 {
                let p = rt.host_alloc(sizes[i % sizes.len()]).unwrap();
                rt.host_free(p).unwrap();
            }
            let after = fake.counters();
            assert_eq!(
                after.host_alloc, warm.host_alloc,
                "a cached pair allocates nothing"
            );
            assert_eq!(after.host_free, 0);
            // Same-stream pairs need no fence either, once the stream has its own blocks.
            let stream = 0usize; // the legacy default stream
            let pair = |i: usize| {
                let p = rt.host_alloc_async(sizes[i % sizes.len()], stream).unwrap();
                rt.host_free_async(p, stream).unwrap();
            };
            (0..sizes.len()).for_each(pair);
            let stream_warm = fake.counters();
            (0..1000).for_each(pair);
            let streamed = fake.counters();
            assert_eq!(streamed.host_alloc, warm.host_alloc);
            assert_eq!(
                streamed.ctx_record_event, stream_warm.ctx_record_event,
                "a same-stream pair records no fence"
            );
            let s = rt.host_stats();
            assert_eq!(s.driver_allocs, streamed.host_alloc);
            assert_eq!(s.num_allocs, 2000 + 2 * sizes.len() as u64);
            assert_eq!(s.num_allocs, s.num_frees);

            // A driver error: out of memory is retried after releasing idle chunks (and the
            // retry gets memory); another error is reported as such.
            fake.fail_next_host_alloc(2);
            let big = rt.host_alloc(200 * MIB).expect("the retry succeeds");
            assert_eq!(rt.host_stats().alloc_retries, 1);
            rt.host_free(big).unwrap();
            fake.fail_next_host_alloc(719);
            assert_eq!(rt.host_alloc(300 * MIB), Err(CupoolStatus::CupoolErrorCuda));

            // Everything given back: the driver holds no page-locked memory of ours.
            assert!(rt.host_empty_cache().unwrap() > 0);
            let end = fake.counters();
            assert_eq!(end.host_live_bytes, 0, "{end:?}");
            assert_eq!(end.host_alloc, end.host_free);
            assert_eq!(end.host_free_errors, 0);
            let s = rt.host_stats();
            assert_eq!(
                (s.driver_allocs, s.driver_frees),
                (end.host_alloc, end.host_free)
            );
            assert_eq!(s.reserved_bytes.current, 0);
        },
    );
}

/// Note [pinned reuse]: with two devices in use, a free is fenced in both contexts, and
/// the block is reused only once the device's work before the free has completed.
#[test]
fn a_free_is_fenced_in_every_context_before_reuse() {
    in_child_with_fake(
        "a_free_is_fenced_in_every_context_before_reuse",
        &[("CUPOOL_CONF", "backend:cuda"), ("FAKE_CUDA_DEVICES", "2")],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let rt = cupool::runtime::runtime().expect("the runtime starts on the fake");
            let ctx1 = rt.backend().device_context(1).unwrap();
            rt.context_pool(ctx1).unwrap(); // device 1 is in use
            let n = 16 * MIB;
            let a = rt.host_alloc(n).unwrap();
            let fences = fake.counters().ctx_record_event;
            // The device runs far behind: no event completes until waited for.
            fake.set_event_latency(1_000_000);
            rt.host_free(a).unwrap();
            assert_eq!(
                fake.counters().ctx_record_event - fences,
                2,
                "one fence per context"
            );
            let b = rt.host_alloc(n).unwrap();
            assert_ne!(a, b, "reused while copies may still read it");
            // empty_cache waits for the fences (cuEventSynchronize) and releases `a`'s chunk.
            fake.set_event_latency(0);
            assert_eq!(rt.host_empty_cache(), Ok(n as u64));
            rt.host_free(b).unwrap();
            let c = rt.host_alloc(n).unwrap();
            assert_eq!(c, b, "reused once its fences completed");
            rt.host_free(c).unwrap();
            rt.host_empty_cache().unwrap();
            assert_eq!(fake.counters().host_live_bytes, 0);
        },
    );
}
