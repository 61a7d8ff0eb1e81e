//! Free blocks indexed by size class, with a bitmap of non-empty classes (TLSF-style
//! segregated fits).
//!
//! Insert and remove are O(1) (intrusive doubly linked lists through the block records);
//! a search looks at a few blocks of the request's own class and otherwise takes the head
//! of the first non-empty larger class, found with a bit scan. No operation depends on how
//! many blocks are free. The caller holds the owning device pool's lock.

use super::block::{BlockIdx, BlockTable, NIL};
use super::size_class::{class_of, NUM_CLASSES};

const WORDS: usize = NUM_CLASSES.div_ceil(64);
/// Blocks of the request's own class examined before moving to a larger class.
const SAME_CLASS_PROBES: usize = 8;

pub struct FreeIndex {
    heads: [BlockIdx; NUM_CLASSES],
    non_empty: [u64; WORDS],
    /// Bytes and blocks in the index.
    pub bytes: u64,
    pub blocks: u64,
}

impl FreeIndex {
    pub fn new() -> Self {
        FreeIndex {
            heads: [NIL; NUM_CLASSES],
            non_empty: [0; WORDS],
            bytes: 0,
            blocks: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// Adds a free block.
    ///
    /// # Safety
    /// The caller owns `idx` (pool lock held) and it is in no other list.
    pub unsafe fn insert(&mut self, table: &BlockTable, idx: BlockIdx) {
        let size = table.get(idx).data().size;
        let c = class_of(size);
        let head = self.heads[c];
        let l = table.links(idx);
        l.list_prev = NIL;
        l.list_next = head;
        if head != NIL {
            table.links(head).list_prev = idx;
        }
        self.heads[c] = idx;
        self.non_empty[c / 64] |= 1 << (c % 64);
        self.bytes += size;
        self.blocks += 1;
    }

    /// Removes a block that is in this index.
    ///
    /// # Safety
    /// As for [`FreeIndex::insert`], and `idx` is in this index.
    pub unsafe fn remove(&mut self, table: &BlockTable, idx: BlockIdx) {
        let size = table.get(idx).data().size;
        let l = table.links(idx);
        let (prev, next) = (l.list_prev, l.list_next);
        l.list_prev = NIL;
        l.list_next = NIL;
        if next != NIL {
            table.links(next).list_prev = prev;
        }
        if prev != NIL {
            table.links(prev).list_next = next;
        } else {
            let c = class_of(size);
            debug_assert_eq!(self.heads[c], idx);
            self.heads[c] = next;
            if next == NIL {
                self.non_empty[c / 64] &= !(1 << (c % 64));
            }
        }
        self.bytes -= size;
        self.blocks -= 1;
    }

    /// A block of at least `size` bytes (a rounded size), still in the index.
    ///
    /// # Safety
    /// Pool lock held.
    pub unsafe fn find(&self, table: &BlockTable, size: u64) -> Option<BlockIdx> {
        let c = class_of(size);
        let mut idx = self.heads[c];
        let mut probes = 0;
        while idx != NIL && probes < SAME_CLASS_PROBES {
            if table.get(idx).data().size >= size {
                return Some(idx);
            }
            idx = table.links(idx).list_next;
            probes += 1;
        }
        self.first_class_above(c).map(|k| self.heads[k])
    }

    /// Like [`FreeIndex::find`], but looks at up to `max` fitting blocks, smallest classes
    /// first, and returns the one whose placement costs least (`place` gives a block's cost
    /// and where in it the request would go), with that offset; the first with cost 0 wins
    /// at once, and ties go to the block found first.
    ///
    /// # Safety
    /// Pool lock held.
    pub unsafe fn find_cheapest(
        &self,
        table: &BlockTable,
        size: u64,
        max: usize,
        mut place: impl FnMut(BlockIdx) -> (u64, u64),
    ) -> Option<(BlockIdx, u64)> {
        let first = self.find(table, size)?;
        let (cost, offset) = place(first);
        let mut best = (cost, first, offset);
        if cost == 0 {
            return Some((first, offset));
        }
        let mut c = class_of(size);
        let mut seen = 0;
        'classes: loop {
            let mut idx = self.heads[c];
            while idx != NIL {
                if table.get(idx).data().size >= size && idx != first {
                    let (k, offset) = place(idx);
                    if k < best.0 {
                        best = (k, idx, offset);
                        if k == 0 {
                            break 'classes;
                        }
                    }
                    seen += 1;
                    if seen >= max {
                        break 'classes;
                    }
                }
                idx = table.links(idx).list_next;
            }
            match self.first_class_above(c) {
                Some(k) => c = k,
                None => break,
            }
        }
        Some((best.1, best.2))
    }

    /// First non-empty class strictly above `c`.
    fn first_class_above(&self, c: usize) -> Option<usize> {
        let start = c + 1;
        if start >= NUM_CLASSES {
            return None;
        }
        let mut w = start / 64;
        let mut bits = self.non_empty[w] & (!0u64 << (start % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == WORDS {
                return None;
            }
            bits = self.non_empty[w];
        }
    }

    /// Every block in the index (slow; for empty_cache and checks).
    ///
    /// # Safety
    /// Pool lock held.
    pub unsafe fn collect(&self, table: &BlockTable) -> Vec<BlockIdx> {
        let mut out = Vec::with_capacity(self.blocks as usize);
        for &head in self.heads.iter() {
            let mut idx = head;
            while idx != NIL {
                out.push(idx);
                idx = table.links(idx).list_next;
            }
        }
        out
    }
}

impl Default for FreeIndex {
    fn default() -> Self {
        Self::new()
    }
}
