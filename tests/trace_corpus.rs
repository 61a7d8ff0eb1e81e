//! Every trace of the corpus (`tests/traces/`, recursively; `bad/` and `fixtures/` are the
//! format tests' own) replays on the host backend, and prints one line with its figures.
//!
//! `cargo test` builds without optimisation, where a replay costs several µs per event, so
//! a long trace is cut to its first [`MAX_EVENTS`] events (`CUPOOL_CORPUS_MAX_EVENTS`
//! overrides it; 0 replays everything). An RMM CSV is then read only that far.

use cupool::runtime::runtime;
use cupool::trace::replay::{replay, ReplayOptions, ReplayReport};
use cupool::trace::{io, rmm_csv, Trace, TraceError};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// Events replayed per trace in this test. Measured unoptimised on this project's 2-core
/// machine: about 5 µs per event, CSV reading included (200,000 events of a training-like
/// trace in 1.0 s), so a trace costs at most ~1.5 s.
const MAX_EVENTS: usize = 300_000;

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("traces")
}

/// Whether a file is a trace (a driver-events file beside a trace is not one).
fn is_trace(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let name = [".zst", ".gz"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
        .unwrap_or(&name);
    !name.ends_with(".driver.csv")
        && [".csv", ".pickle", ".pkl"]
            .iter()
            .any(|ext| name.ends_with(ext))
}

fn traces_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            let top_level = dir == corpus_dir();
            let name = path.file_name().unwrap_or_default();
            let format_tests = name == "bad" || name == "fixtures";
            if !(top_level && format_tests) {
                traces_under(&path, out);
            }
        } else if is_trace(&path) {
            out.push(path);
        }
    }
}

/// The trace, an RMM CSV read only as far as `max_events` rows.
fn read_head(path: &Path, max_events: usize) -> Result<Trace, TraceError> {
    if max_events == 0 {
        return io::read_trace(path);
    }
    let mut reader = BufReader::new(io::open(path)?);
    // A pickle (PyTorch snapshot) cannot be cut: read whole.
    if reader.fill_buf().is_ok_and(|b| b.first() == Some(&0x80)) {
        return io::read_trace(path);
    }
    let mut head = Vec::new();
    for _ in 0..=max_events {
        let before = head.len();
        if reader.read_until(b'\n', &mut head).unwrap_or(0) == 0 || head.len() == before {
            break;
        }
    }
    rmm_csv::read(&head[..])
}

fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_string(), |v| format!("{:.1}%", v * 100.0))
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

/// One line per trace, straight to stderr (the test harness captures `eprintln!`).
fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn summary(name: &str, r: &ReplayReport) -> String {
    let mut line = format!(
        "TRACE {name}: utilization {} (allocated {} / reserved {}), requested {} ({} of reserved); {} of {} events, {} driver allocs, {} OOMs",
        percent(r.utilization),
        mib(r.peak_allocated_bytes),
        mib(r.peak_reserved_bytes),
        mib(r.peak_requested_bytes),
        percent(r.requested_utilization),
        r.events,
        r.trace_events,
        r.device_allocs,
        r.ooms
    );
    if let Some(reference) = r.reference {
        line.push_str(&format!(
            "; the traced program's allocator reserved {}",
            mib(reference.peak_reserved_bytes)
        ));
    }
    line
}

#[test]
fn every_corpus_trace_replays_on_the_host_backend() {
    let max_events = std::env::var("CUPOOL_CORPUS_MAX_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MAX_EVENTS);
    let mut traces = Vec::new();
    traces_under(&corpus_dir(), &mut traces);
    if traces.is_empty() {
        say("TRACE: no corpus traces under tests/traces/ yet; nothing to replay");
        return;
    }
    cupool::config::set("backend", "host").expect("host backend");
    let rt = runtime().expect("runtime starts on the host backend");
    // As `cupool replay` does: only a memory_limit limits a replay.
    rt.host_backend().unwrap().set_capacity(1 << 40);
    let opts = ReplayOptions {
        max_events: (max_events > 0).then_some(max_events),
        samples: 0,
        ..ReplayOptions::default()
    };
    let mut failures = Vec::new();
    for path in &traces {
        let name = path
            .strip_prefix(corpus_dir())
            .unwrap_or(path)
            .display()
            .to_string();
        let report =
            read_head(path, max_events).and_then(|trace| replay(rt, &trace, &opts, &mut |_| {}));
        match report {
            Ok(r) => {
                say(&summary(&name, &r));
                if r.reserved_after_empty_cache != 0 {
                    failures.push(format!(
                        "{name}: {} bytes reserved after empty_cache",
                        r.reserved_after_empty_cache
                    ));
                }
                if r.ops == 0 {
                    failures.push(format!("{name}: nothing replayed"));
                }
                // Note [footprint parts]: the parts of the reserved bytes at the peak are found
                // without overlap, so they never add up to more than the reserved bytes.
                match r.at_peak {
                    Some(p) if p.footprint.accounted() > p.footprint.reserved => {
                        failures.push(format!(
                            "{name}: the footprint at the peak counts {} of {} reserved bytes",
                            p.footprint.accounted(),
                            p.footprint.reserved
                        ))
                    }
                    Some(p) if p.footprint.reserved > r.peak_reserved_bytes => {
                        failures.push(format!("{name}: the footprint's peak passes the peak"))
                    }
                    None if r.peak_reserved_bytes > 0 => {
                        failures.push(format!("{name}: no footprint at the peak"))
                    }
                    _ => {}
                }
            }
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "traces that did not replay:\n{}",
        failures.join("\n")
    );
}

#[test]
fn trace_files_are_told_from_the_files_beside_them() {
    for name in [
        "a.csv",
        "a.csv.zst",
        "b.pickle",
        "b.pickle.gz",
        "c.PKL",
        "d.csv.gz",
    ] {
        assert!(is_trace(Path::new(name)), "{name}");
    }
    for name in [
        "a.driver.csv",
        "a.driver.csv.zst",
        "a.json",
        "README.md",
        "gen.py",
        "x.zst",
    ] {
        assert!(!is_trace(Path::new(name)), "{name}");
    }
}
