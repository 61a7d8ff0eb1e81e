//! The VMM arena (`vmm:on`) through the runtime on the CUDA backend, over the fake libcuda
//! (a TEST DOUBLE of the driver, tests/fake_cuda): blocks are usable memory, granules move
//! between blocks (stitching), injected driver failures return the right status and leak
//! nothing, a device without VMM gets segments, peer access reaches blocks mapped before
//! and after it was enabled, and the queries the interposer answers see the block.
//!
//! Each test runs in a child process of this binary with the fake on its library path
//! (fresh driver and pool state), as in `cuda_backend_fake.rs`.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use std::ffi::{c_int, c_void, CStr};

use cupool::backend::{ContextInfo, DevicePtr};
use cupool::runtime::{runtime, Runtime};
use cupool::CupoolStatus;
use fake_cuda::{in_child_with_fake, FakeCuda, VmmFn};

const MIB: u64 = 1 << 20;
/// The fake's granularity.
const G: u64 = 2 * MIB;

/// Runs `body` in a child process with the fake on the library path, `CUPOOL_CONF=vmm:on`
/// (cuda backend) and `env`; in that child, runs `body` itself.
fn in_child(test_name: &str, env: &[(&str, &str)], body: fn()) {
    let mut all = vec![("CUPOOL_CONF", "backend:cuda,vmm:on")];
    all.extend_from_slice(env);
    in_child_with_fake(test_name, &all, body);
}

fn fake_symbol(fake: &FakeCuda, name: &CStr) -> *mut c_void {
    // SAFETY: dlsym on a live handle with a NUL-terminated name.
    let p = unsafe { libc::dlsym(fake.handle(), name.as_ptr()) };
    assert!(!p.is_null(), "the fake exports {name:?}");
    p
}

/// The program's side: the fake's entry points a CUDA program would call.
struct Program {
    set_current: unsafe extern "C" fn(*mut c_void) -> c_int,
    enable_peer: unsafe extern "C" fn(*mut c_void, u32) -> c_int,
    disable_peer: unsafe extern "C" fn(*mut c_void) -> c_int,
    address_range: unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int,
    ipc_handle: unsafe extern "C" fn(*mut c_void, u64) -> c_int,
    memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
}

impl Program {
    // Each transmute's target is the field's declared type.
    #[allow(clippy::missing_transmute_annotations)]
    fn new(fake: &FakeCuda) -> Program {
        // SAFETY: each symbol has the declared signature (fake_libcuda.c / CUDA's ABI).
        unsafe {
            Program {
                set_current: core::mem::transmute(fake_symbol(fake, c"cuCtxSetCurrent")),
                enable_peer: core::mem::transmute(fake_symbol(fake, c"cuCtxEnablePeerAccess")),
                disable_peer: core::mem::transmute(fake_symbol(fake, c"cuCtxDisablePeerAccess")),
                address_range: core::mem::transmute(fake_symbol(fake, c"cuMemGetAddressRange_v2")),
                ipc_handle: core::mem::transmute(fake_symbol(fake, c"cuIpcGetMemHandle")),
                memcpy_htod: core::mem::transmute(fake_symbol(fake, c"cuMemcpyHtoD_v2")),
                memcpy_dtoh: core::mem::transmute(fake_symbol(fake, c"cuMemcpyDtoH_v2")),
            }
        }
    }

    fn make_current(&self, ctx: ContextInfo) {
        // SAFETY: a context handle from the backend.
        assert_eq!(
            unsafe { (self.set_current)(ctx.id.0 as usize as *mut c_void) },
            0
        );
    }

    fn enable_peer(&self, peer: ContextInfo) -> c_int {
        // SAFETY: a context handle; flags 0.
        unsafe { (self.enable_peer)(peer.id.0 as usize as *mut c_void, 0) }
    }

    fn disable_peer(&self, peer: ContextInfo) -> c_int {
        // SAFETY: a context handle.
        unsafe { (self.disable_peer)(peer.id.0 as usize as *mut c_void) }
    }

    /// Writes `n` bytes of `v` at `p` and reads them back, through the driver's copies
    /// (which check that the range is mapped and accessible by the current device).
    fn write_read(&self, p: u64, n: usize, v: u8) -> bool {
        let src = vec![v; n];
        let mut dst = vec![0u8; n];
        // SAFETY: host buffers of n bytes.
        let copied = unsafe {
            (self.memcpy_htod)(p, src.as_ptr().cast(), n) == 0
                && (self.memcpy_dtoh)(dst.as_mut_ptr().cast(), p, n) == 0
        };
        copied && dst == src
    }
}

fn fill(p: u64, n: u64, v: u8) {
    // SAFETY: the pool handed out at least n bytes at p, mapped read/write by the fake.
    unsafe { std::ptr::write_bytes(p as *mut u8, v, n as usize) };
}

fn holds(p: u64, n: u64, v: u8) -> bool {
    // SAFETY: as for fill.
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) };
    s.iter().all(|&b| b == v)
}

/// The runtime (cuda backend over the fake) and device `device`'s primary context, made
/// current.
fn setup(device: i32) -> (&'static Runtime, FakeCuda, Program, ContextInfo) {
    let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
    let program = Program::new(&fake);
    let rt = runtime().expect("the runtime starts on the cuda backend");
    assert_eq!(rt.backend().name(), "cuda");
    let ctx = rt
        .backend()
        .device_context(device)
        .expect("primary context");
    program.make_current(ctx);
    (rt, fake, program, ctx)
}

/// Frees `blocks`, empties the cache and checks that the driver holds nothing any more.
fn free_all_and_check_nothing_left(rt: &Runtime, fake: &FakeCuda, blocks: &[DevicePtr]) {
    for &p in blocks {
        rt.free(p).unwrap();
    }
    rt.flush_thread_cache();
    rt.empty_cache(None).unwrap();
    let c = fake.counters();
    assert_eq!(
        (c.vmm_handles, c.vmm_mappings, c.vmm_reservations),
        (0, 0, 0),
        "live handles, mappings, reservations: {c:?}"
    );
    assert_eq!(c.vmm_creates, c.vmm_releases, "{c:?}");
    assert_eq!(c.vmm_maps, c.vmm_unmaps, "{c:?}");
    assert_eq!(c.live_bytes, 0, "{c:?}");
    let s = rt.stats(None).unwrap();
    assert_eq!(s.reserved_bytes.current, 0);
}

/// The pool's view agrees with the driver's: every chunk the pool holds is a live handle,
/// every chunk it maps a live mapping, and the bytes agree.
fn pool_matches_driver(rt: &Runtime, fake: &FakeCuda, ctx: ContextInfo) {
    let pool = rt.context_pool(ctx).unwrap();
    pool.check_invariants().unwrap();
    let v = pool.vmm_stats();
    let c = fake.counters();
    assert_eq!(c.vmm_mappings, v.mapped_chunks, "{c:?} {v:?}");
    assert_eq!(c.vmm_handles, v.held_chunks, "{c:?} {v:?}");
}

#[test]
fn vmm_blocks_are_usable_and_stitched_and_nothing_leaks() {
    in_child(
        "vmm_blocks_are_usable_and_stitched_and_nothing_leaks",
        &[("FAKE_CUDA_TOTAL_BYTES", "268435456")],
        || {
            let (rt, fake, program, ctx) = setup(0);
            // A limit that only stitching can honour: sizes never repeat, 40 MiB live at
            // most with the kept blocks, 96 MiB allowed.
            rt.set_memory_limit(0, 96 * MIB).unwrap();
            let mut kept: Vec<(u64, u64, u8)> = Vec::new();
            for i in 0..40u64 {
                let n = 10 * MIB + i * 300_544;
                let p = rt.alloc(n as usize).unwrap();
                let q = rt.alloc(n as usize).unwrap();
                assert_eq!(fake.vmm_access(p, 0), Some(3), "mapped read/write");
                let v = (i % 200) as u8 + 1;
                fill(p, n, v);
                fill(q, n, v ^ 0xff);
                assert!(program.write_read(q + n - 3 * MIB, 3 * MIB as usize, 0x5a));
                assert!(holds(p, n, v), "block {p:#x} lost its contents");
                rt.free(q).unwrap();
                if i % 10 == 0 {
                    kept.push((p, n, v));
                } else {
                    rt.free(p).unwrap();
                }
                if kept.len() > 2 {
                    let (old, _, _) = kept.remove(0);
                    rt.free(old).unwrap();
                }
            }
            for &(p, n, v) in &kept {
                assert!(holds(p, n, v), "a kept block was unmapped or overwritten");
            }
            let s = rt.context_stats(ctx).unwrap();
            assert!(
                s.reserved_bytes.peak <= 96 * MIB,
                "{}",
                s.reserved_bytes.peak
            );
            let v = rt.context_pool(ctx).unwrap().vmm_stats();
            assert!(v.enabled && v.range_bytes >= 1 << 40, "{v:?}");
            let c = fake.counters();
            assert!(
                c.vmm_unmaps > 0 && v.unmaps > 0,
                "granules were unmapped and mapped elsewhere: {c:?}"
            );
            assert_eq!(c.mem_alloc, 0, "large blocks came from the arena only");
            pool_matches_driver(rt, &fake, ctx);
            rt.set_memory_limit(0, 0).unwrap();
            let kept: Vec<u64> = kept.iter().map(|b| b.0).collect();
            free_all_and_check_nothing_left(rt, &fake, &kept);
        },
    );
}

#[test]
fn a_vmm_reserve_is_held_idle_mapped_on_use_and_released_when_it_ends() {
    in_child(
        "a_vmm_reserve_is_held_idle_mapped_on_use_and_released_when_it_ends",
        &[("FAKE_CUDA_TOTAL_BYTES", "268435456")],
        || {
            let (rt, fake, program, ctx) = setup(0);
            assert_eq!(rt.reserve(None, 64 * MIB), Ok(64 * MIB));
            let c = fake.counters();
            assert_eq!(c.vmm_mappings, 0, "held, not mapped: {c:?}");
            assert!(c.vmm_handles > 0 && c.live_bytes >= 64 * MIB, "{c:?}");
            let p = rt.alloc((24 * MIB) as usize).unwrap();
            fill(p, 24 * MIB, 0x3c);
            assert!(program.write_read(p, MIB as usize, 0x6d));
            assert_eq!(
                rt.context_stats(ctx).unwrap().reserved_bytes.current,
                64 * MIB,
                "the block took reserved memory"
            );
            pool_matches_driver(rt, &fake, ctx);
            rt.free(p).unwrap();
            rt.flush_thread_cache();
            rt.empty_cache(None).unwrap();
            assert_eq!(
                rt.context_stats(ctx).unwrap().reserved_bytes.current,
                64 * MIB,
                "empty_cache keeps the reserve"
            );
            pool_matches_driver(rt, &fake, ctx);
            rt.reserve(None, 0).unwrap();
            free_all_and_check_nothing_left(rt, &fake, &[]);
        },
    );
}

#[test]
fn vmm_injected_failures_return_the_status_and_leak_nothing() {
    in_child(
        "vmm_injected_failures_return_the_status_and_leak_nothing",
        &[("FAKE_CUDA_TOTAL_BYTES", "268435456")],
        || {
            let (rt, fake, _program, ctx) = setup(0);
            let warm = rt.alloc(3 * MIB as usize).unwrap(); // reserves the arena
            const LAUNCH_FAILED: i32 = 719;

            // cuMemCreate out of memory, every time: out of memory, nothing held.
            fake.fail_vmm(VmmFn::Create, 1, 1000, 2);
            assert_eq!(
                rt.alloc(8 * MIB as usize),
                Err(CupoolStatus::CupoolErrorOutOfMemory)
            );
            fake.fail_vmm(VmmFn::Create, 1, 0, 0);
            pool_matches_driver(rt, &fake, ctx);
            // Once: the pool releases what it can, retries and succeeds.
            fake.fail_vmm(VmmFn::Create, 1, 1, 2);
            let a = rt.alloc(8 * MIB as usize).expect("retried after one OOM");
            pool_matches_driver(rt, &fake, ctx);
            // Another CUDA error: returned as such.
            fake.fail_vmm(VmmFn::Create, 2, 1, LAUNCH_FAILED);
            assert_eq!(
                rt.alloc(12 * MIB as usize),
                Err(CupoolStatus::CupoolErrorCuda)
            );
            pool_matches_driver(rt, &fake, ctx);

            // cuMemMap failing half-way through a block of several granules.
            fake.fail_vmm(VmmFn::Map, 2, 1, LAUNCH_FAILED);
            let before = fake.counters().vmm_errors;
            let r = rt.alloc(30 * MIB as usize);
            assert!(
                fake.counters().vmm_errors > before,
                "the failure was injected"
            );
            assert_eq!(r, Err(CupoolStatus::CupoolErrorCuda));
            pool_matches_driver(rt, &fake, ctx);

            // cuMemSetAccess failing (one call grants a whole run of granules): the backend
            // unmaps the run it mapped.
            fake.fail_vmm(VmmFn::SetAccess, 1, 1, LAUNCH_FAILED);
            let (maps, errors) = (fake.counters().vmm_maps, fake.counters().vmm_errors);
            assert_eq!(
                rt.alloc(40 * MIB as usize),
                Err(CupoolStatus::CupoolErrorCuda)
            );
            let c = fake.counters();
            assert!(c.vmm_maps > maps && c.vmm_errors > errors, "{c:?}");
            pool_matches_driver(rt, &fake, ctx);
            // Out of memory from cuMemMap, every time: out of memory.
            fake.fail_vmm(VmmFn::Map, 1, 1000, 2);
            assert_eq!(
                rt.alloc(50 * MIB as usize),
                Err(CupoolStatus::CupoolErrorOutOfMemory)
            );
            fake.fail_vmm(VmmFn::Map, 1, 0, 0);
            pool_matches_driver(rt, &fake, ctx);

            // Everything works again, and everything goes back.
            let b = rt.alloc(40 * MIB as usize).unwrap();
            fill(b, 40 * MIB, 7);
            assert!(holds(b, 40 * MIB, 7));
            pool_matches_driver(rt, &fake, ctx);
            free_all_and_check_nothing_left(rt, &fake, &[warm, a, b]);
        },
    );
}

#[test]
fn vmm_unsupported_falls_back_to_segments() {
    in_child(
        "vmm_unsupported_falls_back_to_segments",
        &[("FAKE_CUDA_DEVICES", "2"), ("FAKE_CUDA_VMM", "0")],
        || {
            // Device 0: the attribute says no VMM.
            let (rt, fake, program, ctx0) = setup(0);
            let p = rt.alloc(8 * MIB as usize).unwrap();
            fill(p, 8 * MIB, 1);
            let c = fake.counters();
            assert!(c.mem_alloc >= 1, "a segment from cuMemAlloc: {c:?}");
            assert_eq!((c.vmm_creates, c.vmm_reservations), (0, 0), "{c:?}");
            assert!(!rt.context_pool(ctx0).unwrap().vmm_stats().enabled);

            // Device 1: VMM supported, but the granularity query fails with
            // CUDA_ERROR_NOT_SUPPORTED: segments too.
            fake.set_vmm_supported(true);
            fake.fail_vmm(VmmFn::Granularity, 1, 1, 801);
            let ctx1 = rt.backend().device_context(1).unwrap();
            program.make_current(ctx1);
            let q = rt.alloc(8 * MIB as usize).unwrap();
            fill(q, 8 * MIB, 2);
            assert!(!rt.context_pool(ctx1).unwrap().vmm_stats().enabled);
            let c = fake.counters();
            assert_eq!((c.vmm_creates, c.vmm_reservations), (0, 0), "{c:?}");
            assert!(c.mem_alloc >= 2, "{c:?}");
            rt.free(q).unwrap();
            program.make_current(ctx0);
            free_all_and_check_nothing_left(rt, &fake, &[p]);
        },
    );
}

#[test]
fn vmm_peer_access_reaches_blocks_mapped_before_and_after() {
    in_child(
        "vmm_peer_access_reaches_blocks_mapped_before_and_after",
        &[("FAKE_CUDA_DEVICES", "2")],
        || {
            let (rt, fake, program, ctx1) = setup(1);
            let ctx0 = rt.backend().device_context(0).unwrap();
            // A block of device 1, mapped before any peer access.
            let a = rt.alloc(5 * MIB as usize).unwrap();
            assert_eq!(fake.vmm_access(a, 1), Some(3));
            assert_eq!(
                fake.vmm_access(a, 0),
                Some(0),
                "device 0 cannot reach it yet"
            );

            // Device 0's context gets peer access to device 1's.
            program.make_current(ctx0);
            assert_eq!(program.enable_peer(ctx1), 0);
            assert!(fake.peer_access(0, 1));
            rt.peer_access_enabled(ctx1.id).unwrap();
            for g in 0..3 {
                assert_eq!(fake.vmm_access(a + g * G, 0), Some(3), "granule {g} of a");
            }

            // Blocks mapped later, on device 1, are reachable from device 0 too.
            program.make_current(ctx1);
            let b = rt.alloc(20 * MIB as usize).unwrap();
            for off in (0..20 * MIB).step_by(G as usize) {
                assert_eq!(fake.vmm_access(b + off, 0), Some(3), "b + {off:#x}");
                assert_eq!(fake.vmm_access(b + off, 1), Some(3));
            }
            // Device 0's own blocks are not granted to device 1 (no access that way).
            program.make_current(ctx0);
            let own = rt.alloc(4 * MIB as usize).unwrap();
            assert_eq!(fake.vmm_access(own, 1), Some(0));

            // Disabled: later maps no longer grant device 0; what was granted stays.
            assert_eq!(program.disable_peer(ctx1), 0);
            rt.peer_access_disabled(ctx1.id).unwrap();
            program.make_current(ctx1);
            let c = rt.alloc(30 * MIB as usize).unwrap();
            let fresh = c + 28 * MIB; // beyond what a and b mapped
            assert_eq!(fake.vmm_access(fresh, 0), Some(0));
            assert_eq!(fake.vmm_access(b, 0), Some(3));
            rt.free(c).unwrap();
            rt.free(b).unwrap();
            rt.free(a).unwrap();
            program.make_current(ctx0);
            free_all_and_check_nothing_left(rt, &fake, &[own]);
        },
    );
}

/// What the interposer's query hooks build on: the block (not the arena) contains an
/// interior pointer, the arena is never a block's "whole segment" (so legacy IPC is
/// refused as for any sub-allocated block), and idle mapped granules count as idle.
#[test]
fn vmm_block_queries_see_the_block() {
    in_child("vmm_block_queries_see_the_block", &[], || {
        let (rt, fake, program, ctx) = setup(0);
        let n = 5 * MIB + 3;
        let p = rt.alloc(n as usize).unwrap();
        let info = rt.lookup_containing(p + 4 * MIB).expect("an arena block");
        assert_eq!((info.ptr, info.requested), (p, n));
        assert!(info.size >= n && info.size < n + MIB, "{info:?}");
        assert!(info.segment_size >= 1 << 40, "the arena is the segment");
        let whole_segment = info.ptr == info.segment_base && info.size >= info.segment_size;
        assert!(!whole_segment, "legacy IPC is refused for arena blocks");
        // The driver's own answers for VMM memory: the mapping's range, and no legacy IPC.
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers.
        assert_eq!(
            unsafe { (program.address_range)(&mut base, &mut size, p + 4 * MIB) },
            0
        );
        let inside = base <= p + 4 * MIB && p + 4 * MIB < base + size as u64;
        assert!(
            inside && size as u64 % G == 0 && size as u64 <= 8 * MIB,
            "the driver sees the mapping of one chunk of whole granules: {base:#x} + {size}"
        );
        let mut handle = [0u8; 64];
        // SAFETY: a 64-byte CUipcMemHandle.
        assert_eq!(
            unsafe { (program.ipc_handle)(handle.as_mut_ptr().cast(), p) },
            1,
            "the driver refuses legacy IPC on VMM memory"
        );

        // Freed and fenced: its mapped granules are idle cache, counted as free by the
        // interposer's cuMemGetInfo.
        let idle_before = rt.idle_cached_bytes(ctx.id);
        rt.free(p).unwrap();
        rt.flush_thread_cache();
        let idle = rt.idle_cached_bytes(ctx.id);
        assert!(
            idle > idle_before && idle >= 3 * G,
            "{idle_before} -> {idle}"
        );
        let v = rt.context_pool(ctx).unwrap().vmm_stats();
        assert_eq!(idle, v.mapped_bytes + v.idle_bytes, "{v:?}");
        free_all_and_check_nothing_left(rt, &fake, &[]);
    });
}

/// Note [exported chunks]: an arena block exports as its chunks' descriptors; importing
/// them maps the same bytes at another address (both ways); the exported chunks stay held
/// and mapped through frees and `empty_cache`, and nothing else does.
#[test]
fn vmm_blocks_export_as_descriptors_and_their_chunks_stay() {
    in_child(
        "vmm_blocks_export_as_descriptors_and_their_chunks_stay",
        &[],
        || {
            let (rt, fake, _program, ctx) = setup(0);
            // Two blocks, so that the exported one shares a chunk boundary region.
            let n = 5 * MIB + 3;
            let p = rt.alloc(n as usize).unwrap();
            let other = rt.alloc((3 * MIB) as usize).unwrap();
            fill(p, n, 0x5a);
            let (block, export) = rt
                .export_arena_block(p)
                .expect("exported")
                .expect("an arena block");
            assert_eq!((block.ptr, block.requested), (p, n));
            assert!(!export.chunks.is_empty());
            let total: u64 = export.chunks.iter().map(|c| c.1).sum();
            assert!(total >= n && total % G == 0, "{export:?}");
            assert!(export.offset + n <= total, "{export:?}");
            assert_eq!(fake.counters().vmm_exports, export.chunks.len() as u64);
            // Exporting again reuses the descriptors.
            let (_, again) = rt.export_arena_block(p).unwrap().unwrap();
            assert_eq!(again, export);
            assert_eq!(fake.counters().vmm_exports, export.chunks.len() as u64);
            // Not the start of a block, or not an arena block: nothing to export.
            assert!(rt.export_arena_block(p + 1).unwrap().is_none());
            let small = rt.alloc(4096).unwrap();
            assert!(rt.export_arena_block(small).unwrap().is_none());

            let imported = rt.import_chunks(&export.chunks).expect("imported");
            let q = imported.base + export.offset;
            assert_ne!(q, p);
            assert!(holds(q, n, 0x5a), "the importer sees the exporter's bytes");
            fill(q, n, 0xa5);
            assert!(holds(p, n, 0xa5), "and the exporter the importer's");
            assert_eq!(fake.counters().vmm_imports, export.chunks.len() as u64);
            rt.close_imported(&imported).expect("closed");
            let c = fake.counters();
            assert_eq!(c.vmm_reservations, 1, "the import's range is freed: {c:?}");

            // Freed and emptied: the exported chunks stay, mapped; the rest goes.
            for b in [p, other, small] {
                rt.free(b).unwrap();
            }
            rt.flush_thread_cache();
            rt.empty_cache(None).unwrap();
            pool_matches_driver(rt, &fake, ctx);
            let c = fake.counters();
            assert_eq!(c.vmm_handles, export.chunks.len() as u64, "{c:?}");
            assert_eq!(c.vmm_mappings, export.chunks.len() as u64, "{c:?}");
            let s = rt.stats(None).unwrap();
            assert_eq!(s.reserved_bytes.current, total, "only the exported chunks");
            // The same memory serves the next block there.
            let r = rt.alloc(n as usize).unwrap();
            assert_eq!(rt.stats(None).unwrap().reserved_bytes.current, total);
            rt.free(r).unwrap();
        },
    );
}

/// Note [creation within free memory]: a request larger than the device's free memory fails
/// with out-of-memory without creating any memory first, and the pool works on after it.
#[test]
fn vmm_requests_beyond_free_memory_fail_without_creating() {
    in_child(
        "vmm_requests_beyond_free_memory_fail_without_creating",
        &[],
        || {
            let (rt, fake, _program, ctx) = setup(0);
            let p = rt.alloc((6 * MIB) as usize).unwrap();
            let creates = fake.counters().vmm_creates;
            // The fake's device has 1 GiB.
            assert_eq!(
                rt.alloc((2u64 << 30) as usize),
                Err(CupoolStatus::CupoolErrorOutOfMemory)
            );
            assert_eq!(
                fake.counters().vmm_creates,
                creates,
                "nothing created for a request that cannot fit"
            );
            let q = rt.alloc((8 * MIB) as usize).unwrap();
            pool_matches_driver(rt, &fake, ctx);
            free_all_and_check_nothing_left(rt, &fake, &[p, q]);
        },
    );
}
