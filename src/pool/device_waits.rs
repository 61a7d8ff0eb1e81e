//! Waits on the device: blocks whose context fence has not completed, reused at once
//! behind a wait of the legacy default stream instead of a wait of the program.
//!
//! Note [device waits]: a block freed without a stream (every `cudaFree` under the
//! preload) may be touched by work queued before its free, so the pool reuses it only
//! after a context fence recorded after the free has completed. While the device is behind
//! (a training loop queues its step and runs ahead), that fence is not complete when the
//! next allocation wants the memory, and the pool takes other memory: it remaps granules
//! of the VMM arena (tens of µs a call), waits up to `grow_wait_us`, or grows. On the GPT
//! loop under the preload, those remaps cost about 3 ms of a 36 ms step (docs/BENCHMARKS.md).
//!
//! The CUDA driver orders work on the legacy default stream with every blocking stream of
//! the context: an action on the legacy stream (`cuStreamWaitEvent` included) first waits
//! for all blocking streams, and everything queued on a blocking stream afterwards waits
//! for it. Per-thread default streams are blocking streams. So after the legacy stream is
//! made to wait for a fence, every piece of work queued later on any stream that is not
//! non-blocking runs after the work the fence covers, and a block the fence covers may be
//! handed to the next allocation at once, whichever of those streams its new owner uses.
//! One `cuStreamWaitEvent` replaces the remap or the growth, and the program does not
//! stall. It is what `cudaFree` would have done for the program natively, minus the host
//! synchronization.
//!
//! What stays on the host's side: the *memory* of such a block is still in use by the
//! device until the fence completes, so its granules must not be unmapped, moved to another
//! block or given back before then. A block drained by a device wait therefore keeps a pin
//! on its granules ([`DevicePool::hold_until_confirmed`]) until a fence pass sees its fence
//! complete, and no segment outside the arena is given back while any such block may
//! exist. Reuse in place needs no pin: the new owner's work is ordered after the old
//! owner's on the device.
//!
//! Where it does not hold by itself:
//! - work on a **non-blocking stream** is not ordered after the legacy stream. The preload
//!   sees every stream created and destroyed (`cuStreamCreate`, `cuStreamCreateWithPriority`,
//!   `cuStreamDestroy`, however reached), and keeps the live non-blocking ones in a list
//!   ([`non_blocking_stream_created`], [`stream_destroyed`]). A pass that waits on the
//!   device makes each of them wait for the fence too, under the list's lock, so none is
//!   destroyed meanwhile. A stream created while drained blocks may still be in use waits
//!   at once for the newest fence of each pool, before the program can queue anything on
//!   it. PyTorch's side streams and cuDNN's handles are non-blocking (measured on the
//!   H100: the conv net's `cudnnCreate` makes 32, so every device wait there costs 33
//!   `cuStreamWaitEvent` calls); cuBLASLt's internal stream is not. Beyond
//!   [`MAX_NON_BLOCKING_STREAMS`] live ones, device waits end: a pass would cost more than
//!   the remap it saves.
//! - a **green context's** streams are not ordered by the primary context's legacy stream
//!   either, and their context is another: the first one ends the mode.
//! - work of **another context** is not ordered by this context's legacy stream: a second
//!   context with a pool, or peer access enabled, ends it. So does a context being
//!   destroyed or reset (`cuCtxDestroy`, `cuDevicePrimaryCtxReset`): its streams go with it,
//!   unseen by the destroy hook, and must leave the list first.
//! - without the preload, streams are created unseen: `fence_waits:auto` is `host` there.
//! - **captures**: no wait is queued while a capture is in progress (Note [capture
//!   exclusion]); the pass falls back to polling.
//!
//! Lock order: a pool's fence lock (`events`), then the list. A pass holds the first for
//! all of its work and takes the second around its waits; a creation takes both in that
//! order, so a pass either sees the new stream or has recorded what it drained before the
//! creation looks.
//!
//! Ending it: the state becomes `ENDED` first; then each pool runs a waiting fence pass
//! under its fence lock, which waits on the host for the newest fence. A pass that
//! drained blocks by a device wait held that lock and recorded its fence before, so the
//! wait covers the old owners' work of every block drained that way; a stream that ends
//! the mode is created only after [`end`] returns (or, past the list's bound, before any
//! work can be queued on it), so nothing queued on it can run early. Passes that start
//! later see `ENDED` and poll as before.

use super::block::BlockIdx;
use super::fence_times::FenceCall;
use super::{all_pools, fences::Advance, DevicePool, Shared, BLOCKS};
use crate::backend::StreamHandle;
use crate::config::{self, Key};
use core::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

const OFF: u8 = 0;
const ON: u8 = 1;
const ENDED: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(OFF);

/// The live non-blocking streams each device wait makes wait too (Note [device waits]).
static NON_BLOCKING: Mutex<Vec<StreamHandle>> = Mutex::new(Vec::new());

/// More live non-blocking streams than this end device waits: each pass that waits on the
/// device costs one `cuStreamWaitEvent` per stream (cuDNN makes 32 per handle).
pub const MAX_NON_BLOCKING_STREAMS: usize = 64;

fn non_blocking() -> MutexGuard<'static, Vec<StreamHandle>> {
    // A panic elsewhere cannot leave a list of handles inconsistent.
    NON_BLOCKING.lock().unwrap_or_else(|p| p.into_inner())
}

/// A non-blocking stream was created (the preload's hooks, after the driver made it; the
/// program has not queued anything on it yet). While device waits run, it first waits for
/// the newest fence of every pool that drained blocks behind a device wait not yet seen
/// complete, and each later device wait makes it wait too. Past
/// [`MAX_NON_BLOCKING_STREAMS`] live ones, or when that first wait fails, device waits end.
pub fn non_blocking_stream_created(stream: StreamHandle) {
    if ended() {
        return;
    }
    let ending = {
        // Lock order: the fence locks, then the list (Note [device waits]). At most one
        // pool while device waits run: a second one ends them.
        let pools: Vec<&'static DevicePool> = all_pools().collect();
        let _fence_locks: Vec<_> = pools
            .iter()
            .map(|p| p.events.lock().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let mut list = non_blocking();
        if list.len() >= MAX_NON_BLOCKING_STREAMS {
            Some("more non-blocking streams than device waits make wait")
        } else if !pools.iter().all(|p| p.cover_new_stream(stream)) {
            Some("a new non-blocking stream could not wait for the device")
        } else {
            if !list.contains(&stream) {
                list.push(stream);
            }
            None
        }
    };
    if let Some(reason) = ending {
        end(reason);
    }
}

/// A stream is about to be destroyed: no later device wait names it. Called before the
/// driver destroys it; a pass waiting on it meanwhile holds the list, so this waits for it.
pub fn stream_destroyed(stream: StreamHandle) {
    non_blocking().retain(|&s| s != stream);
}

/// A context is about to be destroyed or reset, and its streams with it, unseen one by one:
/// device waits end (after a wait for what they stood in for), and the list is emptied.
pub fn context_going_away() {
    end("a context is destroyed or reset");
    non_blocking().clear();
}

/// Live non-blocking streams device waits make wait (tests).
pub fn non_blocking_streams() -> usize {
    non_blocking().len()
}

/// Starts device waits when the pool starts, if `fence_waits` asks for them: `device`
/// always, `auto` when `streams_seen` (the preload's hooks report every stream created).
/// Does nothing once they have ended.
pub fn begin_from_config(streams_seen: bool) {
    let mode = config::FENCE_WAIT_MODES
        .get(config::get(Key::FenceWaits) as usize)
        .copied();
    let wanted = match mode {
        Some("device") => true,
        Some("auto") => streams_seen,
        _ => false,
    };
    if wanted {
        let _ = STATE.compare_exchange(OFF, ON, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Whether fence passes may make the legacy stream wait now.
#[inline]
pub fn active() -> bool {
    STATE.load(Ordering::Acquire) == ON
}

/// Whether device waits ran in this process and have ended.
pub fn ended() -> bool {
    STATE.load(Ordering::Acquire) == ENDED
}

/// Ends device waits for good (Note [device waits]) and waits on the host for every fence
/// a device wait stood in for. Safe to call at any time, from any thread, before the pool
/// has started too (they then never start).
pub fn end(reason: &str) {
    if STATE.swap(ENDED, Ordering::SeqCst) != ON {
        return;
    }
    crate::log::info(&format!(
        "cupool: device waits end ({reason}): blocks freed without a stream wait for their fence on the host from now on"
    ));
    for pool in all_pools() {
        pool.settle_device_waits();
    }
}

impl DevicePool {
    /// Makes the legacy stream wait for `fence` (which covers frees up to `epoch`);
    /// returns the epoch the pool may drain to, 0 when no wait was queued (device waits
    /// off, a capture in progress, a driver error). Caller holds `self.events`, so the
    /// state read here orders against [`end`].
    pub(super) fn wait_on_device(&self, fence: crate::backend::EventHandle, epoch: u64) -> u64 {
        if !active() {
            return 0;
        }
        // Note [capture exclusion]: no capture may begin between the check and the wait.
        let Some(_calls) = self.enter_ordering_calls() else {
            return 0;
        };
        // Held over the waits: no listed stream is destroyed meanwhile.
        let streams = non_blocking();
        let waited = self.fence_call(FenceCall::DeviceWait, || {
            self.backend
                .legacy_stream_wait(self.ctx.id, fence)
                .and_then(|()| {
                    streams
                        .iter()
                        .try_for_each(|&s| self.backend.stream_wait(self.ctx.id, s, fence))
                })
        });
        match waited {
            Ok(()) => epoch,
            // The streams that did wait only wait longer than they need; the blocks are not
            // drained, and wait for their fence on the host.
            Err(e) => {
                crate::log::debug(&format!("cupool: device wait failed: {e:?}"));
                0
            }
        }
    }

    /// A new non-blocking stream waits for the newest fence when blocks drained behind a
    /// device wait may still be in use (their fence not seen complete); false when that
    /// wait could not be queued. Caller holds `self.events` (no pass runs, and the
    /// outstanding fences stay recorded).
    fn cover_new_stream(&self, stream: StreamHandle) -> bool {
        let newest = {
            let sh = self.shared.lock();
            if sh.device_drained <= sh.fence_done {
                return true;
            }
            sh.fences.back().map(|&(ev, _)| ev)
        };
        // A fence as new as the newest drained one is outstanding until seen complete
        // (retired only then; the cap drops the oldest, never the newest).
        let Some(fence) = newest else {
            return false;
        };
        let Some(_calls) = self.enter_ordering_calls() else {
            return false;
        };
        self.fence_call(FenceCall::DeviceWait, || {
            self.backend.stream_wait(self.ctx.id, stream, fence)
        })
        .is_ok()
    }

    /// Waits on the host for every fence a device wait stood in for, so that blocks it
    /// drained are idle before work that a legacy-stream wait does not order may start.
    ///
    /// Always a waiting pass, never a look at `device_drained` first: a pass in flight on
    /// another thread may have made its device wait without having recorded it yet. The
    /// waiting pass takes the fence lock after that pass, and waits for the newest fence,
    /// which covers it.
    fn settle_device_waits(&self) {
        self.advance(Advance::Wait);
        let sh = self.shared.lock();
        if sh.device_drained > sh.fence_done {
            crate::log::warn(&format!(
                "cupool: device {}: could not wait for the device when device waits ended; blocks freed before may be reused early by work on a non-blocking stream",
                self.ctx.device
            ));
        }
    }

    /// A block drained by a device wait (its fence not seen complete): pins its arena
    /// granules until a fence pass sees the fence complete, so that they are neither
    /// unmapped nor moved while the device may still use them.
    ///
    /// # Safety
    /// Pool lock held; `idx` is owned by the caller.
    pub(super) unsafe fn hold_until_confirmed(sh: &mut Shared, idx: BlockIdx) {
        let d = BLOCKS.get(idx).data();
        if let Some(a) = sh.arena.as_mut().filter(|a| a.contains(d.ptr)) {
            a.pin(d.ptr, d.size);
            sh.device_pins
                .push((d.ptr, d.size, BLOCKS.links(idx).free_epoch));
        }
    }

    /// Drops the pins of blocks whose fence has now been seen complete.
    pub(super) fn release_confirmed(sh: &mut Shared) {
        if sh.device_pins.is_empty() {
            return;
        }
        let confirmed = sh.fence_done;
        let Shared {
            device_pins, arena, ..
        } = sh;
        device_pins.retain(|&(ptr, size, epoch)| {
            if epoch > confirmed {
                return true;
            }
            if let Some(a) = arena.as_mut().filter(|a| a.contains(ptr)) {
                a.unpin(ptr, size);
            }
            false
        });
    }
}
