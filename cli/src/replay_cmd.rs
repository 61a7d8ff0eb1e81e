//! `cupool replay`: configure, read the trace, replay it, report.

use crate::{conf, plot, ReplayArgs};
use cupool::trace::replay::{replay, FootprintAtPeak, ReplayOptions, ReplayReport};
use cupool::trace::{io, Format, Trace};
use std::io::IsTerminal;
use std::path::Path;

/// Host device memory unless `--capacity` says otherwise: large enough that only a
/// `memory_limit` limits a replay (the host backend maps memory it never touches, so a
/// large capacity costs nothing).
const DEFAULT_HOST_CAPACITY: u64 = 1 << 40;
/// Traces at least this long get a progress bar (when stderr is a terminal).
const PROGRESS_BAR_EVENTS: usize = 200_000;

pub fn execute(args: &ReplayArgs) -> Result<(), String> {
    let entries = conf::entries(&args.conf)?;
    let capacity = match &args.capacity {
        None => None,
        Some(_) if args.backend != "host" => {
            return Err("--capacity applies to the host backend only".to_string())
        }
        Some(text) => Some(
            cupool::config::parse_bytes(text)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("--capacity: '{text}' is not a byte count such as 80G"))?,
        ),
    };
    let path = &args.trace;
    if !path.is_file() {
        return Err(format!("{}: no such file", path.display()));
    }
    // Options first: the backend is fixed once the pool starts.
    cupool::config::set("backend", &args.backend)
        .map_err(|e| format!("--backend {}: {}", args.backend, e.as_str()))?;
    conf::apply(&entries)?;
    let trace = io::read_trace(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let rt = cupool::runtime::runtime().map_err(|e| {
        format!(
            "cannot start the {} backend: {}{}",
            args.backend,
            e.as_str(),
            if args.backend == "host" {
                ""
            } else {
                "; --backend host replays without a GPU"
            }
        )
    })?;
    if let Some(host) = rt.host_backend() {
        host.set_capacity(capacity.unwrap_or(DEFAULT_HOST_CAPACITY));
    }
    let opts = ReplayOptions {
        max_events: args.max_events,
        gpu_lag_us: args.gpu_lag_us,
        per_thread: args.per_thread,
        ..ReplayOptions::default()
    };
    let report =
        replay_with_progress(rt, &trace, &opts).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(png) = &args.plot {
        plot::draw(png, &trace_name(path), &report)
            .map_err(|e| format!("--plot {}: {e}", png.display()))?;
    }
    if args.json {
        println!("{}", json_report(path, &trace, &report, args.series)?);
    } else {
        print!("{}", human_report(path, &trace, &report));
    }
    Ok(())
}

fn replay_with_progress(
    rt: &cupool::runtime::Runtime,
    trace: &Trace,
    opts: &ReplayOptions,
) -> Result<ReplayReport, cupool::trace::TraceError> {
    let events = opts
        .max_events
        .map_or(trace.events.len(), |n| n.min(trace.events.len()));
    if events < PROGRESS_BAR_EVENTS || !std::io::stderr().is_terminal() {
        return replay(rt, trace, opts, &mut |_| {});
    }
    let bar = indicatif::ProgressBar::new(events as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "replaying {bar:40} {human_pos}/{human_len} events ({eta} left)",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let result = replay(rt, trace, opts, &mut |done| bar.set_position(done as u64));
    bar.finish_and_clear();
    result
}

fn trace_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn format_name(format: Format) -> &'static str {
    match format {
        Format::RmmCsv => "RMM CSV",
        Format::TorchSnapshot => "PyTorch snapshot",
    }
}

/// `22.90 GiB`, `512.00 MiB`, `3.50 KiB`, `100 B`.
pub fn bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    UNITS.iter().find(|(_, size)| n >= *size).map_or_else(
        || format!("{n} B"),
        |(unit, size)| format!("{:.2} {unit}", n as f64 / *size as f64),
    )
}

fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_string(), |v| format!("{:.1}%", v * 100.0))
}

/// `1,234,567`.
fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn human_report(path: &Path, trace: &Trace, r: &ReplayReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = write!(
        o,
        "{}: {}, {} events",
        trace_name(path),
        format_name(trace.format),
        count(r.trace_events as u64)
    );
    if r.events < r.trace_events {
        let _ = write!(o, " (first {} replayed)", count(r.events as u64));
    }
    let _ = writeln!(o, ", replayed on the {} backend", r.backend);
    let _ = writeln!(
        o,
        "  peak requested   {:>12}",
        bytes(r.peak_requested_bytes)
    );
    let _ = writeln!(
        o,
        "  peak allocated   {:>12}",
        bytes(r.peak_allocated_bytes)
    );
    let _ = writeln!(
        o,
        "  peak reserved    {:>12}   utilization {} (requested / reserved {})",
        bytes(r.peak_reserved_bytes),
        percent(r.utilization),
        percent(r.requested_utilization)
    );
    if let Some(p) = r.at_peak {
        footprint_lines(&mut o, p);
    }
    if let Some(reference) = r.reference {
        let _ = write!(
            o,
            "  traced program   {:>12}   reserved at peak by its own allocator",
            bytes(reference.peak_reserved_bytes)
        );
        if reference.peak_reserved_bytes > 0 {
            let _ = write!(
                o,
                " (cupool: {:.2}x that)",
                r.peak_reserved_bytes as f64 / reference.peak_reserved_bytes as f64
            );
        }
        o.push('\n');
    }
    let _ = writeln!(
        o,
        "  driver           {} allocations, {} frees; {} fences, {} fence queries, {} device waits",
        count(r.device_allocs),
        count(r.device_frees),
        count(r.fences),
        count(r.fence_queries),
        count(r.fence_device_waits)
    );
    if r.map_calls + r.unmap_calls > 0 {
        let _ = writeln!(
            o,
            "  vmm              {} granules mapped in {} calls, {} unmapped in {} calls",
            count(r.granule_maps),
            count(r.map_calls),
            count(r.granule_unmaps),
            count(r.unmap_calls)
        );
    }
    if let Some(h) = r.second_half {
        let _ = writeln!(
            o,
            "  second half      {} driver calls that move memory from event {} on ({} allocations, {} frees, {} maps, {} unmaps)",
            count(h.calls()),
            count((r.events / 2) as u64),
            count(h.device_allocs),
            count(h.device_frees),
            count(h.map_calls),
            count(h.unmap_calls)
        );
    }
    let _ =
        writeln!(
        o,
        "  calls            {} allocations, {} frees ({} cross-stream), {} created for the trace's",
        count(r.allocs),
        count(r.frees),
        count(r.cross_stream_frees),
        if r.streams == 1 { "1 stream".to_string() } else { format!("{} streams", r.streams) }
    );
    let _ = write!(
        o,
        "  pool             {} cache hits, {} misses",
        count(r.cache_hits),
        count(r.cache_misses)
    );
    if r.prelude_allocs > 0 {
        let _ = write!(
            o,
            " (with the {} blocks alive at the start, allocated first)",
            count(r.prelude_allocs)
        );
    }
    o.push('\n');
    let _ = writeln!(
        o,
        "  failures         {} out of memory in the replay, {} failed in the traced program",
        count(r.ooms),
        count(r.trace_failures)
    );
    let _ = writeln!(
        o,
        "  time per call    alloc {} ns median ({:.0} mean), free {} ns median ({:.0} mean); {:.3} s in all",
        r.alloc_time.median_ns,
        r.alloc_time.mean_ns,
        r.free_time.median_ns,
        r.free_time.mean_ns,
        r.wall_seconds
    );
    if r.simulated_wait_us > 0 {
        let _ = writeln!(
            o,
            "  simulated GPU    the program waited {:.1} ms for fences (trace time)",
            r.simulated_wait_us as f64 / 1000.0
        );
    }
    let _ = writeln!(
        o,
        "  at the end       {} live blocks freed, empty_cache released {}, reserved after: {}",
        count(r.live_at_end),
        bytes(r.released_at_end_bytes),
        bytes(r.reserved_after_empty_cache)
    );
    o
}

/// Where the reserved bytes were at the peak (Note [footprint parts] in the library), one line a
/// place that held any.
fn footprint_lines(o: &mut String, p: FootprintAtPeak) {
    use std::fmt::Write;
    let f = p.footprint;
    let when = if p.events == 0 {
        "before the first event".to_string()
    } else {
        format!("after event {}", count(p.events as u64))
    };
    let _ = writeln!(
        o,
        "  at the peak      {:>12} reserved {when}:",
        bytes(f.reserved)
    );
    f.text_lines(o, "    ", &bytes);
}

fn json_report(
    path: &Path,
    trace: &Trace,
    r: &ReplayReport,
    with_series: bool,
) -> Result<String, String> {
    let mut value: serde_json::Value = serde_json::from_str(&r.to_json(with_series))
        .map_err(|e| format!("internal error: the report is not JSON ({e})"))?;
    if let Some(object) = value.as_object_mut() {
        object.insert("trace".into(), path.display().to_string().into());
        let format = match trace.format {
            Format::RmmCsv => "rmm_csv",
            Format::TorchSnapshot => "torch_snapshot",
        };
        object.insert("format".into(), format.into());
    }
    Ok(value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pick_the_largest_unit() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(2048), "2.00 KiB");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
    }

    #[test]
    fn counts_group_thousands() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1_234_567), "1,234,567");
    }
}
