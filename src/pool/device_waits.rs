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
//! Where it does not hold, it must not run:
//! - work on a **non-blocking stream** is not ordered after the legacy stream. The preload
//!   sees every stream created (`cuStreamCreate`, `cuStreamCreateWithPriority`,
//!   `cuGreenCtxStreamCreate`, however reached); the first non-blocking one ends the mode
//!   for good. PyTorch's side streams and cuDNN's handles are non-blocking; cuBLASLt's
//!   internal stream is not (measured on the H100: the GPT loop creates one blocking
//!   stream, the conv net 32 non-blocking ones in `cudnnCreate`).
//! - work of **another context** is not ordered by this context's legacy stream: a second
//!   context with a pool, or peer access enabled, ends it.
//! - without the preload, streams are created unseen: `fence_waits:auto` is `host` there.
//! - **captures**: no wait is queued while a capture is in progress (Note [capture
//!   exclusion]); the pass falls back to polling.
//!
//! Ending it: the state becomes `ENDED` first; then each pool runs a waiting fence pass
//! under its fence lock, which waits on the host for the newest fence. A pass that
//! drained blocks by a device wait held that lock and recorded its fence before, so the
//! wait covers the old owners' work of every block drained that way; the non-blocking
//! stream is created only after [`end`] returns, so nothing queued on it can run early.
//! Passes that start later see `ENDED` and poll as before.

use super::block::BlockIdx;
use super::{all_pools, fences::Advance, DevicePool, Shared, BLOCKS};
use crate::config::{self, Key};
use core::sync::atomic::{AtomicU8, Ordering};

const OFF: u8 = 0;
const ON: u8 = 1;
const ENDED: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(OFF);

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
        match self.backend.legacy_stream_wait(self.ctx.id, fence) {
            Ok(()) => epoch,
            Err(e) => {
                crate::log::debug(&format!("cupool: legacy stream wait failed: {e:?}"));
                0
            }
        }
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
            sh.device_pins.push((d.ptr, d.size, d.free_epoch));
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
