//! Stream and context lifetime hooks.
//!
//! Creation: every creation makes the stream ids threads remember stale (Note [stream id
//! cache] in `cupool::runtime::stream_ids`), and the first stream a program creates ends
//! legacy order (Note [legacy order] in `cupool::runtime::legacy_order`): from then on work
//! may run outside the legacy default stream's order, so streamless frees wait for context
//! fences again. That mode ends before the real call, so that no block is handed out under
//! legacy order once the stream exists.
//!
//! Device waits (Note [device waits] in `cupool::pool::device_waits`): a non-blocking
//! stream's work is not ordered after a wait of the legacy stream, so the pool keeps the
//! live ones and makes them wait too. A new one is listed after the real call (its handle
//! is known then), before the program can queue work on it; a stream leaves the list
//! before it is destroyed, and a context destroyed or reset (its streams with it) ends
//! device waits first. A green context's streams end them before they exist.
//!
//! The real calls' results are returned unchanged. The driver calls these hooks make (a
//! stream wait, or a wait for queued work when a mode ends) are the pool's own, as in its
//! other calls: none after exit, none in a fork child.

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::{sig, RealFn};
use core::ffi::{c_int, c_uint};

/// `CU_STREAM_NON_BLOCKING`: work on the stream is not ordered with the legacy stream.
const CU_STREAM_NON_BLOCKING: c_uint = 0x1;

/// A stream is being created with `flags`: the ids threads remember go stale (always), and
/// legacy order ends (not in a fork child, where the pool is not used, nor once the
/// process exits). Returns whether the stream, once made, is for the device waits' list.
fn stream_created(how: &str, flags: c_uint) -> bool {
    // Note [stream id cache]: before the real call, so that no thread can name the new
    // stream under an id remembered for the handle's previous stream.
    cupool::runtime::stream_ids::stream_created();
    if lifecycle::pass_through() || lifecycle::exiting() {
        return false;
    }
    if cupool::log::level() >= cupool::log::Level::Debug {
        cupool::log::debug(&format!(
            "cupool: stream created (flags {flags:#x}) at\n{}",
            std::backtrace::Backtrace::force_capture()
        ));
    }
    // Also before the pool starts: a stream created then keeps legacy order from starting.
    cupool::runtime::legacy_order::end(how);
    flags & CU_STREAM_NON_BLOCKING != 0
}

/// After the real creation: a non-blocking stream joins the device waits' list.
///
/// # Safety
/// `stream` is the creation's out-pointer.
unsafe fn stream_made(listed: bool, stream: *mut CuHandle, rc: CuResult) -> CuResult {
    if listed && rc == CUDA_SUCCESS && !stream.is_null() {
        // SAFETY: the driver wrote the new handle there.
        let handle = unsafe { *stream };
        cupool::pool::device_waits::non_blocking_stream_created(handle as usize);
    }
    rc
}

/// The body of a hook on a call that ends a stream's or a context's life (`stream`: the
/// stream, or `None` for a context, whose streams go with it): the device waits' list
/// forgets it first (not in a fork child, nor at exit), then the real call runs with the
/// same argument.
fn going_away<S, A>(hook: &'static str, arg: A, stream: Option<CuHandle>) -> CuResult
where
    S: RealFn<Fn = unsafe extern "C" fn(A) -> CuResult>,
{
    cuda_call(hook, || {
        let Some(real) = real::get::<S>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        if !lifecycle::pass_through() && !lifecycle::exiting() {
            match stream {
                Some(s) => cupool::pool::device_waits::stream_destroyed(s as usize),
                None => cupool::pool::device_waits::context_going_away(),
            }
        }
        // SAFETY: the slot holds `hook`'s real function; the argument forwarded unchanged.
        unsafe { real(arg) }
    })
}

/// `cuStreamCreate(CUstream *phStream, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CuHandle, flags: c_uint) -> CuResult {
    cuda_call("cuStreamCreate", || {
        // SAFETY: the slot holds the real cuStreamCreate.
        let Some(real) = real::get::<sig::StreamCreate>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        let listed = stream_created("the program created a stream", flags);
        // SAFETY: arguments forwarded unchanged.
        let rc = unsafe { real(stream, flags) };
        // SAFETY: the creation's out-pointer.
        unsafe { stream_made(listed, stream, rc) }
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
        let listed = stream_created("the program created a stream", flags);
        // SAFETY: arguments forwarded unchanged.
        let rc = unsafe { real(stream, flags, priority) };
        // SAFETY: the creation's out-pointer.
        unsafe { stream_made(listed, stream, rc) }
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
        stream_created("the program created a stream of a green context", flags);
        // A green context's streams are non-blocking whatever the flags say, and belong to
        // another context: device waits end before one exists.
        if !lifecycle::pass_through() && !lifecycle::exiting() {
            cupool::pool::device_waits::end("the program created a stream of a green context");
        }
        // SAFETY: arguments forwarded unchanged.
        unsafe { real(stream, green_ctx, flags, priority) }
    })
}

/// `cuStreamDestroy_v2(CUstream hStream)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: CuHandle) -> CuResult {
    going_away::<sig::StreamDestroy, _>("cuStreamDestroy_v2", stream, Some(stream))
}

/// `cuStreamDestroy(CUstream hStream)`, the variant before CUDA 4.0.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy(stream: CuHandle) -> CuResult {
    going_away::<sig::StreamDestroyV1, _>("cuStreamDestroy", stream, Some(stream))
}

/// `cuCtxDestroy_v2(CUcontext ctx)`: its streams go with it.
#[no_mangle]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CuHandle) -> CuResult {
    going_away::<sig::CtxDestroy, _>("cuCtxDestroy_v2", ctx, None)
}

/// `cuDevicePrimaryCtxReset_v2(CUdevice dev)` (`cudaDeviceReset`): its streams go with it.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(device: c_int) -> CuResult {
    going_away::<sig::PrimaryCtxReset, _>("cuDevicePrimaryCtxReset_v2", device, None)
}

/// `cuDevicePrimaryCtxReset(CUdevice dev)`, the variant before CUDA 11.0.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset(device: c_int) -> CuResult {
    going_away::<sig::PrimaryCtxResetV1, _>("cuDevicePrimaryCtxReset", device, None)
}
