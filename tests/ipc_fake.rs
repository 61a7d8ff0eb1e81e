//! CUDA IPC of pool blocks through the C API (`cupool_ipc_get_handle`,
//! `cupool_ipc_open_handle`, `cupool_ipc_close_handle`), on the CUDA backend over the fake
//! libcuda (a TEST DOUBLE of the driver, tests/fake_cuda): every kind of block opens at the
//! right bytes, handles the pool did not make go to the driver, and bad input gets a status
//! and changes nothing. The fake's legacy IPC works within one process (it opens a handle
//! at the allocation's own address) and its VMM memory is a memfd that another mapping of
//! the same process shares, so an export and its import can run in one process here;
//! `preload/tests/preload.rs` runs the same code between two processes through the
//! interposer's hooks.
//!
//! Each test runs in a child process of this binary with the fake on its library path.

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;

use core::ffi::c_void;
use core::ptr::null_mut;

use cupool::ffi::ipc::{
    cupool_ipc_close_handle, cupool_ipc_get_handle, cupool_ipc_open_handle, CupoolIpcHandle,
};
use cupool::runtime::runtime;
use cupool::CupoolStatus::{self, *};
use fake_cuda::{in_child_with_fake, runtime_with_device0_current};

const MIB: u64 = 1 << 20;

fn fill(p: u64, n: u64, v: u8) {
    // SAFETY: the pool handed out at least n bytes at p, host memory in the fake.
    unsafe { std::ptr::write_bytes(p as *mut u8, v, n as usize) };
}

fn holds(p: u64, n: u64, v: u8) -> bool {
    // SAFETY: as for fill.
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) };
    s.iter().all(|&b| b == v)
}

fn handle_of(ptr: u64) -> Result<CupoolIpcHandle, CupoolStatus> {
    let mut h = CupoolIpcHandle { reserved: [0; 64] };
    // SAFETY: a valid out-parameter.
    match unsafe { cupool_ipc_get_handle(&mut h, ptr as usize as *const c_void) } {
        CupoolOk => Ok(h),
        e => Err(e),
    }
}

fn open(h: &CupoolIpcHandle) -> Result<u64, CupoolStatus> {
    let mut p = null_mut();
    // SAFETY: valid pointers.
    match unsafe { cupool_ipc_open_handle(&mut p, h, 1) } {
        CupoolOk => Ok(p as usize as u64),
        e => Err(e),
    }
}

fn close(p: u64) -> CupoolStatus {
    // SAFETY: any value may be passed.
    unsafe { cupool_ipc_close_handle(p as usize as *mut c_void) }
}

fn tagged(h: &CupoolIpcHandle) -> bool {
    h.reserved.starts_with(b"cupoolIP")
}

/// With `vmm:on`: a small block (sharing its 2 MiB segment) and an arena block (VMM memory,
/// which legacy IPC refuses) both export as cupool handles and open at the same bytes; an
/// interior pointer names its whole block; opens are counted, and the last close unmaps.
#[test]
fn arena_and_shared_segment_blocks_open_at_their_bytes() {
    in_child_with_fake(
        "arena_and_shared_segment_blocks_open_at_their_bytes",
        &[("CUPOOL_CONF", "backend:cuda,vmm:on")],
        || {
            let (rt, fake) = runtime_with_device0_current();
            let first = rt.alloc(4096).unwrap();
            let small = rt.alloc(4096).unwrap();
            fill(small, 4096, 0x11);
            let n = 5 * MIB + 3;
            let large = rt.alloc(n as usize).unwrap();
            fill(large, n, 0x22);

            let hs = handle_of(small).expect("small block");
            assert!(
                tagged(&hs),
                "a block sharing its segment gets cupool's handle"
            );
            let opened_small = open(&hs).expect("opened");
            assert_eq!(
                opened_small, small,
                "the fake maps a segment at its own address, so the block is where it was"
            );
            assert!(holds(opened_small, 4096, 0x11));

            let hl = handle_of(large + MIB).expect("interior pointer of the arena block");
            assert!(tagged(&hl));
            assert_eq!(handle_of(large).unwrap().reserved[44], hl.reserved[44]);
            let q = open(&hl).expect("opened through the chunks' descriptors");
            assert_ne!(q, large, "mapped again, at an address of its own");
            assert!(holds(q, n, 0x22), "the importer sees the exporter's bytes");
            fill(q, n, 0x33);
            assert!(holds(large, n, 0x33), "and the exporter the importer's");
            let vmm_imports = fake.counters().vmm_imports;
            assert!(vmm_imports > 0);
            assert_eq!(open(&hl), Ok(q), "a second open: the same pointer");
            assert_eq!(
                fake.counters().vmm_imports,
                vmm_imports,
                "not imported again"
            );
            assert_eq!(close(q), CupoolOk);
            assert!(holds(q, n, 0x33), "still mapped: one open left");
            let reservations = fake.counters().vmm_reservations;
            assert_eq!(close(q), CupoolOk);
            assert_eq!(
                fake.counters().vmm_reservations,
                reservations - 1,
                "the last close frees the import's range"
            );
            assert_eq!(close(opened_small), CupoolOk);
            assert_ne!(
                close(opened_small),
                CupoolOk,
                "closed once per open: the next close is the driver's to refuse"
            );
            for p in [first, small, large] {
                rt.free(p).unwrap();
            }
        },
    );
}

/// With `vmm:off`: a block that is a whole segment gets the driver's own handle (any
/// process opens it); a pointer that is no pool block gets the driver's answer; bad input
/// gets a status and writes nothing.
#[test]
fn whole_segments_get_the_drivers_handle_and_bad_input_a_status() {
    in_child_with_fake(
        "whole_segments_get_the_drivers_handle_and_bad_input_a_status",
        &[("CUPOOL_CONF", "backend:cuda,vmm:off")],
        || {
            let (rt, _fake) = runtime_with_device0_current();
            let n = 64 * MIB;
            let whole = rt.alloc(n as usize).unwrap();
            let info = rt.lookup(whole).unwrap();
            assert_eq!(
                (info.segment_base, info.segment_size),
                (whole, info.size),
                "a block of its own segment"
            );
            let h = handle_of(whole).expect("whole segment");
            assert!(!tagged(&h), "the driver's handle");
            let ptr = open(&h).expect("the driver opens its own handle");
            assert_eq!(ptr, whole);
            assert_eq!(close(ptr), CupoolOk);

            // No pool block: what the driver says (the fake, as CUDA: invalid value).
            let mut unknown = 0u64;
            assert_eq!(
                handle_of(&mut unknown as *mut u64 as u64).unwrap_err(),
                CupoolErrorInvalidValue
            );
            // A cupool handle whose record does not match (another nonce).
            let small = rt.alloc(4096).unwrap();
            let mut forged = handle_of(small).unwrap();
            assert!(tagged(&forged));
            forged.reserved[16] ^= 1;
            assert_eq!(open(&forged), Err(CupoolErrorInvalidValue));
            // NULL arguments.
            // SAFETY: NULL is refused before anything is read or written.
            unsafe {
                assert_eq!(
                    cupool_ipc_get_handle(null_mut(), small as usize as *const c_void),
                    CupoolErrorInvalidValue
                );
                let mut p = null_mut();
                assert_eq!(
                    cupool_ipc_open_handle(&mut p, core::ptr::null(), 0),
                    CupoolErrorInvalidValue
                );
                assert!(p.is_null(), "nothing written on failure");
                assert_eq!(
                    cupool_ipc_open_handle(null_mut(), &forged, 0),
                    CupoolErrorInvalidValue
                );
                assert_eq!(cupool_ipc_close_handle(null_mut()), CupoolErrorInvalidValue);
            }
            for p in [whole, small] {
                rt.free(p).unwrap();
            }
        },
    );
}

/// The host backend has no IPC: a clear status, not a handle nobody can open.
#[test]
fn the_host_backend_refuses_ipc_with_a_status() {
    in_child_with_fake(
        "the_host_backend_refuses_ipc_with_a_status",
        &[("CUPOOL_CONF", "backend:host")],
        || {
            let rt = runtime().unwrap();
            for size in [4096, 8 << 20] {
                let p = rt.alloc(size).unwrap();
                assert_eq!(handle_of(p).unwrap_err(), CupoolErrorBackendUnavailable);
                rt.free(p).unwrap();
            }
        },
    );
}
