//! The pool's internal invariants, checked by tests.

use super::block::{Place, NIL};
use super::{DevicePool, ADDRESSES, BLOCKS};

impl DevicePool {
    /// Checks the pool's internal invariants (tests): every segment's blocks tile it
    /// exactly, adjacent shared-free blocks are merged, index totals match, and the map
    /// points at every block. Returns the bytes held by free blocks of each place.
    pub fn check_invariants(&self) -> core::result::Result<InvariantReport, String> {
        let sh = self.shared.lock();
        let mut report = InvariantReport::default();
        // SAFETY: pool lock held; allocated blocks' fields are stable while allocated.
        unsafe {
            for (&base, &head) in sh.segments.iter() {
                // A copy: the walk below takes the head's record again (a `&mut` held over
                // that is invalidated; Miri, Stacked Borrows).
                let (hd, hl) = (*BLOCKS.get(head).data(), *BLOCKS.links(head));
                if !hl.segment_head || hd.ptr != base {
                    return Err(format!("segment {base:#x}: bad head"));
                }
                let mut expect = base;
                let mut idx = head;
                let mut prev = NIL;
                let mut prev_shared = false;
                while idx != NIL {
                    let (d, l) = (BLOCKS.get(idx).data(), *BLOCKS.links(idx));
                    if d.ptr != expect || l.seg_prev != prev || d.pool != self.index {
                        return Err(format!(
                            "segment {base:#x}: block {:#x} out of place",
                            d.ptr
                        ));
                    }
                    if ADDRESSES.get(d.ptr) != Some(idx) {
                        return Err(format!("block {:#x} missing from the address map", d.ptr));
                    }
                    let place = BLOCKS.get(idx).place();
                    let shared = place == Place::FreeShared;
                    if shared && prev_shared {
                        return Err(format!("block {:#x}: free neighbours not merged", d.ptr));
                    }
                    match place {
                        Place::Allocated => report.allocated += d.size,
                        Place::FreeShared => report.shared += d.size,
                        Place::FreeOnStream => report.on_stream += d.size,
                        Place::AwaitingFence => report.awaiting_fence += d.size,
                        Place::ThreadCache => report.thread_cache += d.size,
                        Place::Parked => report.parked += d.size,
                        Place::Unused => {
                            return Err(format!("block {:#x} unused but linked", d.ptr))
                        }
                    }
                    prev_shared = shared;
                    expect = d.ptr + d.size;
                    prev = idx;
                    idx = l.seg_next;
                }
                if expect != base + hl.segment_size {
                    return Err(format!("segment {base:#x}: blocks do not tile it"));
                }
                match sh.arena.as_ref().filter(|a| a.base == base) {
                    Some(a) => {
                        report.reserved += a.held() * a.granule;
                        let mut expected = vec![0u32; a.granule_count()];
                        let mut idx = head;
                        while idx != NIL {
                            let d = BLOCKS.get(idx).data();
                            if BLOCKS.get(idx).place() != Place::FreeShared {
                                for g in a.granules(d.ptr, d.size) {
                                    expected[g] += 1;
                                }
                            }
                            idx = BLOCKS.links(idx).seg_next;
                        }
                        // Note [device waits]: drained blocks not yet seen idle.
                        for &(ptr, size, _) in &sh.device_pins {
                            for g in a.granules(ptr, size) {
                                expected[g] += 1;
                            }
                        }
                        a.check(&expected)?;
                    }
                    None => report.reserved += hl.segment_size,
                }
            }
        }
        if report.reserved != sh.reserved {
            return Err(format!(
                "reserved {} != segments {}",
                sh.reserved, report.reserved
            ));
        }
        if sh.small.bytes + sh.large.bytes != report.shared {
            return Err("shared index bytes disagree with the blocks".into());
        }
        let on_stream: u64 = sh
            .streams
            .iter()
            .map(|s| s.small.bytes + s.large.bytes)
            .sum();
        let aged: u64 = sh.streams.iter().map(|s| s.age.bytes).sum();
        if on_stream != report.on_stream || aged != report.on_stream {
            return Err("stream indexes disagree with the blocks".into());
        }
        if sh.fence_queue.bytes != report.awaiting_fence {
            return Err("fence queue disagrees with the blocks".into());
        }
        Ok(report)
    }
}

/// Bytes by place, from [`DevicePool::check_invariants`].
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvariantReport {
    pub reserved: u64,
    pub allocated: u64,
    pub shared: u64,
    pub on_stream: u64,
    pub awaiting_fence: u64,
    pub thread_cache: u64,
    /// Blocks in the pool's parking slots (Note [parked arena blocks]).
    pub parked: u64,
}
