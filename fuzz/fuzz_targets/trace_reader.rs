//! The trace readers: any bytes as an RMM log CSV, a driver-events CSV and a PyTorch
//! snapshot pickle. A bad input gets an error with its position, never a panic; a trace
//! that reads and is consistent replays on the host backend (its first 300 events).
#![no_main]

use cupool::trace::{replay, rmm_csv, snapshot};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        cupool::config::set("backend", "host").expect("host backend");
        // Fuzzed traces ask for any size: keep the simulated device small.
        cupool::config::set("memory_limit", "256M").expect("limit");
    });
    let _ = rmm_csv::read_driver(data);
    let _ = snapshot::read(data);
    let Ok(trace) = rmm_csv::read(data) else {
        return;
    };
    let Ok(rt) = cupool::runtime::runtime() else {
        return;
    };
    let opts = replay::ReplayOptions {
        max_events: Some(300),
        ..Default::default()
    };
    let _ = replay::replay(rt, &trace, &opts, &mut |_| {});
});
