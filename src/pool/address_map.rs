//! Address → block record, readable without a lock.
//!
//! Note [address map as a hash]: an open-addressing hash table of block starts, one `u64`
//! a slot (the start's 512-byte granule number above the record's index), linear probing,
//! at most half full. Only block *starts* are entered, so a block of any size costs one
//! slot: 16 to 32 bytes a live block (the table doubles when half full), 2 MiB for 10⁵
//! blocks.
//!
//! Why not the radix tree it replaced (13 + 13 + 13 bits, leaves of 4-byte entries, one
//! per 512-byte granule): blocks average tens of KiB, so each one had a 64-byte leaf line of
//! its own, read at random by every free. With 10⁵ blocks live those lines and the records
//! (19 MB) were out of every cache, and the leaf load was half of a free's misses
//! (docs/BENCHMARKS.md, twentieth and twenty-first sessions). For 10⁵ blocks the hash
//! takes 2 MiB against the leaf lines' 6.4 MB, and a lookup is still two dependent loads
//! and no lock.
//!
//! Writers (split, merge, segment creation and release) run under a device pool's lock and
//! also take this map's own lock, since two pools' writers may run at once. Readers take no
//! lock:
//! - a hit is confirmed by the caller through the record's tag (as before: a stale entry
//!   read while a writer changes it is harmless);
//! - a removal closes its gap by moving later entries of the probe run back (no
//!   tombstones), and a reader may then miss an entry it passed while it moved. So removals
//!   that move entries bump `moves` (odd while one runs), and a reader that found nothing
//!   believes it only when `moves` did not change meanwhile (a sequence lock around the
//!   misses). A removal whose next slot is empty moves nothing and skips the bumps;
//! - growing builds a new table and publishes it; the old one stays readable (and holds
//!   every entry it held when it was replaced), so tables are never freed. They double, so
//!   the retired ones together are smaller than the current one.

use super::block::{BlockIdx, MAX_RECORDS, NIL};
use crate::sync::{AtomicPtr, AtomicU64, Lock};
use core::sync::atomic::Ordering;

#[cfg(loom)]
use loom::sync::atomic::fence;
#[cfg(not(loom))]
use std::sync::atomic::fence;

/// Block starts are multiples of 512 bytes.
const GRANULE_SHIFT: u32 = 9;
/// Bits of a slot holding the record's index; the granule number sits above them.
const INDEX_BITS: u32 = 25;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Addresses at or above this cannot be entered (the granule number must fit above the
/// index: 48-bit addresses, as on every platform CUDA runs on).
pub const ADDRESS_LIMIT: u64 = 1 << (64 - INDEX_BITS + GRANULE_SHIFT);

const _: () = assert!(
    MAX_RECORDS as u64 <= 1 << INDEX_BITS,
    "every record index fits a slot"
);

/// Slots of the first table: 8 KiB, which a small program never outgrows.
#[cfg(not(loom))]
const FIRST_CAPACITY: usize = 1 << 10;
#[cfg(loom)]
const FIRST_CAPACITY: usize = 4;

/// The granule number of a block start, or `None` for an address that is never one (0 is
/// kept for empty slots: no block starts in the first granule).
#[inline]
fn key_of(addr: u64) -> Option<u64> {
    let key = addr >> GRANULE_SHIFT;
    (addr < ADDRESS_LIMIT && addr & ((1 << GRANULE_SHIFT) - 1) == 0 && key != 0).then_some(key)
}

/// One table: `capacity` slots (a power of two), each 0 or `key << INDEX_BITS | index`.
struct Table {
    slots: *const AtomicU64,
    mask: usize,
    /// `64 - log2(capacity)`: a key's home slot is the top bits of its Fibonacci hash.
    shift: u32,
}

// SAFETY: the slots are atomics; the pointer is never freed nor moved once published.
unsafe impl Send for Table {}
unsafe impl Sync for Table {}

impl Table {
    fn new(capacity: usize) -> Table {
        debug_assert!(capacity.is_power_of_two());
        Table {
            slots: new_slots(capacity),
            mask: capacity - 1,
            shift: 64 - capacity.trailing_zeros(),
        }
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    #[inline]
    fn slot(&self, i: usize) -> &AtomicU64 {
        // SAFETY: `i & mask` is below the capacity the slots were made with.
        unsafe { &*self.slots.add(i & self.mask) }
    }

    /// The index entered for `key`, if the probe run from its home holds it.
    #[inline]
    fn find(&self, key: u64) -> Option<BlockIdx> {
        let mut i = self.home(key);
        // At most half full, so a run ends soon; the bound only guards a reader that races
        // writers for a long time (it then reports a miss, which its caller checks).
        for _ in 0..=self.mask {
            match self.slot(i).load(Ordering::Acquire) {
                0 => return None,
                v if v >> INDEX_BITS == key => return Some((v & INDEX_MASK) as BlockIdx),
                _ => i += 1,
            }
        }
        None
    }

    /// The slot holding `key`, or the empty slot ending its run. Writers only.
    fn position(&self, key: u64) -> (usize, bool) {
        let mut i = self.home(key) & self.mask;
        loop {
            match self.slot(i).load(Ordering::Relaxed) {
                0 => return (i, false),
                v if v >> INDEX_BITS == key => return (i, true),
                _ => i = (i + 1) & self.mask,
            }
        }
    }

    /// Enters `entry` (whose key is not in the table). Writers only.
    fn insert_new(&self, entry: u64) {
        let (i, found) = self.position(entry >> INDEX_BITS);
        debug_assert!(!found);
        self.slot(i).store(entry, Ordering::Release);
    }

    /// Removes the entry at `hole`, moving the later entries of its run that may not sit
    /// past a gap back into it (backward-shift deletion). Writers only, inside a
    /// `moves` bump.
    fn remove_at(&self, mut hole: usize) {
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let v = self.slot(j).load(Ordering::Relaxed);
            if v == 0 {
                break;
            }
            // `v` may fill the hole unless its home lies cyclically in (hole, j].
            let home = self.home(v >> INDEX_BITS) & self.mask;
            let from_home = j.wrapping_sub(home) & self.mask;
            let from_hole = j.wrapping_sub(hole) & self.mask;
            if from_home >= from_hole {
                // Copied before its old slot is reused, so it is never absent from both.
                self.slot(hole).store(v, Ordering::Release);
                hole = j;
            }
        }
        self.slot(hole).store(0, Ordering::Release);
    }
}

/// `capacity` zeroed slots (all empty), never freed.
#[cfg(not(any(loom, miri)))]
fn new_slots(capacity: usize) -> *const AtomicU64 {
    let bytes = capacity * core::mem::size_of::<AtomicU64>();
    let piece = super::meta_memory::PIECE;
    // Read at random by every free: on huge pages once a table spans one (Note [metadata on
    // huge pages]).
    let align = if bytes >= piece { piece } else { 4096 };
    let Some(at) = crate::os_memory::map_aligned(bytes, align, libc::PROT_READ | libc::PROT_WRITE)
    else {
        std::alloc::handle_alloc_error(
            std::alloc::Layout::from_size_align(bytes, align).expect("a table's layout"),
        );
    };
    if bytes >= piece {
        super::meta_memory::advise_huge(at, bytes);
    }
    // Zeroed memory is a table of empty slots (an all-zero `AtomicU64` is 0).
    at as *const AtomicU64
}

/// Under Miri: from the global allocator, so that the table keeps its pointer's provenance
/// and Miri's leak check sees it reachable from the map's static.
#[cfg(all(miri, not(loom)))]
fn new_slots(capacity: usize) -> *const AtomicU64 {
    let layout = std::alloc::Layout::array::<AtomicU64>(capacity).expect("a table's layout");
    // SAFETY: a layout of non-zero size (the capacity is at least `FIRST_CAPACITY`).
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    p.cast()
}

// loom's atomics are not plain memory: built element by element.
#[cfg(loom)]
fn new_slots(capacity: usize) -> *const AtomicU64 {
    let slots: Box<[AtomicU64]> = (0..capacity).map(|_| AtomicU64::new(0)).collect();
    Box::leak(slots).as_ptr()
}

/// What the map's lock guards.
struct Writer {
    /// Entries in the current table.
    len: usize,
    /// Tables replaced by larger ones: still read by readers that loaded them before, so
    /// kept (and reachable, for Miri's leak check).
    retired: Vec<&'static Table>,
}

pub struct AddressMap {
    table: AtomicPtr<Table>,
    /// Odd while a removal moves entries; bumped twice by each (Note [address map as a
    /// hash]).
    moves: AtomicU64,
    writer: Lock<Writer>,
}

impl AddressMap {
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        AddressMap {
            table: AtomicPtr::new(core::ptr::null_mut()),
            moves: AtomicU64::new(0),
            writer: Lock::new_const(Writer {
                len: 0,
                retired: Vec::new(),
            }),
        }
    }

    #[cfg(loom)]
    pub fn new() -> Self {
        AddressMap {
            table: AtomicPtr::new(core::ptr::null_mut()),
            moves: AtomicU64::new(0),
            writer: Lock::new(Writer {
                len: 0,
                retired: Vec::new(),
            }),
        }
    }

    /// The record entered for a block starting at `addr`, if any.
    #[inline]
    pub fn get(&self, addr: u64) -> Option<BlockIdx> {
        let key = key_of(addr)?;
        loop {
            let moves = self.moves.load(Ordering::Acquire);
            let table = self.table.load(Ordering::Acquire);
            if table.is_null() {
                return None;
            }
            // SAFETY: published tables are never freed.
            if let Some(idx) = unsafe { &*table }.find(key) {
                return Some(idx);
            }
            // A miss counts only if no removal moved entries while it looked.
            if moves & 1 == 0 {
                fence(Ordering::Acquire);
                if self.moves.load(Ordering::Relaxed) == moves {
                    return None;
                }
            }
            core::hint::spin_loop();
        }
    }

    /// Enters `idx` for `addr` (replacing what `addr` had). Called with the owning pool's
    /// lock held. Returns false for an address the map cannot hold.
    pub fn set(&self, addr: u64, idx: BlockIdx) -> bool {
        debug_assert!(idx != NIL && (idx as u64) <= INDEX_MASK);
        let Some(key) = key_of(addr) else {
            return false;
        };
        let entry = key << INDEX_BITS | idx as u64;
        let mut w = self.writer.lock();
        let table = self.table_for_one_more(&mut w);
        let (i, found) = table.position(key);
        table.slot(i).store(entry, Ordering::Release);
        if !found {
            w.len += 1;
        }
        true
    }

    /// Removes the entry for `addr`.
    pub fn clear(&self, addr: u64) {
        let Some(key) = key_of(addr) else {
            return;
        };
        let mut w = self.writer.lock();
        let table = self.table.load(Ordering::Relaxed);
        if table.is_null() {
            return;
        }
        // SAFETY: published tables are never freed.
        let table = unsafe { &*table };
        let (i, found) = table.position(key);
        if !found {
            return;
        }
        w.len -= 1;
        if table.slot(i + 1).load(Ordering::Relaxed) == 0 {
            // Nothing to move back: every run that passed through `i` ended at `i + 1`
            // anyway, so no reader can miss an entry through this removal.
            table.slot(i).store(0, Ordering::Release);
            return;
        }
        // The sequence lock's writer side: odd, then the moves, then even again.
        self.moves.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::Release);
        table.remove_at(i);
        self.moves.fetch_add(1, Ordering::Release);
    }

    /// The current table, made (or replaced by one twice as large) so that it stays at most
    /// half full with one more entry.
    fn table_for_one_more(&self, w: &mut Writer) -> &'static Table {
        let current = self.table.load(Ordering::Relaxed);
        // SAFETY: published tables are never freed.
        let current: Option<&'static Table> = unsafe { current.as_ref() };
        if let Some(t) = current {
            if 2 * (w.len + 1) <= t.capacity() {
                return t;
            }
        }
        let capacity = current.map_or(FIRST_CAPACITY, |t| 2 * t.capacity());
        let fresh: &'static Table = Box::leak(Box::new(Table::new(capacity)));
        if let Some(old) = current {
            for i in 0..old.capacity() {
                let v = old.slot(i).load(Ordering::Relaxed);
                if v != 0 {
                    fresh.insert_new(v);
                }
            }
            w.retired.push(old);
        }
        // Release: a reader that loads it sees its slots filled.
        self.table
            .store(fresh as *const Table as *mut Table, Ordering::Release);
        fresh
    }

    /// The home slot of `addr` in the current table (for tests that need two starts in
    /// one probe run).
    #[doc(hidden)]
    pub fn home_slot(&self, addr: u64) -> Option<usize> {
        let key = key_of(addr)?;
        // SAFETY: published tables are never freed.
        let table = unsafe { self.table.load(Ordering::Acquire).as_ref() }?;
        Some(table.home(key))
    }

    /// Entries in the map.
    pub fn len(&self) -> usize {
        self.writer.lock().len
    }

    /// Whether the map has no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for AddressMap {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn set_get_clear() {
        // A static, as the pool's own map is: tables are never freed, and Miri's leak check
        // skips memory that a static reaches.
        static MAP: AddressMap = AddressMap::new();
        let m = &MAP;
        assert_eq!(m.get(0x7f00_0000_0000), None);
        assert!(m.set(0x7f00_0000_0000, 5));
        assert!(m.set(0x7f00_0000_0200, 6));
        assert_eq!(m.get(0x7f00_0000_0000), Some(5));
        assert_eq!(m.get(0x7f00_0000_0200), Some(6));
        assert_eq!(
            m.get(0x7f00_0000_0100),
            None,
            "unaligned addresses are never blocks"
        );
        assert!(m.set(0x7f00_0000_0000, 7), "a start entered again");
        assert_eq!(m.get(0x7f00_0000_0000), Some(7));
        m.clear(0x7f00_0000_0000);
        assert_eq!(m.get(0x7f00_0000_0000), None);
        assert_eq!(m.get(0x7f00_0000_0200), Some(6));
        assert!(!m.set(ADDRESS_LIMIT, 1));
        assert!(!m.set(0, 1), "no block starts at 0");
        assert_eq!(m.get(!511), None);
    }

    /// Many starts, entered and removed in an order that makes long probe runs and moves
    /// entries back over each other, checked against a model after every step, across
    /// growths of the table.
    #[test]
    fn entries_survive_growth_and_removals_against_a_model() {
        static MAP: AddressMap = AddressMap::new();
        let m = &MAP;
        let mut model = std::collections::BTreeMap::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let steps = if cfg!(miri) { 1_500 } else { 60_000 };
        for step in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Starts of a few thousand granules, so entries meet again after removals.
            let addr = 0x7000_0000_0000 + ((x >> 20) % 6_000 + 1) * 512;
            let idx = (x % 1_000_000) as BlockIdx;
            if x % 3 == 0 {
                m.clear(addr);
                model.remove(&addr);
            } else {
                assert!(m.set(addr, idx));
                model.insert(addr, idx);
            }
            if step % 97 == 0 {
                for (&a, &i) in &model {
                    assert_eq!(m.get(a), Some(i), "step {step}: {a:#x}");
                }
            }
            assert_eq!(m.get(addr), model.get(&addr).copied());
        }
        assert_eq!(m.len(), model.len());
        for &a in model.keys() {
            m.clear(a);
        }
        assert!(m.is_empty());
        for &a in model.keys() {
            assert_eq!(m.get(a), None);
        }
    }
}
