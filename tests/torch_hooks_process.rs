//! The PyTorch hooks whose effects reach past one context, on the host backend, in one
//! test (they share device 1's primary context, its memory limit and `empty_cache`):
//! the `device` argument, the memory fraction, out of memory, `empty_cache` and `init`.

mod host_pool;

use core::ptr::null_mut;
use cupool::ffi::device::cupool_mem_get_info;
use cupool::ffi::torch::{
    cupool_torch_alloc, cupool_torch_empty_cache, cupool_torch_free, cupool_torch_init,
    cupool_torch_set_memory_fraction,
};
use cupool::ffi::{cupool_get_memory_limit, cupool_set_memory_limit, CUstream_st};
use cupool::CupoolStatus;
use host_pool::{setup_on, S1};

const MIB: usize = 1 << 20;

fn limit(device: i32) -> usize {
    let mut bytes = 0usize;
    assert_eq!(
        unsafe { cupool_get_memory_limit(device, &mut bytes) },
        CupoolStatus::CupoolOk
    );
    bytes
}

#[test]
fn device_argument_fraction_out_of_memory_and_empty_cache() {
    // The calling thread works on a context of device 0; the hooks are asked for device 1.
    let (rt, _host, _ctx) = setup_on(0);
    cupool_torch_init(2);
    let device1 = rt.backend().device_context(1).unwrap();

    // A real stream handle: stream-ordered in device 1's primary context.
    let p = unsafe { cupool_torch_alloc(5000, 1, S1 as *mut CUstream_st) };
    assert!(!p.is_null());
    let info = rt.lookup(p as u64).unwrap();
    assert_eq!((info.device, info.context), (1, device1.id));
    // The default stream names a stream of the current context (device 0's): the block is
    // made streamless, still on device 1.
    let q = unsafe { cupool_torch_alloc(5000, 1, null_mut()) };
    assert!(!q.is_null());
    assert_eq!(rt.lookup(q as u64).unwrap().device, 1);
    let s = rt.stats(Some(1)).unwrap();
    assert_eq!(s.allocated_bytes.current, 2 * 5120);
    unsafe {
        cupool_torch_free(p, 5000, 1, S1 as *mut CUstream_st);
        cupool_torch_free(q, 5000, 1, null_mut());
    }
    assert_eq!(rt.stats(Some(1)).unwrap().allocated_bytes.current, 0);

    // Memory fraction: a share of the device's total memory.
    let mut total = 0usize;
    assert_eq!(
        unsafe { cupool_mem_get_info(1, null_mut(), &mut total) },
        CupoolStatus::CupoolOk
    );
    assert!(total > 0);
    cupool_torch_set_memory_fraction(0.5, 1);
    assert_eq!(limit(1), total / 2);
    cupool_torch_set_memory_fraction(7.0, 1);
    assert_eq!(limit(1), total / 2, "a fraction above 1 is refused");

    // Fraction 0: nothing more may be reserved; an allocation that needs a new segment
    // fails with NULL after the pool released its idle cache and retried.
    cupool_torch_empty_cache();
    assert_eq!(rt.stats(Some(1)).unwrap().reserved_bytes.current, 0);
    let ooms = rt.stats(Some(1)).unwrap().num_ooms;
    cupool_torch_set_memory_fraction(0.0, 1);
    assert_eq!(limit(1), 1, "the smallest real limit");
    let none = unsafe { cupool_torch_alloc(64 * MIB, 1, S1 as *mut CUstream_st) };
    assert!(none.is_null(), "out of memory is NULL");
    let s = rt.stats(Some(1)).unwrap();
    assert_eq!(s.num_ooms, ooms + 1);
    assert!(s.alloc_retries >= 1, "released and retried before failing");

    // A full fraction allows the whole device again.
    cupool_torch_set_memory_fraction(1.0, 1);
    assert_eq!(limit(1), total);
    let big = unsafe { cupool_torch_alloc(64 * MIB, 1, S1 as *mut CUstream_st) };
    assert!(!big.is_null());
    unsafe { cupool_torch_free(big, 64 * MIB, 1, S1 as *mut CUstream_st) };
    rt.flush_thread_cache();
    assert!(rt.stats(Some(1)).unwrap().reserved_bytes.current >= 64 * MIB as u64);
    cupool_torch_empty_cache();
    assert_eq!(
        rt.stats(Some(1)).unwrap().reserved_bytes.current,
        0,
        "empty_cache gives the idle segment back"
    );
    assert_eq!(cupool_set_memory_limit(1, 0), CupoolStatus::CupoolOk);
}
