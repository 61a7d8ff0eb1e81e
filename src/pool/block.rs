//! Block records and the table that holds them.
//!
//! A block record describes one contiguous range of a segment: free or handed out. Records
//! live in a [`BlockTable`] whose chunks are never freed or moved ("type-stable memory"),
//! so a stale index read by a racing free is still a valid record to look at; the record's
//! atomic `tag` (address | state) tells whether it is still the block the caller thinks.
//!
//! Ownership of a record's plain fields ([`BlockData`], and [`BlockLinks`] in its cold
//! half): the device pool's lock while the block is free in the pool, the owning thread
//! while it sits in that thread's cache, and the program (through whichever thread frees
//! it) while it is allocated. The hand-over points are the pool lock, and the Release
//! store / AcqRel CAS on `tag`.
//!
//! Note [place is atomic]: a record's [`Place`] is read by other threads: the pool lock's
//! holder asks a neighbour whether it is free to merge with (the neighbour may be a block in
//! use, or in another thread's cache), while the block's owner moves it between `Allocated`
//! and `ThreadCache` without that lock. ThreadSanitizer reported those reads racing the
//! owner's writes (44 reports in `tests/pool_threads.rs`): harmless for the decision (both
//! of the owner's states mean "not free"), but a data race all the same. So the place lives
//! beside `tag` as an atomic byte, read and written with relaxed order: the states that
//! matter to the pool (free in the pool) are only entered and left under its lock, which
//! orders them.

use crate::sync::{AtomicPtr, AtomicU64, AtomicU8, RecordCell, RecordMut};
use core::sync::atomic::Ordering;

/// Index of a record in the table; [`NIL`] means none.
pub type BlockIdx = u32;
pub const NIL: BlockIdx = u32::MAX;

/// `tag` state bits (addresses are 512-aligned, so the low 9 bits are free).
pub const TAG_FREE: u64 = 0;
pub const TAG_ALLOCATED: u64 = 1;
const TAG_STATE_MASK: u64 = 0x1ff;

/// Where a block is while the program does not hold it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Place {
    /// Handed to the program.
    Allocated,
    /// Free, usable by any stream: in the device pool's shared index.
    FreeShared,
    /// Freed on a stream and usable only by that stream until an event recorded after the
    /// free completes: in that stream's index and age list.
    FreeOnStream,
    /// Freed without a stream (or on a stream other than its own): usable by nobody until
    /// a context fence recorded after the free completes.
    AwaitingFence,
    /// In a thread's cache, bound to the cache slot's stream.
    ThreadCache,
    /// A VMM arena block freed on its stream, in one of its pool's parking slots (Note
    /// [parked arena blocks] in `parked.rs`).
    Parked,
    /// The record is not in use.
    Unused,
}

impl Place {
    /// Every place, in discriminant order.
    const ALL: [Place; 7] = [
        Place::Allocated,
        Place::FreeShared,
        Place::FreeOnStream,
        Place::AwaitingFence,
        Place::ThreadCache,
        Place::Parked,
        Place::Unused,
    ];

    /// The place stored as `v` (only ever a discriminant written by [`Block::set_place`]).
    fn from_u8(v: u8) -> Place {
        Self::ALL[(v as usize).min(Self::ALL.len() - 1)]
    }
}

/// Whether a block was carved from a small-block segment or a large one.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SegmentKind {
    Small = 0,
    Large = 1,
}

/// The fields of a record that frees and thread-cache hits read and write: kept on the
/// record's one cache line (Note [hot and cold records]).
#[derive(Copy, Clone, Debug)]
pub struct BlockData {
    pub ptr: u64,
    pub size: u64,
    /// What the program asked for (0 while free).
    pub requested: u64,
    /// The stream the block belongs to: the stream it was allocated on while allocated; the
    /// stream it was freed on while `FreeOnStream` or in a thread cache.
    pub stream: u64,
    /// The stream handle the block was allocated with (lets a free on the same handle skip
    /// asking the driver for the stream's id).
    pub handle: u64,
    /// The device pool the block belongs to.
    pub pool: u16,
    pub kind: SegmentKind,
}

/// The fields of a record that only the pool's slow path (under its lock), fences and
/// parking touch: links, the segment, the free epoch. Owned as [`BlockData`] is (module
/// note), on a line of their own (Note [hot and cold records]).
#[derive(Copy, Clone, Debug)]
pub struct BlockLinks {
    /// Epoch of the stream event or fence that must complete before the block can be
    /// shared (see `fences.rs`).
    pub free_epoch: u64,
    /// Address-order neighbours in the same segment.
    pub seg_prev: BlockIdx,
    pub seg_next: BlockIdx,
    /// Links in a free index class list.
    pub list_prev: BlockIdx,
    pub list_next: BlockIdx,
    /// Links in a FIFO (a stream's age list or the fence queue).
    pub fifo_prev: BlockIdx,
    pub fifo_next: BlockIdx,
    /// Whether this record starts its segment (the segment's driver allocation).
    pub segment_head: bool,
    /// Size of the driver allocation, on the segment head only.
    pub segment_size: u64,
}

impl BlockData {
    const EMPTY: BlockData = BlockData {
        ptr: 0,
        size: 0,
        requested: 0,
        stream: 0,
        handle: 0,
        pool: 0,
        kind: SegmentKind::Small,
    };
}

impl BlockLinks {
    /// No links (every link [`NIL`]).
    pub const UNLINKED: BlockLinks = BlockLinks {
        free_epoch: 0,
        seg_prev: NIL,
        seg_next: NIL,
        list_prev: NIL,
        list_next: NIL,
        fifo_prev: NIL,
        fifo_next: NIL,
        segment_head: false,
        segment_size: 0,
    };
}

/// Note [hot and cold records]: with 10⁵ blocks live a free reads a random record, and
/// the records of every live block are what must stay in the CPU's caches for that read
/// to hit. A free and a thread-cache hit touch the tag, the place and the fields of
/// [`BlockData`]: one 64-byte line. The links, the segment and the free epoch
/// ([`BlockLinks`]) are touched by the pool's slow path only, and live in a second table
/// of lines beside the first, so they do not come along. Before the split a record was
/// one 128-byte unit (two lines, which the adjacent-line prefetcher moves together): 12.8
/// MB of records for 10⁵ blocks against 6.4 MB now (docs/BENCHMARKS.md, twenty-first
/// session).
///
/// Each half has a line of its own: records of blocks that different threads allocate and
/// free at once would otherwise share lines, and every alloc/free writes its record (false
/// sharing measured: per-thread cost ~4x with 4 threads, with records sharing lines). The
/// halves used to be aligned to 128 bytes, a pair of lines, against the adjacent-line
/// prefetcher; at 64 bytes the 16-thread test on the H200 host moved within its noise
/// (twenty-first session).
#[repr(C, align(64))]
pub struct Block {
    /// `ptr | TAG_ALLOCATED` while the program holds the block, `ptr | TAG_FREE` otherwise,
    /// 0 while the record is unused.
    pub tag: AtomicU64,
    /// A [`Place`] (Note [place is atomic]).
    place: AtomicU8,
    data: RecordCell<BlockData>,
}

/// The cold half of a record (Note [hot and cold records]), reached through
/// [`BlockTable::links`].
#[repr(align(64))]
struct BlockCold {
    links: RecordCell<BlockLinks>,
}

// SAFETY: `links` is only accessed by the block's current owner (see the module note).
unsafe impl Sync for BlockCold {}

// SAFETY: `data` is only accessed by the block's current owner (see the module note);
// `tag` is atomic.
unsafe impl Sync for Block {}

impl BlockCold {
    fn new() -> Self {
        BlockCold {
            links: RecordCell::new(BlockLinks::UNLINKED),
        }
    }
}

impl Block {
    fn new() -> Self {
        Block {
            tag: AtomicU64::new(0),
            place: AtomicU8::new(Place::Unused as u8),
            data: RecordCell::new(BlockData::EMPTY),
        }
    }

    /// The record's fields.
    ///
    /// # Safety
    /// The caller owns the block (module note), and holds no other reference to its data.
    #[inline]
    pub unsafe fn data(&self) -> RecordMut<'_, BlockData> {
        // SAFETY: the caller's contract.
        unsafe { self.data.get_mut() }
    }

    /// Where the block is (Note [place is atomic]).
    #[inline]
    pub fn place(&self) -> Place {
        Place::from_u8(self.place.load(Ordering::Relaxed))
    }

    /// Moves the block to `place`: by the pool under its lock, or by the block's owner.
    #[inline]
    pub fn set_place(&self, place: Place) {
        self.place.store(place as u8, Ordering::Relaxed);
    }

    /// Marks the block handed to the program (Release: its fields, written by the
    /// allocating thread, become visible to whichever thread frees it).
    #[inline]
    pub fn publish_allocated(&self, ptr: u64) {
        self.tag.store(ptr | TAG_ALLOCATED, Ordering::Release);
    }

    /// Marks the block free (not held by the program); used by the pool on new blocks.
    #[inline]
    pub fn publish_free(&self, ptr: u64) {
        self.tag.store(ptr | TAG_FREE, Ordering::Release);
    }

    /// Takes the block back from the program if it is allocated at `ptr`.
    #[inline]
    pub fn try_take_back(&self, ptr: u64) -> TakeBack {
        match self.tag.compare_exchange(
            ptr | TAG_ALLOCATED,
            ptr | TAG_FREE,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => TakeBack::Taken,
            Err(tag) if tag & !TAG_STATE_MASK == ptr => TakeBack::AlreadyFree,
            Err(_) => TakeBack::NotThisBlock,
        }
    }

    /// Whether the program holds the block at `ptr` right now.
    #[inline]
    pub fn is_allocated_at(&self, ptr: u64) -> bool {
        self.tag.load(Ordering::Acquire) == ptr | TAG_ALLOCATED
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TakeBack {
    Taken,
    AlreadyFree,
    NotThisBlock,
}

#[cfg(not(loom))]
const CHUNK_SHIFT: u32 = 12;
#[cfg(loom)]
const CHUNK_SHIFT: u32 = 2;
const CHUNK_LEN: usize = 1 << CHUNK_SHIFT;
#[cfg(not(loom))]
const MAX_CHUNKS: usize = 1 << 13;
#[cfg(loom)]
const MAX_CHUNKS: usize = 4;

/// Most records the table can hold (2^25, 4 GiB of records): what the address map's slots
/// have room for.
pub const MAX_RECORDS: usize = CHUNK_LEN * MAX_CHUNKS;

/// `CHUNK_LEN` records: the hot halves, then the cold ones (Note [hot and cold records]).
#[repr(C)]
struct Chunk {
    hot: [Block; CHUNK_LEN],
    cold: [BlockCold; CHUNK_LEN],
}

/// A chunk of unused records, never freed. Frees read records at random: on huge pages
/// (Note [metadata on huge pages]).
#[cfg(not(loom))]
fn new_chunk() -> *mut Chunk {
    let chunk = super::meta_memory::alloc_zeroed::<Chunk>();
    for i in 0..CHUNK_LEN {
        // SAFETY: `chunk` is memory for one `Chunk`, aligned for it (pieces are 2 MiB
        // aligned and the chunk's size divides them), nobody else's yet.
        unsafe {
            core::ptr::addr_of_mut!((*chunk).hot[i]).write(Block::new());
            core::ptr::addr_of_mut!((*chunk).cold[i]).write(BlockCold::new());
        }
    }
    chunk
}

// loom's atomics are not plain memory: built element by element.
#[cfg(loom)]
fn new_chunk() -> *mut Chunk {
    Box::into_raw(Box::new(Chunk {
        hot: core::array::from_fn(|_| Block::new()),
        cold: core::array::from_fn(|_| BlockCold::new()),
    }))
}

/// Type-stable storage for block records (up to [`MAX_RECORDS`] of them).
pub struct BlockTable {
    chunks: [AtomicPtr<Chunk>; MAX_CHUNKS],
    /// Records not in use, and how many chunks exist; changed only under this lock, which
    /// is taken only on the slow path (inside a device pool's lock).
    free: spin::Mutex<FreeRecords>,
}

struct FreeRecords {
    list: Vec<BlockIdx>,
    chunks: usize,
}

impl BlockTable {
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        BlockTable {
            chunks: [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_CHUNKS],
            free: spin::Mutex::new(FreeRecords {
                list: Vec::new(),
                chunks: 0,
            }),
        }
    }

    #[cfg(loom)]
    pub fn new() -> Self {
        BlockTable {
            chunks: core::array::from_fn(|_| AtomicPtr::new(core::ptr::null_mut())),
            free: spin::Mutex::new(FreeRecords {
                list: Vec::new(),
                chunks: 0,
            }),
        }
    }

    /// The record at `idx`. Panics on an index the table never handed out (a bug).
    #[inline]
    pub fn get(&self, idx: BlockIdx) -> &Block {
        self.try_get(idx).expect("block index out of range")
    }

    /// The record at `idx`, or `None` for an index the table never handed out.
    #[inline]
    pub fn try_get(&self, idx: BlockIdx) -> Option<&Block> {
        let chunk = self.chunk(idx)?;
        // SAFETY: chunks are never freed; the index is below `CHUNK_LEN`.
        Some(unsafe { &(*chunk).hot[idx as usize & (CHUNK_LEN - 1)] })
    }

    /// The cold fields of the record at `idx` (Note [hot and cold records]). Panics on an
    /// index the table never handed out (a bug).
    ///
    /// # Safety
    /// As [`Block::data`].
    #[inline]
    pub unsafe fn links(&self, idx: BlockIdx) -> RecordMut<'_, BlockLinks> {
        let chunk = self.chunk(idx).expect("block index out of range");
        // SAFETY: chunks are never freed and the index is below `CHUNK_LEN`; access to
        // the fields is the caller's contract.
        unsafe {
            (*chunk).cold[idx as usize & (CHUNK_LEN - 1)]
                .links
                .get_mut()
        }
    }

    #[inline]
    fn chunk(&self, idx: BlockIdx) -> Option<*const Chunk> {
        let base = self
            .chunks
            .get((idx >> CHUNK_SHIFT) as usize)?
            .load(Ordering::Acquire);
        (!base.is_null()).then_some(base as *const Chunk)
    }

    /// Fills the record at `idx` (new, owned by the caller) as the head of a new segment
    /// (a driver allocation, or the VMM arena) of `size` bytes at `ptr`: one block covering
    /// all of it. The caller sets its place and publishes it.
    ///
    /// # Safety
    /// The caller owns the record (module note).
    pub unsafe fn init_segment_head(
        &self,
        idx: BlockIdx,
        ptr: u64,
        size: u64,
        pool: u16,
        kind: SegmentKind,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            *self.get(idx).data() = BlockData {
                ptr,
                size,
                pool,
                kind,
                ..BlockData::EMPTY
            };
            *self.links(idx) = BlockLinks {
                segment_head: true,
                segment_size: size,
                ..BlockLinks::UNLINKED
            };
        }
    }

    /// A record for a new block; `None` when the table is full.
    pub fn allocate(&self) -> Option<BlockIdx> {
        self.allocate_locked(&mut self.free.lock())
    }

    /// Up to `n` records for new blocks, taken under one lock, pushed onto `out` (fewer
    /// when the table is full).
    pub fn allocate_into(&self, out: &mut Vec<BlockIdx>, n: usize) {
        let mut free = self.free.lock();
        for _ in 0..n {
            match self.allocate_locked(&mut free) {
                Some(idx) => out.push(idx),
                None => break,
            }
        }
    }

    fn allocate_locked(&self, free: &mut FreeRecords) -> Option<BlockIdx> {
        if let Some(idx) = free.list.pop() {
            return Some(idx);
        }
        if free.chunks == MAX_CHUNKS {
            return None;
        }
        let c = free.chunks;
        self.chunks[c].store(new_chunk(), Ordering::Release);
        free.chunks += 1;
        let first = (c << CHUNK_SHIFT) as BlockIdx;
        free.list
            .extend((first + 1..first + CHUNK_LEN as BlockIdx).rev());
        Some(first)
    }

    /// Returns a record that no index or map refers to any more.
    pub fn release(&self, idx: BlockIdx) {
        self.clear(idx);
        self.free.lock().list.push(idx);
    }

    /// Empties a record that no index or map refers to any more, for a caller that keeps
    /// it for reuse (a pool's stash, Note [record stash] in `pool/mod.rs`).
    pub fn clear(&self, idx: BlockIdx) {
        let b = self.get(idx);
        b.tag.store(0, Ordering::Release);
        b.set_place(Place::Unused);
        // SAFETY: the caller owned the block and gives it up here.
        unsafe {
            *b.data() = BlockData::EMPTY;
            *self.links(idx) = BlockLinks::UNLINKED;
        }
    }

    /// Returns records already emptied with [`BlockTable::clear`], under one lock.
    pub fn release_cleared(&self, records: &[BlockIdx]) {
        self.free.lock().list.extend_from_slice(records);
    }
}

#[cfg(not(loom))]
const _: () = assert!(
    core::mem::size_of::<Block>() == 64 && core::mem::size_of::<BlockCold>() == 64,
    "a record's halves are a line each"
);

impl Default for BlockTable {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_records_place_reads_back_and_clears_to_unused() {
        // A static, as the pool's table is: chunks are never freed (Miri's leak check skips
        // memory that a static reaches).
        static TABLE: BlockTable = BlockTable::new();
        let table = &TABLE;
        let idx = table.allocate().expect("a record");
        let b = table.get(idx);
        for place in Place::ALL {
            b.set_place(place);
            assert_eq!(b.place(), place);
        }
        b.set_place(Place::FreeShared);
        table.clear(idx);
        assert_eq!(table.get(idx).place(), Place::Unused);
    }
}
