//! The pool's segments and the blocks that tile them, for memory snapshots
//! (`cupool_segments_json`, the Python package's `cupool.snapshot()`), and each device's
//! account of where its reserved bytes are and were at their peak (`cupool_footprint_json`).
//!
//! Note [layout walk]: the pool offers no walk of its segments, so the layout is read from
//! what it publishes for lock-free frees: every block record's atomic tag holds the
//! block's start address (and whether the program holds it), and the address map enters
//! every block start. A record whose tag address maps back to it is a block; one
//! `find_containing` per segment (under that pool's lock) gives the segment's base and
//! size; a block's size is the distance to the next block start (blocks tile their
//! segment). Blocks the program holds are read through their tag-checked record
//! (`live_record`), as `cupool_free` does. Free blocks show as one state, `inactive`,
//! whether they wait for a fence, sit in a thread cache or are ready for any stream
//! (`pending_fence_bytes` in the statistics has the total that waits). Nothing is stopped
//! while the walk runs: under concurrent allocations a snapshot is a consistent picture
//! of each block, not of the whole pool at one instant.

use super::Runtime;
use crate::backend::DevicePtr;
use crate::pool::block::{SegmentKind, TAG_ALLOCATED};
use crate::pool::fence_times::FenceTimeStats;
use crate::pool::vmm::VmmStats;
use crate::pool::{handover, Containing, DevicePool, Footprint, ADDRESSES, BLOCKS};
use crate::status::Result;
use core::fmt::Write;
use core::sync::atomic::Ordering;

/// Block addresses are multiples of 512, so a tag's low 9 bits carry its state.
const TAG_ADDRESS_MASK: u64 = !0x1ff;

/// One block of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockView {
    pub ptr: DevicePtr,
    pub size: u64,
    /// What the program asked for (0 for free blocks).
    pub requested: u64,
    /// Whether the program holds it.
    pub allocated: bool,
    /// The stream handle it was allocated with (0 for free and streamless blocks).
    pub stream: u64,
}

/// One segment: a driver allocation (or the VMM arena) and its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentView {
    pub device: i32,
    pub base: DevicePtr,
    pub size: u64,
    /// Carved into blocks of up to 1 MiB (`small_segment`), else large.
    pub small: bool,
    /// The VMM arena of its pool (`vmm:on`): a reserved range, only partly mapped.
    pub arena: bool,
    pub blocks: Vec<BlockView>,
}

impl Runtime {
    /// The segments of `device` (all devices for `None`) in address order (Note [layout
    /// walk]).
    pub fn segments(&self, device: Option<i32>) -> Result<Vec<SegmentView>> {
        self.check_device(device)?;
        let mut starts = block_starts();
        starts.sort_unstable();
        let pools: Vec<&'static DevicePool> = Self::pools_of(device).collect();
        let mut segments: Vec<SegmentView> = Vec::new();
        let mut current: Option<(SegmentView, Vec<(u64, u32)>)> = None;
        // The mapped runs of the arena being read, if it is one.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (ptr, idx) in starts {
            if let Some((seg, _)) = &current {
                if ptr >= seg.base + seg.size {
                    let (seg, blocks) = current.take().expect("checked above");
                    segments.extend(split_arena(finish(seg, blocks), &runs));
                }
            }
            if current.is_none() {
                let Some((pool, found)) = pools
                    .iter()
                    .find_map(|p| p.find_containing(ptr).map(|c| (*p, c)))
                else {
                    continue; // a block of another device, or one released meanwhile
                };
                let vmm = pool.vmm_stats();
                let arena = vmm.range_bytes != 0 && vmm.range_bytes == found.segment_size;
                runs = if arena {
                    pool.arena_mapped_runs()
                } else {
                    Vec::new()
                };
                current = Some((
                    SegmentView {
                        device: pool.ctx.device,
                        base: found.segment_base,
                        size: found.segment_size,
                        small: false,
                        arena,
                        blocks: Vec::new(),
                    },
                    Vec::new(),
                ));
            }
            let (seg, blocks) = current.as_mut().expect("set above");
            if ptr >= seg.base {
                blocks.push((ptr, idx));
            }
        }
        if let Some((seg, blocks)) = current {
            segments.extend(split_arena(finish(seg, blocks), &runs));
        }
        Ok(segments)
    }
}

/// Every `(start, record)` the address map enters, from the records' tags.
fn block_starts() -> Vec<(u64, u32)> {
    let mut out = Vec::new();
    // Chunks of records are added in order and never freed: the first missing index ends
    // the table.
    let mut idx: u32 = 0;
    while let Some(block) = BLOCKS.try_get(idx) {
        let tag = block.tag.load(Ordering::Acquire);
        let ptr = tag & TAG_ADDRESS_MASK;
        if tag != 0 && ADDRESSES.get(ptr) == Some(idx) {
            out.push((ptr, idx));
        }
        idx += 1;
    }
    out
}

/// Turns the sorted block starts of one segment into blocks that tile it.
fn finish(mut seg: SegmentView, starts: Vec<(u64, u32)>) -> SegmentView {
    let end = seg.base + seg.size;
    let mut next_starts = starts.iter().map(|&(p, _)| p).skip(1).chain([end]);
    if starts.first().map(|&(p, _)| p) != Some(seg.base) {
        // The head moved while we read (a merge): show the gap as free.
        let first = starts.first().map_or(end, |&(p, _)| p);
        seg.blocks.push(free_block(seg.base, first - seg.base));
    }
    for &(ptr, idx) in &starts {
        let next = next_starts.next().unwrap_or(end).min(end);
        let size = next.saturating_sub(ptr);
        let found = Containing {
            idx,
            block_ptr: ptr,
            segment_base: seg.base,
            segment_size: seg.size,
        };
        let holding = BLOCKS
            .try_get(idx)
            .is_some_and(|b| b.tag.load(Ordering::Acquire) == ptr | TAG_ALLOCATED);
        match holding.then(|| handover::live_record(&found)).flatten() {
            Some(d) => {
                seg.small |= d.kind == SegmentKind::Small;
                seg.blocks.push(BlockView {
                    ptr,
                    size: d.size.min(size),
                    requested: d.requested,
                    allocated: true,
                    stream: d.handle,
                });
                // A block rounded below the next start leaves a free tail (never in a
                // consistent pool: blocks tile their segment).
                if d.size < size {
                    seg.blocks.push(free_block(ptr + d.size, size - d.size));
                }
            }
            None => seg.blocks.push(free_block(ptr, size)),
        }
    }
    if !seg.small && !seg.arena {
        // A segment with no block in use: its size tells its kind.
        seg.small = seg.size <= crate::config::get(crate::config::Key::SmallSegment)
            && seg.blocks.iter().all(|b| !b.allocated);
    }
    seg
}

/// Note [arena in snapshots]: the VMM arena is a reserved range of 4× the device's memory
/// (at least 1 TiB), mostly unmapped. Shown whole, a snapshot would hold a 1 TiB segment
/// with one huge free block, and the segments would add up to far more than the pool
/// holds. So, as PyTorch shows an expandable segment by its mapped size, each run of
/// mapped granules is a segment of its own (`is_expandable`), with the blocks over it
/// clipped to it: blocks in use lie wholly inside one run (their granules are mapped);
/// free blocks may straddle runs and unmapped space, and show only their mapped parts.
/// The arena's idle chunks (held, mapped nowhere) have no address and do not show.
fn split_arena(seg: SegmentView, runs: &[(u64, u64)]) -> Vec<SegmentView> {
    if !seg.arena {
        return vec![seg];
    }
    let mut out = Vec::with_capacity(runs.len());
    for &(start, bytes) in runs {
        let end = start + bytes;
        let blocks = seg
            .blocks
            .iter()
            .filter(|b| b.ptr < end && b.ptr + b.size > start)
            .map(|b| {
                let (lo, hi) = (b.ptr.max(start), (b.ptr + b.size).min(end));
                if lo == b.ptr && hi == b.ptr + b.size {
                    b.clone()
                } else {
                    free_block(lo, hi - lo)
                }
            })
            .collect();
        out.push(SegmentView {
            device: seg.device,
            base: start,
            size: bytes,
            small: false,
            arena: true,
            blocks,
        });
    }
    out
}

fn free_block(ptr: u64, size: u64) -> BlockView {
    BlockView {
        ptr,
        size,
        requested: 0,
        allocated: false,
        stream: 0,
    }
}

impl SegmentView {
    /// Bytes of the blocks the program holds.
    pub fn allocated_bytes(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.allocated)
            .map(|b| b.size)
            .sum()
    }
}

/// The segments as one JSON object: `{"segments": [{"device", "address", "total_size",
/// "allocated_size", "requested_size", "stream", "segment_type", "is_expandable",
/// "blocks": [{"address", "size", "requested_size", "state", "stream"}]}]}`, with
/// PyTorch's snapshot names and block states (`active_allocated`, `inactive`).
pub fn to_json(segments: &[SegmentView]) -> String {
    let mut out = String::from("{\"segments\":[");
    for (i, seg) in segments.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let requested: u64 = seg.blocks.iter().map(|b| b.requested).sum();
        // The segment's stream: its first block in use's (PyTorch: the stream the segment
        // was allocated for).
        let stream = seg
            .blocks
            .iter()
            .find(|b| b.allocated)
            .map_or(0, |b| b.stream);
        let _ = write!(
            out,
            "{{\"device\":{},\"address\":{},\"total_size\":{},\"allocated_size\":{},\
             \"requested_size\":{},\"stream\":{},\"segment_type\":\"{}\",\
             \"is_expandable\":{},\"blocks\":[",
            seg.device,
            seg.base,
            seg.size,
            seg.allocated_bytes(),
            requested,
            stream,
            if seg.small { "small" } else { "large" },
            seg.arena,
        );
        for (j, b) in seg.blocks.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                "{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{}\",\
                 \"stream\":{}}}",
                b.ptr,
                b.size,
                b.requested,
                if b.allocated {
                    "active_allocated"
                } else {
                    "inactive"
                },
                b.stream,
            );
        }
        out.push_str("]}");
    }
    out.push_str("]}");
    out
}

/// Where one device's reserved bytes are now, and where they were at their peak (Note
/// [footprint parts] and Note [footprint at peak] in the pool).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DeviceFootprint {
    pub device: i32,
    pub now: Footprint,
    /// `None` when the pool has not grown since the last peak reset.
    pub at_peak: Option<Footprint>,
    /// The VMM arena's mapping work so far (all zero without an arena).
    pub vmm: VmmStats,
    /// Estimated time in fence calls so far (Note [fence call times]).
    pub fences: FenceTimeStats,
}

impl Runtime {
    /// The footprints of `device`'s pools (every device's for `None`), by device.
    pub fn footprints(&self, device: Option<i32>) -> Result<Vec<DeviceFootprint>> {
        self.check_device(device)?;
        let mut all: Vec<DeviceFootprint> = Self::pools_of(device)
            .map(|p| DeviceFootprint {
                device: p.ctx.device,
                now: p.footprint(),
                at_peak: p.footprint_at_peak(),
                vmm: p.vmm_stats(),
                fences: p.fence_time_stats(),
            })
            .collect();
        all.sort_by_key(|f| f.device);
        Ok(all)
    }
}

/// `{"devices":[{"device":N,"now":{..},"at_peak":{..}|null,"vmm":{..},"fences":{..}}]}`,
/// each footprint as [`Footprint::to_json`] writes it, `vmm` as [`VmmStats::to_json`] and
/// `fences` as [`FenceTimeStats::to_json`] (`cupool_footprint_json`).
pub fn footprints_json(all: &[DeviceFootprint]) -> String {
    let mut out = String::from("{\"devices\":[");
    for (i, f) in all.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let at_peak = f
            .at_peak
            .map_or_else(|| "null".to_string(), |p| p.to_json());
        let _ = write!(
            out,
            "{{\"device\":{},\"now\":{},\"at_peak\":{at_peak},\"vmm\":{},\"fences\":{}}}",
            f.device,
            f.now.to_json(),
            f.vmm.to_json(),
            f.fences.to_json()
        );
    }
    out.push_str("]}");
    out
}
