//! What recording costs per event: stream-ordered alloc+free pairs on the host backend
//! (thread-cache hits, the pool's fastest path) with tracing off, to a plain CSV and to a
//! `.csv.zst`, several rounds each, interleaved.
//!
//! ```sh
//! cargo run --release --example trace_cost [PAIRS_PER_ROUND] [ROUNDS] [SUSTAINED_PAIRS]
//! ```
//!
//! Prints, medians over rounds:
//! - per mode, the cost per event seen by the allocating thread: ns per pair with tracing
//!   on minus off, over two events per pair. A round's events fit in the writer's queue
//!   (`record::MAX_QUEUED` buffers), so this is what a program pays while the writer
//!   thread keeps up: the append, and once per buffer the hand-over.
//! - per mode, the CPU time per event spent making rows, compressing and writing
//!   (`record::time_spent_writing`), done by the writer thread (and by `stop`, for the
//!   last partial buffer), not by the allocating thread.
//! - sustained: the same with a round of SUSTAINED_PAIRS pairs, far more than the queue
//!   holds: the allocating thread then runs at the writer's pace (it writes the oldest
//!   batch itself whenever the queue is full), so the cost per event is about the writing
//!   time per event.
//! - the append alone (tracing on, no buffer fills).

use cupool::runtime::{runtime, Runtime};
use cupool::trace::record;
use std::path::PathBuf;
use std::time::Instant;

const STREAM: usize = 0x1000;
const SIZE: usize = 4096;

#[derive(Copy, Clone, PartialEq)]
enum Mode {
    Off,
    Plain,
    Zstd,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Plain => "csv",
            Mode::Zstd => "csv.zst",
        }
    }
}

/// One round: `pairs` alloc+free pairs; returns (ns per pair on the allocating thread,
/// writing CPU ns per pair). The trace is stopped (the rest written) outside the timed part
/// but inside the writing time.
fn round(rt: &Runtime, mode: Mode, pairs: usize, dir: &std::path::Path) -> (f64, f64) {
    let path: PathBuf = dir.join(format!("cost.{}", mode.name()));
    if mode != Mode::Off {
        record::start(path.to_str().unwrap()).expect("trace starts");
    }
    let writing_before = record::time_spent_writing();
    let t = Instant::now();
    for _ in 0..pairs {
        let p = rt.alloc_async(SIZE, STREAM).unwrap();
        rt.free_async(p, STREAM).unwrap();
    }
    let elapsed = t.elapsed();
    record::stop();
    let writing = record::time_spent_writing() - writing_before;
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(record::driver_path(path.to_str().unwrap()));
    (
        elapsed.as_nanos() as f64 / pairs as f64,
        writing.as_nanos() as f64 / pairs as f64,
    )
}

/// The append alone: tracing on, but rounds short enough that no buffer fills (what is
/// left is written at stop, outside the timed part). Returns ns per pair.
fn append_only(rt: &Runtime, pairs: usize, dir: &std::path::Path) -> f64 {
    let path = dir.join("append.csv");
    let short = record::BUFFER_RECORDS / 2 - 8;
    let mut timed = std::time::Duration::ZERO;
    for _ in 0..pairs.div_ceil(short) {
        record::start(path.to_str().unwrap()).expect("trace starts");
        // The first call after a start empties what the previous stop left written.
        let p = rt.alloc_async(SIZE, STREAM).unwrap();
        rt.free_async(p, STREAM).unwrap();
        let t = Instant::now();
        for _ in 0..short - 1 {
            let p = rt.alloc_async(SIZE, STREAM).unwrap();
            rt.free_async(p, STREAM).unwrap();
        }
        timed += t.elapsed();
        record::stop();
    }
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(record::driver_path(path.to_str().unwrap()));
    timed.as_nanos() as f64 / (pairs.div_ceil(short) * (short - 1)) as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut arg = |default: usize| args.next().and_then(|a| a.parse().ok()).unwrap_or(default);
    // Events of a round fit in the writer's queue (MAX_QUEUED buffers).
    let pairs = arg(record::MAX_QUEUED * record::BUFFER_RECORDS / 2 * 3 / 4);
    let rounds = arg(15);
    let sustained_pairs = arg(1_000_000);
    cupool::config::set("backend", "host").expect("host backend");
    let rt = runtime().expect("the host backend starts");
    let dir = std::env::temp_dir().join(format!("cupool-trace-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    // Warm the pool, the thread cache, this thread's trace buffer and the spare blocks.
    round(rt, Mode::Off, pairs / 10, &dir);
    round(rt, Mode::Plain, pairs, &dir);

    let modes = [Mode::Off, Mode::Plain, Mode::Zstd];
    let mut per_pair = [const { Vec::new() }; 3];
    // Per round, against that round's `off`: added ns per event on the allocating thread,
    // and writing CPU ns per event.
    let mut added = [const { Vec::new() }; 3];
    let mut writing = [const { Vec::new() }; 3];
    let mut off_short = Vec::new();
    let mut append = Vec::new();
    for _ in 0..rounds {
        let mut off = 0.0;
        for (i, &mode) in modes.iter().enumerate() {
            let (ns, w) = round(rt, mode, pairs, &dir);
            if mode == Mode::Off {
                off = ns;
            }
            per_pair[i].push(ns);
            added[i].push((ns - off) / 2.0);
            writing[i].push(w / 2.0);
        }
        // Off and append-only in the same short-loop shape, side by side.
        let (off_ns, _) = round(rt, Mode::Off, pairs / 4, &dir);
        let on_ns = append_only(rt, pairs / 4, &dir);
        off_short.push(off_ns);
        append.push((on_ns - off_ns) / 2.0);
    }
    let sustained_rounds = 3;
    let mut sustained = [const { Vec::new() }; 3];
    let mut sustained_writing = [const { Vec::new() }; 3];
    for _ in 0..sustained_rounds {
        let mut off = 0.0;
        for (i, &mode) in modes.iter().enumerate() {
            let (ns, w) = round(rt, mode, sustained_pairs, &dir);
            if mode == Mode::Off {
                off = ns;
            }
            sustained[i].push((ns - off) / 2.0);
            sustained_writing[i].push(w / 2.0);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "trace_cost: {pairs} stream-ordered alloc+free pairs of {SIZE} B per round \
         ({} events, within the writer's queue of {} buffers), {rounds} rounds, host backend; \
         medians over rounds",
        2 * pairs,
        record::MAX_QUEUED
    );
    println!("{:<8} {:>8.1} ns/pair", "off", median(&mut per_pair[0]));
    for i in 1..modes.len() {
        println!(
            "{:<8} {:>8.1} ns/pair   allocating thread: +{:>5.1} ns/event   writer (rows, zstd, \
             write): {:>6.1} ns CPU/event",
            modes[i].name(),
            median(&mut per_pair[i]),
            median(&mut added[i]),
            median(&mut writing[i]),
        );
    }
    println!(
        "append alone (no buffer fills): added {:.1} ns/event over off ({:.1} ns/pair)",
        median(&mut append),
        median(&mut off_short)
    );
    println!(
        "sustained ({sustained_pairs} pairs a round, {sustained_rounds} rounds: the queue fills, \
         the program runs at the writer's pace):"
    );
    for i in 1..modes.len() {
        println!(
            "{:<8} allocating thread: +{:>6.1} ns/event   writing: {:>6.1} ns CPU/event",
            modes[i].name(),
            median(&mut sustained[i]),
            median(&mut sustained_writing[i]),
        );
    }
}
