//! CUDA IPC of blocks that share a segment (a driver allocation) with others: the
//! segment's legacy handle plus the block's offset, through the registry (Note [ipc
//! registry] in [`super`]).

use super::registry::{self, Kind, Record, Tagged};
use crate::backend::{BackendError, BackendResult, DevicePtr};
use crate::runtime::{BlockInfo, Runtime};
use std::sync::Mutex;

/// The tagged handle of `block`, whose segment's legacy handle is `segment`.
pub(super) fn export(block: &BlockInfo, segment: [u8; 64]) -> BackendResult<[u8; 64]> {
    let mut t = Tagged::new(Kind::Segment, block.ptr - block.segment_base, block.size);
    t.index = registry::append(Record {
        nonce: t.nonce,
        offset: t.offset,
        size: t.size,
        segment,
    })
    .ok_or(BackendError::InvalidValue)?;
    Ok(t.to_bytes())
}

/// Segments this process opened for tagged handles, and the block pointers handed out.
struct Opened {
    /// (segment's legacy handle, its mapping here, blocks open in it).
    segments: Vec<([u8; 64], DevicePtr, u32)>,
    /// (block pointer handed out, segment's legacy handle).
    blocks: Vec<(DevicePtr, [u8; 64])>,
}

static OPENED: Mutex<Opened> = Mutex::new(Opened {
    segments: Vec::new(),
    blocks: Vec::new(),
});

/// Opens a tagged segment-block handle: the segment is mapped once (CUDA maps a handle
/// once per context), and each open of a block in it is counted.
pub(super) fn open(rt: &Runtime, t: &Tagged, flags: u32) -> BackendResult<DevicePtr> {
    // The exporter is gone (its registry with it), or the handle is not one it made.
    let record = registry::lookup(t).ok_or(BackendError::InvalidValue)?;
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    let base = match opened.segments.iter_mut().find(|s| s.0 == record.segment) {
        Some(s) => {
            s.2 += 1;
            s.1
        }
        None => {
            let base = rt.backend().ipc_open(record.segment, flags)?;
            opened.segments.push((record.segment, base, 1));
            base
        }
    };
    let ptr = base + record.offset;
    opened.blocks.push((ptr, record.segment));
    Ok(ptr)
}

/// Closes a pointer [`open`] handed out (the segment's mapping goes with its last block);
/// `None` for any other pointer.
pub(super) fn close(rt: &Runtime, ptr: DevicePtr) -> Option<BackendResult<()>> {
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    let i = opened.blocks.iter().position(|b| b.0 == ptr)?;
    let (_, key) = opened.blocks.swap_remove(i);
    let Some(j) = opened.segments.iter().position(|s| s.0 == key) else {
        return Some(Err(BackendError::InvalidValue));
    };
    opened.segments[j].2 -= 1;
    if opened.segments[j].2 > 0 {
        return Some(Ok(()));
    }
    let (_, base, _) = opened.segments.swap_remove(j);
    Some(rt.backend().ipc_close(base))
}
