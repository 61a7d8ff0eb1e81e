//! What the interposer and the C API report to the pools: stream captures (no fence,
//! sync or release may run inside one) and peer access (arena memory mapped later must
//! reach the peer too).

use super::{Runtime, INTERPOSER_REPORTS_CAPTURES};
use crate::backend::ContextId;
use crate::pool::{self, DevicePool};
use crate::status::{CupoolStatus, Result};
use core::sync::atomic::Ordering;

impl Runtime {
    /// The caller (the interposer) reports every stream capture through
    /// [`Runtime::capture_begin`] and [`Runtime::capture_end`]; the backend may then skip
    /// its own driver probe for captures before each context fence.
    pub fn captures_reported_by_caller(&self) {
        self.backend.captures_reported_by_caller();
    }

    /// From the interposer's load-time constructor (an atomic store only): its hooks will
    /// report every capture of the process, so the pool started later, by a hook or by a
    /// call of the C API, skips the driver probe from its first fence.
    ///
    /// Note [captures seen by hooks]: the interposer told a running pool so at the first
    /// hook that reached it. A program that reached the pool only through the C API (the
    /// interposer's own exports, or a linked libcupool forwarding to them) never ran such a
    /// hook, so each of its context fences asked `cuStreamIsCapturing` as well (the fake
    /// driver's call log of 1200 pinned pairs: 864 fences, 864 probes). Its captures pass
    /// through the hooks all the same (the CUDA runtime reaches `cuStreamBeginCapture`
    /// through the hooked `cuGetProcAddress`).
    pub fn interposer_reports_captures() {
        INTERPOSER_REPORTS_CAPTURES.store(true, Ordering::Relaxed);
    }

    /// A stream capture began in `ctx`: until the matching end, no fence, synchronisation
    /// or release is made there, and a miss fails with `CupoolErrorStreamCapture`.
    pub fn capture_begin(&self, ctx: ContextId) {
        if let Some(p) = self.pool_by_context(ctx) {
            p.capture_begin();
        }
    }

    pub fn capture_end(&self, ctx: ContextId) {
        if let Some(p) = self.pool_by_context(ctx) {
            p.capture_end();
        }
    }

    /// [`Runtime::capture_begin`] for the calling thread's current context (the C API's
    /// `cupool_capture_begin`): its pool is made now if it had none, so that the capture
    /// is not missed.
    pub fn capture_begin_current(&self) -> Result<()> {
        let ctx = self.backend.current_context().map_err(CupoolStatus::from)?;
        self.context_pool(ctx)?.capture_begin();
        Ok(())
    }

    /// [`Runtime::capture_end`] for the calling thread's current context.
    pub fn capture_end_current(&self) -> Result<()> {
        let ctx = self.backend.current_context().map_err(CupoolStatus::from)?;
        self.capture_end(ctx.id);
        Ok(())
    }

    /// The calling thread's current context was given peer access to `peer`'s memory
    /// (`cuCtxEnablePeerAccess(peer)` succeeded): blocks of `peer`'s pool that are backed by
    /// VMM granules become reachable from the caller's device, those mapped already and
    /// those mapped later. (Segments from `cuMemAlloc` need nothing: the driver's peer
    /// access covers them.)
    pub fn peer_access_enabled(&self, peer: ContextId) -> Result<()> {
        let caller = self
            .existing_context()?
            .ok_or(CupoolStatus::CupoolErrorInvalidValue)?;
        if caller.id == peer {
            return Ok(());
        }
        // Note [device waits]: the caller's work is not ordered by the peer's legacy stream.
        pool::device_waits::end("peer access enabled");
        // Recorded first: a map from now on grants the caller's device itself, and one
        // made before is granted below (maps and grants are serialised per pool).
        self.backend.set_peer_access(peer, caller.device, true);
        if let Some(p) = pool::all_pools().find(|p| p.ctx.id == peer) {
            if p.grant_mapped_to(caller.device) > 0 {
                return Err(CupoolStatus::CupoolErrorCuda);
            }
        }
        Ok(())
    }

    /// The calling thread's current context lost peer access to `peer`
    /// (`cuCtxDisablePeerAccess(peer)` succeeded): later maps no longer grant the caller's
    /// device access; what was granted stays.
    pub fn peer_access_disabled(&self, peer: ContextId) -> Result<()> {
        let caller = self
            .existing_context()?
            .ok_or(CupoolStatus::CupoolErrorInvalidValue)?;
        if caller.id != peer {
            self.backend.set_peer_access(peer, caller.device, false);
        }
        Ok(())
    }

    fn pool_by_context(&self, ctx: ContextId) -> Option<&'static DevicePool> {
        if let Some(p) = pool::all_pools().find(|p| p.ctx.id == ctx) {
            return Some(p);
        }
        let cur = self.backend.current_context().ok()?;
        (cur.id == ctx).then(|| self.pool_of(cur).ok()).flatten()
    }
}
