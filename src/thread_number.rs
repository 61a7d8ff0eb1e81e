//! Small numbers for threads: the shared thread fences' recorder role counts closing
//! threads by them (Note [fence recorder role]), and the host backend numbers its done
//! fences with them (Note [host fences]).

use core::cell::Cell;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The calling thread's number, never 0: threads are numbered in the order they first ask,
/// so threads alive together get distinct numbers. `u64::MAX` for a thread whose
/// thread-locals are being torn down.
#[inline]
pub(crate) fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static NUMBER: Cell<u64> = const { Cell::new(0) });
    NUMBER
        .try_with(|n| {
            if n.get() == 0 {
                n.set(NEXT.fetch_add(1, Relaxed));
            }
            n.get()
        })
        .unwrap_or(u64::MAX)
}
