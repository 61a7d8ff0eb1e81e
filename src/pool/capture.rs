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
//! several chunks tens of µs each). Each side reads the other's counter with a
//! read-modify-write (`fetch_add(0)`), which reads the latest value whatever the memory
//! model: with plain loads the argument needs sequential consistency, which loom does not
//! model (it failed the model check that way), and the calls are on slow paths.
//! Model-checked in `tests/loom_lockfree.rs`.

use crate::sync::AtomicU32;
use core::sync::atomic::Ordering::SeqCst;

/// The captures open in one context, and the threads making driver calls a capture must
/// not overlap (Note [capture exclusion]).
pub struct CaptureExclusion {
    depth: AtomicU32,
    ordering_calls: AtomicU32,
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
            ordering_calls: AtomicU32::new(0),
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
        if self.depth.fetch_add(0, SeqCst) != 0 {
            return None; // the guard's drop takes the count back
        }
        Some(guard)
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
            self.captures.begin();
        }

        /// The capture begun on the calling thread is over.
        pub fn capture_end(&self) {
            OWN_CAPTURES.with(|c| c.set(c.get().saturating_sub(1)));
            self.captures.end();
        }

        pub fn capturing(&self) -> bool {
            self.captures.capturing()
        }

        /// `None` while a capture is open; otherwise no capture of this context begins
        /// until the guard is dropped (Note [capture exclusion]).
        pub(in crate::pool) fn enter_ordering_calls(&self) -> Option<OrderingCalls<'_>> {
            self.captures.enter()
        }
    }
}
