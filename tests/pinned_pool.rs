//! The pinned host memory pool on the host backend: reuse ordering (fences, streams,
//! captures), split and merge, statistics, `empty_cache`, out-of-memory and bad input.
//!
//! The pinned pool is one per process and fences every device pool's context, so these
//! tests run one at a time ([`serial`]) and each starts from an empty pool.

mod host_pool;

use cupool::backend::host::HostBackend;
use cupool::backend::{BackendError, ContextInfo};
use cupool::runtime::Runtime;
use cupool::stats::{CupoolHostStats, CUPOOL_HOST_STATS_VERSION};
use cupool::CupoolStatus;
use host_pool::{setup, S1, S2};
use std::sync::{Mutex, MutexGuard};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// One test at a time; each starts with every pinned chunk given back.
fn serial() -> (
    MutexGuard<'static, ()>,
    &'static Runtime,
    &'static HostBackend,
    ContextInfo,
) {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let (rt, host, ctx) = setup();
    rt.host_empty_cache().unwrap();
    assert_eq!(
        rt.host_stats().reserved_bytes.current,
        0,
        "a test before this one left pinned memory in use"
    );
    (guard, rt, host, ctx)
}

/// Work in `ctx` completes only when the test says so, until dropped.
struct Manual<'a>(&'a HostBackend, ContextInfo);

impl<'a> Manual<'a> {
    fn new(host: &'a HostBackend, ctx: ContextInfo) -> Self {
        host.set_manual_completion(ctx.id, true);
        Manual(host, ctx)
    }
}

impl Drop for Manual<'_> {
    fn drop(&mut self) {
        self.0.complete_all(self.1.id);
        self.0.set_manual_completion(self.1.id, false);
    }
}

fn fill(p: u64, len: usize, byte: u8) {
    // SAFETY: `p` is a live pinned block of at least `len` bytes (host memory).
    unsafe { core::ptr::write_bytes(p as *mut u8, byte, len) };
}

/// Whether the block still holds `byte`: its first and last bytes and one per page
/// (a whole scan is slow in debug builds, and another owner would write whole ranges).
fn holds(p: u64, len: usize, byte: u8) -> bool {
    // SAFETY: as in `fill`.
    let bytes = unsafe { core::slice::from_raw_parts(p as *const u8, len) };
    bytes
        .iter()
        .step_by(4096)
        .chain(&bytes[len - 1..])
        .all(|&b| b == byte)
}

#[test]
fn a_streamless_free_is_reused_only_after_its_fence_completes() {
    let (_g, rt, host, ctx) = serial();
    let before = rt.host_stats();
    let manual = Manual::new(host, ctx);
    // 1 MiB: two blocks fill a small chunk; 64 MiB: a chunk of its own. Either way the
    // second request finds no other room and must choose between `a` and the driver.
    for size in [MIB, 64 * MIB] {
        let a = rt.host_alloc(size).unwrap();
        fill(a, size, 0xa5);
        rt.host_free(a).unwrap();
        // An async copy may still read `a`: the next owner must not get it yet.
        let b = rt.host_alloc(size).unwrap();
        assert_ne!(a, b, "{size}: reused before its fence completed");
        assert!(holds(a, size, 0xa5), "nobody wrote the freed block");
        assert_eq!(rt.host_stats().pending_fence_bytes, size as u64);
        host.complete_all(ctx.id);
        let c = rt.host_alloc(size).unwrap();
        assert_eq!(c, a, "{size}: reused once its fence completed");
        assert_eq!(rt.host_stats().pending_fence_bytes, 0);
        rt.host_free(b).unwrap();
        rt.host_free(c).unwrap();
        host.complete_all(ctx.id);
    }
    drop(manual);
    let s = rt.host_stats();
    assert_eq!(
        s.driver_allocs - before.driver_allocs,
        3,
        "a small chunk (`a` and `b`), then one per 64 MiB block"
    );
    assert!(s.fences_recorded - before.fences_recorded >= 2, "{s:?}");
    rt.host_check().unwrap();
}

#[test]
fn a_stream_free_is_reused_at_once_by_its_stream_only() {
    let (_g, rt, host, ctx) = serial();
    let manual = Manual::new(host, ctx);
    let n = 8 * MIB;
    let a = rt.host_alloc_async(n, S1).unwrap();
    rt.host_free_async(a, S1).unwrap();
    assert_eq!(
        rt.host_alloc_async(n, S1),
        Ok(a),
        "the same stream, in order"
    );
    rt.host_free_async(a, S1).unwrap();
    let other = rt.host_alloc_async(n, S2).unwrap();
    let streamless = rt.host_alloc(n).unwrap();
    assert!(
        other != a && streamless != a,
        "S2 and the host wait for S1's work"
    );
    host.complete_all(ctx.id);
    let later = rt.host_alloc_async(n, S2).unwrap();
    assert_eq!(later, a, "S2 gets it once the fence completed");
    // Allocated on S2 and freed on S1: S1 cannot know S2's work is done.
    rt.host_free_async(later, S1).unwrap();
    let again = rt.host_alloc_async(n, S1).unwrap();
    assert_ne!(again, a, "a cross-stream free waits for the fence");
    for p in [other, streamless, again] {
        rt.host_free(p).unwrap();
    }
    drop(manual);
    assert_eq!(rt.host_stats().allocated_bytes.current, 0);
    rt.host_check().unwrap();
}

#[test]
fn blocks_split_from_a_chunk_merge_back_into_it() {
    let (_g, rt, host, _ctx) = serial();
    let before = rt.host_stats();
    // 512 pages fill one 2 MiB chunk exactly.
    let pages: Vec<u64> = (0..512).map(|_| rt.host_alloc(4 * KIB).unwrap()).collect();
    let base = *pages.iter().min().unwrap();
    let mut sorted = pages.clone();
    sorted.sort_unstable();
    assert!(
        sorted
            .iter()
            .enumerate()
            .all(|(i, &p)| p == base + (i * 4 * KIB) as u64),
        "pages tile one chunk"
    );
    assert_eq!(rt.host_stats().driver_allocs - before.driver_allocs, 1);
    rt.host_check().unwrap();
    // Two neighbours freed merge: an 8 KiB request fits where they were.
    rt.host_free(sorted[10]).unwrap();
    rt.host_free(sorted[11]).unwrap();
    let merged = rt.host_alloc(8 * KIB).unwrap();
    assert_eq!(merged, sorted[10], "the two pages merged into one block");
    assert_eq!(rt.host_stats().driver_allocs - before.driver_allocs, 1);
    rt.host_free(merged).unwrap();
    // Every page back, in an order that merges from both sides.
    for (i, &p) in sorted.iter().enumerate() {
        if i % 2 == 0 && i != 10 {
            rt.host_free(p).unwrap();
        }
    }
    for (i, &p) in sorted.iter().enumerate() {
        if i % 2 == 1 && i != 11 {
            rt.host_free(p).unwrap();
        }
    }
    rt.host_check().unwrap();
    let released = rt.host_empty_cache().unwrap();
    assert_eq!(
        released,
        2 * MIB as u64,
        "the chunk is one idle block again"
    );
    let after = rt.host_stats();
    assert_eq!(after.driver_frees - before.driver_frees, 1);
    assert_eq!(after.reserved_bytes.current, 0);
    assert_eq!(
        host.pinned_counters().live,
        0,
        "nothing left with the driver"
    );
}

#[test]
fn statistics_follow_the_pool() {
    let (_g, rt, host, ctx) = serial();
    rt.host_reset_peak_stats();
    let s0 = rt.host_stats();
    assert_eq!(
        (s0.size as usize, s0.version),
        (
            core::mem::size_of::<CupoolHostStats>(),
            CUPOOL_HOST_STATS_VERSION
        )
    );
    let small = rt.host_alloc(1000).unwrap();
    // A 4 MiB chunk; the 1020 KiB left over is too little to split off a large block.
    let large = rt.host_alloc(3 * MIB + 1).unwrap();
    let s = rt.host_stats();
    assert_eq!(s.num_allocs - s0.num_allocs, 2);
    assert_eq!(s.cache_misses - s0.cache_misses, 2);
    assert_eq!(s.allocated_bytes.current, (4 * KIB + 4 * MIB) as u64);
    assert_eq!(s.requested_bytes.current, (1000 + 3 * MIB + 1) as u64);
    assert_eq!(s.reserved_bytes.current, (2 * MIB + 4 * MIB) as u64);
    assert_eq!(s.chunks.current, 2);
    assert_eq!(
        host.pinned_counters().live_bytes,
        s.reserved_bytes.current,
        "reserved is what the driver gave"
    );
    {
        let _manual = Manual::new(host, ctx);
        rt.host_free(small).unwrap();
        let s = rt.host_stats();
        assert_eq!(s.pending_fence_bytes, 4 * KIB as u64);
        assert_eq!(s.num_frees - s0.num_frees, 1);
        assert_eq!(s.allocated_bytes.current, 4 * MIB as u64);
        assert_eq!(s.allocated_bytes.peak, (4 * MIB + 4 * KIB) as u64);
    }
    // The rest of the small chunk serves it: a hit.
    let again = rt.host_alloc(1000).unwrap();
    let s = rt.host_stats();
    assert_eq!(s.cache_hits - s0.cache_hits, 1);
    assert_eq!(s.driver_allocs - s0.driver_allocs, 2);
    rt.host_free(again).unwrap();
    rt.host_free(large).unwrap();
    assert_eq!(rt.host_empty_cache(), Ok(6 * MIB as u64));
    assert_eq!(rt.host_stats().pending_fence_bytes, 0);
    rt.host_reset_peak_stats();
    let s = rt.host_stats();
    assert_eq!((s.allocated_bytes.peak, s.reserved_bytes.peak), (0, 0));
    assert_eq!(s.chunks, cupool::stats::CupoolStat::default());
    assert_eq!(s.driver_allocs - s0.driver_allocs, 2);
    assert_eq!(s.driver_frees - s0.driver_frees, 2);

    // The C API: JSON and a struct written up to the caller's size.
    let mut needed = 0usize;
    // SAFETY: NULL buffer of length 0 asks for the size.
    let st = unsafe {
        cupool::ffi::pinned::cupool_host_stats_json(core::ptr::null_mut(), 0, &mut needed)
    };
    assert_eq!(st, CupoolStatus::CupoolErrorBufferTooSmall);
    let mut buf = vec![0u8; needed];
    // SAFETY: a buffer of `needed` bytes.
    let st = unsafe {
        cupool::ffi::pinned::cupool_host_stats_json(buf.as_mut_ptr().cast(), needed, &mut needed)
    };
    assert_eq!(st, CupoolStatus::CupoolOk);
    let json = String::from_utf8(buf[..needed - 1].to_vec()).unwrap();
    assert!(
        json.contains(&format!("\"driver_frees\":{}", s.driver_frees)),
        "{json}"
    );
    let mut short = CupoolHostStats {
        size: 24,
        version: 1,
        ..Default::default()
    };
    // SAFETY: the struct is larger than the size announced.
    let st = unsafe { cupool::ffi::pinned::cupool_host_get_stats(&mut short) };
    assert_eq!(st, CupoolStatus::CupoolOk);
    assert_eq!(short.size, 24);
    assert_eq!(
        short.reserved_bytes,
        Default::default(),
        "past the caller's size"
    );
}

#[test]
fn empty_cache_waits_for_pending_frees_and_keeps_live_chunks() {
    let (_g, rt, host, ctx) = serial();
    let live = rt.host_alloc(64 * KIB).unwrap();
    let big = rt.host_alloc(16 * MIB).unwrap();
    {
        let _manual = Manual::new(host, ctx);
        rt.host_free(big).unwrap();
        // Waits for the fence (the host backend's wait completes the simulated work).
        let released = rt.host_empty_cache().unwrap();
        assert_eq!(released, 16 * MIB as u64);
    }
    let s = rt.host_stats();
    assert_eq!(
        s.reserved_bytes.current,
        2 * MIB as u64,
        "the live block's chunk"
    );
    assert_eq!(s.pending_fence_bytes, 0);
    assert_eq!(host.pinned_counters().live, 1);
    rt.host_free(live).unwrap();
    assert_eq!(rt.host_empty_cache(), Ok(2 * MIB as u64));
    assert_eq!(host.pinned_counters().live_bytes, 0);
    assert_eq!(rt.host_empty_cache(), Ok(0), "nothing left");
}

#[test]
fn bad_input_gets_a_clear_status_and_changes_nothing() {
    let (_g, rt, _host, _ctx) = serial();
    let p = rt.host_alloc(100 * KIB).unwrap();
    let before = rt.host_stats();
    let stack = 0u64;
    let device = rt.alloc(4096).unwrap();
    let checks = [
        (
            rt.host_alloc(0).err(),
            CupoolStatus::CupoolErrorInvalidValue,
        ),
        (
            rt.host_alloc(usize::MAX).err(),
            CupoolStatus::CupoolErrorOutOfMemory,
        ),
        (
            rt.host_free(&stack as *const u64 as u64).err(),
            CupoolStatus::CupoolErrorInvalidPointer,
        ),
        (
            rt.host_free(p + 4096).err(),
            CupoolStatus::CupoolErrorInvalidPointer,
        ),
        (
            rt.host_free(device).err(),
            CupoolStatus::CupoolErrorInvalidPointer,
        ),
        (
            rt.host_free_async(p + 1, S1).err(),
            CupoolStatus::CupoolErrorInvalidPointer,
        ),
        (rt.free(p).err(), CupoolStatus::CupoolErrorInvalidPointer),
    ];
    for (i, (got, want)) in checks.into_iter().enumerate() {
        assert_eq!(got, Some(want), "check {i}");
    }
    let after = rt.host_stats();
    assert_eq!(before, after, "no bad call changed the pool");
    assert_eq!(rt.host_block_containing(p + 99).map(|b| b.ptr), Some(p));
    fill(p, 100 * KIB, 7);
    rt.host_free(p).unwrap();
    assert_eq!(rt.host_free(p), Err(CupoolStatus::CupoolErrorDoubleFree));
    assert_eq!(
        rt.host_free_async(p, S1),
        Err(CupoolStatus::CupoolErrorDoubleFree)
    );
    assert_eq!(rt.host_stats().num_frees, before.num_frees + 1);
    rt.free(device).unwrap();
    rt.host_check().unwrap();
}

#[test]
fn out_of_memory_releases_idle_chunks_retries_and_then_fails_cleanly() {
    let (_g, rt, host, _ctx) = serial();
    host.set_pinned_capacity(9 * MIB as u64);
    let before = rt.host_stats();
    let a = rt.host_alloc(3 * MIB).unwrap(); // a 4 MiB chunk
    rt.host_free(a).unwrap();
    // 6 MiB more would pass the capacity while `a`'s idle chunk is held: it goes back.
    let b = rt.host_alloc(5 * MIB + 1).unwrap();
    let s = rt.host_stats();
    assert_eq!(s.alloc_retries - before.alloc_retries, 1);
    assert_eq!(s.driver_frees - before.driver_frees, 1);
    assert_eq!(s.num_ooms, before.num_ooms);
    // Nothing idle is left to give back: a clean out-of-memory, nothing lost.
    let err = rt.host_alloc(6 * MIB);
    assert_eq!(err, Err(CupoolStatus::CupoolErrorOutOfMemory));
    let s = rt.host_stats();
    assert_eq!(s.num_ooms - before.num_ooms, 1);
    assert_eq!(s.allocated_bytes.current, 6 * MIB as u64);
    // A driver error other than out-of-memory is reported as such, without a retry.
    host.fail_next_pinned_alloc(BackendError::Driver(999));
    assert_eq!(rt.host_alloc(2 * MIB), Err(CupoolStatus::CupoolErrorCuda));
    host.set_pinned_capacity(u64::MAX);
    rt.host_free(b).unwrap();
    rt.host_empty_cache().unwrap();
    assert_eq!(host.pinned_counters().live, 0);
    rt.host_check().unwrap();
}

#[test]
fn no_fence_is_recorded_and_nothing_released_during_a_capture() {
    let (_g, rt, host, ctx) = serial();
    let n = 32 * MIB;
    let a = rt.host_alloc(n).unwrap();
    rt.capture_begin_current().unwrap();
    let fences = host.counters().fences_recorded;
    rt.host_free(a).unwrap();
    // Reusing `a` needs a fence in every context, and this one has a capture open.
    let grown = rt.host_alloc(n);
    assert_eq!(
        grown,
        Err(CupoolStatus::CupoolErrorStreamCapture),
        "the capturing thread's own miss takes nothing from the driver"
    );
    assert_eq!(rt.host_empty_cache(), Ok(0), "no wait, no release");
    // Another thread may grow the pool meanwhile (Note [growth during another thread's
    // capture]), in the same context.
    let other = std::thread::spawn(move || {
        let (rt, host, _) = setup();
        host.make_current(ctx);
        rt.host_alloc(n)
    })
    .join()
    .unwrap()
    .unwrap();
    assert_ne!(other, a);
    assert_eq!(
        host.counters().fences_recorded,
        fences,
        "no fence anywhere during the capture"
    );
    rt.capture_end_current().unwrap();
    assert_eq!(rt.host_alloc(n), Ok(a), "fenced once the capture ended");
    for p in [a, other] {
        rt.host_free(p).unwrap();
    }
    rt.host_check().unwrap();
}

#[test]
fn threads_share_the_pool_without_mixing_blocks() {
    let (_g, rt, _host, ctx) = serial();
    let before = rt.host_stats();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            std::thread::spawn(move || {
                let (rt, host, _) = setup();
                host.make_current(ctx);
                let mut live: Vec<(u64, usize, u8)> = Vec::new();
                for i in 0..2000usize {
                    if live.len() > 16 || (i % 3 == 0 && !live.is_empty()) {
                        let (p, len, byte) = live.swap_remove(i % live.len());
                        assert!(holds(p, len, byte), "thread {t}: block overwritten");
                        if i % 2 == 0 {
                            rt.host_free(p).unwrap();
                        } else {
                            rt.host_free_async(p, S1 + t as usize).unwrap();
                        }
                    } else {
                        let len = [100, 4096, 70_000, 900 * KIB, 3 * MIB][(i * 7 + t as usize) % 5];
                        let byte = (i % 251) as u8;
                        let p = if i % 2 == 0 {
                            rt.host_alloc(len).unwrap()
                        } else {
                            rt.host_alloc_async(len, S1 + t as usize).unwrap()
                        };
                        fill(p, len, byte);
                        live.push((p, len, byte));
                    }
                }
                for (p, len, byte) in live {
                    assert!(holds(p, len, byte));
                    rt.host_free(p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = rt.host_stats();
    assert_eq!(
        s.num_allocs - before.num_allocs,
        s.num_frees - before.num_frees
    );
    assert_eq!(s.allocated_bytes.current, 0);
    assert!(s.cache_hits - before.cache_hits > s.cache_misses - before.cache_misses);
    rt.host_check().unwrap();
    rt.host_empty_cache().unwrap();
    assert_eq!(rt.host_stats().reserved_bytes.current, 0);
}
