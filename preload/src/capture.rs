//! Stream-capture hooks: the pool must know when a capture is in progress, because a
//! context fence, a synchronisation or a release to the driver made while any stream of
//! the context captures fails and invalidates the program's graph (measured).
//!
//! Begin: the pool is told *before* the real call (so no fence can slip in between) and
//! told again if the driver refuses. End: the pool is told *after* the real call, when the
//! capture is over: on success, and on `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, which also
//! ends it. The capture's context is the calling thread's current context (the runtime
//! always makes the stream's context current before capturing).

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::sig;
use core::ffi::{c_int, c_void};
use cupool::backend::ContextId;

/// Tells the pool a capture is starting, runs `begin`, and takes it back if the driver
/// refused.
fn begin_capture(begin: impl FnOnce() -> CuResult) -> CuResult {
    let tracked = match (lifecycle::exiting(), real::current_context()) {
        (false, Some(ctx)) => lifecycle::runtime().map(|rt| (rt, ContextId(ctx))),
        _ => None,
    };
    if let Some((rt, ctx)) = tracked {
        rt.capture_begin(ctx);
    }
    let rc = begin();
    if rc != CUDA_SUCCESS {
        if let Some((rt, ctx)) = tracked {
            rt.capture_end(ctx);
        }
    }
    rc
}

/// Runs `end`, then tells the pool the capture is over when it is.
fn end_capture(end: impl FnOnce() -> CuResult) -> CuResult {
    let rc = end();
    if rc == CUDA_SUCCESS || rc == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
        if let (Some(rt), Some(ctx)) = (lifecycle::runtime_if_started(), real::current_context()) {
            rt.capture_end(ContextId(ctx));
        }
    }
    rc
}

/// Exports hook `$name`: the real function of the same name (`sig::$slot`) called with the
/// arguments unchanged, wrapped in `$around`.
macro_rules! capture_hook {
    ($(#[$doc:meta])* $name:ident, $slot:ident, $around:ident,
     ($($arg:ident: $arg_type:ty),*)) => {
        $(#[$doc])*
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $arg_type),*) -> CuResult {
            cuda_call(stringify!($name), || {
                let Some(real) = real::get::<sig::$slot>() else {
                    return CUDA_ERROR_NOT_INITIALIZED;
                };
                $around(|| unsafe { real($($arg),*) })
            })
        }
    };
}

capture_hook!(
    /// `cuStreamBeginCapture(CUstream)` (v1, CUDA 10.0: global mode).
    cuStreamBeginCapture, BeginCapture, begin_capture, (stream: CuHandle)
);
capture_hook!(
    /// `cuStreamBeginCapture_ptsz(CUstream)`.
    cuStreamBeginCapture_ptsz, BeginCapturePtsz, begin_capture, (stream: CuHandle)
);
capture_hook!(
    /// `cuStreamBeginCapture_v2(CUstream, CUstreamCaptureMode)`.
    cuStreamBeginCapture_v2, BeginCaptureV2, begin_capture,
    (stream: CuHandle, mode: c_int)
);
capture_hook!(
    /// `cuStreamBeginCapture_v2_ptsz(CUstream, CUstreamCaptureMode)`.
    cuStreamBeginCapture_v2_ptsz, BeginCaptureV2Ptsz, begin_capture,
    (stream: CuHandle, mode: c_int)
);
capture_hook!(
    /// `cuStreamBeginCaptureToGraph(CUstream, CUgraph, const CUgraphNode *, const
    /// CUgraphEdgeData *, size_t, CUstreamCaptureMode)` (CUDA 12.3).
    cuStreamBeginCaptureToGraph, BeginCaptureToGraph, begin_capture,
    (stream: CuHandle, graph: CuHandle, dependencies: *const c_void, edge_data: *const c_void,
     count: usize, mode: c_int)
);
capture_hook!(
    /// `cuStreamBeginCaptureToGraph_ptsz`.
    cuStreamBeginCaptureToGraph_ptsz, BeginCaptureToGraphPtsz, begin_capture,
    (stream: CuHandle, graph: CuHandle, dependencies: *const c_void, edge_data: *const c_void,
     count: usize, mode: c_int)
);
capture_hook!(
    /// `cuStreamEndCapture(CUstream, CUgraph *)`.
    cuStreamEndCapture, EndCapture, end_capture, (stream: CuHandle, graph: *mut CuHandle)
);
capture_hook!(
    /// `cuStreamEndCapture_ptsz(CUstream, CUgraph *)`.
    cuStreamEndCapture_ptsz, EndCapturePtsz, end_capture,
    (stream: CuHandle, graph: *mut CuHandle)
);
