//! Note [stream id cache] in `src/runtime/stream_ids.rs`, on the host backend: where every
//! stream creation is reported (as the interposer's hooks do), a thread remembers the ids
//! of the streams it names, until the next creation.
//!
//! A test binary of its own: "creations are reported" is process-wide. The host backend
//! forgets a handle's id when the stream is destroyed (`destroy_stream`) and gives the
//! handle a new id at its next use, as the driver does when it hands a destroyed stream's
//! handle to a new stream.

mod host_pool;

use cupool::backend::host::HostBackend;
use cupool::backend::StreamHandle;
use cupool::runtime::{stream_ids, Runtime};
use host_pool::{freed_on, renamed_handle_takes_no_old_block, setup_held};
use std::sync::{Mutex, MutexGuard};

/// A creation reported by one test makes every thread's ids stale: the tests take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// A pool of the test's own whose fences complete only when the test says so (a block
/// freed on a stream may still be in use there, and only its own stream may take it at
/// once), with stream creations reported; held while the guard lives.
fn reporting_pool() -> (
    MutexGuard<'static, ()>,
    &'static Runtime,
    &'static HostBackend,
) {
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let (rt, host, _ctx) = setup_held();
    stream_ids::creations_seen_by_caller();
    (turn, rt, host)
}

#[test]
fn a_handle_that_names_a_new_stream_does_not_get_the_old_streams_blocks() {
    let (_turn, rt, host) = reporting_pool();
    // The program destroys the stream and creates another, which gets the same handle.
    renamed_handle_takes_no_old_block(rt, host, 0x7100, stream_ids::stream_created);
}

#[test]
fn an_id_is_remembered_until_a_stream_is_created() {
    let (_turn, rt, host) = reporting_pool();
    let s: StreamHandle = 0x7200;
    let p = freed_on(rt, s);
    // The backend would now give the handle a new id, but no creation was reported, so
    // the handle still names its stream: the id is not asked for again, and the block
    // freed on it is taken at once. (A driver never renames a handle without a creation.)
    host.destroy_stream(s);
    assert_eq!(freed_on(rt, s), p, "the id was asked for again");
}

/// The pinned pool's stream-ordered calls use the same remembered ids: a pinned buffer
/// freed on a stream comes back to it at once, and the handle's id is not asked for again
/// until a creation is reported (before, each call asked the driver, `cuStreamGetId`).
#[test]
fn pinned_stream_ordered_calls_use_the_remembered_ids() {
    let (_turn, rt, host) = reporting_pool();
    let s: StreamHandle = 0x7300;
    let pinned_freed_on = |s| {
        let p = rt.host_alloc_async(4096, s).unwrap();
        rt.host_free_async(p, s).unwrap();
        p
    };
    let p = pinned_freed_on(s);
    assert_eq!(pinned_freed_on(s), p, "same stream: reused at once");
    // The backend would now give the handle a new id; no creation was reported.
    host.destroy_stream(s);
    assert_eq!(pinned_freed_on(s), p, "the id was asked for again");
    // A creation reported: the id is asked for again, and the new stream waits for a fence.
    host.destroy_stream(s);
    stream_ids::stream_created();
    let q = rt.host_alloc_async(4096, s).unwrap();
    assert_ne!(q, p, "a renamed handle took the old stream's pinned buffer");
    rt.host_free_async(q, s).unwrap();
}
