//! Address → block record, readable without a lock.
//!
//! A three-level radix tree over the 48-bit address space at block granularity (512 B):
//! 13 + 13 + 13 bits. Leaves are arrays of `AtomicU32` (record index + 1, 0 = none), each
//! covering 4 MiB. Only block *starts* are entered, so a large block costs one entry.
//! Writers (split, merge, segment release) run under a device pool's lock and publish with
//! Release stores; `free` reads with Acquire loads and then confirms the record through its
//! tag, so a racing stale read is harmless. Nodes are never freed.
//!
//! Why not a hash map: a lookup here is three dependent loads and no lock, and it does not
//! slow down as the number of live blocks grows.

use super::block::{BlockIdx, NIL};
use crate::sync::{AtomicPtr, AtomicU32};
use core::sync::atomic::Ordering;

#[cfg(not(loom))]
const BITS: u32 = 13;
#[cfg(loom)]
const BITS: u32 = 1;
const FANOUT: usize = 1 << BITS;
const GRANULE_SHIFT: u32 = 9;
/// Addresses at or above this cannot be entered.
pub const ADDRESS_LIMIT: u64 = 1 << (GRANULE_SHIFT + 3 * BITS);

type Leaf = [AtomicU32; FANOUT];
type Mid = [AtomicPtr<Leaf>; FANOUT];

pub struct AddressMap {
    root: [AtomicPtr<Mid>; FANOUT],
}

#[inline]
fn split(addr: u64) -> (usize, usize, usize) {
    let key = addr >> GRANULE_SHIFT;
    let mask = (FANOUT - 1) as u64;
    (
        ((key >> (2 * BITS)) & mask) as usize,
        ((key >> BITS) & mask) as usize,
        (key & mask) as usize,
    )
}

/// A node of zeroed memory: an all-zero `AtomicU32` is 0 (no entry) and an all-zero
/// `AtomicPtr` is null. Not built element by element: under Miri, writing 8192 elements
/// one at a time through the array took minutes per node (every write retags the whole
/// array), and the pool tests create several nodes.
#[cfg(not(loom))]
fn new_zeroed_node<T>() -> *mut T {
    // (`Box::new_zeroed` is newer than the crate's MSRV.)
    let layout = std::alloc::Layout::new::<T>();
    // SAFETY: `T` is `Leaf` or `Mid` (non-zero size), arrays of atomics of integers and
    // pointers, for which all-zero bytes are a valid value (0 and null).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    p
}

/// Leaves are read at random by frees: on huge pages (Note [metadata on huge pages]).
#[cfg(not(loom))]
fn new_leaf() -> *mut Leaf {
    super::meta_memory::alloc_zeroed::<Leaf>()
}

#[cfg(not(loom))]
fn new_mid() -> *mut Mid {
    new_zeroed_node::<Mid>()
}

// loom's atomics are not plain memory: built element by element.
#[cfg(loom)]
fn new_leaf() -> *mut Leaf {
    let b: Box<Leaf> = Box::new(core::array::from_fn(|_| AtomicU32::new(0)));
    Box::into_raw(b)
}

#[cfg(loom)]
fn new_mid() -> *mut Mid {
    let b: Box<Mid> = Box::new(core::array::from_fn(|_| {
        AtomicPtr::new(core::ptr::null_mut())
    }));
    Box::into_raw(b)
}

/// Frees a node of `new_mid` (or loom's `new_leaf`) that lost the race to be published.
///
/// # Safety
/// `node` came from `Box` (through `new_zeroed_node` or `Box::into_raw`) and was never
/// published.
unsafe fn drop_unused<T>(node: *mut T) {
    // SAFETY: the caller's contract (`alloc_zeroed` with `T`'s layout is what `Box` uses).
    drop(unsafe { Box::from_raw(node) });
}

/// Gives back a leaf of `new_leaf` that lost the race to be published.
///
/// # Safety
/// As [`drop_unused`], for a leaf of `new_leaf`.
unsafe fn unused_leaf(leaf: *mut Leaf) {
    #[cfg(not(loom))]
    // SAFETY: the caller's contract: from `meta_memory::alloc_zeroed`, never written.
    unsafe {
        super::meta_memory::give_back_unused(leaf)
    };
    #[cfg(loom)]
    // SAFETY: loom's leaves come from `Box::into_raw`.
    unsafe {
        drop_unused(leaf)
    };
}

impl AddressMap {
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        AddressMap {
            root: [const { AtomicPtr::new(core::ptr::null_mut()) }; FANOUT],
        }
    }

    #[cfg(loom)]
    pub fn new() -> Self {
        AddressMap {
            root: core::array::from_fn(|_| AtomicPtr::new(core::ptr::null_mut())),
        }
    }

    /// The record entered for a block starting at `addr`, if any.
    #[inline]
    pub fn get(&self, addr: u64) -> Option<BlockIdx> {
        if addr >= ADDRESS_LIMIT || addr & ((1 << GRANULE_SHIFT) - 1) != 0 {
            return None;
        }
        let (a, b, c) = split(addr);
        let mid = self.root[a].load(Ordering::Acquire);
        if mid.is_null() {
            return None;
        }
        // SAFETY: published nodes are never freed.
        let leaf = unsafe { &*mid }[b].load(Ordering::Acquire);
        if leaf.is_null() {
            return None;
        }
        // SAFETY: as above.
        match unsafe { &*leaf }[c].load(Ordering::Acquire) {
            0 => None,
            v => Some(v - 1),
        }
    }

    /// Enters `idx` for `addr`. Must be called with the owning pool's lock held (writers
    /// of one address never race; node creation is made safe by CAS anyway). Returns false
    /// for an address the map cannot hold.
    pub fn set(&self, addr: u64, idx: BlockIdx) -> bool {
        debug_assert!(idx != NIL);
        self.store(addr, idx + 1)
    }

    /// Removes the entry for `addr`.
    pub fn clear(&self, addr: u64) {
        self.store(addr, 0);
    }

    fn store(&self, addr: u64, value: u32) -> bool {
        if addr >= ADDRESS_LIMIT || addr & ((1 << GRANULE_SHIFT) - 1) != 0 {
            return false;
        }
        let (a, b, c) = split(addr);
        let mid = Self::get_or_create(&self.root[a], new_mid, drop_unused::<Mid>);
        // SAFETY: published nodes are never freed.
        let leaf = Self::get_or_create(&unsafe { &*mid }[b], new_leaf, unused_leaf);
        // SAFETY: as above.
        (unsafe { &*leaf })[c].store(value, Ordering::Release);
        true
    }

    fn get_or_create<T>(
        slot: &AtomicPtr<T>,
        make: fn() -> *mut T,
        unused: unsafe fn(*mut T),
    ) -> *mut T {
        let cur = slot.load(Ordering::Acquire);
        if !cur.is_null() {
            return cur;
        }
        let fresh = make();
        match slot.compare_exchange(
            core::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => fresh,
            Err(winner) => {
                // SAFETY: `fresh` came from `make`, was never published nor written.
                unsafe { unused(fresh) };
                winner
            }
        }
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
        // A static, as the pool's own map is: nodes are never freed, and Miri's leak check
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
        m.clear(0x7f00_0000_0000);
        assert_eq!(m.get(0x7f00_0000_0000), None);
        assert!(!m.set(ADDRESS_LIMIT, 1));
        assert_eq!(m.get(!511), None);
    }
}
