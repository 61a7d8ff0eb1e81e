//! What reading the statistics costs on the host backend, with the VMM arena on: the
//! statistics (`cupool_stats`, which `cupool.stats()` and, through `cupool.torch.enable()`,
//! `torch.cuda.memory_stats()` and `memory_allocated()` read) and the footprint
//! (`cupool_footprint_json`), with a pool shaped like a training loop's: large and small
//! blocks live, others freed, so the shared index holds free blocks in the mapped part of
//! the arena and the unmapped rest of its reserved range. Medians of 201 reads, µs.
//!
//! ```sh
//! cargo run --release --example stats_cost
//! ```
//!
//! Programs log memory figures every step; a read that walks the arena's whole reserved
//! range (1 TiB, 2^19 granules of 2 MiB) costs them a millisecond each time.

use cupool::stats::CupoolStats;
use std::time::Instant;

const READS: usize = 201;
const MIB: usize = 1 << 20;

fn main() {
    cupool::config::set("backend", "host").expect("host backend");
    cupool::config::set("vmm", "on").expect("vmm option");
    let rt = cupool::runtime::runtime().expect("runtime on the host backend");
    // 96 large blocks of 3..98 MiB and 512 small ones; every other one freed.
    let mut live = Vec::new();
    for i in 0..96 {
        live.push(rt.alloc((3 + i) * MIB + 4096 * i).expect("large alloc"));
    }
    for i in 0..512 {
        live.push(rt.alloc(512 + 64 * i).expect("small alloc"));
    }
    for p in live.iter().step_by(2) {
        rt.free(*p).expect("free");
    }
    let median_us = |f: &mut dyn FnMut()| {
        let mut t: Vec<f64> = (0..READS)
            .map(|_| {
                let s = Instant::now();
                f();
                s.elapsed().as_nanos() as f64 / 1e3
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[READS / 2]
    };
    let mut stats = CupoolStats::new();
    let stats_us = median_us(&mut || {
        stats = rt.stats(None).expect("stats");
    });
    let mut buf = vec![0u8; 1 << 16];
    let mut needed = 0usize;
    let footprint_us = median_us(&mut || {
        // SAFETY: `buf` is valid for its length; `needed` for a write.
        let rc = unsafe {
            cupool::ffi::device::cupool_footprint_json(
                -1,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut needed,
            )
        };
        assert_eq!(rc, cupool::CupoolStatus::CupoolOk);
    });
    println!(
        "reserved {} MiB, allocated {} MiB: statistics {stats_us:.1} µs, footprint {footprint_us:.1} µs a read",
        stats.reserved_bytes.current >> 20,
        stats.allocated_bytes.current >> 20
    );
    for p in live.iter().skip(1).step_by(2) {
        rt.free(*p).expect("free");
    }
}
