//! Fences of the pinned pool (Note [pinned reuse]): one context fence per device pool,
//! recorded together for the blocks freed since the last ones, polled or waited for, and
//! what they cover made reusable; and giving idle chunks back to the driver.
//!
//! The device pools' machinery is reused: the backend's `record_context_fence` /
//! `event_completed`, and each pool's capture exclusion (Note [capture exclusion]): no
//! fence is recorded in a context while a capture is open there (the blocks then wait for
//! a later pass), and no chunk is freed in one.

use super::{PinnedPool, BACKEND_OFF};
use crate::backend::{BackendError, ContextId, EventHandle};
use crate::pool::{all_pools, DevicePool};
use core::sync::atomic::Ordering;
use std::collections::VecDeque;

/// Fences outstanding at most before a poll stops recording new ones (as for the device
/// pools: while the device is this far behind, another would not complete sooner).
const MAX_OUTSTANDING: usize = 64;

/// One context fence per device pool, recorded when the clock read `epoch`.
pub(super) struct Fence {
    events: Vec<(ContextId, EventHandle)>,
    epoch: u64,
}

/// The fences recorded and not yet seen complete, oldest first. Behind its own mutex,
/// held across backend calls (Note [pinned locks]).
#[derive(Default)]
pub(super) struct Fences {
    outstanding: VecDeque<Fence>,
}

#[derive(Copy, Clone, PartialEq, Eq)]
pub(super) enum Advance {
    /// Record a fence for unsealed frees and poll the outstanding ones.
    Poll,
    /// Record, then wait for every outstanding fence (out of memory, `empty_cache`).
    Wait,
}

/// Whether a failed fence call means the context itself is gone (destroyed by the program,
/// or the driver shutting down): it has no work left that a block could wait for, and a
/// context that can never fence again must not hold every pinned block back.
fn context_gone(e: BackendError) -> bool {
    const INVALID_CONTEXT: u32 = 201;
    const CONTEXT_IS_DESTROYED: u32 = 709;
    matches!(
        e,
        BackendError::InvalidValue
            | BackendError::ShuttingDown
            | BackendError::Driver(INVALID_CONTEXT | CONTEXT_IS_DESTROYED)
    )
}

impl PinnedPool {
    /// Seals unsealed frees under a new fence, polls (or waits for) the outstanding fences
    /// and makes the blocks the completed ones cover reusable; returns how many became so.
    pub(super) fn advance(&self, mode: Advance) -> usize {
        let mut fences = self.fences.lock().unwrap_or_else(|p| p.into_inner());
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return 0;
        }
        self.seal(&mut fences, mode);
        // Waiting is a synchronisation, which a capture forbids: poll then.
        let waiting = mode == Advance::Wait && !all_pools().any(DevicePool::capturing);
        let mut queries = 0;
        let done = if waiting {
            self.wait_newest(&fences)
        } else {
            self.newest_complete(&fences, &mut queries)
        };
        let mut retired = Vec::new();
        while fences.outstanding.front().is_some_and(|f| f.epoch <= done) {
            retired.extend(fences.outstanding.pop_front().map(|f| f.events));
        }
        drop(fences);
        for (ctx, ev) in retired.into_iter().flatten() {
            self.backend.recycle_event(ctx, ev);
        }
        let mut st = self.lock();
        st.counts.fence_queries += queries;
        st.done = st.done.max(done);
        let done = st.done;
        st.map.release_waiting(done)
    }

    /// Records a fence for the frees no fence covers yet, polling nothing (Note [pinned
    /// fences at free]).
    pub(super) fn seal_now(&self) {
        let mut fences = self.fences.lock().unwrap_or_else(|p| p.into_inner());
        if !BACKEND_OFF.load(Ordering::Relaxed) {
            self.seal(&mut fences, Advance::Poll);
        }
    }

    /// Records one fence per device pool covering every block freed so far that no fence
    /// covers yet. Nothing is recorded when a capture is open in any context (every
    /// context must be fenced for the block to be safe) or when `MAX_OUTSTANDING` are out.
    fn seal(&self, fences: &mut Fences, mode: Advance) {
        // Every context must be fenced: with a capture open in one, record none at all
        // (checked again under each pool's exclusion below, which closes the race).
        if all_pools().any(DevicePool::capturing) {
            return;
        }
        let epoch = {
            let mut st = self.lock();
            if st.map.newest_waiting_epoch() <= st.sealed
                || (mode == Advance::Poll && fences.outstanding.len() >= MAX_OUTSTANDING)
            {
                return;
            }
            let epoch = st.clock;
            st.clock += 1;
            epoch
        };
        let mut events = Vec::new();
        for pool in all_pools() {
            // Note [capture exclusion]: no capture may begin between the check and the fence.
            let recorded = match pool.enter_ordering_calls() {
                Some(_calls) => self.backend.record_context_fence(pool.ctx.id),
                None => Err(BackendError::Capturing),
            };
            match recorded {
                Ok(ev) => events.push((pool.ctx.id, ev)),
                Err(e) if context_gone(e) => {}
                Err(e) => {
                    crate::log::debug(&format!("cupool: pinned pool: context fence failed: {e:?}"));
                    for (ctx, ev) in events {
                        self.backend.recycle_event(ctx, ev);
                    }
                    return;
                }
            }
        }
        let mut st = self.lock();
        st.counts.fences += events.len() as u64;
        st.sealed = epoch;
        fences.outstanding.push_back(Fence { events, epoch });
    }

    /// Whether every event of `f` has completed (a context gone counts as done); `queries`
    /// counts the driver queries.
    fn complete(&self, f: &Fence, queries: &mut u64) -> bool {
        f.events.iter().all(|&(ctx, ev)| {
            *queries += 1;
            self.backend
                .event_completed(ctx, ev)
                .unwrap_or_else(context_gone)
        })
    }

    /// The epoch of the newest fence known complete (0: none). The newest is asked first:
    /// on an idle device it has completed and settles everything in one query per context;
    /// otherwise the oldest ones are asked in order, up to the first still running.
    fn newest_complete(&self, fences: &Fences, queries: &mut u64) -> u64 {
        let Some(newest) = fences.outstanding.back() else {
            return 0;
        };
        if self.complete(newest, queries) {
            return newest.epoch;
        }
        let mut done = 0;
        for f in fences.outstanding.iter().take(fences.outstanding.len() - 1) {
            if !self.complete(f, queries) {
                break;
            }
            done = f.epoch;
        }
        done
    }

    /// Waits for the newest fence; returns the epoch it covers (0 when a wait failed). A
    /// context fence covers all earlier work of its context, so the newest one's events
    /// cover every older fence's.
    fn wait_newest(&self, fences: &Fences) -> u64 {
        let Some(newest) = fences.outstanding.back() else {
            return 0;
        };
        for &(ctx, ev) in &newest.events {
            match self.backend.wait_event(ctx, ev) {
                Ok(()) => {}
                Err(e) if context_gone(e) => {}
                Err(_) => return self.newest_complete(fences, &mut 0),
            }
        }
        newest.epoch
    }

    /// Gives every chunk that is one free block back to the driver; returns the bytes.
    /// A chunk whose context has a capture open stays (Note [capture exclusion]: a free of
    /// page-locked memory synchronises), as does one the driver refuses.
    pub(super) fn release_idle(&self) -> u64 {
        if BACKEND_OFF.load(Ordering::Relaxed) {
            return 0;
        }
        let pool_of = |ctx: ContextId| all_pools().find(|p| p.ctx.id == ctx);
        let idle = self
            .lock()
            .map
            .take_idle_chunks(|c| pool_of(c.ctx).is_some_and(DevicePool::capturing));
        let mut released = 0;
        for (base, chunk) in idle {
            let owner = pool_of(chunk.ctx);
            let calls = owner.map(|p| p.enter_ordering_calls());
            let freed = match calls {
                Some(None) => Err(BackendError::Capturing),
                _ => self.backend.host_free(chunk.ctx, base),
            };
            drop(calls);
            let mut st = self.lock();
            match freed {
                Ok(()) => {
                    st.counts.driver_frees += 1;
                    released += chunk.size;
                }
                Err(e) => {
                    crate::log::debug(&format!(
                        "cupool: pinned pool: releasing a chunk of {} bytes failed: {e:?}",
                        chunk.size
                    ));
                    st.map.restore_chunk(base, chunk);
                }
            }
        }
        released
    }
}
