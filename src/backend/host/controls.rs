//! The tests' and the replay's controls of the host backend: events held in flight and
//! completed on demand, a simulated device running behind the program, captures, and the
//! counters tests read.

use super::{HostBackend, HostCounters, State};
use crate::backend::ContextId;
use core::sync::atomic::Ordering;

impl HostBackend {
    /// Holds the events of `ctx` in flight until [`HostBackend::complete_all`] (or a wait)
    /// completes them, whatever `host_auto_complete` says.
    pub fn set_manual_completion(&self, ctx: ContextId, manual: bool) {
        let mut s = self.state.lock();
        if manual {
            s.manual.insert(ctx.0);
        } else {
            s.manual.remove(&ctx.0);
        }
        self.count_special(&s);
    }

    /// Makes the simulated device of `ctx` run `lag_us` microseconds behind the program
    /// (0: events complete when recorded, as usual): a trace replay's model of a GPU that
    /// is behind the CPU. Time moves with [`HostBackend::set_time`].
    pub fn set_lag(&self, ctx: ContextId, lag_us: u64) {
        let mut s = self.state.lock();
        if lag_us == 0 {
            s.lagging.remove(&ctx.0);
        } else {
            s.lagging.insert(ctx.0, (lag_us, 0));
        }
        self.count_special(&s);
    }

    /// Moves the simulated time of a lagging context to `now_us`: its events due by then
    /// complete.
    pub fn set_time(&self, ctx: ContextId, now_us: u64) {
        let mut s = self.state.lock();
        let Some(entry) = s.lagging.get_mut(&ctx.0) else {
            return;
        };
        entry.1 = entry.1.max(now_us);
        let now = entry.1;
        let State { events, due, .. } = &mut *s;
        for (id, (c, done)) in events.iter_mut() {
            if *c == ctx.0 && !*done && due.get(id).is_some_and(|&d| d <= now) {
                *done = true;
            }
        }
    }

    /// Simulated microseconds spent waiting for lagging contexts' events (the stalls a
    /// replay's waits would have cost on the device).
    pub fn waited_us(&self) -> u64 {
        self.state.lock().waited_us
    }

    /// Completes all work recorded so far in `ctx`.
    pub fn complete_all(&self, ctx: ContextId) {
        let mut s = self.state.lock();
        for (c, done) in s.events.values_mut() {
            if *c == ctx.0 {
                *done = true;
            }
        }
    }

    /// Completes the `n` oldest events of `ctx` still in flight, as a device that has run
    /// only part of the context's work.
    pub fn complete_oldest(&self, ctx: ContextId, n: usize) {
        let mut s = self.state.lock();
        let mut pending: Vec<u64> = s
            .events
            .iter()
            .filter(|(_, (c, done))| *c == ctx.0 && !done)
            .map(|(&id, _)| id)
            .collect();
        pending.sort_unstable();
        for id in pending.into_iter().take(n) {
            if let Some(e) = s.events.get_mut(&id) {
                e.1 = true;
            }
        }
    }

    /// Completion queries answered so far for events of `ctx`.
    pub fn queries(&self, ctx: ContextId) -> u64 {
        self.state.lock().queries.get(&ctx.0).copied().unwrap_or(0)
    }

    /// Events recorded and not yet completed in `ctx`.
    pub fn in_flight(&self, ctx: ContextId) -> usize {
        self.state
            .lock()
            .events
            .values()
            .filter(|(c, d)| *c == ctx.0 && !d)
            .count()
    }

    /// Simulates a stream capture in progress in `ctx` that the pool was not told about
    /// (the API library alone has no capture hooks): context fences of `ctx` fail with
    /// [`BackendError::Capturing`](crate::backend::BackendError::Capturing) while it is on, as the CUDA backend's probe makes them.
    pub fn set_capturing(&self, ctx: ContextId, on: bool) {
        let mut s = self.state.lock();
        if on {
            s.capturing.insert(ctx.0);
        } else {
            s.capturing.remove(&ctx.0);
        }
        self.count_special(&s);
    }

    pub fn counters(&self) -> HostCounters {
        let s = self.state.lock();
        HostCounters {
            allocs: s.allocs,
            releases: s.releases,
            fences_recorded: s.fences_recorded
                + self
                    .done_fences
                    .iter()
                    .map(|c| c.load(Ordering::Relaxed))
                    .sum::<u64>(),
            device_waits: s.device_waits,
            stream_waits: s.stream_waits,
            live_bytes: s.live_bytes.iter().sum(),
            vmm_ranges: s.vmm.ranges.len() as u64,
            vmm_handles: s.vmm.handles.len() as u64,
            vmm_mappings: s.vmm.mappings.len() as u64,
            vmm_creates: s.vmm.creates,
            vmm_releases: s.vmm.releases,
            vmm_maps: s.vmm.maps,
            vmm_unmaps: s.vmm.unmaps,
        }
    }
}
