//! Where a pool's reserved bytes are at one moment: what `cupool replay` reports at the
//! peak, so that a footprint above the live bytes can be traced to its cause.
//!
//! Note [footprint parts]: the reserved bytes split without overlap into
//! - bytes of blocks the program holds (the `allocated` level);
//! - freed bytes nobody else may take yet: blocks waiting for a context fence, and blocks
//!   freed on a stream, which that stream reuses at once and others after a fence;
//! - in the VMM arena (Note [vmm arena]), free bytes in mapped memory: in granules a block
//!   in use also touches (the ends of holes between blocks: no granule can be split), in
//!   free granules of chunks another granule of which is in use (a chunk maps and unmaps
//!   whole, Note [arena chunks]), and in chunks wholly free (they move where they are needed);
//!   then physical memory mapped nowhere (idle);
//! - in segments, free bytes of segments that also hold blocks in use, and wholly free
//!   segments (which only a release gives back);
//! - the rest: blocks in threads' caches, which only their threads may read.
//!
//! The pool sees every free block it holds, so all but the first and the last come from its
//! lists, under its lock, as [`DevicePool::stats`] does (Note [fragmentation stats]);
//! blocks in use and in thread caches belong to other threads and are not read. A free
//! shared block of the arena lies over mapped granules only at its ends (pinned by a
//! neighbour) or in granules no block in use touches; the second kind are exactly the
//! unpinned granules of mapped chunks, counted per chunk.

use super::counters::Level;
use super::pool_stats::FreeTally;
use super::{thread_cache, DevicePool, Shared};

/// Where the reserved bytes of one pool are (Note [footprint parts]); every field is bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    pub reserved: u64,
    /// Blocks the program holds, after the pool's rounding.
    pub in_use: u64,
    /// Freed without a stream (or on another stream than the block's), waiting for a fence.
    pub awaiting_fence: u64,
    /// Freed on a stream: that stream reuses them at once, the others after a fence.
    pub stream_only: u64,
    /// VMM arena: free bytes in granules that blocks not free also touch (hole ends).
    pub arena_hole_ends: u64,
    /// VMM arena: free granules of chunks partly in use.
    pub arena_in_busy_chunks: u64,
    /// VMM arena: granules of mapped chunks wholly free (stealable).
    pub arena_stealable: u64,
    /// VMM arena: physical memory held and mapped nowhere.
    pub arena_idle: u64,
    /// Free bytes of segments that also hold blocks not free.
    pub segments_partly_free: u64,
    /// Segments that are one free block.
    pub segments_free: u64,
    /// How many segments those are.
    pub segments_free_count: u64,
    /// The rest: blocks in threads' caches.
    pub other: u64,
}

impl Footprint {
    /// The bytes the pool found in its lists and levels: all but [`Footprint::other`].
    pub fn accounted(&self) -> u64 {
        self.in_use
            + self.awaiting_fence
            + self.stream_only
            + self.arena_hole_ends
            + self.arena_in_busy_chunks
            + self.arena_stealable
            + self.arena_idle
            + self.segments_partly_free
            + self.segments_free
    }
}

/// One place of a [`Footprint`]: its key in JSON (`…_bytes`), what it holds in words, and
/// its bytes. [`Footprint::places`] lists them in the order of Note [footprint parts], so the
/// replay's report, the statistics export and the exit summary name them alike.
pub struct Place {
    pub key: &'static str,
    pub what: &'static str,
    pub bytes: u64,
}

impl Footprint {
    /// Every place the reserved bytes may be, in Note [footprint parts]'s order (wholly free
    /// segments by their bytes; their count is [`Footprint::segments_free_count`]).
    pub fn places(&self) -> [Place; 10] {
        let place = |key, what, bytes| Place { key, what, bytes };
        [
            place("in_use_bytes", "in use by the program", self.in_use),
            place(
                "awaiting_fence_bytes",
                "freed, waiting for a fence",
                self.awaiting_fence,
            ),
            place(
                "stream_only_bytes",
                "freed on a stream (reused there at once, elsewhere after a fence)",
                self.stream_only,
            ),
            place(
                "arena_hole_ends_bytes",
                "VMM arena: free at the ends of holes (granules shared with blocks in use)",
                self.arena_hole_ends,
            ),
            place(
                "arena_in_busy_chunks_bytes",
                "VMM arena: free granules of chunks partly in use (a chunk maps whole)",
                self.arena_in_busy_chunks,
            ),
            place(
                "arena_stealable_bytes",
                "VMM arena: free chunks (they move where they are needed)",
                self.arena_stealable,
            ),
            place(
                "arena_idle_bytes",
                "VMM arena: physical memory mapped nowhere",
                self.arena_idle,
            ),
            place(
                "segments_partly_free_bytes",
                "free in segments partly in use",
                self.segments_partly_free,
            ),
            place(
                "segments_free_bytes",
                "in wholly free segments",
                self.segments_free,
            ),
            place("other_bytes", "in threads' caches", self.other),
        ]
    }

    /// The members of a JSON object, each after a comma: `"reserved_bytes"`, then every
    /// place's key, then `"segments_free"` (a count).
    pub fn json_members(&self, out: &mut String) {
        use core::fmt::Write;
        let _ = write!(out, ",\"reserved_bytes\":{}", self.reserved);
        for p in self.places() {
            let _ = write!(out, ",\"{}\":{}", p.key, p.bytes);
        }
        let _ = write!(out, ",\"segments_free\":{}", self.segments_free_count);
    }

    /// The footprint as one JSON object ([`Footprint::json_members`]).
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(512);
        self.json_members(&mut out);
        out.replace_range(0..1, "{");
        out.push('}');
        out
    }

    /// One line per place that holds any bytes: `indent`, the bytes (written by `bytes`),
    /// their share of the reserved bytes, and what holds them.
    pub fn text_lines(&self, out: &mut String, indent: &str, bytes: &dyn Fn(u64) -> String) {
        use core::fmt::Write;
        for p in self.places().iter().filter(|p| p.bytes > 0) {
            let share = 100.0 * p.bytes as f64 / self.reserved.max(1) as f64;
            let _ = write!(
                out,
                "{indent}{:>12} {share:5.1}%  {}",
                bytes(p.bytes),
                p.what
            );
            if p.key == "segments_free_bytes" {
                let n = self.segments_free_count;
                let _ = write!(out, " ({n} segment{})", if n == 1 { "" } else { "s" });
            }
            out.push('\n');
        }
    }
}

/// A new footprint at the peak is taken once reserved bytes exceed the kept one's by more
/// than this fraction of it (Note [footprint at peak]).
pub const PEAK_FOOTPRINT_STEP: u64 = 64;

/// Note [footprint at peak]: the pool keeps its footprint as it was when its reserved bytes
/// were highest, so a program on the GPU can say where a peak above its live bytes went,
/// as `cupool replay` does for a trace (its `at_peak`). Reserved bytes reach a new high
/// only when the pool grows, so the footprint is taken after a growth that leaves them
/// more than 1/[`PEAK_FOOTPRINT_STEP`] above the kept one: one walk of the free lists under
/// the pool lock, on a path that has just made driver calls of tens of µs. The kept one
/// thus describes a point within 1.6% of the peak (its `reserved` says which; the
/// statistics' peak is exact). Not at every new high: the walk is as long as the free
/// lists, and a pool of 10⁵ live blocks that grows by a segment now and then paid a walk
/// at each (on the host backend, 1.47 µs a pair against 0.56 µs without the walks,
/// docs/BENCHMARKS.md). Programs stop growing once warm, so the walks stop too. A peak
/// reset drops it; the next growth takes it again.
impl DevicePool {
    /// Where this pool's reserved bytes are now (Note [footprint parts]).
    pub fn footprint(&self) -> Footprint {
        self.file_all_parked();
        let in_use = thread_cache::sum_level(self.index, Level::Allocated).max(0) as u64;
        let sh = self.shared.lock();
        Self::footprint_of(&sh, in_use)
    }

    /// The footprint when reserved bytes were highest since the last peak reset, if the
    /// pool has grown since (Note [footprint at peak]).
    pub fn footprint_at_peak(&self) -> Option<Footprint> {
        self.shared.lock().footprint_at_peak
    }

    /// After a growth: keeps the footprint if reserved bytes are more than
    /// 1/[`PEAK_FOOTPRINT_STEP`] above the kept one's (Note [footprint at peak]).
    pub(super) fn watch_peak_footprint(&self) {
        let in_use = thread_cache::sum_level(self.index, Level::Allocated).max(0) as u64;
        let mut sh = self.shared.lock();
        if sh
            .footprint_at_peak
            .is_some_and(|f| sh.reserved <= f.reserved + f.reserved / PEAK_FOOTPRINT_STEP)
        {
            return;
        }
        sh.footprint_at_peak = Some(Self::footprint_of(&sh, in_use));
    }

    fn footprint_of(sh: &Shared, in_use: u64) -> Footprint {
        let mut f = Footprint {
            reserved: sh.reserved,
            in_use,
            awaiting_fence: sh.fence_queue.bytes,
            stream_only: sh.streams.iter().map(|st| st.age.bytes).sum(),
            ..Footprint::default()
        };
        if let Some(a) = sh.arena.as_ref() {
            f.arena_in_busy_chunks = a.granules_free_in_busy_chunks() * a.granule;
            f.arena_stealable = a.stealable_granules() * a.granule;
            f.arena_idle = a.idle_granules() * a.granule;
        }
        // SAFETY: pool lock held.
        let tally = unsafe { FreeTally::of_shared_index(sh) };
        f.arena_hole_ends = tally.arena_mapped;
        // SAFETY: pool lock held, the tally made under it.
        let segments = unsafe { tally.segments(sh) };
        f.segments_partly_free = segments.partly_free;
        f.segments_free = segments.wholly_free;
        f.segments_free_count = segments.wholly_free_count;
        f.other = f.reserved.saturating_sub(f.accounted());
        f
    }
}
