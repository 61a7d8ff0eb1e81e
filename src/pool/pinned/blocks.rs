//! The pinned pool's memory map: chunks from the driver, the blocks that tile each chunk,
//! and the indexes of blocks that can be handed out. Bookkeeping only: no backend call
//! and no lock of its own (the pool's lock guards it).
//!
//! A block is `Free` (anyone may take it), `Live` (the program holds it) or `Waiting`
//! (freed, and work submitted before the free may still read or write it: it becomes
//! `Free` once a fence covering its free epoch has completed; meanwhile only the stream it
//! was freed on, if any, may take it). Adjacent `Free` blocks of a chunk are always merged,
//! so a chunk whose blocks are all free is one block again and can go back to the driver.

use super::{Kind, STREAMLESS};
use crate::backend::{ContextId, HostPtr};
use crate::ptr_map::IntMap;
use crate::status::CupoolStatus;
use std::collections::{BTreeMap, BTreeSet};

/// Blocks are multiples of a page, so every block is page aligned (what `cudaHostAlloc`
/// gives, and what `O_DIRECT` reads into pinned buffers need).
pub const PAGE: u64 = 4096;
/// Requests up to this size are small: carved from [`SMALL_CHUNK`] chunks.
pub const SMALL_MAX: u64 = 1 << 20;
/// Size of the chunks small blocks come from.
pub const SMALL_CHUNK: u64 = 2 << 20;
/// Larger requests get a chunk of their own, rounded up to this.
pub const LARGE_ROUND: u64 = 2 << 20;
/// A free large block is split only when the rest would be at least this big: a block
/// handed out is less than this larger than its request, and the rest is a large block.
pub const LARGE_SPLIT_MIN: u64 = SMALL_MAX;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum State {
    Free,
    /// Handed to the program; `stream` is the allocation's stream id ([`STREAMLESS`]).
    Live {
        requested: u64,
        stream: u64,
    },
    /// Freed at `epoch`; `stream` may take it before its fence completes ([`STREAMLESS`]:
    /// nobody may).
    Waiting {
        epoch: u64,
        stream: u64,
    },
}

#[derive(Copy, Clone, Debug)]
pub struct Block {
    pub size: u64,
    /// Base of the chunk the block lies in.
    pub chunk: u64,
    pub kind: Kind,
    pub state: State,
}

#[derive(Copy, Clone, Debug)]
pub struct Chunk {
    pub size: u64,
    /// The context that was current when the chunk was allocated (freed with it current).
    pub ctx: ContextId,
    pub kind: Kind,
}

/// (size, address): best fit is the first entry at or after `(need, 0)`.
type BySize = BTreeSet<(u64, u64)>;

#[derive(Default)]
pub struct Blocks {
    chunks: BTreeMap<u64, Chunk>,
    blocks: BTreeMap<u64, Block>,
    free_small: BySize,
    free_large: BySize,
    /// Waiting blocks freed on a stream, which that stream may take at once.
    on_stream: IntMap<(u64, Kind), BySize>,
    /// Every waiting block, by (epoch, address): drained oldest first.
    waiting: BTreeSet<(u64, u64)>,
    pub reserved: u64,
    pub allocated: u64,
    pub requested: u64,
    pub waiting_bytes: u64,
}

impl Blocks {
    fn free_index(&mut self, kind: Kind) -> &mut BySize {
        match kind {
            Kind::Small => &mut self.free_small,
            Kind::Large => &mut self.free_large,
        }
    }

    pub fn chunk_count(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// The newest free epoch among the waiting blocks (0: none waits).
    pub fn newest_waiting_epoch(&self) -> u64 {
        self.waiting.last().map_or(0, |&(e, _)| e)
    }

    /// Adds a chunk from the driver as one free block.
    pub fn add_chunk(&mut self, base: HostPtr, size: u64, ctx: ContextId, kind: Kind) {
        self.chunks.insert(base, Chunk { size, ctx, kind });
        self.blocks.insert(
            base,
            Block {
                size,
                chunk: base,
                kind,
                state: State::Free,
            },
        );
        self.free_index(kind).insert((size, base));
        self.reserved += size;
    }

    /// The smallest free block of `kind` of at least `need` bytes: (size, address).
    pub fn fit_free(&self, kind: Kind, need: u64) -> Option<(u64, HostPtr)> {
        let index = match kind {
            Kind::Small => &self.free_small,
            Kind::Large => &self.free_large,
        };
        index.range((need, 0)..).next().copied()
    }

    /// The smallest block of `kind` of at least `need` bytes that `stream` freed and may
    /// take before its fence completes: (size, address).
    pub fn fit_on_stream(&self, stream: u64, kind: Kind, need: u64) -> Option<(u64, HostPtr)> {
        self.on_stream
            .get(&(stream, kind))?
            .range((need, 0)..)
            .next()
            .copied()
    }

    /// Hands the block at `ptr` (found by a fit) to the program: `need` bytes of it,
    /// the rest split off when it is worth keeping apart. Returns the block's size.
    pub fn take(&mut self, ptr: HostPtr, need: u64, requested: u64, stream: u64) -> u64 {
        let mut b = self.blocks[&ptr];
        self.unindex(ptr, &b);
        let rest = b.size - need;
        let split = match b.kind {
            Kind::Small => rest >= PAGE,
            Kind::Large => rest >= LARGE_SPLIT_MIN,
        };
        if split {
            let tail = Block { size: rest, ..b };
            self.blocks.insert(ptr + need, tail);
            self.index(ptr + need, &tail);
            b.size = need;
        }
        b.state = State::Live { requested, stream };
        self.blocks.insert(ptr, b);
        self.allocated += b.size;
        self.requested += requested;
        b.size
    }

    /// The program gives the block at `ptr` back at `epoch`; `stream` may take it before
    /// its fence completes ([`STREAMLESS`]: nobody). Returns the stream that may take it
    /// ([`STREAMLESS`] also for a block allocated on another stream).
    pub fn give_back(
        &mut self,
        ptr: HostPtr,
        epoch: u64,
        stream: u64,
    ) -> Result<u64, CupoolStatus> {
        let Some(b) = self.blocks.get_mut(&ptr) else {
            return Err(CupoolStatus::CupoolErrorInvalidPointer);
        };
        let State::Live {
            requested,
            stream: allocated_on,
        } = b.state
        else {
            return Err(CupoolStatus::CupoolErrorDoubleFree);
        };
        // A block allocated on one stream and freed on another: the pool cannot know the
        // two are ordered, so nobody takes it before its fence (as for device blocks).
        let stream = if allocated_on != STREAMLESS && allocated_on != stream {
            STREAMLESS
        } else {
            stream
        };
        b.state = State::Waiting { epoch, stream };
        let b = *b;
        self.allocated -= b.size;
        self.requested -= requested;
        self.index(ptr, &b);
        Ok(stream)
    }

    /// Makes every block freed at or before `epoch` free for anyone, merged with its free
    /// neighbours. Returns how many blocks became free.
    pub fn release_waiting(&mut self, epoch: u64) -> usize {
        let mut n = 0;
        while let Some(&(e, ptr)) = self.waiting.first() {
            if e > epoch {
                break;
            }
            let b = self.blocks[&ptr];
            self.unindex(ptr, &b);
            self.make_free(ptr, b);
            n += 1;
        }
        n
    }

    /// Marks `b` (at `ptr`, in no index) free, merges it with free neighbours of its chunk
    /// and indexes the result.
    fn make_free(&mut self, ptr: HostPtr, mut b: Block) {
        b.state = State::Free;
        let next = ptr + b.size;
        if let Some(&nb) = self.blocks.get(&next) {
            if nb.chunk == b.chunk && nb.state == State::Free {
                self.unindex(next, &nb);
                self.blocks.remove(&next);
                b.size += nb.size;
            }
        }
        // Blocks tile their chunk, so a previous block of the same chunk ends at `ptr`.
        let mut start = ptr;
        if let Some((&prev, &pb)) = self.blocks.range(..ptr).next_back() {
            if pb.chunk == b.chunk && pb.state == State::Free {
                self.unindex(prev, &pb);
                self.blocks.remove(&ptr);
                start = prev;
                b.size += pb.size;
            }
        }
        self.blocks.insert(start, b);
        self.index(start, &b);
    }

    fn index(&mut self, ptr: HostPtr, b: &Block) {
        match b.state {
            State::Free => {
                self.free_index(b.kind).insert((b.size, ptr));
            }
            State::Waiting { epoch, stream } => {
                self.waiting.insert((epoch, ptr));
                self.waiting_bytes += b.size;
                if stream != STREAMLESS {
                    self.on_stream
                        .entry((stream, b.kind))
                        .or_default()
                        .insert((b.size, ptr));
                }
            }
            State::Live { .. } => {}
        }
    }

    fn unindex(&mut self, ptr: HostPtr, b: &Block) {
        match b.state {
            State::Free => {
                self.free_index(b.kind).remove(&(b.size, ptr));
            }
            State::Waiting { epoch, stream } => {
                self.waiting.remove(&(epoch, ptr));
                self.waiting_bytes -= b.size;
                if stream != STREAMLESS {
                    let key = (stream, b.kind);
                    if let Some(set) = self.on_stream.get_mut(&key) {
                        set.remove(&(b.size, ptr));
                        if set.is_empty() {
                            self.on_stream.remove(&key);
                        }
                    }
                }
            }
            State::Live { .. } => {}
        }
    }

    /// The block that starts at `ptr`.
    #[cfg(test)]
    pub fn block(&self, ptr: HostPtr) -> Option<Block> {
        self.blocks.get(&ptr).copied()
    }

    /// The block containing `ptr` (interior addresses included) and its start.
    pub fn block_containing(&self, ptr: HostPtr) -> Option<(HostPtr, Block)> {
        let (&start, &b) = self.blocks.range(..=ptr).next_back()?;
        (ptr - start < b.size).then_some((start, b))
    }

    /// Removes every chunk that is one free block; returns them (base, chunk) for the
    /// caller to give back to the driver. `keep` says which chunks must stay for now.
    pub fn take_idle_chunks(&mut self, keep: impl Fn(&Chunk) -> bool) -> Vec<(HostPtr, Chunk)> {
        let idle: Vec<(HostPtr, Chunk)> = self
            .chunks
            .iter()
            .filter(|&(base, c)| {
                self.blocks
                    .get(base)
                    .is_some_and(|b| b.state == State::Free && b.size == c.size)
                    && !keep(c)
            })
            .map(|(&base, &c)| (base, c))
            .collect();
        for &(base, c) in &idle {
            let b = self.blocks.remove(&base).expect("an idle chunk's block");
            self.unindex(base, &b);
            self.chunks.remove(&base);
            self.reserved -= c.size;
        }
        idle
    }

    /// Puts back a chunk [`Blocks::take_idle_chunks`] removed that the driver would not
    /// take.
    pub fn restore_chunk(&mut self, base: HostPtr, c: Chunk) {
        self.add_chunk(base, c.size, c.ctx, c.kind);
    }

    /// Checks the map's invariants (tests): blocks tile each chunk exactly, no two free
    /// neighbours, every index entry matches its block, and the byte counts add up.
    pub fn check(&self) -> Result<(), String> {
        let (mut allocated, mut requested, mut waiting) = (0, 0, 0);
        let mut indexed = 0;
        for (&base, c) in &self.chunks {
            let mut at = base;
            let mut last_free = false;
            for (&p, b) in self.blocks.range(base..base + c.size) {
                if p != at || b.chunk != base || b.kind != c.kind {
                    return Err(format!("chunk {base:#x}: block {p:#x} out of place"));
                }
                let free = b.state == State::Free;
                if free && last_free {
                    return Err(format!("chunk {base:#x}: free neighbours at {p:#x}"));
                }
                last_free = free;
                match b.state {
                    State::Free => {
                        let index = match b.kind {
                            Kind::Small => &self.free_small,
                            Kind::Large => &self.free_large,
                        };
                        if !index.contains(&(b.size, p)) {
                            return Err(format!("free block {p:#x} not indexed"));
                        }
                        indexed += 1;
                    }
                    State::Live { requested: r, .. } => {
                        allocated += b.size;
                        requested += r;
                    }
                    State::Waiting { epoch, stream } => {
                        waiting += b.size;
                        indexed += 1;
                        if !self.waiting.contains(&(epoch, p)) {
                            return Err(format!("waiting block {p:#x} not indexed"));
                        }
                        if stream != STREAMLESS
                            && !self
                                .on_stream
                                .get(&(stream, b.kind))
                                .is_some_and(|s| s.contains(&(b.size, p)))
                        {
                            return Err(format!("stream block {p:#x} not indexed"));
                        }
                    }
                }
                at = p + b.size;
            }
            if at != base + c.size {
                return Err(format!("chunk {base:#x} not tiled: ends at {at:#x}"));
            }
        }
        let entries = self.free_small.len() + self.free_large.len() + self.waiting.len();
        if entries != indexed || self.blocks.len() < indexed {
            return Err(format!("{entries} index entries for {indexed} blocks"));
        }
        let reserved: u64 = self.chunks.values().map(|c| c.size).sum();
        if (reserved, allocated, requested, waiting)
            != (
                self.reserved,
                self.allocated,
                self.requested,
                self.waiting_bytes,
            )
        {
            return Err("byte counts disagree with the blocks".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: ContextId = ContextId(1);
    const BASE: u64 = 0x10_0000_0000;

    fn chunk() -> Blocks {
        let mut m = Blocks::default();
        m.add_chunk(BASE, SMALL_CHUNK, CTX, Kind::Small);
        m
    }

    #[test]
    fn splits_and_merges_back_into_one_block() {
        let mut m = chunk();
        let a = m.fit_free(Kind::Small, PAGE).unwrap().1;
        assert_eq!(m.take(a, PAGE, 100, STREAMLESS), PAGE);
        let b = m.fit_free(Kind::Small, 3 * PAGE).unwrap().1;
        assert_eq!(b, a + PAGE, "the rest of the chunk follows");
        m.take(b, 3 * PAGE, 3 * PAGE, STREAMLESS);
        let c = m.fit_free(Kind::Small, PAGE).unwrap().1;
        m.take(c, PAGE, 1, STREAMLESS);
        m.check().unwrap();
        assert_eq!(m.allocated, 5 * PAGE);
        // Free the middle block, then its neighbours: each merge leaves one free block.
        for (i, p) in [b, a, c].into_iter().enumerate() {
            m.give_back(p, i as u64 + 1, STREAMLESS).unwrap();
            assert_eq!(m.release_waiting(i as u64 + 1), 1);
            m.check().unwrap();
        }
        assert_eq!(m.block(BASE).unwrap().size, SMALL_CHUNK, "one block again");
        assert_eq!(m.take_idle_chunks(|_| false).len(), 1);
        assert_eq!(m.reserved, 0);
        m.check().unwrap();
    }

    #[test]
    fn waiting_blocks_are_taken_only_by_their_stream_until_released() {
        let mut m = chunk();
        let a = m.fit_free(Kind::Small, SMALL_CHUNK).unwrap().1;
        m.take(a, SMALL_CHUNK, SMALL_CHUNK, 7);
        m.give_back(a, 5, 7).unwrap();
        assert_eq!(m.fit_free(Kind::Small, PAGE), None, "nobody else yet");
        assert_eq!(m.fit_on_stream(8, Kind::Small, PAGE), None);
        assert_eq!(
            m.fit_on_stream(7, Kind::Small, PAGE),
            Some((SMALL_CHUNK, a))
        );
        // Taking part of it keeps the rest waiting on the stream.
        m.take(a, PAGE, PAGE, 7);
        m.check().unwrap();
        assert_eq!(
            m.fit_on_stream(7, Kind::Small, PAGE),
            Some((SMALL_CHUNK - PAGE, a + PAGE))
        );
        assert_eq!(m.release_waiting(4), 0, "an older fence covers nothing");
        assert_eq!(m.release_waiting(5), 1);
        assert_eq!(m.fit_free(Kind::Small, PAGE).map(|f| f.1), Some(a + PAGE));
        assert_eq!(m.fit_on_stream(7, Kind::Small, PAGE), None);
        m.check().unwrap();
    }

    #[test]
    fn a_block_freed_on_another_stream_waits_for_everyone() {
        let mut m = chunk();
        let a = m.fit_free(Kind::Small, PAGE).unwrap().1;
        m.take(a, PAGE, PAGE, 7);
        m.give_back(a, 1, 8).unwrap();
        assert_eq!(m.fit_on_stream(8, Kind::Small, PAGE), None);
        assert_eq!(m.fit_on_stream(7, Kind::Small, PAGE), None);
        assert_eq!(
            m.give_back(a, 2, 8),
            Err(CupoolStatus::CupoolErrorDoubleFree)
        );
        assert_eq!(
            m.give_back(a + 1, 2, 8),
            Err(CupoolStatus::CupoolErrorInvalidPointer)
        );
        m.check().unwrap();
    }

    #[test]
    fn large_blocks_split_only_for_a_large_rest() {
        let mut m = Blocks::default();
        m.add_chunk(BASE, 8 * LARGE_ROUND, CTX, Kind::Large);
        let a = m.fit_free(Kind::Large, 3 * LARGE_ROUND).unwrap().1;
        assert_eq!(m.take(a, 3 * LARGE_ROUND, 1, STREAMLESS), 3 * LARGE_ROUND);
        let rest = m.fit_free(Kind::Large, 5 * LARGE_ROUND - PAGE).unwrap().1;
        // 512 KiB over: handed out whole.
        let need = 5 * LARGE_ROUND - (512 << 10);
        assert_eq!(m.take(rest, need, need, STREAMLESS), 5 * LARGE_ROUND);
        assert_eq!(
            m.fit_free(Kind::Small, PAGE),
            None,
            "small requests never split it"
        );
        m.check().unwrap();
        assert_eq!(m.block_containing(rest + 12345).map(|(p, _)| p), Some(rest));
    }
}
