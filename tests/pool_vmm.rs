//! The VMM arena prototype (`vmm:on`) on the host backend: every byte usable, invariants
//! (pins, stealable granules, reserved = physical memory held), nothing leaks after
//! `empty_cache`, footprint follows the live bytes, capture and fence safety.
//!
//! The host backend's VMM counters are process-wide, so the tests of this binary run one
//! at a time (`SERIAL`) and each leaves nothing behind.

mod host_pool;

use cupool::backend::host::HOST_VMM_GRANULE as G;
use cupool::backend::BackendError;
use cupool::runtime::Runtime;
use cupool::CupoolStatus;
use host_pool::{empty_and_check_nothing_left, setup_on, setup_vmm, S1, S2};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());
const MIB: u64 = 1 << 20;

fn fill(p: u64, n: u64, v: u8) {
    // SAFETY: the pool handed out at least n bytes at p (mapped host memory).
    unsafe { std::ptr::write_bytes(p as *mut u8, v, n as usize) };
}

fn holds(p: u64, n: u64, v: u8) -> bool {
    // SAFETY: as for fill.
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, n as usize) };
    s.iter().all(|&b| b == v)
}

/// Sets option `key` back to its default.
fn set_default(key: &str) {
    let o = cupool::config::OPTIONS.iter().find(|o| o.key == key);
    cupool::config::set(key, o.expect("a known option").default).unwrap();
}

/// Replays `t` on the host backend with its simulated device `lag_us` microseconds behind
/// (the replay's model of a GPU behind the program).
fn replay_lagging(
    rt: &'static Runtime,
    t: &cupool::trace::Trace,
    lag_us: u64,
) -> cupool::trace::replay::ReplayReport {
    let opts = cupool::trace::replay::ReplayOptions {
        gpu_lag_us: lag_us,
        ..Default::default()
    };
    cupool::trace::replay::replay(rt, t, &opts, &mut |_| {}).unwrap()
}

/// A trace event of thread 1 at `t` µs made without a stream (a `cudaMalloc`/`cudaFree`
/// under the preload).
fn streamless_event(
    t: u64,
    action: cupool::trace::Action,
    ptr: u64,
    size: u64,
) -> cupool::trace::TraceEvent {
    let mut ev = cupool::trace::TraceEvent::rmm(1, t, action, ptr, size, 0);
    ev.streamless = true;
    ev
}

/// An option set for one test and put back to its default when the test ends, failed or
/// not, so that the tests after it run with the defaults.
struct OptionFor(&'static str);

impl OptionFor {
    fn set(key: &'static str, value: &str) -> Self {
        cupool::config::set(key, value).unwrap();
        OptionFor(key)
    }
}

impl Drop for OptionFor {
    fn drop(&mut self) {
        set_default(self.0);
    }
}

#[test]
fn every_byte_is_usable_while_memory_moves() {
    bytes_stay_usable_while_memory_moves(true);
}

/// The same with both calls of a move on the allocating thread (`vmm_deferred_unmap:false`).
#[test]
fn every_byte_is_usable_while_memory_moves_unmapped_at_once() {
    bytes_stay_usable_while_memory_moves(false);
}

fn bytes_stay_usable_while_memory_moves(deferred_unmap: bool) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let _deferred = OptionFor::set(
        "vmm_deferred_unmap",
        if deferred_unmap { "true" } else { "false" },
    );
    let pool = rt.context_pool(ctx).unwrap_or_else(|_| {
        let p = rt.alloc(1).unwrap();
        rt.free(p).unwrap();
        rt.context_pool(ctx).unwrap()
    });
    let sizes = [
        MIB + 1,
        3 * MIB,
        5 * MIB + 512,
        2 * MIB,
        17 * MIB + 3,
        40 * MIB,
        1_500_000,
    ];
    let mut live: Vec<(u64, u64, u8)> = Vec::new();
    let mut tag = 1u8;
    for round in 0..6 {
        for (i, &n) in sizes.iter().enumerate() {
            let n = n + round * 777 * 512;
            let p = if i % 2 == 0 {
                rt.alloc_async(n as usize, if round % 2 == 0 { S1 } else { S2 })
                    .unwrap()
            } else {
                rt.alloc(n as usize).unwrap()
            };
            fill(p, n, tag);
            live.push((p, n, tag));
            tag = tag.wrapping_add(1).max(1);
        }
        // Free every other block: their granules become stealable once fenced, and the next
        // round's blocks (of other sizes) take their physical memory.
        let mut keep = Vec::new();
        for (k, b) in live.drain(..).enumerate() {
            if k % 2 == 0 {
                assert!(holds(b.0, b.1, b.2), "block {:#x} lost its contents", b.0);
                rt.free(b.0).unwrap();
            } else {
                keep.push(b);
            }
        }
        live = keep;
        host.complete_all(ctx.id);
        pool.check_invariants().unwrap();
        for &(p, n, v) in &live {
            assert!(holds(p, n, v), "block {p:#x} was overwritten or unmapped");
        }
    }
    let v = pool.vmm_stats();
    assert!(v.enabled && v.range_bytes > 0);
    assert!(
        v.unmaps > 0 || v.stale_bytes > 0,
        "memory was stitched from freed blocks"
    );
    let u = pool.unmapper_counts();
    assert_eq!(u.failures, 0);
    if !deferred_unmap {
        assert_eq!((u.stale, u.worker_calls, u.inline_calls), (0, 0, 0));
    } else {
        assert!(pool.settle_unmaps(std::time::Duration::from_secs(10)));
        assert!(
            pool.unmapper_counts().worker_calls > 0,
            "the worker unmapped old places"
        );
    }
    let report = pool.check_invariants().unwrap();
    assert_eq!(
        report.reserved,
        rt.context_stats(ctx).unwrap().reserved_bytes.current
    );
    for (p, n, v) in live {
        assert!(holds(p, n, v));
        rt.free(p).unwrap();
    }
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn growing_sizes_keep_reserved_near_the_live_peak() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let run = |on: bool| {
        let (rt, host, ctx) = setup_vmm(on);
        // Each step frees the previous tensor and takes a slightly larger one, as a KV cache
        // grown by concatenation does; two are live at once.
        let mut prev = rt.alloc(2 * MIB as usize).unwrap();
        let mut peak_live = 0;
        for i in 1..120u64 {
            let n = 2 * MIB + i * 1_437_184;
            let p = rt.alloc(n as usize).unwrap();
            fill(p, 4096, 7);
            peak_live = peak_live.max(n + 2 * MIB + (i - 1) * 1_437_184);
            rt.free(prev).unwrap();
            prev = p;
        }
        rt.free(prev).unwrap();
        let s = rt.context_stats(ctx).unwrap();
        rt.context_pool(ctx).unwrap().check_invariants().unwrap();
        let peak = s.reserved_bytes.peak;
        empty_and_check_nothing_left(rt, host, ctx);
        (peak, peak_live)
    };
    let (on, live) = run(true);
    let (off, _) = run(false);
    eprintln!("growing: live peak {live}, reserved peak vmm on {on}, off {off}");
    // Live peak plus the granules shared at block edges, and one block freed but not yet
    // fenced (streamless frees wait for a fence before their memory can move).
    assert!(
        on <= live + 4 * G,
        "vmm: reserved peak {on} for a live peak of {live}"
    );
    assert!(on < off, "vmm on {on} should beat segments {off}");
}

#[test]
fn stream_ordered_growth_tracks_live_bytes_closely() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let mut peak_live = 0;
    let mut prev: Option<(u64, u64)> = None;
    for i in 0..200u64 {
        let n = 3 * MIB + (i * 7_919 * 512) % (60 * MIB);
        let p = rt.alloc_async(n as usize, S1).unwrap();
        fill(p, n, (i % 250) as u8 + 1);
        peak_live = peak_live.max(n + prev.map_or(0, |x| x.1));
        if let Some((q, _)) = prev.take() {
            rt.free_async(q, S1).unwrap();
        }
        prev = Some((p, n));
    }
    rt.free_async(prev.unwrap().0, S1).unwrap();
    rt.flush_thread_cache();
    let s = rt.context_stats(ctx).unwrap();
    eprintln!(
        "stream growth: live peak {peak_live}, reserved peak {}",
        s.reserved_bytes.peak
    );
    assert!(
        s.reserved_bytes.peak <= peak_live + 4 * G,
        "reserved peak {} for live peak {peak_live}",
        s.reserved_bytes.peak
    );
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn blocks_awaiting_a_fence_keep_their_memory_mapped() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    host.set_manual_completion(ctx.id, true);
    let a = rt.alloc(20 * MIB as usize).unwrap();
    fill(a, 20 * MIB, 0xab);
    rt.free(a).unwrap();
    let unmaps = host.counters().vmm_unmaps;
    // The device may still read `a`: its granules may not move to `b`.
    let b = rt.alloc(24 * MIB as usize).unwrap();
    assert_ne!(a, b);
    assert_eq!(
        host.counters().vmm_unmaps,
        unmaps,
        "nothing unmapped under a pending free"
    );
    assert!(
        holds(a, 20 * MIB, 0xab),
        "the pending block is still mapped, contents intact"
    );
    fill(b, 24 * MIB, 1);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    rt.free(b).unwrap();
    host.set_manual_completion(ctx.id, false);
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn a_streams_own_mapped_free_beats_a_smaller_unmapped_shared_fit() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let own = rt.alloc_async(30 * MIB as usize, S1).unwrap();
    let hole = rt.alloc(20 * MIB as usize).unwrap();
    let spacer = rt.alloc(4 * MIB as usize).unwrap();
    // The hole goes back to the driver: a free shared block smaller than `own`, unmapped.
    rt.free(hole).unwrap();
    host.complete_all(ctx.id);
    rt.empty_cache(Some(0)).unwrap();
    // The device is behind: the freed block stays on its stream's list.
    host.set_manual_completion(ctx.id, true);
    rt.free_async(own, S1).unwrap();
    let maps = host.counters().vmm_maps;
    // The shared index's best fit by size is the hole, which needs granules mapped; the
    // stream's own free block is mapped and serves the request without a driver call.
    let p = rt.alloc_async(18 * MIB as usize, S1).unwrap();
    assert_eq!(p, own, "the stream's own block, already mapped");
    assert_eq!(host.counters().vmm_maps, maps, "no driver mapping");
    fill(p, 18 * MIB, 7);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    rt.free_async(p, S1).unwrap();
    rt.free(spacer).unwrap();
    host.set_manual_completion(ctx.id, false);
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn an_out_of_memory_retry_that_releases_the_arena_still_carves_from_one() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let p = rt.alloc((20 * MIB) as usize).unwrap();
    rt.free(p).unwrap();
    host.complete_all(ctx.id);
    let segments = host.counters().allocs;
    // The first creation fails: the retry releases everything idle, the whole arena with
    // it, and grows again.
    host.fail_next_create(BackendError::OutOfMemory);
    let q = rt.alloc((40 * MIB) as usize).unwrap();
    assert_eq!(
        host.counters().allocs,
        segments,
        "no plain segment for the block"
    );
    let pool = rt.context_pool(ctx).unwrap();
    assert!(pool.vmm_stats().mapped_bytes >= 40 * MIB, "from the arena");
    fill(q, 40 * MIB, 9);
    pool.check_invariants().unwrap();
    rt.free(q).unwrap();
    host.complete_all(ctx.id);
    empty_and_check_nothing_left(rt, host, ctx);
}

#[test]
fn no_mapping_while_a_capture_is_active() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    // Map 8 MiB and cache it.
    let a = rt.alloc_async(8 * MIB as usize, S1).unwrap();
    rt.free_async(a, S1).unwrap();
    rt.flush_thread_cache();
    let before = host.counters();
    rt.capture_begin(ctx.id);
    // A cached, mapped block is still handed out.
    let b = rt.alloc_async(8 * MIB as usize, S1).unwrap();
    fill(b, 8 * MIB, 3);
    // One that needs new granules is refused, with no driver call.
    let r = rt.alloc_async(64 * MIB as usize, S2);
    assert!(r.is_err(), "growth during a capture: {r:?}");
    let during = host.counters();
    assert_eq!(
        (during.vmm_maps, during.vmm_unmaps, during.vmm_creates),
        (before.vmm_maps, before.vmm_unmaps, before.vmm_creates)
    );
    rt.capture_end(ctx.id);
    rt.free_async(b, S1).unwrap();
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    empty_and_check_nothing_left(rt, host, ctx);
}

/// Device 1, for its memory limit.
#[test]
fn the_limit_holds_and_stitching_serves_requests_under_it() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_on(1);
    cupool::config::set("vmm", "on").unwrap();
    rt.set_memory_limit(1, 64 * MIB).unwrap();
    // Sizes that never repeat, 40 MiB live at most: only stitching keeps this under 64 MiB.
    for i in 0..50u64 {
        let n = 10 * MIB + i * 300_544;
        let p = rt.alloc_async(n as usize, S1).unwrap();
        let q = rt.alloc(n as usize).unwrap();
        fill(p, n, 1);
        fill(q, n, 2);
        assert!(holds(p, n, 1));
        rt.free_async(p, S1).unwrap();
        rt.free(q).unwrap();
    }
    assert!(rt.context_stats(ctx).unwrap().reserved_bytes.peak <= 64 * MIB);
    assert_eq!(
        rt.alloc_async(100 * MIB as usize, S2),
        Err(CupoolStatus::CupoolErrorOutOfMemory)
    );
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    // Physical memory creation failing once: the pool stays consistent and works after.
    host.fail_next_create(BackendError::OutOfMemory);
    let r = rt.alloc_async(30 * MIB as usize, S2);
    rt.context_pool(ctx).unwrap().check_invariants().unwrap();
    if let Ok(p) = r {
        fill(p, 30 * MIB, 9);
        rt.free_async(p, S2).unwrap();
    }
    rt.flush_thread_cache();
    host.complete_all(ctx.id);
    rt.empty_cache(Some(1)).unwrap();
    rt.set_memory_limit(1, 0).unwrap();
    let c = host.counters();
    assert_eq!((c.vmm_mappings, c.vmm_handles, c.vmm_ranges), (0, 0, 0));
    assert_eq!(rt.context_stats(ctx).unwrap().reserved_bytes.current, 0);
}

#[test]
fn stats_report_the_arena_mapping() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let a = rt.alloc(3 * MIB as usize).unwrap();
    let pool = rt.context_pool(ctx).unwrap();
    let v = pool.vmm_stats();
    assert!(v.enabled && v.mapped_bytes > 0);
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.mapped_bytes.current, v.mapped_bytes);
    assert_eq!(s.granules, v.mapped_bytes / G);
    assert_eq!(s.segments, 1, "the arena counts as one segment");
    assert_eq!(
        s.inactive_split_bytes,
        v.mapped_bytes - s.allocated_bytes.current,
        "the free part of the granule the block ends in is not releasable"
    );
    let b = rt.alloc(9 * MIB as usize).unwrap();
    let peak = pool.vmm_stats().mapped_bytes;
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(s.mapped_bytes.current, peak);
    assert_eq!(s.mapped_bytes.peak, peak);
    assert_eq!(s.granules, peak / G);
    rt.free(a).unwrap();
    rt.free(b).unwrap();
    empty_and_check_nothing_left(rt, host, ctx);
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!((s.mapped_bytes.current, s.granules, s.segments), (0, 0, 0));
    assert_eq!(
        s.mapped_bytes.peak, peak,
        "the peak outlives the released arena"
    );
    pool.reset_peaks();
    assert_eq!(rt.context_stats(ctx).unwrap().mapped_bytes.peak, 0);
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [footprint parts]: the pool's account of where its reserved bytes are adds up to them
/// exactly. Three blocks laid back to back from the arena's start (3, 3.5 and 3 MiB over
/// granules 0–4), the middle one freed: its hole keeps 1 MiB of granule 1 and 0.5 MiB of
/// granule 3 (shared with its neighbours), the arena's free tail 0.5 MiB of granule 4, and
/// granule 2 stays mapped in the chunk of granules 2–3, which the third block keeps busy.
#[test]
fn the_footprint_accounts_for_every_reserved_byte() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    // Chunks of `vmm_chunk` (8 MiB) from the start, for the layout above.
    let _divisor = OptionFor::set("vmm_chunk_divisor", "0");
    let a = rt.alloc(3 * MIB as usize).unwrap();
    let b = rt.alloc((3 * MIB + MIB / 2) as usize).unwrap();
    let c = rt.alloc(3 * MIB as usize).unwrap();
    assert_eq!(
        (b - a, c - b),
        (3 * MIB, 3 * MIB + MIB / 2),
        "laid back to back"
    );
    let pool = rt.context_pool(ctx).unwrap();
    let f = pool.footprint();
    assert_eq!(f.reserved, 5 * G);
    assert_eq!(f.in_use, 9 * MIB + MIB / 2);
    assert_eq!(
        f.arena_hole_ends,
        MIB / 2,
        "the free tail's part of granule 4"
    );
    rt.free(b).unwrap();
    let f = pool.footprint();
    assert_eq!(
        f.awaiting_fence,
        3 * MIB + MIB / 2,
        "freed without a stream"
    );
    assert_eq!(f.in_use, 6 * MIB);
    // The fence completes and the block joins the shared index; idle memory goes back.
    rt.empty_cache(Some(0)).unwrap();
    let f = pool.footprint();
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(f.reserved, s.reserved_bytes.current);
    assert_eq!(
        f.reserved,
        5 * G,
        "nothing could go back: every chunk is busy"
    );
    assert_eq!(f.in_use, s.allocated_bytes.current);
    assert_eq!(f.awaiting_fence, 0);
    assert_eq!(f.arena_hole_ends, MIB + MIB / 2 + MIB / 2);
    assert_eq!(f.arena_in_busy_chunks, G, "granule 2");
    assert_eq!((f.arena_stealable, f.arena_idle), (0, 0));
    assert_eq!(f.other, 0);
    assert_eq!(f.accounted(), f.reserved);
    rt.free(a).unwrap();
    rt.free(c).unwrap();
    empty_and_check_nothing_left(rt, host, ctx);
    assert_eq!(pool.footprint(), cupool::pool::Footprint::default());
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [footprint at peak]: the pool keeps where its reserved bytes were when they were
/// highest, after the blocks of that moment are gone; a peak reset drops it and the next
/// growth above the old footprint takes it again. Through the C export too.
#[test]
fn the_footprint_at_the_peak_outlives_the_peak() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let pool = rt.context_pool(ctx).unwrap();
    rt.reset_peak_stats(Some(0)).unwrap();
    assert_eq!(pool.footprint_at_peak(), None, "no growth since the reset");
    let a = rt.alloc(3 * MIB as usize).unwrap();
    let b = rt.alloc(5 * MIB as usize).unwrap();
    let at_two = pool.footprint_at_peak().expect("the pool grew");
    assert_eq!(at_two.in_use, 8 * MIB);
    rt.free(a).unwrap();
    // The fence completes; the pool then holds what it held at the peak, with a block less.
    rt.empty_cache(Some(0)).unwrap();
    let now = pool.footprint();
    let peak = pool.footprint_at_peak().unwrap();
    assert_eq!(now.in_use, 5 * MIB);
    assert_eq!(
        peak, at_two,
        "a free takes nothing from the peak's footprint"
    );
    assert_eq!(peak.accounted() + peak.other, peak.reserved);
    assert_eq!(
        peak.reserved,
        rt.context_stats(ctx).unwrap().reserved_bytes.peak
    );
    // A larger block than the arena holds: the pool grows past its peak and takes the
    // footprint there.
    let c = rt.alloc(20 * MIB as usize).unwrap();
    let higher = pool.footprint_at_peak().unwrap();
    assert!(higher.reserved > peak.reserved);
    assert_eq!(higher.in_use, 25 * MIB);
    assert_eq!(
        higher.reserved,
        rt.context_stats(ctx).unwrap().reserved_bytes.peak
    );

    // The C export: both footprints, by device, with the replay's keys.
    let mut needed = 0usize;
    assert_eq!(
        unsafe {
            cupool::ffi::device::cupool_footprint_json(0, std::ptr::null_mut(), 0, &mut needed)
        },
        CupoolStatus::CupoolErrorBufferTooSmall
    );
    let mut buf = vec![0u8; needed];
    assert_eq!(
        unsafe {
            cupool::ffi::device::cupool_footprint_json(
                0,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut needed,
            )
        },
        CupoolStatus::CupoolOk
    );
    let text = std::ffi::CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_str()
        .unwrap();
    assert!(
        text.starts_with("{\"devices\":[{\"device\":0,\"now\":{\"reserved_bytes\":"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "\"at_peak\":{{\"reserved_bytes\":{},\"in_use_bytes\":{}",
            higher.reserved,
            25 * MIB
        )),
        "{text}"
    );
    // The arena's mapping work so far, as `vmm_stats` counts it.
    let vmm = pool.vmm_stats();
    assert!(vmm.map_calls > 0, "{vmm:?}");
    assert!(
        text.contains(&format!(
            "\"vmm\":{{\"enabled\":true,\"range_bytes\":{},\"mapped_bytes\":{},",
            vmm.range_bytes, vmm.mapped_bytes
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "\"maps\":{},\"unmaps\":{},\"map_calls\":{},\"unmap_calls\":{},",
            vmm.maps, vmm.unmaps, vmm.map_calls, vmm.unmap_calls
        )),
        "{text}"
    );
    // The fence calls' estimated time (Note [fence call times]), as the pool reads it.
    let fences = pool.fence_time_stats();
    assert!(
        text.contains(&format!(
            "\"fences\":{{\"record_ns\":{},\"record_sampled\":{},",
            fences.estimated_ns[0], fences.sampled[0]
        )),
        "{text}"
    );
    assert_eq!(
        unsafe {
            cupool::ffi::device::cupool_footprint_json(
                -2,
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        },
        CupoolStatus::CupoolErrorInvalidDevice
    );

    rt.reset_peak_stats(Some(0)).unwrap();
    assert_eq!(pool.footprint_at_peak(), None, "dropped by the reset");
    rt.free(b).unwrap();
    rt.free(c).unwrap();
    empty_and_check_nothing_left(rt, host, ctx);
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [footprint at peak]: a growth that leaves reserved bytes less than 1/64 above the
/// kept footprint's does not walk the free lists again; one past that does.
#[test]
fn the_footprint_at_the_peak_is_taken_again_only_past_a_step() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let pool = rt.context_pool(ctx).unwrap();
    rt.reset_peak_stats(Some(0)).unwrap();
    let peak = || rt.context_stats(ctx).unwrap().reserved_bytes.peak;
    let big = rt.alloc(256 * MIB as usize).unwrap();
    let first = pool.footprint_at_peak().expect("the pool grew");
    assert_eq!(first.reserved, peak());
    // A small block: a small segment, far less than 1/64 of 256 MiB.
    let small = rt.alloc(4096).unwrap();
    assert!(peak() > first.reserved, "the pool grew");
    assert!(peak() <= first.reserved + first.reserved / 64);
    assert_eq!(pool.footprint_at_peak(), Some(first), "not taken again");
    // 64 MiB more: past the step, taken again at the new peak.
    let more = rt.alloc(64 * MIB as usize).unwrap();
    let again = pool.footprint_at_peak().unwrap();
    assert_eq!(again.reserved, peak());
    assert!(again.in_use >= 320 * MIB + 4096, "{again:?}");
    for p in [big, small, more] {
        rt.free(p).unwrap();
    }
    empty_and_check_nothing_left(rt, host, ctx);
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [wait before growing], in the arena: a buffer freed without a stream while the
/// device is behind and allocated again a little larger (a KV cache grown step by step)
/// waits for the fence of the old one, whose memory then moves to the new block, instead
/// of the pool holding both. Without a stream it waits even when the old copy covers only
/// a third of the request (any granule saved); on a stream, a third is too little.
#[test]
fn a_growing_buffer_waits_for_its_old_copy_instead_of_holding_two() {
    use cupool::trace::{Action, Trace, TraceEvent};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, _ctx) = setup_vmm(true);
    // Steps of 10 µs, each buffer 8 MiB larger than the one it replaces.
    let grow = |from: u64, step: u64| {
        let mut events = Vec::new();
        let mut size = from;
        for i in 0..8u64 {
            let ptr = 0x7f00_0000_0000 + (i << 32);
            events.push(streamless_event(20 * i, Action::Allocate, ptr, size));
            events.push(streamless_event(20 * i + 10, Action::Free, ptr, size));
            size += step;
        }
        Trace::from_events(events, Vec::new())
    };
    // 64 MiB growing by 8 MiB up to 120 MiB; the device 5 ms behind.
    let t = grow(64 * MIB, 8 * MIB);
    let lagging = replay_lagging(rt, &t, 5000);
    assert!(
        lagging.simulated_wait_us > 0,
        "each step waited for the fence"
    );
    assert!(
        lagging.peak_reserved_bytes <= 120 * MIB + 2 * G,
        "one copy at a time: {} MiB",
        lagging.peak_reserved_bytes / MIB
    );
    // With the device in step the same trace holds one copy too, and never waits.
    let in_step = replay_lagging(rt, &t, 0);
    assert_eq!(in_step.simulated_wait_us, 0);
    assert!(in_step.peak_reserved_bytes <= 120 * MIB + 2 * G);
    // Growing threefold each step, 4 MiB up to 108 MiB: the old copy covers a third of
    // the new one. `stream` None makes each pair a `cudaMalloc`/`cudaFree`.
    let threefold = |stream: Option<u64>| {
        let events: Vec<TraceEvent> = (0..4u64)
            .flat_map(|i| {
                let (ptr, size) = (0x7f00_0000_0000 + (i << 32), 4 * MIB * 3u64.pow(i as u32));
                let at = |t, action| match stream {
                    None => streamless_event(t, action, ptr, size),
                    Some(s) => TraceEvent::rmm(1, t, action, ptr, size, s),
                };
                [at(20 * i, Action::Allocate), at(20 * i + 10, Action::Free)]
            })
            .collect();
        Trace::from_events(events, Vec::new())
    };
    // Without a stream the third is waited for (its `cudaFree` would have waited), and it
    // moves: one copy and a third's growth.
    let r = replay_lagging(rt, &threefold(None), 5000);
    assert!(r.simulated_wait_us > 0, "waited for a third of the request");
    assert!(
        r.peak_reserved_bytes <= 108 * MIB + 2 * G,
        "one copy held: {} MiB",
        r.peak_reserved_bytes / MIB
    );
    // On a stream, a third of the request is too little to stall for: both copies held.
    let r = replay_lagging(rt, &threefold(Some(7)), 5000);
    assert_eq!(r.simulated_wait_us, 0, "no wait for a third of the request");
    assert!(
        r.peak_reserved_bytes >= 108 * MIB + 36 * MIB,
        "both copies held: {} MiB",
        r.peak_reserved_bytes / MIB
    );
    cupool::config::set("vmm", "off").unwrap();
}

/// A replay's `second_half` counts the arena's driver calls from the trace's middle event
/// on: a block mapped in the first half and taken again in the second moves nothing there.
#[test]
fn the_replays_second_half_counts_the_steady_state_only() {
    use cupool::trace::{Action, Trace};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, _ctx) = setup_vmm(true);
    let ptr = 0x7f00_0000_0000;
    let pair = |t: u64, size: u64| {
        [
            streamless_event(t, Action::Allocate, ptr, size),
            streamless_event(t + 10, Action::Free, ptr, size),
        ]
    };
    let again: Vec<_> = [pair(0, 64 * MIB), pair(20, 64 * MIB)].concat();
    let r = replay_lagging(rt, &Trace::from_events(again, Vec::new()), 0);
    assert!(
        r.map_calls > 0 && r.device_allocs > 0,
        "the first block maps"
    );
    let half = r.second_half.expect("four events");
    assert_eq!(
        half.calls(),
        0,
        "the same block again moves nothing: {half:?}"
    );
    // A second block twice as large needs memory of its own in the second half.
    let larger: Vec<_> = [pair(0, 64 * MIB), pair(20, 128 * MIB)].concat();
    let r = replay_lagging(rt, &Trace::from_events(larger, Vec::new()), 0);
    let half = r.second_half.expect("four events");
    assert!(half.map_calls > 0, "{half:?}");
    assert!(
        half.map_calls < r.map_calls,
        "the first half's maps are not counted: {r:?}"
    );
    assert_eq!(half.granule_maps, 32, "64 MiB more are mapped: {half:?}");
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [wait before growing], frees on a stream: a buffer freed on a stream while the
/// device is behind and allocated again larger on the same stream (PyTorch's frees through
/// `cupool.torch.enable()`) waits for the fence of the old one once it covers half of the
/// request, and its memory moves to the new block. Frees on another stream do not count
/// toward that half: that stream could reuse them at once.
#[test]
fn a_buffer_freed_on_its_stream_moves_to_a_larger_one_instead_of_holding_two() {
    use cupool::trace::{Action, Trace, TraceEvent};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, _ctx) = setup_vmm(true);
    // Each buffer 1.5 times the one before, from 64 MiB: no freed block fits the next
    // request, and each covers two thirds of it. `steps` buffers, each allocated and freed
    // on a stream of `streams` in turn. Returns the trace and its largest buffer.
    let trace = |steps: u64, streams: &[u64]| {
        let mut events = Vec::new();
        let mut size = 64 * MIB;
        let mut largest = size;
        for i in 0..steps {
            let ptr = 0x7f00_0000_0000 + (i << 32);
            let s = streams[i as usize % streams.len()];
            events.push(TraceEvent::rmm(1, 20 * i, Action::Allocate, ptr, size, s));
            events.push(TraceEvent::rmm(1, 20 * i + 10, Action::Free, ptr, size, s));
            largest = size;
            size = size * 3 / 2;
        }
        (Trace::from_events(events, Vec::new()), largest)
    };
    // Seven buffers, 64 MiB up to 729 MiB, all on one stream.
    let (same, largest) = trace(7, &[7]);
    let r = replay_lagging(rt, &same, 5000);
    assert!(r.simulated_wait_us > 0, "each step waited for the fence");
    assert!(
        r.peak_reserved_bytes <= largest + 2 * G,
        "one copy at a time: {} MiB held for {} MiB",
        r.peak_reserved_bytes / MIB,
        largest / MIB
    );
    // 64 MiB freed on another stream than the 96 MiB request's: two thirds of it, but no
    // wait, and both held. (Frees of any stream that cover a whole request are waited for:
    // that rule is older and is not what this checks.)
    let (other, _) = trace(2, &[9, 7]);
    let r = replay_lagging(rt, &other, 5000);
    assert_eq!(
        r.simulated_wait_us, 0,
        "another stream's frees are not waited for"
    );
    assert!(
        r.peak_reserved_bytes >= 160 * MIB,
        "both held: {} MiB",
        r.peak_reserved_bytes / MIB
    );
    // The same two on one stream: the wait, and one copy.
    let (one, _) = trace(2, &[7]);
    let r = replay_lagging(rt, &one, 5000);
    assert!(r.simulated_wait_us > 0);
    assert!(
        r.peak_reserved_bytes <= 96 * MIB + 2 * G,
        "one copy: {} MiB",
        r.peak_reserved_bytes / MIB
    );
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [wait before growing], the second rule: a request that the arena's stealable memory
/// covers but for a little waits when frees awaiting their fence cover that little, though
/// they are far from half of the request: waiting saves the whole growth.
#[test]
fn a_request_waits_when_pending_frees_cover_what_the_arena_would_create() {
    use cupool::trace::{Action, Trace};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, _ctx) = setup_vmm(true);
    // Each free records its fence at once, so that X's has completed by the request.
    let _batch = OptionFor::set("fence_batch", "1");
    let (x, y, z) = (0x7f00_0000_0000, 0x7f01_0000_0000, 0x7f02_0000_0000);
    let events = vec![
        streamless_event(0, Action::Allocate, x, 200 * MIB),
        streamless_event(10, Action::Allocate, y, 60 * MIB),
        // X's fence completes long before Y is freed: X's memory is the arena's to move.
        streamless_event(20, Action::Free, x, 200 * MIB),
        streamless_event(20_000, Action::Free, y, 60 * MIB),
        // 250 MiB at once: X's 200 MiB and 50 MiB more, which Y (awaiting its fence, a
        // quarter of the request) covers.
        streamless_event(20_010, Action::Allocate, z, 250 * MIB),
        streamless_event(20_020, Action::Free, z, 250 * MIB),
    ];
    let t = Trace::from_events(events, Vec::new());
    let r = replay_lagging(rt, &t, 5000);
    assert!(r.simulated_wait_us > 0, "waited for Y's fence");
    assert!(
        r.peak_reserved_bytes <= 260 * MIB + 2 * G,
        "Z in X's and Y's memory: {} MiB held",
        r.peak_reserved_bytes / MIB
    );
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [arena in snapshots]: the layout walk shows the arena as its mapped runs, each a
/// segment that its blocks tile, and not as one reserved range of a terabyte.
#[test]
fn snapshots_show_the_arena_as_its_mapped_runs() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let sizes = [3 * MIB, 12 * MIB, 40 * MIB, 5 * MIB];
    let ptrs: Vec<u64> = sizes
        .iter()
        .map(|&n| rt.alloc_async(n as usize, S1).unwrap())
        .collect();
    // A free block between blocks in use, mapped: it shows, clipped to its runs.
    rt.free_async(ptrs[1], S1).unwrap();
    let segments = rt.segments(Some(ctx.device)).unwrap();
    let arena: Vec<_> = segments.iter().filter(|s| s.arena).collect();
    let mapped = rt.context_pool(ctx).unwrap().vmm_stats().mapped_bytes;
    assert!(!arena.is_empty());
    assert_eq!(arena.iter().map(|s| s.size).sum::<u64>(), mapped);
    for seg in &arena {
        assert!(!seg.small);
        assert_eq!((seg.base % G, seg.size % G), (0, 0), "whole granules");
        let mut at = seg.base;
        for b in &seg.blocks {
            assert_eq!(b.ptr, at, "blocks tile the run at {:#x}", seg.base);
            at += b.size;
        }
        assert_eq!(at, seg.base + seg.size);
    }
    for (i, (&p, &n)) in ptrs.iter().zip(&sizes).enumerate() {
        let found = arena
            .iter()
            .flat_map(|s| &s.blocks)
            .find(|b| b.ptr == p || (b.ptr..b.ptr + b.size).contains(&p));
        let b = found.unwrap_or_else(|| panic!("block {p:#x} in no run"));
        if i == 1 {
            assert!(!b.allocated);
        } else {
            assert_eq!((b.ptr, b.requested, b.allocated), (p, n, true));
            assert_eq!(b.size, rt.lookup(p).unwrap().size);
        }
    }
    let json = cupool::runtime::segments_json(&segments);
    assert!(json.contains("\"is_expandable\":true"), "{json}");
    for (i, &p) in ptrs.iter().enumerate() {
        if i != 1 {
            rt.free_async(p, S1).unwrap();
        }
    }
    empty_and_check_nothing_left(rt, host, ctx);
    assert!(rt
        .segments(Some(ctx.device))
        .unwrap()
        .iter()
        .all(|s| !s.arena));
}

/// Note [arena chunks], Note [merged chunks]: with `vmm_chunk_divisor`, a pool that is still
/// small creates one-granule chunks; when a later block takes them, they are made again as
/// chunks of the size the grown pool allows, holding the same memory. A creation that fails
/// in the middle of a merge leaves the pool consistent and nothing behind.
#[test]
fn chunks_made_while_the_pool_was_small_are_merged_as_they_move() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    set_default("vmm_chunk");
    let _divisor = OptionFor::set("vmm_chunk_divisor", "2");
    // An empty pool: chunks of one granule (reserved / 2 rounds down to less than one).
    let a = rt.alloc(4 * G as usize).unwrap();
    let pool = rt.context_pool(ctx).unwrap();
    let v = pool.vmm_stats();
    assert_eq!(v.held_chunks, 4, "four one-granule chunks");
    // A block right after it pins the next granule, so the next request cannot grow `a`'s
    // place and takes its memory instead.
    let pin = rt.alloc((MIB + MIB / 2) as usize).unwrap();
    fill(pin, MIB + MIB / 2, 7);
    rt.free(a).unwrap();
    host.complete_all(ctx.id);
    let releases_before = host.counters().vmm_releases;
    let reserved_before = rt.context_stats(ctx).unwrap().reserved_bytes.current;
    let b = rt.alloc(6 * G as usize).unwrap();
    fill(b, 6 * G, 3);
    let c = host.counters();
    assert!(
        c.vmm_releases >= releases_before + 2,
        "one-granule chunks were released to be merged ({} -> {})",
        releases_before,
        c.vmm_releases
    );
    let s = rt.context_stats(ctx).unwrap();
    assert_eq!(
        s.reserved_bytes.current,
        reserved_before + 2 * G,
        "the four granules moved; only the two missing ones were new"
    );
    let v = pool.vmm_stats();
    assert!(
        v.held_chunks < 4 + 1 + 2,
        "fewer chunks than one per moved granule: {v:?}"
    );
    pool.check_invariants().unwrap();
    assert!(holds(pin, MIB + MIB / 2, 7));
    // The same move with the merge's creation failing: an error or another placement,
    // never a broken pool or a leak.
    rt.free(b).unwrap();
    host.complete_all(ctx.id);
    host.fail_next_create(BackendError::OutOfMemory);
    match rt.alloc(9 * G as usize) {
        Ok(p) => {
            fill(p, 9 * G, 5);
            assert!(holds(p, 9 * G, 5));
            rt.free(p).unwrap();
        }
        Err(e) => assert_eq!(e, CupoolStatus::CupoolErrorOutOfMemory),
    }
    host.clear_faults();
    pool.check_invariants().unwrap();
    assert!(holds(pin, MIB + MIB / 2, 7));
    rt.free(pin).unwrap();
    empty_and_check_nothing_left(rt, host, ctx);
    cupool::config::set("vmm", "off").unwrap();
}

/// Note [unmaps off the launching thread]: a moved chunk is mapped at its new place at once
/// and stays mapped where it was (a stale alias) until the worker unmaps it; a map over the
/// old place unmaps it first on the mapping thread, and `empty_cache` leaves nothing mapped.
/// The worker runs on trace time here, as in a replay (Note [simulated unmapper]): an alias
/// is unmapped once `SIMULATED_UNMAP_US` has passed since it appeared and since the unmap
/// before it, by the thread that moves the time on, and by no other thread meanwhile.
#[test]
fn a_moved_chunks_old_place_is_unmapped_later_or_when_in_the_way() {
    use cupool::pool::vmm::unmapper::SIMULATED_UNMAP_US;
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, ctx) = setup_vmm(true);
    let _deferred = OptionFor::set("vmm_deferred_unmap", "true");
    let a = rt.alloc_async(16 * MIB as usize, S1).unwrap();
    let b = rt.alloc_async(16 * MIB as usize, S1).unwrap();
    let pool = rt.context_pool(ctx).unwrap();
    pool.simulate_unmapper();
    let t = 1000;
    pool.run_simulated_unmapper(t);
    let before = pool.unmapper_counts();
    // A's memory, freed and fenced, moves under a larger block placed past B.
    rt.free(a).unwrap();
    host.complete_all(ctx.id);
    let c = rt.alloc_async(24 * MIB as usize, S2).unwrap();
    fill(c, 24 * MIB, 3);
    let u = pool.unmapper_counts();
    assert!(u.stale > before.stale, "A's place is left mapped");
    assert!(u.stale_bytes >= 8 * MIB);
    assert_eq!(
        (u.worker_calls, u.inline_calls),
        (before.worker_calls, before.inline_calls)
    );
    let v = pool.vmm_stats();
    assert!(
        host.counters().vmm_mappings > v.mapped_chunks,
        "the driver still maps the old places: {} mappings for {} chunks",
        host.counters().vmm_mappings,
        v.mapped_chunks
    );
    assert_eq!(v.stale_bytes, u.stale_bytes);
    // Too early for the worker's first unmap, and no thread makes it meanwhile.
    pool.run_simulated_unmapper(t + SIMULATED_UNMAP_US - 1);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(pool.unmapper_counts(), u);
    // A block placed where A was maps memory there: the aliases in its way go first (the
    // host backend, like the driver, refuses a mapping over another).
    let d = rt.alloc(16 * MIB as usize).unwrap();
    fill(d, 16 * MIB, 4);
    assert!(
        pool.unmapper_counts().inline_calls > before.inline_calls,
        "cleared in the way"
    );
    assert!(holds(c, 24 * MIB, 3));
    // D's memory moves under a block of 40 MiB; the worker unmaps those old places one
    // per SIMULATED_UNMAP_US of trace time from their move on.
    rt.free(d).unwrap();
    host.complete_all(ctx.id);
    let e = rt.alloc_async(40 * MIB as usize, S1).unwrap();
    fill(e, 40 * MIB, 5);
    let left = pool.unmapper_counts();
    assert!(left.stale > 0, "D's place is left mapped");
    let moved_at = t + SIMULATED_UNMAP_US - 1;
    pool.run_simulated_unmapper(moved_at + SIMULATED_UNMAP_US);
    assert_eq!(pool.unmapper_counts().worker_calls, left.worker_calls + 1);
    pool.run_simulated_unmapper(moved_at + left.stale * SIMULATED_UNMAP_US);
    let done = pool.unmapper_counts();
    assert_eq!(done.stale, 0);
    assert_eq!(done.worker_calls, left.worker_calls + left.stale);
    assert_eq!(done.failures, 0);
    for (p, s) in [(b, S1), (c, S2), (e, S1)] {
        rt.free_async(p, s).unwrap();
    }
    empty_and_check_nothing_left(rt, host, ctx);
}

/// Note [simulated unmapper]: a replay gives the same driver calls on every run, and its
/// unmapper keeps trace time: events 1 µs apart leave the worker no time for an unmap,
/// events 100 µs apart leave it time for all of them.
#[test]
fn a_replay_unmaps_moved_chunks_on_trace_time_and_repeats_exactly() {
    use cupool::trace::{Action, Trace};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, _host, _ctx) = setup_vmm(true);
    let _deferred = OptionFor::set("vmm_deferred_unmap", "true");
    // Each round, events `gap_us` apart: A and B of 16 MiB, A freed, C of 24 MiB (A's
    // memory moves under it, past B), C and B freed.
    let moves_every = |gap_us: u64| {
        let mut events = Vec::new();
        for i in 0..4u64 {
            let ptr = |k: u64| 0x7f00_0000_0000 + (i << 36) + (k << 32);
            let steps = [
                (Action::Allocate, ptr(0), 16 * MIB),
                (Action::Allocate, ptr(1), 16 * MIB),
                (Action::Free, ptr(0), 16 * MIB),
                (Action::Allocate, ptr(2), 24 * MIB),
                (Action::Free, ptr(2), 24 * MIB),
                (Action::Free, ptr(1), 16 * MIB),
            ];
            for (k, (action, p, size)) in steps.into_iter().enumerate() {
                let t = gap_us * (6 * i + k as u64);
                events.push(streamless_event(t, action, p, size));
            }
        }
        Trace::from_events(events, Vec::new())
    };
    let worker =
        |r: &cupool::trace::replay::ReplayReport| r.second_half.expect("events").worker_unmap_calls;
    let calls = |r: &cupool::trace::replay::ReplayReport| {
        (r.map_calls, r.unmap_calls, worker(r), r.peak_reserved_bytes)
    };
    let spaced = replay_lagging(rt, &moves_every(100), 0);
    assert!(worker(&spaced) > 0, "the worker had time: {spaced:?}");
    for _ in 0..3 {
        assert_eq!(
            calls(&replay_lagging(rt, &moves_every(100), 0)),
            calls(&spaced)
        );
    }
    let packed = replay_lagging(rt, &moves_every(1), 0);
    assert_eq!(worker(&packed), 0, "no time for the worker: {packed:?}");
    assert_eq!(packed.peak_reserved_bytes, spaced.peak_reserved_bytes);
    cupool::config::set("vmm", "off").unwrap();
}
