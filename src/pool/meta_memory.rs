//! Memory for the pool's own metadata that a free reads at random: block records (the
//! address map's tables are mapped the same way, Note [address map as a hash]).
//!
//! Note [metadata on huge pages]: with 10⁵ blocks live, a free of a random block reads the
//! address map and the block's record, each a likely cache miss, and on 4 KiB pages each
//! also a TLB miss: the records of 10⁵ blocks span 12.8 MB, thousands of pages (and in a
//! virtual machine a TLB miss walks two page tables). Records are carved here from 2 MiB
//! pieces aligned to 2 MiB and advised as transparent huge pages (`MADV_HUGEPAGE`,
//! honoured when the system's setting is `madvise` or `always`), so a few TLB entries
//! cover them (docs/BENCHMARKS.md, `examples/live_cost.rs`). Nothing carved here is ever
//! freed: records are type-stable (their readers hold no lock), so they live as long as
//! the process. A piece that cannot be mapped falls back to the global allocator.

/// Size and alignment of the pieces metadata is carved from.
pub const PIECE: usize = 2 << 20;

/// Advises `bytes` at `at` (a mapping of [`crate::os_memory::map_aligned`]) as huge pages.
#[cfg(not(miri))]
pub fn advise_huge(at: u64, bytes: usize) {
    // SAFETY: advice on a mapping of the caller's; where the kernel does not take it, the
    // memory stays on 4 KiB pages, which is what the global allocator would have given.
    unsafe { libc::madvise(at as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
}

/// Miri has no `madvise`: nothing to advise.
#[cfg(miri)]
pub fn advise_huge(_at: u64, _bytes: usize) {}

#[cfg(not(miri))]
mod imp {
    use super::PIECE;

    /// The piece being carved: (size carved from it, next free byte, bytes left). One
    /// size is carved (records), so each piece is used to its end.
    static CARVER: spin::Mutex<(usize, usize, usize)> = spin::Mutex::new((0, 0, 0));

    /// A new piece of `PIECE` bytes aligned to `PIECE`, zeroed, advised as huge pages;
    /// `None` when the kernel refuses the mapping.
    fn map_piece() -> Option<usize> {
        let piece =
            crate::os_memory::map_aligned(PIECE, PIECE, libc::PROT_READ | libc::PROT_WRITE)?;
        super::advise_huge(piece, PIECE);
        Some(piece as usize)
    }

    pub fn alloc_zeroed(bytes: usize) -> Option<*mut u8> {
        let mut c = CARVER.lock();
        if c.0 != bytes || c.2 < bytes {
            // `bytes` divides `PIECE`: the old piece was used to its end (or held
            // another size, which no caller asks for today).
            *c = (bytes, map_piece()?, PIECE);
        }
        let (_, next, left) = &mut *c;
        let p = *next;
        *next += bytes;
        *left -= bytes;
        Some(p as *mut u8)
    }
}

// Miri has no `mmap`: the global allocator, as before.
#[cfg(miri)]
mod imp {
    pub fn alloc_zeroed(_bytes: usize) -> Option<*mut u8> {
        None
    }
}

/// Zeroed memory for one `T` (whose size divides [`PIECE`] and whose alignment does not
/// exceed 4 KiB), never freed. From a huge-page piece where possible, else from the global
/// allocator.
pub fn alloc_zeroed<T>() -> *mut T {
    let layout = std::alloc::Layout::new::<T>();
    debug_assert!(PIECE % layout.size() == 0 && layout.align() <= 4096);
    if let Some(p) = imp::alloc_zeroed(layout.size()) {
        return p.cast();
    }
    // SAFETY: `T` has a non-zero size (it divides `PIECE`, so it is at least 1).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carved_nodes_are_zeroed_aligned_and_apart() {
        type Node = [u64; 2048];
        let a = alloc_zeroed::<Node>();
        let b = alloc_zeroed::<Node>();
        assert_ne!(a, b);
        let (a_at, b_at) = (a as usize, b as usize);
        assert!(
            a_at.abs_diff(b_at) >= core::mem::size_of::<Node>(),
            "nodes overlap"
        );
        assert_eq!(a_at % core::mem::align_of::<Node>(), 0);
        // SAFETY: fresh nodes of this test, nobody else refers to them.
        unsafe {
            assert!((*a).iter().chain((*b).iter()).all(|&w| w == 0));
        }
        // Under Miri the nodes come from the global allocator, which its leak check sees.
        #[cfg(miri)]
        for node in [a, b] {
            // SAFETY: from the global allocator with this layout, no longer used.
            unsafe { std::alloc::dealloc(node.cast(), std::alloc::Layout::new::<Node>()) };
        }
    }
}
