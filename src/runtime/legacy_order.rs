//! Legacy order: streamless calls served as calls on the legacy default stream while every
//! piece of device work of the process is in that one order.
//!
//! Note [legacy order]: a streamless free (`cudaFree`, `cupool_free`) must not let its
//! block be reused while work queued before the free may still touch it. In general the
//! pool cannot know which stream that work is on, so the block waits for a context fence
//! (`cuCtxRecordEvent`) recorded after the free: one record and at least one query per
//! reuse, and while the device is behind, a block that is not reusable yet, so the pool
//! grows or remaps (docs/BENCHMARKS.md). But most programs that call `cudaMalloc` and
//! `cudaFree` never create a stream: everything they queue goes to the legacy default
//! stream, in the order it was queued. For them a streamless free *is* a free on the
//! legacy stream, and a block freed there may be handed to the next allocation at once:
//! whatever the new owner queues runs after what the old owner queued (the legacy stream
//! runs its work in order), and copies and memsets without a stream are on that stream
//! too. That is what a single-stream caching allocator (PyTorch's) relies on.
//!
//! So while this mode is active, streamless allocations and frees go through the
//! stream-ordered path on the legacy stream: thread-cache hits, no lock, no fence. It ends
//! for good, for every context, at the first sign that work may run outside that order:
//! - a stream is created (`cuStreamCreate`, `cuStreamCreateWithPriority`,
//!   `cuGreenCtxStreamCreate`, hooked by the preload, however the program reaches them;
//!   a stream created before the pool starts keeps the mode from starting);
//! - a stream-ordered pool call names any stream other than the legacy one, the
//!   per-thread default stream included.
//!
//! Ending it: the state becomes `ENDED` first, so every later call takes the fenced path,
//! then each pool's context is waited for once (a context fence, recorded and waited
//! for). Why that is enough: a block freed in this mode was freed by a call that saw the
//! mode active, so before the state changed, and the work its old owner queued on it was
//! queued before that free; the wait covers it. A block handed out in this mode and used
//! later on the new stream is therefore idle by then. Blocks freed in this mode sit on the
//! legacy stream's lists, which hand them to other streams only through a fence, as for
//! any stream-ordered free. A block freed after the end is fenced.
//!
//! What the mode cannot see, it cannot end on. Every way to create a stream is hooked by
//! the preload; without it, only the pool calls show streams. Per-thread default streams
//! cannot be seen at all: they need no creation, and the CUDA runtime asks the driver for
//! the per-thread variants of its entry points in every program, `--default-stream
//! per-thread` or not (measured on the H100: `cuStreamGetCaptureInfo`, `cuMemcpyAsync`,
//! ... are asked for with the per-thread flag by plain nvcc programs and by PyTorch). A
//! program whose threads each queue work on their per-thread default stream and free
//! without a stream would see a block reused while another thread's work still uses it.
//! So the mode is opt-in (`legacy_order:on`), for programs that use no per-thread stream.
//! Work of another context (peer access, a copy queued in another device's context) was
//! never covered by a context fence either: unchanged.

use crate::backend::Backend;
use crate::config::{self, Key};
use crate::pool::{self, DevicePool, StreamRef};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// The handle the pool files legacy-order blocks under: NULL, the legacy default stream
/// for the driver's legacy entry points (the backend's), and the one replays use.
pub const LEGACY_STREAM: crate::backend::StreamHandle = 0;
/// `CU_STREAM_LEGACY`: also the legacy default stream.
const CU_STREAM_LEGACY: crate::backend::StreamHandle = 0x1;
/// `CU_STREAM_PER_THREAD`.
const PER_THREAD_STREAM: crate::backend::StreamHandle = 0x2;

const UNSET: u8 = 0;
const ACTIVE: u8 = 1;
const ENDED: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNSET);

/// Each pool's id of its legacy stream, by pool index (`u64::MAX`: not asked yet).
static LEGACY_IDS: [AtomicU64; pool::MAX_POOLS] =
    [const { AtomicU64::new(u64::MAX) }; pool::MAX_POOLS];

/// Starts the mode when the pool starts, if the `legacy_order` option asks for it. Does
/// nothing once it has ended (a stream created before the pool started).
pub(crate) fn begin_from_config() {
    let wanted =
        config::LEGACY_ORDER_MODES.get(config::get(Key::LegacyOrder) as usize) == Some(&"on");
    if wanted {
        let _ = STATE.compare_exchange(UNSET, ACTIVE, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Whether streamless calls are served on the legacy stream now: one relaxed load.
#[inline(always)]
pub fn active() -> bool {
    STATE.load(Ordering::Relaxed) == ACTIVE
}

/// Whether the mode ran in this process and has ended.
pub fn ended() -> bool {
    STATE.load(Ordering::Relaxed) == ENDED
}

/// Ends the mode for good (Note [legacy order]): from now on streamless frees wait for
/// context fences. Waits once for the work queued so far in every pool's context. Safe to
/// call at any time, from any thread, before the pool has started too.
pub fn end(reason: &str) {
    match STATE.swap(ENDED, Ordering::SeqCst) {
        ACTIVE => {}
        UNSET => {
            crate::log::info(&format!("cupool: legacy order will not start ({reason})"));
            return;
        }
        _ => return,
    }
    crate::log::info(&format!(
        "cupool: legacy order ends ({reason}): streamless frees wait for context fences from now on"
    ));
    for pool in pool::all_pools() {
        if let Err(e) = pool.wait_for_queued_work() {
            crate::log::warn(&format!(
                "cupool: device {}: could not wait for queued work when legacy order ended ({e:?})",
                pool.ctx.device
            ));
        }
    }
}

/// Ends the mode when a stream-ordered call names a stream other than the legacy one.
#[inline(always)]
pub fn note_stream(stream: crate::backend::StreamHandle) {
    if active() && stream > CU_STREAM_LEGACY {
        end(if stream == PER_THREAD_STREAM {
            "a pool call on the per-thread default stream"
        } else {
            "a pool call on a stream other than the legacy default stream"
        });
    }
}

/// The legacy stream of `pool`'s context, its id asked of the backend once.
#[inline]
pub(crate) fn legacy_stream(backend: &dyn Backend, pool: &DevicePool) -> Result<StreamRef> {
    let slot = &LEGACY_IDS[pool.index as usize];
    let mut id = slot.load(Ordering::Relaxed);
    if id == u64::MAX {
        // The caller's current context is the pool's: the driver answers for it.
        id = backend
            .stream_id(LEGACY_STREAM)
            .map_err(CupoolStatus::from)?
            .0;
        slot.store(id, Ordering::Relaxed);
    }
    Ok(StreamRef {
        id,
        handle: LEGACY_STREAM,
    })
}
