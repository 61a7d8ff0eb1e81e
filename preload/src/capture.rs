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
use crate::real::{self, typed};
use crate::table::Slot;
use core::ffi::{c_int, c_void};
use cupool::backend::ContextId;

type BeginV1Fn = unsafe extern "C" fn(CuHandle) -> CuResult;
type BeginV2Fn = unsafe extern "C" fn(CuHandle, c_int) -> CuResult;
type BeginToGraphFn = unsafe extern "C" fn(
    CuHandle,
    CuHandle,
    *const c_void,
    *const c_void,
    usize,
    c_int,
) -> CuResult;
type EndFn = unsafe extern "C" fn(CuHandle, *mut CuHandle) -> CuResult;

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

/// `cuStreamBeginCapture(CUstream)` (v1, CUDA 10.0: global mode).
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture(stream: CuHandle) -> CuResult {
    cuda_call("cuStreamBeginCapture", || {
        // SAFETY: the slot's exported function has this signature; arguments unchanged.
        let Some(real) = (unsafe { typed::<BeginV1Fn>(Slot::BeginCapture) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream) })
    })
}

/// `cuStreamBeginCapture_ptsz(CUstream)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_ptsz(stream: CuHandle) -> CuResult {
    cuda_call("cuStreamBeginCapture_ptsz", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<BeginV1Fn>(Slot::BeginCapturePtsz) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream) })
    })
}

/// `cuStreamBeginCapture_v2(CUstream, CUstreamCaptureMode)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: CuHandle, mode: c_int) -> CuResult {
    cuda_call("cuStreamBeginCapture_v2", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<BeginV2Fn>(Slot::BeginCaptureV2) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream, mode) })
    })
}

/// `cuStreamBeginCapture_v2_ptsz(CUstream, CUstreamCaptureMode)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCapture_v2_ptsz(stream: CuHandle, mode: c_int) -> CuResult {
    cuda_call("cuStreamBeginCapture_v2_ptsz", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<BeginV2Fn>(Slot::BeginCaptureV2Ptsz) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream, mode) })
    })
}

/// `cuStreamBeginCaptureToGraph(CUstream, CUgraph, const CUgraphNode *, const
/// CUgraphEdgeData *, size_t, CUstreamCaptureMode)` (CUDA 12.3).
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph(
    stream: CuHandle,
    graph: CuHandle,
    dependencies: *const c_void,
    edge_data: *const c_void,
    count: usize,
    mode: c_int,
) -> CuResult {
    cuda_call("cuStreamBeginCaptureToGraph", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<BeginToGraphFn>(Slot::BeginCaptureToGraph) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream, graph, dependencies, edge_data, count, mode) })
    })
}

/// `cuStreamBeginCaptureToGraph_ptsz`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamBeginCaptureToGraph_ptsz(
    stream: CuHandle,
    graph: CuHandle,
    dependencies: *const c_void,
    edge_data: *const c_void,
    count: usize,
    mode: c_int,
) -> CuResult {
    cuda_call("cuStreamBeginCaptureToGraph_ptsz", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<BeginToGraphFn>(Slot::BeginCaptureToGraphPtsz) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        begin_capture(|| unsafe { real(stream, graph, dependencies, edge_data, count, mode) })
    })
}

/// `cuStreamEndCapture(CUstream, CUgraph *)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(stream: CuHandle, graph: *mut CuHandle) -> CuResult {
    cuda_call("cuStreamEndCapture", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<EndFn>(Slot::EndCapture) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        end_capture(|| unsafe { real(stream, graph) })
    })
}

/// `cuStreamEndCapture_ptsz(CUstream, CUgraph *)`.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture_ptsz(
    stream: CuHandle,
    graph: *mut CuHandle,
) -> CuResult {
    cuda_call("cuStreamEndCapture_ptsz", || {
        // SAFETY: as above.
        let Some(real) = (unsafe { typed::<EndFn>(Slot::EndCapturePtsz) }) else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        end_capture(|| unsafe { real(stream, graph) })
    })
}
