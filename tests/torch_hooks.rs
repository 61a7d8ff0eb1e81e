//! The PyTorch pluggable-allocator hooks (`cupool_torch_*`) and the exports under them, on
//! the host backend, each test in a context of its own on device 0 (so its pool and
//! statistics are private). Hooks with process-wide effects (another device's primary
//! context, limits, `empty_cache`) are in `torch_hooks_process.rs`.

mod host_pool;

use core::ffi::c_void;
use core::ptr::null_mut;
use cupool::ffi::device::{cupool_alloc_async_device, cupool_segment_of, cupool_segments_json};
use cupool::ffi::torch::{
    cupool_torch_alloc, cupool_torch_base_allocation, cupool_torch_delete, cupool_torch_free,
    cupool_torch_record_stream,
};
use cupool::ffi::CUstream_st;
use cupool::CupoolStatus;
use host_pool::{setup, setup_held, S1, S2};

fn stream(handle: usize) -> *mut CUstream_st {
    handle as *mut CUstream_st
}

fn alloc(size: usize, handle: usize) -> *mut c_void {
    let p = unsafe { cupool_torch_alloc(size, 0, stream(handle)) };
    assert!(!p.is_null(), "cupool_torch_alloc({size}) returned NULL");
    p
}

fn free(p: *mut c_void, size: usize, handle: usize) {
    unsafe { cupool_torch_free(p, size, 0, stream(handle)) };
}

#[test]
fn allocations_are_stream_ordered_on_the_current_context() {
    // Fences never complete: only a same-stream reuse can hand a block out again.
    let (rt, _host, ctx) = setup_held();
    let p = alloc(1000, S1);
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        (s.allocated_bytes.current, s.requested_bytes.current),
        (1024, 1000),
        "the block came from the test's own context"
    );
    assert_eq!(rt.lookup(p as u64).unwrap().context, ctx.id);
    free(p, 1000, S1);
    assert_eq!(rt.context_stats(ctx).unwrap().allocated_bytes.current, 0);
    let again = alloc(1000, S1);
    assert_eq!(again, p, "a block freed on S1 goes back to S1 at once");
    let other = alloc(1000, S2);
    assert_ne!(other, p, "S2 waits for a fence");
    free(again, 1000, S1);
    free(other, 1000, S2);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}

#[test]
fn a_block_recorded_on_another_stream_waits_for_a_fence() {
    let (rt, host, ctx) = setup_held();
    let p = alloc(4096, S1);
    unsafe { cupool_torch_record_stream(p, stream(S2)) };
    free(p, 4096, S1);
    let next = alloc(4096, S1);
    assert_ne!(
        next, p,
        "work on S2 may still use the block: S1 must not get it back before a fence"
    );
    assert!(
        rt.context_stats(ctx).unwrap().pending_fence_bytes >= 4096,
        "the block waits for its fence"
    );
    free(next, 4096, S1);

    // Recorded on its own allocation stream only: an ordinary stream-ordered free.
    let q = alloc(8192, S1);
    unsafe { cupool_torch_record_stream(q, stream(S1)) };
    free(q, 8192, S1);
    assert_eq!(alloc(8192, S1), q);
    free(q, 8192, S1);

    // Once the fence completes, the recorded block is free for every stream.
    host.complete_all(ctx.id);
    rt.flush_thread_cache();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.allocated_bytes.current, 0);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}

#[test]
fn record_stream_and_free_of_foreign_pointers_are_harmless() {
    let (rt, _host, ctx) = setup();
    let mut local = [0u8; 64];
    let foreign = local.as_mut_ptr().cast::<c_void>();
    unsafe {
        cupool_torch_record_stream(foreign, stream(S2));
        cupool_torch_free(foreign, 64, 0, stream(S1));
    }
    let p = alloc(512, S1);
    free(p, 512, S1);
    // A second free is reported and ignored.
    free(p, 512, S1);
    assert_eq!(rt.context_stats(ctx).unwrap().num_frees, 1);
}

#[test]
fn base_allocation_is_the_segment_of_the_block() {
    let (rt, _host, ctx) = setup();
    let p = alloc(3000, S1);
    let mut size = 0usize;
    let base = unsafe { cupool_torch_base_allocation(p, &mut size) };
    let info = rt.lookup(p as u64).unwrap();
    assert_eq!(base as u64, info.segment_base);
    assert_eq!(size as u64, info.segment_size);
    assert!((base as u64..base as u64 + size as u64).contains(&(p as u64)));
    // Interior pointers find the same segment.
    let interior = unsafe { p.cast::<u8>().add(100).cast::<c_void>() };
    let (mut b2, mut s2) = (null_mut(), 0usize);
    assert_eq!(
        unsafe { cupool_segment_of(interior, &mut b2, &mut s2) },
        CupoolStatus::CupoolOk
    );
    assert_eq!((b2, s2), (base, size));
    // A pointer cupool did not hand out is its own base; the size is left alone.
    let mut untouched = 77usize;
    let mut local = 0u64;
    let foreign = (&mut local as *mut u64).cast::<c_void>();
    assert_eq!(
        unsafe { cupool_torch_base_allocation(foreign, &mut untouched) },
        foreign
    );
    assert_eq!(untouched, 77);
    free(p, 3000, S1);
    assert_eq!(
        unsafe { cupool_segment_of(p, null_mut(), null_mut()) },
        CupoolStatus::CupoolErrorInvalidPointer,
        "a freed block has no segment to share"
    );
    assert_eq!(rt.context_stats(ctx).unwrap().allocated_bytes.current, 0);
}

#[test]
fn the_layout_walk_shows_every_block_of_the_test_segments() {
    let (rt, _host, ctx) = setup();
    let sizes = [1000usize, 5000, 700_000, 3 << 20, 12 << 20];
    let ptrs: Vec<*mut c_void> = sizes.iter().map(|&s| alloc(s, S1)).collect();
    // Free the second: the segment shows a free block between two in use.
    free(ptrs[1], sizes[1], S1);
    rt.flush_thread_cache();

    let segments = rt.segments(Some(0)).unwrap();
    let mine: Vec<_> = segments
        .iter()
        .filter(|s| {
            ptrs.iter()
                .any(|&p| (s.base..s.base + s.size).contains(&(p as u64)))
        })
        .collect();
    assert_eq!(
        mine.len() as u64,
        rt.context_stats(ctx).unwrap().segments,
        "every segment of the context holds one of the test's blocks"
    );
    for seg in &mine {
        let mut at = seg.base;
        for b in &seg.blocks {
            assert_eq!(b.ptr, at, "blocks tile segment {:#x}", seg.base);
            at += b.size;
        }
        assert_eq!(at, seg.base + seg.size);
    }
    for (i, (&p, &size)) in ptrs.iter().zip(&sizes).enumerate() {
        let block = mine
            .iter()
            .flat_map(|s| &s.blocks)
            .find(|b| b.ptr == p as u64)
            .unwrap_or_else(|| panic!("block {p:p} missing"));
        if i == 1 {
            assert!(!block.allocated, "the freed block is free");
        } else {
            assert!(block.allocated);
            assert_eq!(block.requested, size as u64);
            assert_eq!(block.size, rt.lookup(p as u64).unwrap().size);
            assert_eq!(block.stream, S1 as u64);
        }
    }
    let small = mine
        .iter()
        .find(|s| (s.base..s.base + s.size).contains(&(ptrs[0] as u64)))
        .unwrap();
    assert!(small.small, "a 1000-byte block comes from a small segment");
    let allocated: u64 = mine.iter().map(|s| s.allocated_bytes()).sum();
    assert_eq!(
        allocated,
        rt.context_stats(ctx).unwrap().allocated_bytes.current
    );

    // The JSON form: asks for its size, then fills a buffer.
    let mut needed = 0usize;
    assert_eq!(
        unsafe { cupool_segments_json(0, null_mut(), 0, &mut needed) },
        CupoolStatus::CupoolErrorBufferTooSmall
    );
    let mut buf = vec![0u8; needed * 2 + 4096];
    assert_eq!(
        unsafe { cupool_segments_json(0, buf.as_mut_ptr().cast(), buf.len(), &mut needed) },
        CupoolStatus::CupoolOk
    );
    let text = std::ffi::CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap();
    assert!(text.starts_with("{\"segments\":["), "{text}");
    for &p in &ptrs {
        assert!(text.contains(&format!("\"address\":{}", p as u64)));
    }
    assert!(text.contains("\"state\":\"active_allocated\""));
    assert_eq!(
        unsafe { cupool_segments_json(-2, null_mut(), 0, null_mut()) },
        CupoolStatus::CupoolErrorInvalidDevice
    );

    for (i, (&p, &size)) in ptrs.iter().zip(&sizes).enumerate() {
        if i != 1 {
            free(p, size, S1);
        }
    }
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}

#[test]
fn device_aware_allocation_checks_its_arguments() {
    let (_rt, _host, _ctx) = setup();
    let mut p = null_mut();
    unsafe {
        assert_eq!(
            cupool_alloc_async_device(null_mut(), 16, 0, null_mut()),
            CupoolStatus::CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_alloc_async_device(&mut p, 0, 0, null_mut()),
            CupoolStatus::CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_alloc_async_device(&mut p, 16, -1, null_mut()),
            CupoolStatus::CupoolErrorInvalidDevice
        );
        assert_eq!(
            cupool_alloc_async_device(&mut p, 16, 1000, null_mut()),
            CupoolStatus::CupoolErrorInvalidDevice
        );
        assert!(p.is_null(), "nothing written on failure");
        assert!(
            cupool_torch_alloc(0, 0, null_mut()).is_null(),
            "empty tensors"
        );
        assert!(cupool_torch_alloc(16, 1000, null_mut()).is_null());
        assert!(cupool_torch_alloc(usize::MAX, 0, null_mut()).is_null());
    }
}

#[test]
fn a_free_in_allocation_order_goes_to_the_allocation_stream_or_waits_for_a_fence() {
    use cupool::ffi::cupool_free_in_allocation_order;
    let (rt, _host, ctx) = setup_held();
    // Allocated on S1: freed on S1 without naming it, so S1 takes it back at once.
    let p = alloc(4096, S1);
    assert_eq!(
        unsafe { cupool_free_in_allocation_order(p) },
        CupoolStatus::CupoolOk
    );
    assert_eq!(alloc(4096, S1), p, "back on S1 at once");
    assert_eq!(
        unsafe { cupool_free_in_allocation_order(p) },
        CupoolStatus::CupoolOk
    );
    // Allocated without a stream: freed without one, so it waits for a fence (which never
    // completes here) and no stream gets it.
    let mut q = null_mut();
    assert_eq!(
        unsafe { cupool::ffi::cupool_alloc(&mut q, 8192) },
        CupoolStatus::CupoolOk
    );
    assert_eq!(
        unsafe { cupool_free_in_allocation_order(q) },
        CupoolStatus::CupoolOk
    );
    assert_ne!(alloc(8192, S1), q, "a streamless block waits for its fence");
    // Bad input: NULL is fine, a second free and a foreign pointer are reported.
    assert_eq!(
        unsafe { cupool_free_in_allocation_order(null_mut()) },
        CupoolStatus::CupoolOk
    );
    let freed = unsafe { cupool_free_in_allocation_order(q) };
    assert_eq!(freed, CupoolStatus::CupoolErrorDoubleFree);
    let foreign = unsafe { cupool_free_in_allocation_order(0x10 as *mut c_void) };
    assert_eq!(foreign, CupoolStatus::CupoolErrorInvalidPointer);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}

#[test]
fn the_shim_deleter_frees_on_the_allocation_stream_unless_recorded() {
    let (rt, _host, ctx) = setup_held();
    // Not told the stream: S1 still takes the block back at once, S2 does not.
    let p = alloc(4096, S1);
    unsafe { cupool_torch_delete(p) };
    assert_eq!(rt.context_stats(ctx).unwrap().allocated_bytes.current, 0);
    assert_eq!(alloc(4096, S1), p, "back on S1 at once");
    unsafe { cupool_torch_delete(p) };
    assert_ne!(alloc(4096, S2), p, "S2 waits for a fence");

    // Recorded on another stream: freed without a stream, so not even S1 gets it back.
    let q = alloc(8192, S1);
    unsafe { cupool_torch_record_stream(q, stream(S2)) };
    unsafe { cupool_torch_delete(q) };
    assert_ne!(alloc(8192, S1), q, "work on S2 may still use it");
    assert!(rt.context_stats(ctx).unwrap().pending_fence_bytes >= 8192);

    // NULL does nothing; a second free and a foreign pointer are reported and ignored.
    let allocated = rt.context_stats(ctx).unwrap().allocated_bytes.current;
    unsafe {
        cupool_torch_delete(null_mut());
        cupool_torch_delete(q);
        cupool_torch_delete(0x10 as *mut c_void);
    }
    assert_eq!(
        rt.context_stats(ctx).unwrap().allocated_bytes.current,
        allocated
    );
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
}
