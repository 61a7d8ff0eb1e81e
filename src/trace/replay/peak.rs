//! Where the reserved bytes were at the replay's peak (Note [footprint parts] in
//! `src/pool/footprint.rs`): taken after every event that left the pool's reserved bytes
//! higher than any event before it.

use super::Replayer;
use crate::pool::{DevicePool, Footprint};

/// The pool's footprint after the event that left its reserved bytes highest.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FootprintAtPeak {
    /// Events replayed when it was taken (0: after the trace's prelude).
    pub events: usize,
    pub footprint: Footprint,
}

impl Replayer<'_> {
    /// Takes the footprint when the pool's reserved bytes are the highest so far (one
    /// lock and a read per event; the walk of the free lists only at a new high).
    pub(super) fn watch_peak(&mut self, pool: &DevicePool, events: usize) {
        let reserved = pool.reserved();
        if reserved > self.at_peak.map_or(0, |p| p.footprint.reserved) {
            self.at_peak = Some(FootprintAtPeak {
                events,
                footprint: pool.footprint(),
            });
        }
    }
}
