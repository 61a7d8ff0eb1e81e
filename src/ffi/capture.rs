//! Stream captures reported by the program: what the interposer's capture hooks tell the
//! pool, for programs that use the API library without the interposer (Note [capture
//! exclusion] in `pool/capture.rs`). Same three steps as every export (see [`super`]).

use super::{guard, process_api};
use crate::runtime::runtime;
use crate::status::CupoolStatus;

/// Reports that the calling thread is about to begin a stream capture
/// (`cudaStreamBeginCapture`) in its current context. Until the matching
/// `cupool_capture_end`, the pool records no context fence, waits for nothing and gives
/// nothing back to the driver in that context: a context fence made while any stream of
/// the context captures invalidates the capture, even one in thread-local mode on another
/// thread (and on driver 580 it can crash the driver). Returns once no such call of another
/// thread is in flight. Allocations and frees go on meanwhile; frees are fenced after the
/// capture ends.
///
/// Needed only by programs that capture while other threads use the pool and that do not
/// run under `libcupool_preload.so` (whose hooks report every capture). Without it, the
/// library alone detects captures of streams that synchronise with the legacy default
/// stream only, and only at the moment it checks. Calls nest; each needs its
/// `cupool_capture_end`.
#[no_mangle]
pub extern "C" fn cupool_capture_begin() -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.capture_begin)() };
    }
    guard(|| runtime()?.capture_begin_current())
}

/// Reports that the capture announced by `cupool_capture_begin` is over
/// (`cudaStreamEndCapture` returned, successfully or with the capture invalidated). Call
/// it from a thread whose current context is the capture's.
#[no_mangle]
pub extern "C" fn cupool_capture_end() -> CupoolStatus {
    if let Some(api) = process_api::other_copy() {
        // SAFETY: the table holds this same function of the copy that owns the pool.
        return unsafe { (api.capture_end)() };
    }
    guard(|| runtime()?.capture_end_current())
}
