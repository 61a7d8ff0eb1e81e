//! Memory for the pool's own metadata that a free reads at random: block records and the
//! address map's leaves.
//!
//! Note [metadata on huge pages]: with 10⁵ blocks live, a free of a random block reads a
//! leaf of the address map and the block's record, each a cache miss, and on 4 KiB pages
//! each also a TLB miss: the leaves and records of 10⁵ blocks span tens of MB, thousands of
//! pages (and in a virtual machine a TLB miss walks two page tables). Both are carved here
//! from 2 MiB pieces aligned to 2 MiB and advised as transparent huge pages
//! (`MADV_HUGEPAGE`, honoured when the system's setting is `madvise` or `always`), so a
//! few TLB entries cover them (docs/BENCHMARKS.md, `examples/live_cost.rs`). Nothing
//! carved here is ever freed: records and leaves are type-stable (their readers hold no
//! lock), so they live as long as the process. A piece that cannot be mapped falls back
//! to the global allocator.

/// Size and alignment of the pieces metadata is carved from.
pub const PIECE: usize = 2 << 20;

#[cfg(not(miri))]
mod imp {
    use super::PIECE;

    /// Pieces being carved, one per size (two sizes are carved: records and leaves), so
    /// that each piece is used to its end; and parts never published (a lost race to
    /// publish a node), handed out again first: still zero, nobody wrote them.
    struct Carver {
        /// (size, next free byte, bytes left in its piece).
        pieces: Vec<(usize, usize, usize)>,
        /// (size, address).
        unused: Vec<(usize, usize)>,
    }

    static CARVER: spin::Mutex<Carver> = spin::Mutex::new(Carver {
        pieces: Vec::new(),
        unused: Vec::new(),
    });

    /// A new piece of `PIECE` bytes aligned to `PIECE`, zeroed, advised as huge pages;
    /// `None` when the kernel refuses the mapping.
    fn map_piece() -> Option<usize> {
        let piece =
            crate::os_memory::map_aligned(PIECE, PIECE, libc::PROT_READ | libc::PROT_WRITE)?;
        // SAFETY: advice on the mapping just made. Where the kernel does not take it, the
        // piece stays on 4 KiB pages, which is what the global allocator would have given.
        unsafe { libc::madvise(piece as *mut libc::c_void, PIECE, libc::MADV_HUGEPAGE) };
        Some(piece as usize)
    }

    pub fn alloc_zeroed(bytes: usize) -> Option<*mut u8> {
        let mut c = CARVER.lock();
        if let Some(i) = c.unused.iter().position(|&(n, _)| n == bytes) {
            return Some(c.unused.swap_remove(i).1 as *mut u8);
        }
        let i = match c.pieces.iter().position(|&(n, _, _)| n == bytes) {
            Some(i) => i,
            None => {
                c.pieces.push((bytes, 0, 0));
                c.pieces.len() - 1
            }
        };
        if c.pieces[i].2 < bytes {
            // `bytes` divides `PIECE`: the old piece is used to its end.
            c.pieces[i] = (bytes, map_piece()?, PIECE);
        }
        let (_, next, left) = &mut c.pieces[i];
        let p = *next;
        *next += bytes;
        *left -= bytes;
        Some(p as *mut u8)
    }

    pub fn give_back_unused(ptr: *mut u8, bytes: usize) {
        CARVER.lock().unused.push((bytes, ptr as usize));
    }
}

// Miri has no `mmap`: the global allocator, as before.
#[cfg(miri)]
mod imp {
    pub fn alloc_zeroed(_bytes: usize) -> Option<*mut u8> {
        None
    }

    pub fn give_back_unused(_ptr: *mut u8, _bytes: usize) {}
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

/// Takes back memory of [`alloc_zeroed`] that was never published nor written (a lost
/// race to publish it), for the next request of the same size.
///
/// # Safety
/// `ptr` came from `alloc_zeroed::<T>()`, nobody else refers to it, and it is still zero.
pub unsafe fn give_back_unused<T>(ptr: *mut T) {
    let layout = std::alloc::Layout::new::<T>();
    // Carved or from the global allocator, it is zeroed memory of that size, kept for
    // the next request.
    #[cfg(not(miri))]
    imp::give_back_unused(ptr.cast(), layout.size());
    #[cfg(miri)]
    {
        // SAFETY: the caller's contract: it came from the global allocator with `layout`.
        unsafe { std::alloc::dealloc(ptr.cast(), layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carved_nodes_are_zeroed_aligned_apart_and_reused_when_given_back() {
        // 16 KiB: a size nothing else in the process carves, so no other test takes the node
        // given back first.
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
            (*a)[7] = 1;
        }
        // SAFETY: `b` came from `alloc_zeroed::<Node>()`, was never written nor shared.
        unsafe { give_back_unused(b) };
        let c = alloc_zeroed::<Node>();
        #[cfg(not(miri))]
        assert_eq!(c, b, "a node given back is handed out again first");
        // SAFETY: as above.
        assert!(unsafe { (*c).iter().all(|&w| w == 0) });
        // Under Miri the nodes come from the global allocator, which its leak check sees.
        #[cfg(miri)]
        for node in [a, c] {
            // SAFETY: from the global allocator with this layout, no longer used.
            unsafe { std::alloc::dealloc(node.cast(), std::alloc::Layout::new::<Node>()) };
        }
    }
}
