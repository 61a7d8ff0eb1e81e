//! Streamless alloc+free pairs (the path of `cupool_free` and of every `cudaFree` under the
//! preload) from one thread on device 0, then from one thread per device, on the host
//! backend's simulated devices: each thread works in its own device's pool, so anything the
//! threads still share shows as lost scaling. The loop of `benches/c/streamless_scaling.c`
//! (8 sizes from 512 B to 256 KiB, each freed one iteration later).
//!
//! ```sh
//! cargo run --release --example devices_scaling [PAIRS] [ROUNDS] [DEVICES]
//! ```
//!
//! Prints pairs per second (median of ROUNDS) and the ratio; on two GPUs the same pairs
//! went from 4.3–5.4 M/s to 2.5–3.0 M/s (docs/BENCHMARKS.md).

mod support;

use cupool::backend::ContextInfo;
use cupool::runtime::{runtime, Runtime};
use std::time::Instant;
use support::median;

const SIZES: [usize; 8] = [512, 1024, 4096, 8192, 16384, 65536, 131072, 262144];

fn worker(rt: &Runtime, pairs: u64) {
    let mut live = [0u64; 8];
    for i in 0..pairs {
        let k = (i & 7) as usize;
        if live[k] != 0 {
            rt.free(live[k]).expect("free");
        }
        live[k] = rt.alloc(SIZES[k]).expect("alloc");
    }
    for p in live {
        if p != 0 {
            rt.free(p).expect("free");
        }
    }
}

fn rate(rt: &'static Runtime, ctxs: &[ContextInfo], pairs: u64) -> f64 {
    let host = rt.host_backend().expect("host backend");
    let start = Instant::now();
    let threads: Vec<_> = ctxs
        .iter()
        .map(|&ctx| {
            std::thread::spawn(move || {
                host.make_current(ctx);
                worker(rt, pairs);
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker");
    }
    (pairs * ctxs.len() as u64) as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let arg = |i: usize, d: u64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (pairs, rounds, devices) = (arg(1, 400_000), arg(2, 7), arg(3, 2));
    cupool::config::set("backend", "host").expect("host backend");
    let rt = runtime().expect("runtime on the host backend");
    let host = rt.host_backend().expect("host backend");
    let ctxs: Vec<ContextInfo> = (0..devices as i32)
        .map(|d| host.create_context(d))
        .collect();
    rate(rt, &ctxs, pairs / 10); // warm every pool
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        one.push(rate(rt, &ctxs[..1], pairs));
        all.push(rate(rt, &ctxs, pairs));
    }
    let (one, all) = (median(one), median(all));
    println!(
        "streamless pairs/s, host backend: 1 thread on device 0 {:.2} M, 1 thread per device on {} devices {:.2} M ({:.2}x)",
        one / 1e6,
        devices,
        all / 1e6,
        all / one
    );
}
