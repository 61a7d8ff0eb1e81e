//! What a cached alloc+free pair costs on the host backend (the pool's own CPU work, no
//! driver calls), by size and path, with the VMM arena on and off: stream-ordered pairs on
//! one stream and streamless pairs, 200 000 a round, 7 rounds, medians.
//!
//! ```sh
//! cargo run --release --example pair_cost [on|off]...   # default: on off
//! ```
//!
//! Each mode runs in its own process (the arena mode is read when a pool starts), so the
//! example runs itself once per mode. `PAIR_ONLY=SIZE:ordered` (or `SIZE:streamless`) runs
//! that one loop, for a profiler.

use std::process::Command;
use std::time::Instant;

const SIZES: [usize; 4] = [512, 1 << 20, 4 << 20, 64 << 20];
const PAIRS: usize = 200_000;
const ROUNDS: usize = 7;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, mode] = &args[..] {
        if flag == "--child" {
            return child(mode);
        }
    }
    let modes = if args.is_empty() {
        vec!["on".to_string(), "off".to_string()]
    } else {
        args
    };
    let me = std::env::current_exe().expect("own path");
    for mode in modes {
        if mode != "on" && mode != "off" {
            eprintln!("pair_cost: modes are `on` and `off`, not `{mode}`");
            std::process::exit(2);
        }
        let status = Command::new(&me)
            .args(["--child", &mode])
            .status()
            .expect("runs itself");
        if !status.success() {
            std::process::exit(1);
        }
    }
}

fn child(mode: &str) {
    cupool::config::set("backend", "host").expect("host backend");
    cupool::config::set("vmm", mode).expect("vmm option");
    let rt = cupool::runtime::runtime().expect("runtime on the host backend");
    let only: Option<(usize, bool)> = std::env::var("PAIR_ONLY").ok().map(|v| {
        let (a, b) = v.split_once(':').unwrap();
        (a.parse().unwrap(), b == "streamless")
    });
    for size in SIZES {
        for streamless in [false, true] {
            if only.is_some_and(|o| o != (size, streamless)) {
                continue;
            }
            let mut rounds: Vec<f64> = (0..ROUNDS)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..PAIRS {
                        if streamless {
                            let p = rt.alloc(size).expect("alloc");
                            rt.free(p).expect("free");
                        } else {
                            let p = rt.alloc_async(size, 0x1000).expect("alloc_async");
                            rt.free_async(p, 0x1000).expect("free_async");
                        }
                    }
                    t.elapsed().as_nanos() as f64 / PAIRS as f64
                })
                .collect();
            rounds.sort_by(f64::total_cmp);
            println!(
                "vmm:{mode:<3} {size:>9} B {:<14} {:7.1} ns per pair",
                if streamless {
                    "streamless"
                } else {
                    "stream-ordered"
                },
                rounds[ROUNDS / 2]
            );
        }
    }
}
