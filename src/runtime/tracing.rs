//! What the runtime tells the trace recorder about each allocation and free, gathered on
//! the way so that the common case needs no second lookup.

use crate::backend::DevicePtr;
use crate::pool::handover;
use crate::pool::size_class::round_size;
use crate::status::Result;
use crate::trace::record;

/// What a free learnt about its block, for the trace.
#[derive(Copy, Clone)]
pub(super) struct Freed {
    pub(super) requested: u64,
    pub(super) size: u64,
    pub(super) device: i32,
    pub(super) stream_id: u64,
}

/// What an allocation learnt on its way, for the trace (each field unknown until set).
#[derive(Copy, Clone)]
pub(super) struct Seen {
    pub(super) device: i32,
    pub(super) stream_id: u64,
    /// The block's size in the pool when the fast path had it at hand; 0: look it up.
    pub(super) block: u64,
}

impl Seen {
    pub(super) const NOTHING: Seen = Seen {
        device: record::NO_DEVICE,
        stream_id: record::NO_STREAM_ID,
        block: 0,
    };

    pub(super) fn device(device: i32) -> Seen {
        Seen {
            device,
            ..Seen::NOTHING
        }
    }
}

/// Records an allocation (a trace is running): a success with its block's size, a failure
/// with the rounded request. `stream`: the handle of a stream-ordered call.
#[inline(never)]
pub(super) fn trace_allocation(
    result: Result<DevicePtr>,
    size: usize,
    seen: Seen,
    stream: Option<u64>,
) {
    let rounded = match result {
        Ok(_) if seen.block != 0 => seen.block,
        Ok(ptr) => handover::allocated_size(ptr),
        Err(_) => round_size(size as u64).unwrap_or(0),
    };
    let stream = stream.map(|h| (h, seen.stream_id));
    record::allocation(result, size as u64, rounded, seen.device, stream);
}

/// Records a free (a trace is running); `stream`: the handle of a stream-ordered call.
#[inline(never)]
pub(super) fn trace_free(result: Result<Freed>, ptr: DevicePtr, stream: Option<u64>) {
    let known = result.ok();
    let stream = stream.map(|h| (h, known.map_or(record::NO_STREAM_ID, |f| f.stream_id)));
    record::free(
        result.map(|_| ()),
        ptr,
        known.map_or(0, |f| f.requested),
        known.map_or(0, |f| f.size),
        known.map_or(record::NO_DEVICE, |f| f.device),
        stream,
    );
}
