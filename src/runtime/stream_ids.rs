//! Note [stream id cache]: the pool keys streams by the driver's id (`cuStreamGetId`), and
//! a stream-ordered call names its stream by handle, so each allocation asked the driver
//! (8–35 ns on an H100 host, up to a third of a cached pair; docs/BENCHMARKS.md).
//!
//! A handle comes to name another stream only through a stream creation: the driver may
//! hand a destroyed stream's handle to the next stream it creates. Where every creation in
//! the process is seen, under the interposer, whose hooks on `cuStreamCreate`,
//! `cuStreamCreateWithPriority` and `cuGreenCtxStreamCreate` call [`stream_created`] before
//! the real call, each thread keeps the ids of the last few (context, handle) pairs it
//! named, valid while no stream has been created since. The context is in the key because
//! the default handles (NULL, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`) name a stream of
//! each context, and the cache is per thread because `CU_STREAM_PER_THREAD` names one per
//! thread; the context is the current one, which is the pool's for an allocation (a free
//! on a handle other than its block's asks the driver: the current context need not be
//! the block's). Contexts are the primary ones, which live until exit (as the backend's
//! context table assumes).
//!
//! Why it is safe: an entry is used only if no creation was counted between the count it
//! was filled under and now. A thread that names a stream created after its entry was
//! filled learnt that handle from the creation, so it reads the newer count, and the driver
//! is asked. An id read from a stale entry would name the destroyed stream, whose freed
//! blocks the new one must not take without a fence: exactly what the count prevents.
//!
//! Without the interposer (the API library alone) creations are not seen, and every call
//! naming a stream the program created asks the driver. The default handles are the
//! exception: NULL, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` name a context's (or, per
//! thread, a thread's) default stream, which lives as long as the context, and no creation
//! can make them name another. Their entries are kept whoever reports creations: PyTorch's
//! and CuPy's default stream is NULL, and so is a C program's that passes 0.

use crate::backend::{
    names_a_default_stream, Backend, BackendResult, ContextId, StreamHandle, StreamId,
};
use core::cell::Cell;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Whether every stream creation of the process reaches [`stream_created`].
static CREATIONS_SEEN: AtomicBool = AtomicBool::new(false);
/// Stream creations counted so far, plus one (0 marks an empty entry).
static CREATIONS: AtomicU64 = AtomicU64::new(1);
/// The creation count of an entry for a default handle: valid at any count.
const ANY_COUNT: u64 = u64::MAX;

/// (context, handle) pairs each thread remembers.
const ENTRIES: usize = 4;

#[derive(Copy, Clone)]
struct Entry {
    /// [`CREATIONS`] when the entry was filled; 0 for none.
    creations: u64,
    ctx: u64,
    handle: StreamHandle,
    id: u64,
}

const EMPTY: Entry = Entry {
    creations: 0,
    ctx: 0,
    handle: 0,
    id: 0,
};

thread_local! {
    static CACHE: [Cell<Entry>; ENTRIES] = const { [const { Cell::new(EMPTY) }; ENTRIES] };
    static NEXT: Cell<usize> = const { Cell::new(0) };
}

/// From the interposer's load-time constructor: its hooks see every stream creation of
/// the process and report it through [`stream_created`].
pub fn creations_seen_by_caller() {
    CREATIONS_SEEN.store(true, Ordering::Release);
}

/// Whether the interposer reports every stream creation ([`creations_seen_by_caller`]).
pub fn creations_seen() -> bool {
    CREATIONS_SEEN.load(Ordering::Acquire)
}

/// A stream is about to be created: every thread's remembered ids are stale from now on.
pub fn stream_created() {
    CREATIONS.fetch_add(1, Ordering::AcqRel);
}

/// The id of the stream `stream` names in context `ctx` (Note [stream id cache]).
#[inline]
pub(super) fn stream_id(
    backend: &dyn Backend,
    ctx: ContextId,
    stream: StreamHandle,
) -> BackendResult<StreamId> {
    let creations = if names_a_default_stream(stream) {
        ANY_COUNT
    } else if CREATIONS_SEEN.load(Ordering::Acquire) {
        CREATIONS.load(Ordering::Acquire)
    } else {
        return backend.stream_id(stream);
    };
    let remembered = CACHE
        .try_with(|entries| {
            entries
                .iter()
                .map(Cell::get)
                .find(|e| e.creations == creations && e.ctx == ctx.0 && e.handle == stream)
        })
        .ok()
        .flatten();
    if let Some(e) = remembered {
        return Ok(StreamId(e.id));
    }
    let id = backend.stream_id(stream)?;
    // Filled under the count read before the driver was asked: a creation meanwhile makes
    // the entry stale at once, never the other way round.
    let _ = CACHE.try_with(|entries| {
        let next = NEXT.try_with(|n| {
            let i = n.get();
            n.set((i + 1) % ENTRIES);
            i
        });
        entries[next.unwrap_or(0)].set(Entry {
            creations,
            ctx: ctx.0,
            handle: stream,
            id: id.0,
        });
    });
    Ok(id)
}
