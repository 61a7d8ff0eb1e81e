//! One row of a statistics struct as text or as a JSON member, so that every struct
//! (`cupool_stats`, `cupool_host_stats`) prints its fields the same way.

use super::CupoolStat;
use core::fmt::Write;

/// `name current N  peak N`.
pub fn text_level(out: &mut String, name: &str, s: CupoolStat) {
    let _ = writeln!(
        out,
        "{name:<20} current {:>16}  peak {:>16}",
        s.current, s.peak
    );
}

/// `name N`, for a count.
pub fn text_count(out: &mut String, name: &str, v: u64) {
    let _ = writeln!(out, "{name:<20} {v:>24}");
}

/// `name current N`, for a gauge.
pub fn text_gauge(out: &mut String, name: &str, v: u64) {
    let _ = writeln!(out, "{name:<20} current {v:>16}");
}

/// `"name":{"current":N,"peak":N}`, after a comma unless it is the object's first member.
pub fn json_level(out: &mut String, name: &str, s: CupoolStat) {
    separate(out);
    let _ = write!(
        out,
        "\"{name}\":{{\"current\":{},\"peak\":{}}}",
        s.current, s.peak
    );
}

/// `"name":N`, after a comma unless it is the object's first member.
pub fn json_value(out: &mut String, name: &str, v: u64) {
    separate(out);
    let _ = write!(out, "\"{name}\":{v}");
}

fn separate(out: &mut String) {
    if !out.ends_with('{') {
        out.push(',');
    }
}
