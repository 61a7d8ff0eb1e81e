//! The CUDA driver backend against the fake libcuda test double (tests/fake_cuda), and the
//! fake itself. Each check runs in a child process of this test binary whose
//! `LD_LIBRARY_PATH` points at the fake: the parent test builds the fake, starts the child
//! with `CUPOOL_TEST_CHILD=1`, and asserts it passed.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use std::ffi::{c_char, c_int, c_void, CStr};

use fake_cuda::{build_fake_libcuda, is_child, run_child, FakeCuda};

/// Runs `body` in a child process with the fake on the library path (and `env`), or, in
/// that child, runs `body` itself.
fn in_child_with_fake(test_name: &str, env: &[(&str, &str)], body: fn()) {
    if is_child() {
        body();
        return;
    }
    let dir = build_fake_libcuda();
    let (status, output) = run_child(test_name, Some(&dir), env);
    assert!(status.success(), "child {test_name} failed:\n{output}");
    // The child ran exactly the one test (a typo in the name would run none and pass).
    assert!(
        output.contains("1 passed"),
        "child {test_name} did not run:\n{output}"
    );
}

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
        &[("FAKE_CUDA_TOTAL_BYTES", "8388608")],
        || {
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
        },
    );
}
