//! Note [stream id cache] in `src/runtime/stream_ids.rs`, on the host backend, without the
//! interposer (no stream creation is reported, as for the API library alone): a thread
//! remembers the ids of the default handles (NULL, `CU_STREAM_LEGACY`,
//! `CU_STREAM_PER_THREAD`), which no creation renames, and asks again for every other
//! handle, which a creation the library does not see may have given to a new stream.
//!
//! A test binary of its own: "creations are reported" is process-wide, and here it must
//! stay off. The host backend forgets a handle's id when the stream is destroyed
//! (`destroy_stream`) and gives the handle a new id at its next use, so a block freed on
//! the handle is taken back at once only if the old id was remembered.

mod host_pool;

use cupool::runtime::stream_ids;
use host_pool::{freed_on, renamed_handle_takes_no_old_block, setup_held};

#[test]
fn default_handles_are_remembered_without_the_interposer() {
    // Fences complete only when the test says so: a block freed on one stream is taken at
    // once only by an allocation on that same stream.
    let (rt, host, _ctx) = setup_held();
    assert!(!stream_ids::creations_seen());
    for s in [0, 1, 2] {
        let p = freed_on(rt, s);
        // A driver never renames a default handle; the backend's new id here shows
        // whether the id was asked for again.
        host.destroy_stream(s);
        assert_eq!(freed_on(rt, s), p, "handle {s}: the id was asked for again");
    }
}

#[test]
fn other_handles_are_asked_for_every_time_without_the_interposer() {
    let (rt, host, _ctx) = setup_held();
    // The stream is destroyed and its handle given to a new stream, which the library,
    // without the interposer, does not see.
    renamed_handle_takes_no_old_block(rt, host, 0x7300, || {});
}
