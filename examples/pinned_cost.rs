//! What a cached pinned alloc+free pair costs on the host backend: the pinned pool's own
//! CPU work, with the driver's calls simulated (a context fence recorded at each
//! streamless free and polled at the next allocation, as on a GPU; there they add about
//! 0.66 µs, docs/BENCHMARKS.md). Streamless pairs (`host_alloc` + `host_free`) and
//! stream-ordered pairs on one stream, by size, 100 000 a round, 7 rounds, medians.
//!
//! ```sh
//! cargo run --release --example pinned_cost [SIZE...]   # default: 512 65536 1048576 67108864
//! ```
//!
//! `PINNED_ONLY=SIZE:streamless` (or `SIZE:ordered`) runs that one loop, for a profiler.

mod support;

use std::time::Instant;
use support::{median, numbers_or};

const PAIRS: usize = 100_000;
const ROUNDS: usize = 7;
const STREAM: usize = 0x1000;

fn main() {
    let sizes = numbers_or(
        "pinned_cost",
        "sizes (bytes)",
        &[512, 64 << 10, 1 << 20, 64 << 20],
    );
    let only: Option<(usize, bool)> = std::env::var("PINNED_ONLY").ok().and_then(|v| {
        let (size, path) = v.split_once(':')?;
        Some((size.parse().ok()?, path == "streamless"))
    });
    cupool::config::set("backend", "host").expect("host backend");
    let rt = cupool::runtime::runtime().expect("runtime on the host backend");
    for size in sizes {
        for streamless in [true, false] {
            if only.is_some_and(|o| o != (size, streamless)) {
                continue;
            }
            let pair = || {
                if streamless {
                    let p = rt.host_alloc(size).expect("host_alloc");
                    rt.host_free(p).expect("host_free");
                } else {
                    let p = rt.host_alloc_async(size, STREAM).expect("host_alloc_async");
                    rt.host_free_async(p, STREAM).expect("host_free_async");
                }
            };
            for _ in 0..PAIRS / 10 {
                pair();
            }
            let ns: Vec<f64> = (0..ROUNDS)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..PAIRS {
                        pair();
                    }
                    t.elapsed().as_nanos() as f64 / PAIRS as f64
                })
                .collect();
            let path = if streamless {
                "streamless"
            } else {
                "stream-ordered"
            };
            println!("{size:>9} B {path:<15} {:7.1} ns per pair", median(ns));
        }
    }
    rt.empty_cache(None).ok();
}
