//! Stream captures and the pool's driver calls that would break them.
//!
//! Note [capture exclusion]: a context fence (`cuCtxRecordEvent`) made while any stream of
//! the context captures invalidates that capture, even one in thread-local mode on another
//! thread; on driver 580 it can also crash inside the driver. Both were measured on an H100
//! by `gpu/stress.cu` (16 threads, a capture every ~256 operations): under the preload,
//! `cudaStreamEndCapture` returned `cudaErrorStreamCaptureInvalidated` within seconds, and
//! through the API library (which saw no captures) `cuCtxRecordEvent` took a segfault.
//! Checking "no capture open" and then calling the driver is a race, since a capture can
//! begin in between. So the two exclude each other, Dekker-style, with sequentially
//! consistent counters: a thread about to make such calls counts itself in
//! `ordering_calls` and then checks `depth` (backing off if a capture is open); a capture
//! about to begin counts itself in `depth` and then waits until no thread is in
//! `ordering_calls`. Either the caller sees the capture, or the capture waits for the
//! caller's calls to end: as long as the calls in flight (a fence ~1 µs; a VMM map of
//! several chunks tens of µs each). The capture side reads `ordering_calls` with a
//! read-modify-write (`fetch_add(0)`), which reads the latest value whatever the memory
//! model. The calling side reads `depth` with a sequentially consistent load, which the
//! argument needs sequential consistency for; loom does not model that (it failed the
//! model check with loads on both sides), so under loom that read is a read-modify-write
//! too ([`CaptureExclusion::depth_after_entering`]). A read-modify-write there on
//! hardware cost every fencing thread a cache miss: each fence of one thread wrote
//! `depth`'s line, which the next fence of every other thread then read (Note [fence
//! counters apart] in `pool/mod.rs`).
//! Model-checked in `tests/loom_lockfree.rs`.

use crate::sync::{AtomicU32, LineApart};
use core::sync::atomic::Ordering::SeqCst;

/// The captures open in one context, and the threads making driver calls a capture must
/// not overlap (Note [capture exclusion]).
pub struct CaptureExclusion {
    depth: AtomicU32,
    /// On a line of its own: every fence writes it twice, and `depth` is read on every
    /// fence (Note [fence counters apart] in `pool/mod.rs`).
    ordering_calls: LineApart<AtomicU32>,
}

/// Proof that no capture can begin until it is dropped.
pub struct OrderingCalls<'a>(&'a CaptureExclusion);

impl Drop for OrderingCalls<'_> {
    fn drop(&mut self) {
        self.0.ordering_calls.fetch_sub(1, SeqCst);
    }
}

impl Default for CaptureExclusion {
    fn default() -> Self {
        Self::new()
    }
}

impl CaptureExclusion {
    pub fn new() -> Self {
        CaptureExclusion {
            depth: AtomicU32::new(0),
            ordering_calls: LineApart(AtomicU32::new(0)),
        }
    }

    /// A capture is about to begin: returns once no guarded call is in flight.
    pub fn begin(&self) {
        self.depth.fetch_add(1, SeqCst);
        // Read-modify-writes, not loads (Note [capture exclusion]).
        while self.ordering_calls.fetch_add(0, SeqCst) != 0 {
            #[cfg(loom)]
            loom::thread::yield_now();
            #[cfg(not(loom))]
            std::thread::yield_now();
        }
    }

    /// A capture is over (never below zero: an end without a begin is ignored).
    pub fn end(&self) {
        let mut d = self.depth.load(SeqCst);
        while d > 0 {
            match self.depth.compare_exchange(d, d - 1, SeqCst, SeqCst) {
                Ok(_) => return,
                Err(now) => d = now,
            }
        }
    }

    pub fn capturing(&self) -> bool {
        self.depth.load(SeqCst) != 0
    }

    /// `None` while a capture is open; otherwise no capture begins until the guard is
    /// dropped. Hold it across fences, maps and releases.
    pub fn enter(&self) -> Option<OrderingCalls<'_>> {
        self.ordering_calls.fetch_add(1, SeqCst);
        let guard = OrderingCalls(self);
        if self.depth_after_entering() != 0 {
            return None; // the guard's drop takes the count back
        }
        Some(guard)
    }

    /// `depth`, read after counting the caller in `ordering_calls` (Note [capture
    /// exclusion]). A sequentially consistent load suffices in Rust's memory model: every
    /// write to either counter is a sequentially consistent read-modify-write, so the
    /// load and the capture side's `fetch_add` on `depth` are ordered in the single total
    /// order of such operations, and one side sees the other. Loom models `SeqCst` as
    /// acquire/release only, which would let both sides miss each other, so under loom the
    /// read is a read-modify-write (which loom does order); on hardware a load, which keeps
    /// `depth`'s line shared among the threads that fence (Note [fence counters apart]).
    #[inline]
    fn depth_after_entering(&self) -> u32 {
        #[cfg(loom)]
        return self.depth.fetch_add(0, SeqCst);
        #[cfg(not(loom))]
        return self.depth.load(SeqCst);
    }
}

#[cfg(not(loom))]
pub use pool_side::this_thread_captures;

#[cfg(not(loom))]
mod pool_side {
    use super::OrderingCalls;
    use crate::pool::DevicePool;
    use core::cell::Cell;

    std::thread_local! {
        /// Captures the calling thread has begun and not ended (Note [growth during
        /// another thread's capture]).
        static OWN_CAPTURES: Cell<u32> = const { Cell::new(0) };
    }

    /// Whether the calling thread has a capture open (in any context).
    pub fn this_thread_captures() -> bool {
        OWN_CAPTURES.with(|c| c.get() != 0)
    }

    impl DevicePool {
        /// A capture of this pool's context is about to begin, on the calling thread
        /// (Note [capture exclusion]).
        pub fn capture_begin(&self) {
            OWN_CAPTURES.with(|c| c.set(c.get() + 1));
            self.fence_side.captures.begin();
        }

        /// The capture begun on the calling thread is over.
        pub fn capture_end(&self) {
            OWN_CAPTURES.with(|c| c.set(c.get().saturating_sub(1)));
            self.fence_side.captures.end();
        }

        pub fn capturing(&self) -> bool {
            self.fence_side.captures.capturing()
        }

        /// `None` while a capture is open; otherwise no capture of this context begins
        /// until the guard is dropped (Note [capture exclusion]).
        pub(in crate::pool) fn enter_ordering_calls(&self) -> Option<OrderingCalls<'_>> {
            self.fence_side.captures.enter()
        }
    }
}
