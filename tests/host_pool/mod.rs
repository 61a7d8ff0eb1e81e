//! Set-up shared by the test binaries that drive the pool on the host backend.
// Each test binary compiles its own copy and uses part of it.
#![allow(dead_code)]

use cupool::backend::host::{HostBackend, HOST_DEVICES};
use cupool::backend::{ContextInfo, StreamHandle};
use cupool::runtime::{runtime, Runtime};

pub const S1: StreamHandle = 0x1000;
pub const S2: StreamHandle = 0x2000;

/// The runtime on the host backend and a new context of device 0, current on this thread.
pub fn setup() -> (&'static Runtime, &'static HostBackend, ContextInfo) {
    setup_on(0)
}

/// A 4 KiB block allocated and freed on `s`; its address.
pub fn freed_on(rt: &Runtime, s: StreamHandle) -> u64 {
    let p = rt.alloc_async(4096, s).unwrap();
    rt.free_async(p, s).unwrap();
    p
}

/// With fences held (as [`setup_held`]): a block freed on `s` comes back at once to `s`;
/// then the stream is destroyed, `created` runs (where a test reports the creation of the
/// stream that gets the handle next) and `s`, which the backend now gives a new id, must
/// not get the block without a fence.
pub fn renamed_handle_takes_no_old_block(
    rt: &Runtime,
    host: &HostBackend,
    s: StreamHandle,
    created: impl FnOnce(),
) {
    let p = freed_on(rt, s);
    assert_eq!(freed_on(rt, s), p, "same stream: reused at once");
    host.destroy_stream(s);
    created();
    let q = rt.alloc_async(4096, s).unwrap();
    assert_ne!(
        q, p,
        "the new stream took the old stream's block without a fence"
    );
    rt.free_async(q, s).unwrap();
}

/// As [`setup`], with the context's fences held in flight until the test completes them
/// (`complete_all`, `complete_oldest`): only a same-stream reuse hands a block out again.
pub fn setup_held() -> (&'static Runtime, &'static HostBackend, ContextInfo) {
    let (rt, host, ctx) = setup();
    host.set_manual_completion(ctx.id, true);
    (rt, host, ctx)
}

/// As [`setup`], on `device`: each test gets a context (so a pool and statistics) of its own.
///
/// The pool is the segment pool (`vmm:off`): these tests count segments, fences and
/// releases of segments, which are also what a device without virtual memory management
/// gets. The VMM arena (the default) has tests of its own (`pool_vmm.rs`, and tests that
/// set `vmm:on` after this).
pub fn setup_on(device: i32) -> (&'static Runtime, &'static HostBackend, ContextInfo) {
    // The host backend makes a context for any number, but its pools refuse a device it
    // does not have (as CUDA does): a test on one would fail for a reason of its own.
    assert!(
        (0..HOST_DEVICES).contains(&device),
        "the host backend has devices 0 to {}",
        HOST_DEVICES - 1
    );
    cupool::config::set("backend", "host").expect("host backend");
    cupool::config::set("vmm", "off").expect("vmm option");
    let rt = runtime().expect("runtime starts on the host backend");
    let host = rt.host_backend().expect("host backend in use");
    let ctx = host.create_context(device);
    host.make_current(ctx);
    (rt, host, ctx)
}

/// `n` streamless alloc+free pairs of `size` bytes, one after the other; returns the
/// addresses handed out, in order.
pub fn alloc_free_pairs(rt: &Runtime, n: usize, size: usize) -> Vec<u64> {
    (0..n)
        .map(|_| {
            let p = rt.alloc(size).unwrap();
            rt.free(p).unwrap();
            p
        })
        .collect()
}

/// As [`setup_on`] on device 0, with the VMM arena on or off (read when the pool is
/// created, at its first call).
pub fn setup_vmm(on: bool) -> (&'static Runtime, &'static HostBackend, ContextInfo) {
    // After `setup_on`, which picks segments; read when the pool is created.
    let setup = setup_on(0);
    cupool::config::set("vmm", if on { "on" } else { "off" }).expect("vmm option");
    setup
}

/// Empties the cache and checks that the host backend holds no VMM object any more.
pub fn empty_and_check_nothing_left(rt: &Runtime, host: &HostBackend, ctx: ContextInfo) {
    rt.flush_thread_cache();
    host.complete_all(ctx.id);
    rt.empty_cache(Some(0)).unwrap();
    let pool = rt.context_pool(ctx).unwrap();
    pool.check_invariants().unwrap();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.reserved_bytes.current, 0, "everything went back");
    assert_eq!(s.device_frees, s.device_allocs);
    let v = pool.vmm_stats();
    assert_eq!((v.mapped_bytes, v.idle_bytes, v.range_bytes), (0, 0, 0));
    let c = host.counters();
    assert_eq!(c.vmm_mappings, 0, "every granule unmapped");
    assert_eq!(c.vmm_handles, 0, "every physical handle released");
    assert_eq!(c.vmm_ranges, 0, "the reservation is freed");
    assert_eq!(c.vmm_creates, c.vmm_releases);
    assert_eq!(c.vmm_maps, c.vmm_unmaps);
}
