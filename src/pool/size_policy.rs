//! How big things are: which segments a request is carved from, how large they are, and
//! when a block is split (Note [reuse excess]).

use super::block::SegmentKind;
use super::size_class::ALIGNMENT;
use super::DevicePool;
use crate::config::{self, Key};

/// Largest block carved from small segments.
pub const SMALL_MAX: u64 = 1 << 20;
/// A large block is split only when the remainder is at least this big (smaller remainders
/// stay with the block: splitting them off would only make fragments). It is also the most
/// a block handed out may exceed its rounded request by, on every path (Note [reuse excess]).
///
/// Note [reuse excess]: the shared index splits a larger free block down to the request unless
/// the remainder is under this bound, and a segment of a block's own is rounded to 2 MiB
/// with the same rule; the thread cache, which never splits, hands out a cached block only
/// when it is less than this bound larger than the request. Before that rule a thread-cache
/// hit could hand out a block of the same size class whole, up to 1/8 larger than asked
/// (4 MiB on a 34 MiB request): memory the program could not use and the pool could not
/// lend. `tests/pool_host.rs` checks the bound on every allocation.
pub const LARGE_SPLIT_MIN: u64 = 1 << 20;
/// Smallest remainder split off a block of the VMM arena.
const VMM_SPLIT_MIN: u64 = ALIGNMENT;
/// Granularity of large segments (the driver's own).
pub(super) const SEGMENT_GRANULE: u64 = 2 << 20;

impl DevicePool {
    pub(super) fn kind_for(size: u64) -> SegmentKind {
        if size <= SMALL_MAX {
            SegmentKind::Small
        } else {
            SegmentKind::Large
        }
    }

    pub(super) fn segment_size_for(&self, size: u64, kind: SegmentKind) -> u64 {
        match kind {
            SegmentKind::Small => config::get(Key::SmallSegment).max(SMALL_MAX),
            SegmentKind::Large => {
                let large = config::get(Key::LargeSegment).max(2 * SMALL_MAX);
                if size <= large / 2 {
                    large
                } else {
                    size.div_ceil(SEGMENT_GRANULE) * SEGMENT_GRANULE
                }
            }
        }
    }
}

/// The smallest remainder worth splitting off a free block of `kind` (Note [reuse excess]); in
/// the VMM arena a remainder costs no segment of its own, so the split is exact.
pub(super) fn split_min(kind: SegmentKind, in_arena: bool) -> u64 {
    match kind {
        SegmentKind::Small => ALIGNMENT,
        SegmentKind::Large if in_arena => VMM_SPLIT_MIN,
        SegmentKind::Large => LARGE_SPLIT_MIN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_up_to_one_mib_are_small() {
        assert_eq!(DevicePool::kind_for(ALIGNMENT), SegmentKind::Small);
        assert_eq!(DevicePool::kind_for(SMALL_MAX), SegmentKind::Small);
        assert_eq!(
            DevicePool::kind_for(SMALL_MAX + ALIGNMENT),
            SegmentKind::Large
        );
    }

    #[test]
    fn remainders_worth_splitting_off() {
        assert_eq!(split_min(SegmentKind::Small, false), ALIGNMENT);
        // Note [reuse excess]: outside the arena a large block keeps a remainder under 1 MiB.
        assert_eq!(split_min(SegmentKind::Large, false), LARGE_SPLIT_MIN);
        assert_eq!(split_min(SegmentKind::Large, true), VMM_SPLIT_MIN);
    }
}
