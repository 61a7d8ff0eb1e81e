//! Note [fence call times]: what the driver calls that order reuse after frees cost the
//! program, measured where they are made. Under the preload every free is streamless, and
//! a step of the GPT loop records ~130 context fences, queries them ~350 times and makes
//! the legacy stream wait ~85 times (docs/BENCHMARKS.md). What those calls cost depends on
//! the process: a fence query takes ~0.3 µs in a fresh process and ~1.5 µs in one whose
//! non-blocking streams ran work and were synchronised, so the counts alone do not say
//! whether fences matter to a step.
//!
//! Timing every call would add two clock reads (~40 ns) to calls of 0.2–1.5 µs, on paths a
//! pair benchmark measures. So each thread times one call in [`SAMPLE_EVERY`] of each
//! kind, and the pool adds that call's time times [`SAMPLE_EVERY`] to an estimate: over the
//! hundreds of calls of a step the estimate is close, and a call that is not sampled costs
//! a thread-local increment. The estimates appear in `cupool_footprint_json` (`fences`),
//! beside the VMM arena's driver time.

use core::cell::Cell;
use core::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// One call in this many is timed, per thread and kind.
pub const SAMPLE_EVERY: u32 = 8;

/// The kinds of call timed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FenceCall {
    /// A context fence recorded (`cuCtxRecordEvent`).
    Record = 0,
    /// A fence asked whether it completed (`cuEventQuery`).
    Query = 1,
    /// A stream made to wait on the device for a fence (`cuStreamWaitEvent`).
    DeviceWait = 2,
}

const KINDS: usize = 3;

thread_local! {
    /// Calls of each kind this thread made, for the sampling.
    static MADE: [Cell<u32>; KINDS] = const { [const { Cell::new(0) }; KINDS] };
}

/// Estimated time in each kind of call, of one pool.
#[derive(Default)]
pub struct FenceTimes {
    estimated_ns: [AtomicU64; KINDS],
    sampled: [AtomicU64; KINDS],
}

/// Estimates read from a [`FenceTimes`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FenceTimeStats {
    /// Estimated ns in each kind of call, by [`FenceCall`] order.
    pub estimated_ns: [u64; KINDS],
    /// Calls timed of each kind.
    pub sampled: [u64; KINDS],
}

impl FenceTimes {
    pub const fn new() -> Self {
        FenceTimes {
            estimated_ns: [const { AtomicU64::new(0) }; KINDS],
            sampled: [const { AtomicU64::new(0) }; KINDS],
        }
    }

    /// Runs the driver call `f` of kind `call`, timing it if it is this thread's turn.
    #[inline]
    pub fn time<T>(&self, call: FenceCall, f: impl FnOnce() -> T) -> T {
        let k = call as usize;
        // A thread being torn down has no cell: its call goes untimed.
        let turn = MADE
            .try_with(|made| {
                let n = made[k].get().wrapping_add(1);
                made[k].set(n);
                n % SAMPLE_EVERY == 0
            })
            .unwrap_or(false);
        if !turn {
            return f();
        }
        let started = Instant::now();
        let out = f();
        let ns = started.elapsed().as_nanos() as u64;
        self.estimated_ns[k].fetch_add(ns * SAMPLE_EVERY as u64, Relaxed);
        self.sampled[k].fetch_add(1, Relaxed);
        out
    }

    pub fn stats(&self) -> FenceTimeStats {
        FenceTimeStats {
            estimated_ns: core::array::from_fn(|k| self.estimated_ns[k].load(Relaxed)),
            sampled: core::array::from_fn(|k| self.sampled[k].load(Relaxed)),
        }
    }
}

impl FenceTimeStats {
    /// One JSON object: `record_ns`, `query_ns`, `device_wait_ns` (estimates) and the calls
    /// timed of each kind (`…_sampled`), so a program reads what a stretch of its run spent
    /// in fences as the difference of two readings.
    pub fn to_json(&self) -> String {
        use crate::stats::print::json_value;
        let mut out = String::from("{");
        for (k, name) in ["record", "query", "device_wait"].iter().enumerate() {
            json_value(&mut out, &format!("{name}_ns"), self.estimated_ns[k]);
            json_value(&mut out, &format!("{name}_sampled"), self.sampled[k]);
        }
        out.push('}');
        out
    }

    /// One line for the exit summary, `None` when no call was timed.
    pub fn to_line(&self, device: i32) -> Option<String> {
        if self.sampled.iter().all(|&n| n == 0) {
            return None;
        }
        let ms = |k: FenceCall| self.estimated_ns[k as usize] as f64 / 1e6;
        Some(format!(
            "  device {device}: fence calls (estimated from one in {SAMPLE_EVERY}): records {:.1} ms, queries {:.1} ms, device waits {:.1} ms\n",
            ms(FenceCall::Record),
            ms(FenceCall::Query),
            ms(FenceCall::DeviceWait),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_call_in_sample_every_is_timed_and_counted_for_all() {
        let t = FenceTimes::new();
        let calls = 10 * SAMPLE_EVERY;
        for _ in 0..calls {
            let v = t.time(FenceCall::Query, || {
                std::thread::sleep(std::time::Duration::from_micros(50));
                7
            });
            assert_eq!(v, 7, "the call's result comes back");
        }
        let s = t.stats();
        assert_eq!(s.sampled[FenceCall::Query as usize], 10);
        assert_eq!(s.sampled[FenceCall::Record as usize], 0);
        let per_call = s.estimated_ns[FenceCall::Query as usize] / calls as u64;
        assert!(
            per_call >= 50_000,
            "each call slept 50 µs; the estimate says {per_call} ns a call"
        );
        let json = s.to_json();
        assert!(json.contains("\"query_sampled\":10"), "{json}");
        assert!(json.contains("\"record_ns\":0"), "{json}");
        let line = s.to_line(3).expect("calls were timed");
        assert!(line.starts_with("  device 3: fence calls"), "{line}");
        assert!(line.contains("records 0.0 ms"), "{line}");
        assert_eq!(FenceTimes::new().stats().to_line(0), None, "nothing timed");
    }
}
