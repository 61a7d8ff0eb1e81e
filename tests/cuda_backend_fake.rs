//! The CUDA driver backend against the fake libcuda test double (tests/fake_cuda), and the
//! fake itself. Each check runs in a child process of this test binary whose
//! `LD_LIBRARY_PATH` points at the fake: the parent test builds the fake, starts the child
//! with `CUPOOL_TEST_CHILD=1`, and asserts it passed.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use std::ffi::{c_char, c_int, c_void, CStr};

use fake_cuda::{in_child_with_fake, is_child, run_child, FakeCuda};

// ---- the fake itself -------------------------------------------------------------------

type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
type GetProcAddressV1 = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int;

fn fake_symbol(fake: &FakeCuda, name: &CStr) -> *mut c_void {
    // SAFETY: dlsym on a live handle with a NUL-terminated name.
    let p = unsafe { libc::dlsym(fake.handle(), name.as_ptr()) };
    assert!(!p.is_null(), "the fake exports {name:?}");
    p
}

/// (result, pfn, symbolStatus) of cuGetProcAddress_v2(name, version, flags).
fn gpa(fake: &FakeCuda, name: &CStr, version: c_int, flags: u64) -> (c_int, *mut c_void, c_int) {
    // SAFETY: the fake's cuGetProcAddress_v2 has this signature.
    let f: GetProcAddressV2 =
        unsafe { core::mem::transmute(fake_symbol(fake, c"cuGetProcAddress_v2")) };
    let mut pfn = core::ptr::dangling_mut::<c_void>();
    let mut status = -1;
    // SAFETY: valid out-pointers.
    let rc = unsafe { f(name.as_ptr(), &mut pfn, version, flags, &mut status) };
    (rc, pfn, status)
}

#[test]
fn fake_get_proc_address_picks_the_versioned_variant() {
    in_child_with_fake(
        "fake_get_proc_address_picks_the_versioned_variant",
        &[],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let cases: &[(&CStr, c_int, u64, &CStr)] = &[
                (c"cuMemAlloc", 3020, 0, c"cuMemAlloc_v2"),
                (c"cuMemAlloc", 13000, 0, c"cuMemAlloc_v2"),
                (c"cuMemAlloc", 3010, 0, c"cuMemAlloc"),
                (c"cuMemFree", 12000, 0, c"cuMemFree_v2"),
                (c"cuMemGetInfo", 3020, 0, c"cuMemGetInfo_v2"),
                (c"cuMemGetAddressRange", 3020, 0, c"cuMemGetAddressRange_v2"),
                (c"cuMemAllocAsync", 11020, 0, c"cuMemAllocAsync"),
                (c"cuMemAllocAsync", 11020, 1, c"cuMemAllocAsync"),
                (c"cuMemAllocAsync", 12000, 2, c"cuMemAllocAsync_ptsz"),
                (c"cuMemFreeAsync", 12000, 2, c"cuMemFreeAsync_ptsz"),
                (c"cuMemFreeAsync", 12000, 0, c"cuMemFreeAsync"),
                (c"cuGetProcAddress", 12000, 0, c"cuGetProcAddress_v2"),
                (c"cuGetProcAddress", 11030, 0, c"cuGetProcAddress"),
                (c"cuEventDestroy", 4000, 0, c"cuEventDestroy_v2"),
                (c"cuCtxPushCurrent", 4000, 0, c"cuCtxPushCurrent_v2"),
                (c"cuCtxPopCurrent", 12000, 0, c"cuCtxPopCurrent_v2"),
                (
                    c"cuDevicePrimaryCtxRelease",
                    11000,
                    0,
                    c"cuDevicePrimaryCtxRelease_v2",
                ),
                (
                    c"cuDevicePrimaryCtxRelease",
                    10020,
                    0,
                    c"cuDevicePrimaryCtxRelease",
                ),
                (
                    c"cuStreamBeginCapture",
                    10010,
                    0,
                    c"cuStreamBeginCapture_v2",
                ),
                (c"cuStreamBeginCapture", 10000, 0, c"cuStreamBeginCapture"),
                (c"cuEventRecord", 12000, 2, c"cuEventRecord"),
            ];
            for &(name, version, flags, expected) in cases {
                let (rc, pfn, status) = gpa(&fake, name, version, flags);
                assert_eq!((rc, status), (0, 0), "{name:?}@{version} flags {flags}");
                assert_eq!(
                    pfn,
                    fake_symbol(&fake, expected),
                    "{name:?}@{version} flags {flags} should give {expected:?}"
                );
            }
            // Unknown name: success, NULL, SYMBOL_NOT_FOUND.
            assert_eq!(
                gpa(&fake, c"cuNoSuchThing", 12000, 0),
                (0, core::ptr::null_mut(), 1)
            );
            // Known name asked below its first version: NULL, VERSION_NOT_SUFFICIENT.
            assert_eq!(
                gpa(&fake, c"cuMemAllocAsync", 11000, 0),
                (0, core::ptr::null_mut(), 2)
            );
            // A version newer than the driver.
            assert_eq!(gpa(&fake, c"cuMemAlloc", 13010, 0).0, 1);

            // The 4-argument v1 entry resolves the same way.
            // SAFETY: the fake's cuGetProcAddress has the v1 signature.
            let v1: GetProcAddressV1 =
                unsafe { core::mem::transmute(fake_symbol(&fake, c"cuGetProcAddress")) };
            let mut pfn = core::ptr::null_mut();
            // SAFETY: valid out-pointer.
            assert_eq!(unsafe { v1(c"cuMemFree".as_ptr(), &mut pfn, 11030, 0) }, 0);
            assert_eq!(pfn, fake_symbol(&fake, c"cuMemFree_v2"));

            assert_eq!(fake.counters().gpa_queries, cases.len() as u64 + 4);
        },
    );
}

type InitFn = unsafe extern "C" fn(u32) -> c_int;
type RetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type SetCurrentFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type AllocFn = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(u64) -> c_int;
type GetInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type RangeFn = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;

#[test]
fn fake_memory_accounting_and_free_checks() {
    in_child_with_fake(
        "fake_memory_accounting_and_free_checks",
        &[
            ("FAKE_CUDA_TOTAL_BYTES", "8388608"),
            (
                "FAKE_CUDA_LOG",
                concat!(env!("CARGO_TARGET_TMPDIR"), "/fake_cuda_memory.log"),
            ),
        ],
        || {
            let log = concat!(env!("CARGO_TARGET_TMPDIR"), "/fake_cuda_memory.log");
            // Appended to: lines of an earlier run must not count. The fake opens the file
            // on its first call, which comes later.
            let _ = std::fs::remove_file(log);
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            // SAFETY: each symbol has the declared signature (fake_libcuda.c).
            unsafe {
                let init: InitFn = core::mem::transmute(fake_symbol(&fake, c"cuInit"));
                let retain: RetainFn =
                    core::mem::transmute(fake_symbol(&fake, c"cuDevicePrimaryCtxRetain"));
                let set_current: SetCurrentFn =
                    core::mem::transmute(fake_symbol(&fake, c"cuCtxSetCurrent"));
                let alloc: AllocFn = core::mem::transmute(fake_symbol(&fake, c"cuMemAlloc_v2"));
                let free: FreeFn = core::mem::transmute(fake_symbol(&fake, c"cuMemFree_v2"));
                let info: GetInfoFn = core::mem::transmute(fake_symbol(&fake, c"cuMemGetInfo_v2"));
                let range: RangeFn =
                    core::mem::transmute(fake_symbol(&fake, c"cuMemGetAddressRange_v2"));

                let mut p = 0u64;
                assert_eq!(
                    alloc(&mut p, 1024),
                    3,
                    "calls before cuInit: NOT_INITIALIZED"
                );
                assert_eq!(init(0), 0);
                assert_eq!(
                    alloc(&mut p, 1024),
                    201,
                    "no current context: INVALID_CONTEXT"
                );
                let mut ctx = core::ptr::null_mut();
                assert_eq!(retain(&mut ctx, 0), 0);
                assert_eq!(set_current(ctx), 0);

                assert_eq!(alloc(&mut p, 1000), 0);
                assert_eq!(p % 512, 0);
                let mut big = 0u64;
                assert_eq!(alloc(&mut big, 4 << 20), 0);
                assert_eq!(big % (2 << 20), 0);
                let (mut free_b, mut total_b) = (0usize, 0usize);
                assert_eq!(info(&mut free_b, &mut total_b), 0);
                assert_eq!((free_b, total_b), (8388608 - 1000 - (4 << 20), 8388608));
                assert_eq!(fake.counters().live_bytes, 1000 + (4 << 20));

                let mut over = 0u64;
                assert_eq!(
                    alloc(&mut over, 4 << 20),
                    2,
                    "past the budget: OUT_OF_MEMORY"
                );
                fake.fail_next_alloc(999);
                assert_eq!(alloc(&mut over, 16), 999, "injected failure");
                assert_eq!(alloc(&mut over, 16), 0, "injection is one-shot");

                let (mut base, mut size) = (0u64, 0usize);
                assert_eq!(range(&mut base, &mut size, big + 12345), 0);
                assert_eq!((base, size), (big, 4 << 20));

                assert_eq!(free(big + 512), 1, "interior pointer: INVALID_VALUE");
                assert_eq!(free(0x1000), 1, "foreign pointer: INVALID_VALUE");
                assert_eq!(free(0), 0, "NULL is fine");
                assert_eq!(free(big), 0);
                assert_eq!(free(big), 1, "double free: INVALID_VALUE");
                assert_eq!(free(p), 0);
                assert_eq!(free(over), 0);
                let c = fake.counters();
                assert_eq!((c.mem_alloc, c.mem_free, c.mem_free_errors), (3, 3, 3));
                assert_eq!((c.mem_alloc_errors, c.live_bytes), (2, 0));
            }
            // FAKE_CUDA_LOG: one line per call, appended.
            let text = std::fs::read_to_string(log).expect("the fake's call log");
            assert!(
                text.lines()
                    .any(|l| l.starts_with("cuMemAlloc_v2(1000) -> 0")),
                "{text}"
            );
            assert!(
                text.lines()
                    .any(|l| l.starts_with("cuMemFree_v2(0x1000) -> 1")),
                "{text}"
            );
            let _ = std::fs::remove_file(log);
        },
    );
}

// ---- the CUDA backend ------------------------------------------------------------------

use cupool::backend::cuda::CudaBackend;
use cupool::backend::{Backend, BackendError, ContextId};

/// The fake's CUDA entry points the tests use to play the program's part (make streams,
/// capture, inspect pointers).
struct Program {
    ctx_get_current: unsafe extern "C" fn(*mut *mut c_void) -> c_int,
    stream_create: unsafe extern "C" fn(*mut usize, u32) -> c_int,
    stream_destroy: unsafe extern "C" fn(usize) -> c_int,
    begin_capture: unsafe extern "C" fn(usize, c_int) -> c_int,
    end_capture: unsafe extern "C" fn(usize, *mut *mut c_void) -> c_int,
    pointer_attribute: unsafe extern "C" fn(*mut c_void, c_int, u64) -> c_int,
}

impl Program {
    // Each transmute's target is the field's declared type.
    #[allow(clippy::missing_transmute_annotations)]
    fn new(fake: &FakeCuda) -> Program {
        // SAFETY: each symbol has the declared signature (fake_libcuda.c / CUDA's ABI).
        unsafe {
            Program {
                ctx_get_current: core::mem::transmute(fake_symbol(fake, c"cuCtxGetCurrent")),
                stream_create: core::mem::transmute(fake_symbol(fake, c"cuStreamCreate")),
                stream_destroy: core::mem::transmute(fake_symbol(fake, c"cuStreamDestroy_v2")),
                begin_capture: core::mem::transmute(fake_symbol(fake, c"cuStreamBeginCapture_v2")),
                end_capture: core::mem::transmute(fake_symbol(fake, c"cuStreamEndCapture")),
                pointer_attribute: core::mem::transmute(fake_symbol(
                    fake,
                    c"cuPointerGetAttribute",
                )),
            }
        }
    }

    fn current_context(&self) -> u64 {
        let mut ctx = core::ptr::null_mut();
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { (self.ctx_get_current)(&mut ctx) }, 0);
        ctx as u64
    }

    /// A new stream (flags 1 = CU_STREAM_NON_BLOCKING).
    fn create_stream(&self, flags: u32) -> usize {
        let mut s = 0usize;
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { (self.stream_create)(&mut s, flags) }, 0);
        s
    }

    fn destroy_stream(&self, s: usize) {
        // SAFETY: a stream from create_stream.
        assert_eq!(unsafe { (self.stream_destroy)(s) }, 0);
    }

    fn begin_capture(&self, s: usize) {
        // SAFETY: a live stream; mode 0 = CU_STREAM_CAPTURE_MODE_GLOBAL.
        assert_eq!(unsafe { (self.begin_capture)(s, 0) }, 0);
    }

    fn begin_thread_local_capture(&self, s: usize) {
        // SAFETY: a live stream; mode 1 = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL.
        assert_eq!(unsafe { (self.begin_capture)(s, 1) }, 0);
    }

    /// The CUresult of cuStreamEndCapture.
    fn end_capture(&self, s: usize) -> c_int {
        let mut graph = core::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe { (self.end_capture)(s, &mut graph) }
    }

    /// CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL of `ptr`.
    fn device_of(&self, ptr: u64) -> i32 {
        let mut device: c_int = -1;
        // SAFETY: attribute 9 writes one int.
        let rc = unsafe { (self.pointer_attribute)((&mut device as *mut c_int).cast(), 9, ptr) };
        assert_eq!(rc, 0);
        device
    }
}

const MIB: u64 = 1 << 20;

#[test]
fn backend_contexts_and_memory() {
    in_child_with_fake(
        "backend_contexts_and_memory",
        &[
            ("FAKE_CUDA_DEVICES", "2"),
            ("FAKE_CUDA_TOTAL_BYTES", "67108864"),
        ],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let program = Program::new(&fake);
            let backend = CudaBackend::new().expect("the backend loads the fake driver");
            assert_eq!(backend.name(), "cuda");

            // No context yet: device 0's primary context is retained and made current.
            let ctx0 = backend.current_context().expect("a context");
            assert_eq!(ctx0.device, 0);
            assert_ne!(ctx0.id, ContextId(0));
            assert_eq!(program.current_context(), ctx0.id.0);
            assert_eq!(
                backend.current_context(),
                Ok(ctx0),
                "stable on the hot path"
            );
            assert_eq!(
                backend.device_context(0),
                Ok(ctx0),
                "the same primary context"
            );

            assert_eq!(backend.device_count(), Ok(2));
            let ctx1 = backend.device_context(1).expect("device 1");
            assert_eq!(ctx1.device, 1);
            assert_ne!(ctx1.id, ctx0.id);
            assert_eq!(backend.device_context(2), Err(BackendError::InvalidValue));
            assert_eq!(backend.device_context(-1), Err(BackendError::InvalidValue));

            // Allocate and release in the current context.
            assert_eq!(backend.memory_info(ctx0.id), Ok((64 * MIB, 64 * MIB)));
            let p = backend.allocate(ctx0.id, 3 * MIB).expect("3 MiB");
            assert_eq!(program.device_of(p), 0);
            assert_eq!(fake.counters().live_bytes, 3 * MIB);
            assert_eq!(backend.memory_info(ctx0.id), Ok((61 * MIB, 64 * MIB)));

            // Allocate in device 1's context while device 0's is current: pushed and popped.
            let q = backend.allocate(ctx1.id, MIB).expect("1 MiB on device 1");
            assert_eq!(program.device_of(q), 1);
            assert_eq!(program.current_context(), ctx0.id.0, "push/pop balanced");
            assert_eq!(backend.memory_info(ctx1.id), Ok((63 * MIB, 64 * MIB)));
            assert_eq!(backend.memory_info(ctx0.id), Ok((61 * MIB, 64 * MIB)));
            assert_eq!(backend.release(ctx1.id, q, MIB), Ok(()));
            assert_eq!(program.current_context(), ctx0.id.0);

            assert_eq!(backend.release(ctx0.id, p, 3 * MIB), Ok(()));
            assert_eq!(fake.counters().live_bytes, 0);
            assert_eq!(
                backend.release(ctx0.id, p, 3 * MIB),
                Err(BackendError::InvalidValue),
                "the driver refuses a pointer it no longer owns"
            );
            assert_eq!(
                backend.allocate(ContextId(0), MIB),
                Err(BackendError::InvalidValue)
            );

            // Out of memory, from the budget and injected.
            assert_eq!(
                backend.allocate(ctx0.id, 65 * MIB),
                Err(BackendError::OutOfMemory)
            );
            fake.fail_next_alloc(2);
            assert_eq!(
                backend.allocate(ctx0.id, MIB),
                Err(BackendError::OutOfMemory)
            );
            fake.fail_next_alloc(4);
            assert_eq!(
                backend.allocate(ctx0.id, MIB),
                Err(BackendError::ShuttingDown)
            );
            fake.fail_next_alloc(719);
            assert_eq!(
                backend.allocate(ctx0.id, MIB),
                Err(BackendError::Driver(719))
            );
            fake.set_total_bytes(2 * MIB as usize);
            let r = backend
                .allocate(ctx0.id, 2 * MIB)
                .expect("exactly the budget");
            assert_eq!(backend.allocate(ctx0.id, 1), Err(BackendError::OutOfMemory));
            assert_eq!(backend.memory_info(ctx0.id), Ok((0, 2 * MIB)));
            assert_eq!(backend.release(ctx0.id, r, 2 * MIB), Ok(()));
            let c = fake.counters();
            assert_eq!((c.mem_alloc, c.mem_free, c.live_bytes), (3, 3, 0));
        },
    );
}

/// `existing_context` (the interposer's view) never initialises the driver or makes a
/// context current: a program's call without a context keeps getting the driver's answer.
#[test]
fn backend_existing_context_creates_nothing() {
    in_child_with_fake("backend_existing_context_creates_nothing", &[], || {
        let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
        let program = Program::new(&fake);
        let backend = CudaBackend::new().expect("the backend loads the fake driver");
        type MemAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
        // SAFETY: the fake's cuMemAlloc_v2 has this signature.
        let mem_alloc: MemAlloc =
            unsafe { core::mem::transmute(fake_symbol(&fake, c"cuMemAlloc_v2")) };
        let mut p = 0u64;

        assert_eq!(
            backend.existing_context(),
            Ok(None),
            "driver not initialised: no context"
        );
        // SAFETY: valid out-pointer.
        assert_eq!(
            unsafe { mem_alloc(&mut p, 4096) },
            3,
            "still CUDA_ERROR_NOT_INITIALIZED"
        );

        let ctx = backend
            .current_context()
            .expect("current_context makes one");
        assert_eq!(backend.existing_context(), Ok(Some(ctx)));
        assert_eq!(program.current_context(), ctx.id.0);
    });
}

#[test]
fn backend_current_context_on_many_threads() {
    in_child_with_fake("backend_current_context_on_many_threads", &[], || {
        let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
        let backend = CudaBackend::new().expect("the backend loads the fake driver");
        let contexts: Vec<_> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    scope.spawn(|| {
                        let ctx = backend.current_context().expect("a context");
                        for _ in 0..50 {
                            let p = backend.allocate(ctx.id, 4096).expect("allocate");
                            backend.release(ctx.id, p, 4096).expect("release");
                        }
                        ctx
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker"))
                .collect()
        });
        assert!(contexts.iter().all(|c| *c == contexts[0] && c.device == 0));
        let c = fake.counters();
        assert_eq!((c.mem_alloc, c.mem_free, c.live_bytes), (200, 200, 0));
    });
}

#[test]
fn backend_streams_and_events() {
    in_child_with_fake(
        "backend_streams_and_events",
        &[("FAKE_CUDA_EVENT_LATENCY", "3")],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let program = Program::new(&fake);
            let backend = CudaBackend::new().expect("the backend loads the fake driver");
            let ctx = backend.current_context().expect("a context").id;

            // Stream ids: distinct per stream, for the default streams too, never reused.
            let (a, b) = (program.create_stream(0), program.create_stream(1));
            let ids = [
                backend.stream_id(0).expect("legacy stream"),
                backend.stream_id(2).expect("per-thread stream"),
                backend.stream_id(a).expect("stream a"),
                backend.stream_id(b).expect("stream b"),
            ];
            for (i, x) in ids.iter().enumerate() {
                for y in &ids[i + 1..] {
                    assert_ne!(x, y, "stream ids differ: {ids:?}");
                }
            }
            assert_eq!(backend.stream_id(a), Ok(ids[2]), "stable");
            program.destroy_stream(a);
            let c = program.create_stream(0);
            let id_c = backend.stream_id(c).expect("stream c");
            assert!(!ids.contains(&id_c), "a new stream gets a new id");
            assert_eq!(backend.stream_id(0xdead0), Err(BackendError::InvalidValue));

            // A context fence is in flight for 3 queries, then complete.
            let fence = backend.record_context_fence(ctx).expect("fence");
            for _ in 0..3 {
                assert_eq!(backend.event_completed(ctx, fence), Ok(false));
            }
            assert_eq!(backend.event_completed(ctx, fence), Ok(true));
            assert_eq!(backend.event_completed(ctx, fence), Ok(true));

            // Events are reused once given back.
            backend.recycle_event(ctx, fence);
            let again = backend.record_context_fence(ctx).expect("fence again");
            assert_eq!(again, fence, "the idle event is reused");
            assert_eq!(
                backend.event_completed(ctx, again),
                Ok(false),
                "recorded anew"
            );
            assert_eq!(backend.wait_event(ctx, again), Ok(()));
            assert_eq!(backend.event_completed(ctx, again), Ok(true), "waited for");
            let third = backend
                .record_context_fence(ctx)
                .expect("a second live fence");
            assert_ne!(third, again);
            let counters = fake.counters();
            assert_eq!((counters.ctx_record_event, counters.event_sync), (3, 1));
            program.destroy_stream(b);
            program.destroy_stream(c);
        },
    );
}

#[test]
fn backend_before_cuda_12_5_fences_on_the_legacy_stream() {
    in_child_with_fake(
        "backend_before_cuda_12_5_fences_on_the_legacy_stream",
        &[
            ("FAKE_CUDA_DRIVER_VERSION", "12040"),
            ("FAKE_CUDA_EVENT_LATENCY", "1"),
        ],
        || {
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let backend = CudaBackend::new().expect("the backend loads the older driver");
            let ctx = backend.current_context().expect("a context").id;
            // No cuCtxRecordEvent before 12.5: the fence is an event on the legacy stream.
            let fence = backend.record_context_fence(ctx).expect("fence");
            assert_eq!(backend.event_completed(ctx, fence), Ok(false));
            assert_eq!(backend.event_completed(ctx, fence), Ok(true));
            let counters = fake.counters();
            assert_eq!((counters.ctx_record_event, counters.event_record), (0, 1));
        },
    );
}

#[test]
fn backend_refuses_fences_during_capture() {
    in_child_with_fake("backend_refuses_fences_during_capture", &[], || {
        let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
        let program = Program::new(&fake);
        let backend = CudaBackend::new().expect("the backend loads the fake driver");
        let ctx = backend.current_context().expect("a context").id;

        // A capture on a blocking stream is seen through the legacy stream: the fence is
        // refused before the driver is asked, and the capture survives.
        let blocking = program.create_stream(0);
        program.begin_capture(blocking);
        assert_eq!(
            backend.record_context_fence(ctx),
            Err(BackendError::Capturing)
        );
        assert_eq!(fake.counters().ctx_record_event_errors, 0, "not even tried");
        assert_eq!(program.end_capture(blocking), 0, "the capture is intact");

        // A capture on a non-blocking stream is invisible until the driver refuses the fence,
        // which invalidates it (the limitation written in Note [context fences and capture]).
        let non_blocking = program.create_stream(1);
        program.begin_capture(non_blocking);
        assert_eq!(
            backend.record_context_fence(ctx),
            Err(BackendError::Capturing)
        );
        assert_eq!(fake.counters().ctx_record_event_errors, 1);
        assert_eq!(
            program.end_capture(non_blocking),
            901,
            "invalidated by the driver"
        );

        // No capture: fences work again, reusing the event the refused one gave back.
        let fence = backend.record_context_fence(ctx).expect("fence");
        assert_eq!(backend.event_completed(ctx, fence), Ok(true));
        assert_eq!(fake.counters().ctx_record_event, 1);
    });
}

/// Note [capture exclusion]: a program that reports its capture (`cupool_capture_begin`)
/// keeps even a capture on a non-blocking stream, which the backend cannot see: the pool
/// makes no fence until `cupool_capture_end`, and the capture ends intact.
#[test]
fn reported_captures_get_no_fence() {
    in_child_with_fake(
        "reported_captures_get_no_fence",
        &[("CUPOOL_CONF", "backend:cuda")],
        || {
            use cupool::ffi::capture::{cupool_capture_begin, cupool_capture_end};
            use cupool::CupoolStatus;
            let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
            let program = Program::new(&fake);
            let rt = cupool::runtime::runtime().expect("the runtime starts on the fake");
            let p = rt.alloc(4096).unwrap();
            let non_blocking = program.create_stream(1);
            assert_eq!(cupool_capture_begin(), CupoolStatus::CupoolOk);
            program.begin_thread_local_capture(non_blocking);
            rt.free(p).unwrap();
            assert_eq!(
                rt.empty_cache(None),
                Err(CupoolStatus::CupoolErrorStreamCapture),
                "nothing is fenced or released during the capture"
            );
            // Note [growth during another thread's capture]: a miss of another thread grows
            // the pool (a 3 MiB block: a new segment); the capturing thread's is refused.
            let other = std::thread::spawn(move || {
                let rt = cupool::runtime::runtime().unwrap();
                let q = rt.alloc(3 << 20);
                (q, q.map(|q| rt.free(q)))
            })
            .join()
            .unwrap();
            assert!(matches!(other, (Ok(_), Ok(Ok(())))), "{other:?}");
            assert_eq!(
                rt.alloc(64 << 20),
                Err(CupoolStatus::CupoolErrorStreamCapture),
                "the capturing thread's own miss (a new segment)"
            );
            let c = fake.counters();
            assert_eq!(
                (c.ctx_record_event, c.ctx_record_event_errors),
                (0, 0),
                "{c:?}"
            );
            assert_eq!(
                program.end_capture(non_blocking),
                0,
                "the capture is intact"
            );
            assert_eq!(cupool_capture_end(), CupoolStatus::CupoolOk);
            // Over: the free is fenced and the memory released.
            assert!(rt.empty_cache(None).is_ok());
            assert!(fake.counters().ctx_record_event >= 1);
            assert_eq!(rt.stats(None).unwrap().reserved_bytes.current, 0);
        },
    );
}

#[test]
fn backend_without_device_is_unavailable() {
    in_child_with_fake(
        "backend_without_device_is_unavailable",
        &[("FAKE_CUDA_DEVICES", "0")],
        || {
            let backend = CudaBackend::new().expect("the library loads; no call is made yet");
            assert_eq!(backend.current_context(), Err(BackendError::Unavailable));
            assert_eq!(backend.device_count(), Err(BackendError::Unavailable));
            assert_eq!(backend.device_context(0), Err(BackendError::Unavailable));
        },
    );
}

#[test]
fn backend_without_libcuda_is_unavailable() {
    const NAME: &str = "backend_without_libcuda_is_unavailable";
    if !is_child() {
        let (status, output) = run_child(NAME, None, &[]);
        assert!(status.success(), "child failed:\n{output}");
        assert!(output.contains("1 passed"), "child did not run:\n{output}");
        assert!(!output.contains("panicked"), "{output}");
        return;
    }
    // SAFETY: a probe with a NUL-terminated name and valid flags.
    let installed = unsafe {
        !libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD).is_null()
            || !libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY).is_null()
    };
    if installed {
        // A machine with a real driver installed cannot show this case.
        eprintln!("{NAME}: skipped, a libcuda.so.1 is installed on this machine");
        return;
    }
    assert_eq!(CudaBackend::new().err(), Some(BackendError::Unavailable));
    assert_eq!(
        CudaBackend::new().err(),
        Some(BackendError::Unavailable),
        "the failed load is remembered"
    );
    assert!(cupool::backend::driver::driver().is_err());
    assert!(cupool::backend::driver::real_get_proc_address_v2().is_none());
}
