//! Peer-access hooks: memory the pool maps through CUDA virtual memory management (the VMM
//! arena, `vmm:on`) is reachable only by the devices `cuMemSetAccess` names; the driver's
//! peer access (`cuCtxEnablePeerAccess`, what `cudaDeviceEnablePeerAccess` becomes) does
//! not extend to it. So a successful enable is reported to the pool, which grants the
//! calling context's device access to every granule the peer context's pool has mapped
//! and will map (`Runtime::peer_access_enabled`); a successful disable stops the grants
//! for later maps. Segments from `cuMemAlloc` need nothing: the driver covers them.
//!
//! The real call comes first and its result is returned unchanged; the pool is told only
//! on success. The pool is started if it has not been (programs enable peer access before
//! they allocate): starting it makes no allocation.

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::real;
use crate::slots::sig;
use core::ffi::c_uint;
use cupool::backend::ContextId;

/// `cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: CuHandle, flags: c_uint) -> CuResult {
    cuda_call("cuCtxEnablePeerAccess", || {
        // SAFETY: the slot holds the real cuCtxEnablePeerAccess.
        let Some(real) = real::get::<sig::CtxEnablePeerAccess>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: arguments forwarded unchanged.
        let rc = unsafe { real(peer, flags) };
        if rc == CUDA_SUCCESS && !peer.is_null() && !lifecycle::exiting() {
            if let Some(rt) = lifecycle::runtime() {
                if let Err(status) = rt.peer_access_enabled(ContextId(peer as u64)) {
                    cupool::log::warn(&format!(
                        "cupool: pool blocks may not be reachable from the peer device: {}",
                        status.as_str()
                    ));
                }
            }
        }
        rc
    })
}

/// `cuCtxDisablePeerAccess(CUcontext peerContext)`.
#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: CuHandle) -> CuResult {
    cuda_call("cuCtxDisablePeerAccess", || {
        // SAFETY: the slot holds the real cuCtxDisablePeerAccess.
        let Some(real) = real::get::<sig::CtxDisablePeerAccess>() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: argument forwarded unchanged.
        let rc = unsafe { real(peer) };
        if rc == CUDA_SUCCESS && !peer.is_null() {
            if let Some(rt) = lifecycle::runtime_if_started() {
                let _ = rt.peer_access_disabled(ContextId(peer as u64));
            }
        }
        rc
    })
}
