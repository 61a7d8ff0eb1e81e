//! Test support: builds and drives the fake `libcuda.so.1` (a TEST DOUBLE of the CUDA driver,
//! see `fake_libcuda.c`), so driver-level code can be tested with no GPU.
//!
//! Use from an integration test with
//! `#[path = "fake_cuda/mod.rs"] mod fake_cuda;`, call [`build_fake_libcuda`] and run the code
//! under test in a child process whose `LD_LIBRARY_PATH` starts with the returned directory
//! (the dynamic loader reads `LD_LIBRARY_PATH` once, at process start). Inside that child,
//! [`FakeCuda::loaded`] reaches the fake's control functions (counters, fault injection).
#![allow(dead_code)]

use std::ffi::{c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The C source of the fake driver.
pub const FAKE_LIBCUDA_SOURCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fake_cuda/fake_libcuda.c"
);

/// Compiles the fake driver (once per test binary) and returns the directory holding
/// `libcuda.so.1`, to put first in a child's `LD_LIBRARY_PATH`.
///
/// Panics when the C compiler fails (a test-setup failure, with the compiler's output).
pub fn build_fake_libcuda() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(compile).clone()
}

fn compile() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_cuda");
    std::fs::create_dir_all(&dir).expect("create the fake libcuda directory");
    // Several test binaries may build at once: each compiles to its own temporary name and
    // renames it into place, which is atomic, so a loader never sees a half-written file.
    static SEQUENCE: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        "libcuda.so.1.{}.{}.tmp",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    ));
    let include = Path::new(FAKE_LIBCUDA_SOURCE)
        .parent()
        .expect("source has a directory");
    let output = Command::new("cc")
        .args([
            "-shared", "-fPIC", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
        ])
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(&tmp)
        .arg(FAKE_LIBCUDA_SOURCE)
        .output()
        .expect("run cc to build the fake libcuda");
    assert!(
        output.status.success(),
        "building the fake libcuda failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::rename(&tmp, dir.join("libcuda.so.1")).expect("move the fake libcuda into place");
    dir
}

/// Mirror of `struct fake_cuda_counters` (fake_cuda.h).
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FakeCudaCounters {
    pub mem_alloc: u64,
    pub mem_free: u64,
    pub mem_free_errors: u64,
    pub event_record: u64,
    pub ctx_record_event: u64,
    pub event_query: u64,
    pub event_sync: u64,
    pub gpa_queries: u64,
    pub live_bytes: u64,
    pub mem_alloc_errors: u64,
    pub ctx_record_event_errors: u64,
    pub stream_sync: u64,
    pub ctx_sync: u64,
    /// Alive now: reserved ranges, physical handles, mappings.
    pub vmm_reservations: u64,
    pub vmm_handles: u64,
    pub vmm_mappings: u64,
    pub vmm_creates: u64,
    pub vmm_releases: u64,
    pub vmm_maps: u64,
    pub vmm_unmaps: u64,
    pub vmm_set_access: u64,
    pub vmm_errors: u64,
    pub vmm_exports: u64,
    pub vmm_imports: u64,
    /// Page-locked host memory: calls, and bytes alive now.
    pub host_alloc: u64,
    pub host_free: u64,
    pub host_free_errors: u64,
    pub host_live_bytes: u64,
    pub host_register: u64,
    pub host_unregister: u64,
    /// `cuStreamWaitEvent` calls that succeeded, and of them those on `CU_STREAM_LEGACY`.
    pub stream_wait_event: u64,
    pub stream_wait_event_legacy: u64,
}

/// The fake's VMM functions, for [`FakeCuda::fail_vmm`] (`enum fake_cuda_vmm_fn`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum VmmFn {
    Granularity = 0,
    Reserve = 1,
    AddressFree = 2,
    Create = 3,
    Release = 4,
    Map = 5,
    SetAccess = 6,
    Unmap = 7,
}

/// The fake's control functions, as loaded in the current process.
#[derive(Copy, Clone)]
pub struct FakeCuda {
    handle: *mut c_void,
    counters: unsafe extern "C" fn(*mut FakeCudaCounters),
    reset_counters: unsafe extern "C" fn(),
    set_total_bytes: unsafe extern "C" fn(usize),
    set_event_latency: unsafe extern "C" fn(c_int),
    fail_next_alloc: unsafe extern "C" fn(c_int),
    fail_vmm: unsafe extern "C" fn(c_int, c_int, c_int, c_int),
    set_vmm_supported: unsafe extern "C" fn(c_int),
    vmm_access: unsafe extern "C" fn(u64, c_int) -> c_int,
    peer_access: unsafe extern "C" fn(c_int, c_int) -> c_int,
    fail_next_host_alloc: unsafe extern "C" fn(c_int),
    host_flags: unsafe extern "C" fn(*const c_void) -> c_int,
}

impl FakeCuda {
    /// The fake as this process's dynamic loader finds `libcuda.so.1` (loading it if
    /// needed); `None` when that library is not the fake (or is absent).
    // Each transmute's target is the field's declared type.
    #[allow(clippy::missing_transmute_annotations)]
    pub fn loaded() -> Option<FakeCuda> {
        // SAFETY: plain dlopen/dlsym calls with NUL-terminated names; the symbols, when
        // present, have the signatures declared in fake_cuda.h.
        unsafe {
            let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if handle.is_null() {
                return None;
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(handle, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            Some(FakeCuda {
                handle,
                counters: core::mem::transmute::<*mut c_void, _>(sym(c"fake_cuda_counters")?),
                reset_counters: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_reset_counters",
                )?),
                set_total_bytes: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_set_total_bytes",
                )?),
                set_event_latency: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_set_event_latency",
                )?),
                fail_next_alloc: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_fail_next_alloc",
                )?),
                fail_vmm: core::mem::transmute::<*mut c_void, _>(sym(c"fake_cuda_fail_vmm")?),
                set_vmm_supported: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_set_vmm_supported",
                )?),
                vmm_access: core::mem::transmute::<*mut c_void, _>(sym(c"fake_cuda_vmm_access")?),
                peer_access: core::mem::transmute::<*mut c_void, _>(sym(c"fake_cuda_peer_access")?),
                fail_next_host_alloc: core::mem::transmute::<*mut c_void, _>(sym(
                    c"fake_cuda_fail_next_host_alloc",
                )?),
                host_flags: core::mem::transmute::<*mut c_void, _>(sym(c"fake_cuda_host_flags")?),
            })
        }
    }

    /// The `dlopen` handle of the fake, for looking up its CUDA entry points.
    pub fn handle(&self) -> *mut c_void {
        self.handle
    }

    /// Makes the context `ctx` (a backend's context id) current on the calling thread
    /// through the fake's `cuCtxSetCurrent`, as a program's CUDA runtime would.
    pub fn make_current(&self, ctx: u64) {
        // SAFETY: dlsym on the live handle with a NUL-terminated name.
        let f = unsafe { libc::dlsym(self.handle, c"cuCtxSetCurrent".as_ptr()) };
        assert!(!f.is_null(), "the fake exports cuCtxSetCurrent");
        // SAFETY: the fake's cuCtxSetCurrent has CUDA's signature.
        let set: unsafe extern "C" fn(*mut c_void) -> i32 = unsafe { core::mem::transmute(f) };
        // SAFETY: a context handle the fake made.
        assert_eq!(unsafe { set(ctx as usize as *mut c_void) }, 0);
    }

    pub fn counters(&self) -> FakeCudaCounters {
        let mut c = FakeCudaCounters::default();
        // SAFETY: the fake writes one whole struct through a valid pointer.
        unsafe { (self.counters)(&mut c) };
        c
    }

    pub fn reset_counters(&self) {
        // SAFETY: no arguments; the fake locks its own state.
        unsafe { (self.reset_counters)() }
    }

    pub fn set_total_bytes(&self, total: usize) {
        // SAFETY: plain value argument.
        unsafe { (self.set_total_bytes)(total) }
    }

    pub fn set_event_latency(&self, queries: i32) {
        // SAFETY: plain value argument.
        unsafe { (self.set_event_latency)(queries) }
    }

    /// Makes the next device allocation fail with CUresult `code` (0 cancels).
    pub fn fail_next_alloc(&self, code: i32) {
        // SAFETY: plain value argument.
        unsafe { (self.fail_next_alloc)(code) }
    }
}

impl FakeCuda {
    /// Makes calls of `f` fail with CUresult `code`: the `nth` from now (1: the next) and
    /// the `count - 1` after it; `count` 0 cancels.
    pub fn fail_vmm(&self, f: VmmFn, nth: i32, count: i32, code: i32) {
        // SAFETY: plain value arguments.
        unsafe { (self.fail_vmm)(f as c_int, nth, count, code) }
    }

    /// Whether devices report virtual memory management (and VMM calls work).
    pub fn set_vmm_supported(&self, on: bool) {
        // SAFETY: plain value argument.
        unsafe { (self.set_vmm_supported)(on as c_int) }
    }

    /// The access flags `device` has on the mapping containing `ptr` (0 none, 1 read, 3
    /// read/write), `None` when nothing is mapped there.
    pub fn vmm_access(&self, ptr: u64, device: i32) -> Option<i32> {
        // SAFETY: plain value arguments; the fake only looks the address up.
        let f = unsafe { (self.vmm_access)(ptr, device) };
        (f >= 0).then_some(f)
    }

    /// Whether `from`'s context has peer access to `to`'s.
    pub fn peer_access(&self, from: i32, to: i32) -> bool {
        // SAFETY: plain value arguments.
        unsafe { (self.peer_access)(from, to) != 0 }
    }

    /// Makes the next page-locked host allocation fail with CUresult `code` (0 cancels).
    pub fn fail_next_host_alloc(&self, code: i32) {
        // SAFETY: plain value argument.
        unsafe { (self.fail_next_host_alloc)(code) }
    }

    /// The `cuMemHostAlloc` flags of the fake's host allocation containing `ptr`.
    pub fn host_flags(&self, ptr: u64) -> Option<u32> {
        // SAFETY: the fake only looks the address up.
        let f = unsafe { (self.host_flags)(ptr as usize as *const c_void) };
        (f >= 0).then_some(f as u32)
    }
}

/// Runs the test named `test_name` of the current test binary in a child process with
/// `LD_LIBRARY_PATH=lib_dir` (no fake when `None`: an empty path), the extra `env`, and
/// `CUPOOL_TEST_CHILD=1`; returns the child's exit status and its combined output.
pub fn run_child(
    test_name: &str,
    lib_dir: Option<&Path>,
    env: &[(&str, &str)],
) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().expect("current test binary");
    let mut cmd = Command::new(exe);
    cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env("CUPOOL_TEST_CHILD", "1")
        .env(
            "LD_LIBRARY_PATH",
            lib_dir
                .map(|d| d.as_os_str().to_owned())
                .unwrap_or_default(),
        );
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the child test process");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// Runs `body` in a child process of this test binary with the fake on the library path
/// (and `env`), and asserts that the child ran the test and passed; in that child, runs
/// `body` itself.
/// The fake (loaded), the runtime on the CUDA backend over it, and device 0's primary
/// context made current on the calling thread, as a program's CUDA runtime makes it.
pub fn runtime_with_device0_current() -> (&'static cupool::runtime::Runtime, FakeCuda) {
    let fake = FakeCuda::loaded().expect("the fake libcuda is on the path");
    let rt = cupool::runtime::runtime().expect("the runtime starts on the cuda backend");
    let ctx = rt.backend().device_context(0).expect("primary context");
    fake.make_current(ctx.id.0);
    (rt, fake)
}

pub fn in_child_with_fake(test_name: &str, env: &[(&str, &str)], body: fn()) {
    if is_child() {
        body();
        return;
    }
    let dir = build_fake_libcuda();
    let (status, output) = run_child(test_name, Some(&dir), env);
    assert!(status.success(), "child {test_name} failed:\n{output}");
    assert!(
        output.contains("1 passed"),
        "child {test_name} did not run:\n{output}"
    );
}

/// Whether this process is a child started by [`run_child`].
pub fn is_child() -> bool {
    std::env::var_os("CUPOOL_TEST_CHILD").is_some()
}
