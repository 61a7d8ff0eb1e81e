//! Stream-creation hooks: every creation makes the stream ids threads remember stale (Note
//! [stream id cache] in `cupool::runtime::stream_ids`), the first stream a program creates
//! ends legacy order (Note [legacy order] in `cupool::runtime::legacy_order`): from then on
//! work may run outside the legacy default stream's order, so streamless frees wait for
//! context fences again; and the first non-blocking stream ends device waits (Note [device
//! waits] in `cupool::pool::device_waits`): its work is not ordered after a wait of the
//! legacy stream.
//!
//! The mode ends before the real call, so that no block is handed out under legacy order
//! once the stream exists; the real call's result is returned unchanged. Ending it waits
//! once for the work queued so far (a driver call from this hook, as the pool's own calls
//! are; none after exit, none in a fork child).

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::sig;
use core::ffi::{c_int, c_uint};

/// `CU_STREAM_NON_BLOCKING`: work on the stream is not ordered with the legacy stream.
const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

/// A stream is being created with `flags`: the ids threads remember go stale (always),
/// legacy order ends, and device waits end if it is non-blocking (not in a fork child,
/// where the pool is not used, nor once the process exits).
fn stream_created(how: &str, flags: c_uint) {
    // Note [stream id cache]: before the real call, so that no thread can name the new
    // stream under an id remembered for the handle's previous stream.
    cupool::runtime::stream_ids::stream_created();
    if lifecycle::pass_through() || lifecycle::exiting() {
        return;
    }
    if cupool::log::level() >= cupool::log::Level::Debug {
        cupool::log::debug(&format!(
            "cupool: stream created (flags {flags:#x}) at\n{}",
            std::backtrace::Backtrace::force_capture()
        ));
    }
    // Also before the pool starts: a stream created then keeps legacy order from starting.
    cupool::runtime::legacy_order::end(how);
    if flags & CU_STREAM_NON_BLOCKING != 0 {
        // Note [device waits]: its work is not ordered after the legacy stream.
        cupool::pool::device_waits::end("the program created a non-blocking stream");
    }
}

/// `cuStreamCreate(CUstream *phStream, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CuHandle, flags: c_uint) -> CuResult {
    cuda_call("cuStreamCreate", || {
        // SAFETY: the slot holds the real cuStreamCreate.
        let Some(real) = real::get::<sig::StreamCreate>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        stream_created("the program created a stream", flags);
        // SAFETY: arguments forwarded unchanged.
        unsafe { real(stream, flags) }
    })
}

/// `cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    stream: *mut CuHandle,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    cuda_call("cuStreamCreateWithPriority", || {
        // SAFETY: the slot holds the real cuStreamCreateWithPriority.
        let Some(real) = real::get::<sig::StreamCreateWithPriority>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        stream_created("the program created a stream", flags);
        // SAFETY: arguments forwarded unchanged.
        unsafe { real(stream, flags, priority) }
    })
}

/// `cuGreenCtxStreamCreate(CUstream *phStream, CUgreenCtx greenCtx, unsigned int flags,
/// int priority)`.
#[no_mangle]
pub unsafe extern "C" fn cuGreenCtxStreamCreate(
    stream: *mut CuHandle,
    green_ctx: CuHandle,
    flags: c_uint,
    priority: c_int,
) -> CuResult {
    cuda_call("cuGreenCtxStreamCreate", || {
        // SAFETY: the slot holds the real cuGreenCtxStreamCreate.
        let Some(real) = real::get::<sig::GreenCtxStreamCreate>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // A green context's streams are non-blocking whatever the flags say.
        stream_created(
            "the program created a stream of a green context",
            flags | CU_STREAM_NON_BLOCKING,
        );
        // SAFETY: arguments forwarded unchanged.
        unsafe { real(stream, green_ctx, flags, priority) }
    })
}
