//! The arena's chunks: which pieces of physical memory it holds, where each is mapped or
//! whether it is idle, and the plans that back a run of unmapped granules from them (Note
//! [arena chunks], Note [exported chunks] in `mod.rs`).

use super::{Arena, Chunk, ExportedChunk, Step, Taken, NO_CHUNK};
use std::collections::BTreeSet;

impl Arena {
    fn take_set(&mut self, stolen: bool, key: (u32, u32)) -> Taken {
        let set = if stolen {
            &mut self.stealable
        } else {
            &mut self.idle
        };
        let removed = set.remove(&key);
        debug_assert!(removed);
        let (len, id) = key;
        if stolen {
            self.chunks[id as usize].listed = false;
            self.stealable_granules -= len as u64;
        }
        let c = self.chunks[id as usize];
        let was_at = if stolen {
            for g in c.at as usize..(c.at + c.len) as usize {
                self.chunk_at[g] = NO_CHUNK;
            }
            self.mapped -= len as u64;
            Some(c.at as usize)
        } else {
            self.idle_granules -= len as u64;
            None
        };
        self.chunks[id as usize].at = NO_CHUNK;
        Taken {
            id,
            handle: c.handle,
            len,
            was_at,
        }
    }

    /// The largest chunk of `set` of at most `len` granules.
    fn largest_up_to(set: &BTreeSet<(u32, u32)>, len: u32) -> Option<(u32, u32)> {
        set.range(..(len, u32::MAX)).next_back().copied()
    }

    /// The smallest chunk of `set` of more than `len` granules.
    fn smallest_above(set: &BTreeSet<(u32, u32)>, len: u32) -> Option<(u32, u32)> {
        set.range((len + 1, 0)..).next().copied()
    }

    /// Plans how to back the run of `len` unmapped granules from `at` (Note [arena chunks]):
    /// idle chunks that fit, stolen chunks that fit, a larger chunk re-cut, then (with
    /// `create` granules allowed) new memory. Chunks used are taken out of the bookkeeping
    /// at once (the caller gives each back with [`Arena::record_mapped`] or
    /// [`Arena::record_idle`]); `create` is lowered by what is planned. Returns `None`, with
    /// nothing taken, when the run cannot be backed.
    /// `max_chunk` is the most granules one new chunk gets.
    pub fn plan_run(
        &mut self,
        at: usize,
        len: usize,
        create: &mut u64,
        max_chunk: u32,
        merge: bool,
    ) -> Option<Vec<Step>> {
        let mut steps = Vec::new();
        let mut pos = at;
        let end = at + len;
        // Nothing is taken unless the whole run can be backed.
        if len as u64 > (self.idle_granules + self.stealable_granules).saturating_add(*create) {
            return None;
        }
        while pos < end {
            let want = (end - pos).min(u32::MAX as usize) as u32;
            let step = if let Some(k) = Self::largest_up_to(&self.idle, want) {
                Step::Map {
                    chunk: self.take_set(false, k),
                    at: pos,
                }
            } else if let Some(k) = self.stealable_up_to(want) {
                Step::Map {
                    chunk: self.take_set(true, k),
                    at: pos,
                }
            } else if let Some(k) = Self::smallest_above(&self.idle, want) {
                Step::Recut {
                    chunk: self.take_set(false, k),
                    len: want,
                    at: pos,
                }
            } else if let Some(k) = self.stealable_above(want) {
                Step::Recut {
                    chunk: self.take_set(true, k),
                    len: want,
                    at: pos,
                }
            } else {
                let len = want.min(max_chunk.max(1));
                // Checked above: what idle and stealable chunks do not cover fits `create`.
                *create -= len as u64;
                Step::Create { len, at: pos }
            };
            pos += match step {
                Step::Map { chunk, .. } => chunk.len as usize,
                Step::Recut { len, .. } | Step::Create { len, .. } => len as usize,
                Step::Drop { .. } => unreachable!("drops are planned after the run"),
            };
            steps.push(step);
        }
        if merge {
            steps = Self::merge_small(steps, max_chunk);
        }
        Some(steps)
    }

    /// Note [merged chunks]: chunks smaller than `max_chunk` that a run would map side by
    /// side are released and made again as one chunk of up to `max_chunk` granules. The
    /// memory held does not change. On an H100 (docs/BENCHMARKS.md, `gpu/vmm_cost.cu`) a
    /// release costs ~13 µs and a creation ~14 µs against ~28 µs to map and ~18 µs to unmap
    /// a handle, whatever its size, so merging k chunks costs about as much as mapping them
    /// one by one, and every later move of those granules takes one map and one unmap
    /// instead of k of each. Without it, the one-granule chunks a pool makes while it is
    /// small (`vmm_chunk_divisor`) would keep its moves at one call per granule for good.
    fn merge_small(steps: Vec<Step>, max_chunk: u32) -> Vec<Step> {
        let mut out = Vec::with_capacity(steps.len());
        let mut group: Vec<Taken> = Vec::new();
        let mut group_at = 0;
        let mut group_len = 0u32;
        let flush = |out: &mut Vec<Step>, group: &mut Vec<Taken>, at: usize, len: u32| {
            match group.len() {
                0 => {}
                1 => out.push(Step::Map {
                    chunk: group[0],
                    at,
                }),
                _ => {
                    out.extend(group.iter().map(|&chunk| Step::Drop { chunk }));
                    out.push(Step::Create { len, at });
                }
            }
            group.clear();
        };
        for step in steps {
            match step {
                Step::Map { chunk, at } if chunk.len < max_chunk => {
                    if group.is_empty() || group_len + chunk.len > max_chunk {
                        flush(&mut out, &mut group, group_at, group_len);
                        group_at = at;
                        group_len = 0;
                    }
                    group.push(chunk);
                    group_len += chunk.len;
                }
                other => {
                    flush(&mut out, &mut group, group_at, group_len);
                    out.push(other);
                }
            }
        }
        flush(&mut out, &mut group, group_at, group_len);
        out
    }

    /// Records a chunk (taken, or new with `id` from [`Arena::new_chunk`]) as mapped at `at`.
    pub fn record_mapped(&mut self, id: u32, at: usize) {
        let len = self.chunks[id as usize].len;
        let mut busy = 0;
        for g in at..at + len as usize {
            debug_assert_eq!(self.chunk_at[g], NO_CHUNK, "granule {g} mapped twice");
            self.chunk_at[g] = id;
            busy += (self.pins[g] > 0) as u32;
        }
        let c = &mut self.chunks[id as usize];
        c.at = at as u32;
        c.busy = busy;
        if busy == 0 {
            self.list_stealable(id);
        }
        self.mapped += len as u64;
        self.mapped_peak = self.mapped_peak.max(self.mapped);
        self.top = self.top.max(at + len as usize);
    }

    /// Records a chunk (taken, or new) as held but mapped nowhere.
    pub fn record_idle(&mut self, id: u32) {
        let c = &mut self.chunks[id as usize];
        c.at = NO_CHUNK;
        c.busy = 0;
        self.idle.insert((c.len, id));
        self.idle_granules += c.len as u64;
    }

    pub fn chunk_len(&self, id: u32) -> u32 {
        self.chunks[id as usize].len
    }

    /// Chunks mapped now, and chunks held (mapped or idle): one driver mapping and one
    /// driver handle each.
    pub fn chunk_counts(&self) -> (u64, u64) {
        let held = self.chunks.iter().filter(|c| c.handle != 0);
        let mapped = held.clone().filter(|c| c.at != NO_CHUNK).count() as u64;
        (mapped, held.count() as u64)
    }

    /// A new chunk record for `handle` of `len` granules (neither mapped nor idle yet).
    pub fn new_chunk(&mut self, handle: u64, len: u32) -> u32 {
        let c = Chunk {
            handle,
            len,
            at: NO_CHUNK,
            busy: 0,
            exported: false,
            shared_fd: -1,
            listed: false,
        };
        match self.unused_ids.pop() {
            Some(id) => {
                self.chunks[id as usize] = c;
                id
            }
            None => {
                self.chunks.push(c);
                (self.chunks.len() - 1) as u32
            }
        }
    }

    /// Forgets a taken chunk whose memory was released.
    pub fn drop_chunk(&mut self, id: u32) {
        self.chunks[id as usize].handle = 0;
        self.unused_ids.push(id);
    }

    /// Takes every stealable and idle chunk, for release.
    pub fn take_all_unused(&mut self) -> Vec<Taken> {
        self.take_unused(u64::MAX)
    }

    /// As [`Arena::take_all_unused`], but only chunks totalling at most `max_granules`
    /// (a chunk that would pass it is left where it is): what a release may take when the
    /// pool keeps a reserve.
    pub fn take_unused(&mut self, max_granules: u64) -> Vec<Taken> {
        let mut out = Vec::new();
        let mut left = max_granules;
        self.purge_stale_stealable();
        for stolen in [true, false] {
            let set = if stolen { &self.stealable } else { &self.idle };
            let cap = left.min(u32::MAX as u64) as u32;
            let fitting: Vec<(u32, u32)> = set.range(..=(cap, u32::MAX)).copied().collect();
            // Smallest first: each taken chunk lowers what the next may be.
            for k in fitting {
                if k.0 as u64 > left {
                    break;
                }
                left -= k.0 as u64;
                out.push(self.take_set(stolen, k));
            }
        }
        out
    }

    /// Marks every chunk under `[ptr, ptr + size)` (all mapped: a live block) exported,
    /// so that it stays where it is for good (Note [exported chunks]). Returns the address
    /// of the first chunk, and each chunk's id, handle, bytes and the descriptor it was
    /// exported as before (-1: not yet), in address order.
    pub fn export(&mut self, ptr: u64, size: u64) -> Option<(u64, Vec<ExportedChunk>)> {
        let mut out: Vec<ExportedChunk> = Vec::new();
        let mut first = None;
        let granules = self.granules(ptr, size);
        let mut g = *granules.start();
        while g <= *granules.end() {
            let id = self.chunk_at[g];
            if id == NO_CHUNK {
                return None;
            }
            if !self.chunks[id as usize].exported {
                // The extra count keeps the chunk busy for good: never stealable again.
                self.chunks[id as usize].exported = true;
                self.add_busy(id);
            }
            let c = &self.chunks[id as usize];
            first.get_or_insert(c.at as usize);
            out.push(ExportedChunk {
                id,
                handle: c.handle,
                bytes: c.len as u64 * self.granule,
                fd: c.shared_fd,
            });
            g = (c.at + c.len) as usize;
        }
        Some((self.address(first?), out))
    }

    /// Records the descriptor an exported chunk was exported as; false when it already
    /// had one (the caller closes the new one and uses [`Arena::shared_fd`]).
    pub fn set_shared_fd(&mut self, id: u32, fd: i32) -> bool {
        let c = &mut self.chunks[id as usize];
        debug_assert!(c.exported);
        if c.shared_fd >= 0 {
            return false;
        }
        c.shared_fd = fd;
        true
    }

    pub fn shared_fd(&self, id: u32) -> i32 {
        self.chunks[id as usize].shared_fd
    }
}
