//! The C API as a sequence of calls on the host backend: allocations of random sizes,
//! streamless and stream-ordered frees on four streams, frees of pointers cupool never
//! handed out and double frees, `empty_cache`, limits, options and statistics. Every call
//! must return a status a C caller expects, never panic; every live block keeps the bytes
//! written to it; at the end of each input everything is freed and nothing is left
//! allocated.
#![no_main]

use core::ffi::c_void;
use cupool::ffi::*;
use cupool::stats::CupoolStats;
use cupool::CupoolStatus::{self, *};
use libfuzzer_sys::fuzz_target;

fn stream(k: u8) -> *mut CUstream_st {
    match k % 5 {
        0 => core::ptr::null_mut(),
        s => (0x1000 * s as usize) as *mut CUstream_st,
    }
}

struct Live {
    ptr: *mut u8,
    size: usize,
    tag: u8,
}

fn ok_or(st: CupoolStatus, allowed: &[CupoolStatus], what: &str) {
    assert!(
        st == CupoolOk || allowed.contains(&st),
        "{what}: unexpected status {st:?}"
    );
}

fn check_bytes(b: &Live) {
    // SAFETY: host backend: a live block is host memory of `size` bytes.
    unsafe {
        assert_eq!(*b.ptr, b.tag, "first byte of a live block changed");
        assert_eq!(
            *b.ptr.add(b.size - 1),
            b.tag,
            "last byte of a live block changed"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        cupool::config::set("backend", "host").expect("host backend");
        cupool::config::set("verbose", "false").expect("verbose");
    });
    let mut live: Vec<Live> = Vec::new();
    let mut freed: Vec<*mut c_void> = Vec::new();
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next();
    while let Some(op) = next() {
        let a = next().unwrap_or(0);
        let b = next().unwrap_or(0);
        match op % 10 {
            0 | 1 => {
                // Sizes from 1 B to 64 MiB, log-uniform-ish.
                let shift = (a % 27) as u32;
                let size = ((1usize << shift) + (b as usize) * 37) & ((64 << 20) - 1);
                let size = size.max(1);
                let mut p: *mut c_void = core::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                let st = unsafe {
                    if op % 10 == 0 {
                        cupool_alloc(&mut p, size)
                    } else {
                        cupool_alloc_async(&mut p, size, stream(b))
                    }
                };
                ok_or(st, &[CupoolErrorOutOfMemory], "alloc");
                if st == CupoolOk {
                    let tag = a ^ b ^ 0x5a;
                    // SAFETY: host memory of `size` bytes, ours.
                    unsafe {
                        *(p as *mut u8) = tag;
                        *(p as *mut u8).add(size - 1) = tag;
                    }
                    live.push(Live {
                        ptr: p.cast(),
                        size,
                        tag,
                    });
                }
            }
            2 | 3 if !live.is_empty() => {
                let blk = live.swap_remove(a as usize % live.len());
                check_bytes(&blk);
                // SAFETY: a block this input allocated and has not freed.
                let st = unsafe {
                    if op % 10 == 2 {
                        cupool_free(blk.ptr.cast())
                    } else {
                        cupool_free_async(blk.ptr.cast(), stream(b))
                    }
                };
                ok_or(st, &[], "free of a live block");
                freed.push(blk.ptr.cast());
            }
            4 => {
                // A pointer cupool never handed out (or an interior one).
                let p = match live.first() {
                    Some(blk) if blk.size > 1 => unsafe { blk.ptr.add(1) }.cast(),
                    _ => (0xdead_0000usize + a as usize * 4096) as *mut c_void,
                };
                // SAFETY: cupool looks the pointer up, never dereferences it.
                let st = unsafe { cupool_free(p) };
                ok_or(
                    st,
                    &[CupoolErrorInvalidPointer],
                    "free of a foreign pointer",
                );
            }
            5 if !freed.is_empty() => {
                let p = freed[a as usize % freed.len()];
                if live.iter().any(|blk| blk.ptr.cast() == p) {
                    continue; // handed out again meanwhile: not a double free
                }
                // SAFETY: as above.
                let st = unsafe { cupool_free(p) };
                ok_or(
                    st,
                    &[CupoolErrorDoubleFree, CupoolErrorInvalidPointer],
                    "double free",
                );
            }
            6 => {
                let mut released = 0usize;
                // SAFETY: a valid out-pointer.
                ok_or(
                    unsafe { cupool_empty_cache(&mut released) },
                    &[],
                    "empty_cache",
                );
            }
            7 => {
                const KEYS: &[&[u8]] = &[
                    b"fence_batch\0",
                    b"thread_cache\0",
                    b"thread_cache_bytes\0",
                    b"grow_wait_us\0",
                    b"release_above_percent\0",
                    b"no_such_key\0",
                ];
                const VALUES: &[&[u8]] = &[b"0\0", b"1\0", b"64\0", b"true\0", b"2M\0", b"x\0"];
                let k = KEYS[a as usize % KEYS.len()];
                let v = VALUES[b as usize % VALUES.len()];
                // SAFETY: NUL-terminated strings.
                let st = unsafe { cupool_config_set(k.as_ptr().cast(), v.as_ptr().cast()) };
                ok_or(
                    st,
                    &[CupoolErrorUnknownConfigKey, CupoolErrorInvalidConfigValue],
                    "config_set",
                );
            }
            8 => {
                let mut s = CupoolStats::new();
                // SAFETY: a valid, initialised stats struct.
                ok_or(unsafe { cupool_get_stats(-1, &mut s) }, &[], "get_stats");
            }
            9 => {
                let limit = (a as usize) << 22; // 0 (none) to 1 GiB
                ok_or(cupool_set_memory_limit(0, limit), &[], "set_memory_limit");
            }
            _ => {}
        }
    }
    for blk in live.drain(..) {
        check_bytes(&blk);
        // SAFETY: a block this input allocated.
        ok_or(unsafe { cupool_free(blk.ptr.cast()) }, &[], "final free");
    }
    ok_or(cupool_set_memory_limit(0, 0), &[], "limit off");
    let mut s = CupoolStats::new();
    // SAFETY: a valid stats struct.
    ok_or(unsafe { cupool_get_stats(-1, &mut s) }, &[], "get_stats");
    assert_eq!(
        s.allocated_bytes.current, 0,
        "allocated after everything was freed"
    );
});
