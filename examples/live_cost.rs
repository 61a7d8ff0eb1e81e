//! What a cached pair costs on the host backend with N blocks live: the pool's own CPU work
//! (no driver calls) as the live set outgrows the CPU caches. The loop is the GPU
//! benchmark's (`gpu/bench_common.h`, `live_blocks`): N blocks of 256 B – 64 KiB stay live;
//! each step frees a random one and allocates a new random size in its place,
//! stream-ordered on one stream. 20 000 steps a round, 11 rounds, medians; the program's
//! own loop (the random numbers and the live array) is timed alone and subtracted.
//!
//! ```sh
//! cargo run --release --example live_cost [N...]   # default: 10 1000 100000
//! ```

mod support;

use std::time::Instant;
use support::{median, numbers_or};

const STEPS: usize = 20_000;
const ROUNDS: usize = 11;
const STREAM: usize = 0x1000;

/// The GPU benchmark's generator (a 64-bit LCG), so both loops draw alike.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn size_between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.next() as usize % (hi - lo + 1)
    }
}

fn main() {
    let counts = numbers_or("live_cost", "live counts", &[10, 1000, 100_000]);
    cupool::config::set("backend", "host").expect("host backend");
    let rt = cupool::runtime::runtime().expect("runtime on the host backend");
    for n in counts {
        let mut rng = Lcg(42);
        let mut live: Vec<u64> = (0..n)
            .map(|_| {
                rt.alloc_async(rng.size_between(256, 64 << 10), STREAM)
                    .expect("prefill")
            })
            .collect();
        let step = |rng: &mut Lcg, live: &mut Vec<u64>| {
            let k = rng.next() as usize % live.len();
            rt.free_async(live[k], STREAM).expect("free_async");
            live[k] = rt
                .alloc_async(rng.size_between(256, 64 << 10), STREAM)
                .expect("alloc_async");
        };
        for _ in 0..STEPS {
            step(&mut rng, &mut live);
        }
        let pool: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..STEPS {
                    step(&mut rng, &mut live);
                }
                t.elapsed().as_nanos() as f64 / STEPS as f64
            })
            .collect();
        // The same loop without the pool: the random index, the size and the array write.
        let mut shadow = vec![0u64; n];
        let bare: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..STEPS {
                    let k = rng.next() as usize % shadow.len();
                    shadow[k] = std::hint::black_box(rng.size_between(256, 64 << 10) as u64);
                }
                t.elapsed().as_nanos() as f64 / STEPS as f64
            })
            .collect();
        for p in live {
            rt.free_async(p, STREAM).expect("free_async");
        }
        let (pool, bare) = (median(pool), median(bare));
        println!("{n:>7} live: {pool:6.1} ns per pair ({bare:.1} ns of it the loop's own)");
    }
}
