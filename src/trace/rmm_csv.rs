//! RMM's log CSV, as RMM's `logging_resource_adaptor` writes it, with cupool's own columns
//! after RMM's.
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream,Device,StreamId,Streamless,Rounded,Result,Nanos
//! 140573312345856,14:03:27.123456,allocate,0x7f8a40000000,1024,0x0,0,3,0,1024,ok,81234
//! ```
//!
//! - RMM's columns: the thread id, the time of day (`HH:MM:SS.ffffff`), `allocate`, `free`
//!   or `allocate failure`, the pointer and the stream in hex, the size in bytes. RMM's
//!   replay benchmark selects columns by header name, so it reads cupool's traces; cupool
//!   reads RMM's logs (the extra columns are then absent).
//! - cupool's columns: `Device`, `StreamId` (`cuStreamGetId`; empty for a streamless call),
//!   `Streamless` (1 for `cupool_alloc`/`cupool_free` and every call through the preload),
//!   `Rounded` (the block's size in the pool), `Result` (`ok` or the failure, e.g.
//!   `out_of_memory`), `Nanos` (since the recording started).
//!
//! Driver events (segments, mappings) go to a second file with [`DRIVER_HEADER`]: RMM's
//! replay rejects actions other than `allocate` and `free`.

use super::{DriverAction, TraceEvent};
use core::fmt::Write as _;

/// RMM's header, exactly as RMM writes it.
pub const RMM_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";
/// cupool's columns, after RMM's.
pub const CUPOOL_COLUMNS: &str = "Device,StreamId,Streamless,Rounded,Result,Nanos";
/// The header of the driver-events file.
pub const DRIVER_HEADER: &str = "Thread,Time,Action,Pointer,Size,Device,Nanos";

/// The full header line cupool writes (no newline).
pub fn header() -> String {
    format!("{RMM_HEADER},{CUPOOL_COLUMNS}")
}

/// Appends `HH:MM:SS.ffffff` for `us` microseconds since midnight (wrapped to one day).
pub fn push_time_of_day(out: &mut String, us: u64) {
    let us = us % (24 * 3600 * 1_000_000);
    let secs = us / 1_000_000;
    let _ = write!(
        out,
        "{:02}:{:02}:{:02}.{:06}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60,
        us % 1_000_000
    );
}

/// Appends one row (with a newline) for `ev`, cupool's columns included.
pub fn push_row(out: &mut String, ev: &TraceEvent) {
    let _ = write!(out, "{},", ev.thread);
    push_time_of_day(out, ev.time_us);
    let _ = write!(
        out,
        ",{},{:#x},{},{:#x},",
        ev.action.rmm_word(),
        ev.ptr,
        ev.size,
        ev.stream
    );
    if let Some(d) = ev.device {
        let _ = write!(out, "{d}");
    }
    out.push(',');
    if let Some(id) = ev.stream_id {
        let _ = write!(out, "{id}");
    }
    let _ = write!(out, ",{},", u8::from(ev.streamless));
    if let Some(r) = ev.rounded {
        let _ = write!(out, "{r}");
    }
    out.push(',');
    out.push_str(ev.result.as_deref().unwrap_or("ok"));
    out.push(',');
    if let Some(n) = ev.nanos {
        let _ = write!(out, "{n}");
    }
    out.push('\n');
}

/// One driver event, as a row of the driver-events file.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DriverRow {
    pub thread: u64,
    pub time_us: u64,
    pub action: DriverAction,
    pub ptr: u64,
    pub size: u64,
    pub device: i32,
    pub nanos: u64,
}

/// Appends one row (with a newline) of the driver-events file.
pub fn push_driver_row(out: &mut String, row: &DriverRow) {
    let _ = write!(out, "{},", row.thread);
    push_time_of_day(out, row.time_us);
    let _ = writeln!(
        out,
        ",{},{:#x},{},{},{}",
        row.action.word(),
        row.ptr,
        row.size,
        row.device,
        row.nanos
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Action;

    #[test]
    fn rows_have_rmm_columns_first() {
        let mut ev = TraceEvent::rmm(7, 50_607_123_456, Action::Allocate, 0x7f00, 1000, 0);
        ev.device = Some(0);
        ev.stream_id = Some(3);
        ev.rounded = Some(1024);
        ev.nanos = Some(99);
        let mut s = String::new();
        push_row(&mut s, &ev);
        assert_eq!(s, "7,14:03:27.123456,allocate,0x7f00,1000,0x0,0,3,0,1024,ok,99\n");
        let mut s = String::new();
        push_row(
            &mut s,
            &TraceEvent::rmm(1, 0, Action::AllocateFailure, 0, 5, 0x10),
        );
        assert_eq!(s, "1,00:00:00.000000,allocate failure,0x0,5,0x10,,,0,,ok,\n");
    }
}
