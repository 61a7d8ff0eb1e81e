//! The arena's set of stealable chunks: mapped chunks none of whose granules is pinned,
//! found by size when a run of granules needs memory.
//!
//! Note [lazy stealable set]: a chunk turns busy and free again on every alloc+free pair
//! of a block over it (a 64 MiB block spans eight 8 MiB chunks), and keeping the ordered set
//! exact cost a tree removal and an insertion per chunk per pair: with the pin loops, most
//! of a cached 64 MiB pair's CPU time on the host backend (perf: 16% `BTreeMap::insert`, 8%
//! node splits, 28% pinning). So a chunk that turns busy keeps its entry (now stale, with
//! `listed` still set) and one that turns free again adds none when it has one. Searches
//! skip stale entries in set order and drop them as they pass, so they return exactly what
//! an exact set would; `stealable_granules` is kept exact for the planner's "can this run
//! be backed" test. Each chunk has at most one entry, so the set never outgrows the mapped
//! chunks.

use super::{Arena, NO_CHUNK};

impl Arena {
    /// A pinned granule or an export made chunk `id` (mapped) busier.
    pub(super) fn add_busy(&mut self, id: u32) {
        let c = &mut self.chunks[id as usize];
        if c.busy == 0 {
            // Its entry stays, stale, until a search passes it or the chunk is free again.
            self.stealable_granules -= c.len as u64;
        }
        c.busy += 1;
    }

    /// The inverse of [`Arena::add_busy`].
    pub(super) fn drop_busy(&mut self, id: u32) {
        let c = &mut self.chunks[id as usize];
        c.busy -= 1;
        if c.busy == 0 {
            self.list_stealable(id);
        }
    }

    /// Chunk `id`, mapped with no granule pinned, is stealable now.
    pub(super) fn list_stealable(&mut self, id: u32) {
        let c = &mut self.chunks[id as usize];
        debug_assert!(c.busy == 0 && c.at != NO_CHUNK);
        self.stealable_granules += c.len as u64;
        if !c.listed {
            c.listed = true;
            self.stealable.insert((c.len, id));
        }
    }

    /// The largest stealable chunk of at most `len` granules (of those, the newest id).
    pub(super) fn stealable_up_to(&mut self, len: u32) -> Option<(u32, u32)> {
        loop {
            let key = *self.stealable.range(..(len, u32::MAX)).next_back()?;
            if self.chunks[key.1 as usize].busy == 0 {
                return Some(key);
            }
            self.unlist(key);
        }
    }

    /// The smallest stealable chunk of more than `len` granules (of those, the oldest id).
    pub(super) fn stealable_above(&mut self, len: u32) -> Option<(u32, u32)> {
        loop {
            let key = *self.stealable.range((len + 1, 0)..).next()?;
            if self.chunks[key.1 as usize].busy == 0 {
                return Some(key);
            }
            self.unlist(key);
        }
    }

    /// Drops every stale entry, for callers that walk the set themselves.
    pub(super) fn purge_stale_stealable(&mut self) {
        let stale: Vec<(u32, u32)> = self
            .stealable
            .iter()
            .filter(|&&(_, id)| self.chunks[id as usize].busy > 0)
            .copied()
            .collect();
        for key in stale {
            self.unlist(key);
        }
    }

    fn unlist(&mut self, key: (u32, u32)) {
        self.stealable.remove(&key);
        self.chunks[key.1 as usize].listed = false;
    }
}
