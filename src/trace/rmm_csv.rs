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
//!
//! [`read`] selects columns by header name, as RMM's replay does: RMM's six are required,
//! cupool's are optional, others are ignored. It is lenient where RMM's own writers differ
//! (`deallocate` for `free`, epoch seconds for the time of day, pointers without `0x`) and
//! strict elsewhere: every bad field is an error naming its line, column and value.

mod write;

use super::{Action, DriverAction, Format, Position, Trace, TraceError, TraceEvent};
pub use write::{header, push_driver_row, push_row, push_time_of_day, DriverRow};

/// RMM's header, exactly as RMM writes it.
pub const RMM_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";
/// cupool's columns, after RMM's.
pub const CUPOOL_COLUMNS: &str = "Device,StreamId,Streamless,Rounded,Result,Nanos";
/// The header of the driver-events file.
pub const DRIVER_HEADER: &str = "Thread,Time,Action,Pointer,Size,Device,Nanos";

/// RMM's required columns, in the order RMM writes them.
const RMM_COLUMNS: [&str; 6] = ["Thread", "Time", "Action", "Pointer", "Size", "Stream"];

/// Where each known column sits in the file's rows (by header name).
struct Columns {
    thread: usize,
    time: usize,
    action: usize,
    pointer: usize,
    size: usize,
    stream: usize,
    device: Option<usize>,
    stream_id: Option<usize>,
    streamless: Option<usize>,
    rounded: Option<usize>,
    result: Option<usize>,
    nanos: Option<usize>,
    /// Fields the header has: every row must have as many.
    width: usize,
}

impl Columns {
    fn from_header(header: &csv::ByteRecord) -> Result<Columns, TraceError> {
        let at_line_1 = |msg: String| TraceError::new(Position::Line(1), msg);
        if header.iter().any(|f| std::str::from_utf8(f).is_err()) {
            return Err(at_line_1(format!(
                "not an RMM CSV log or a PyTorch snapshot: the first line is not text (expected \
                 the header {RMM_HEADER})"
            )));
        }
        let find = |name: &str| {
            header.iter().position(|field| {
                let field = field.strip_prefix(b"\xef\xbb\xbf").unwrap_or(field); // UTF-8 BOM
                field.trim_ascii().eq_ignore_ascii_case(name.as_bytes())
            })
        };
        if header.len() == DRIVER_HEADER.split(',').count()
            && header
                .iter()
                .zip(DRIVER_HEADER.split(','))
                .all(|(f, n)| f.trim_ascii() == n.as_bytes())
        {
            return Err(at_line_1(
                "this is cupool's driver-events file (the pool's segments), not an allocation \
                 trace: use the trace recorded beside it"
                    .into(),
            ));
        }
        let mut required = [0usize; 6];
        for (slot, name) in required.iter_mut().zip(RMM_COLUMNS) {
            *slot = find(name).ok_or_else(|| {
                let found: Vec<_> = header.iter().map(String::from_utf8_lossy).collect();
                at_line_1(format!(
                    "missing column {name}: an RMM log's header names {RMM_HEADER} (this one \
                     has {} fields: {})",
                    header.len(),
                    shorten(found.join(",").as_bytes())
                ))
            })?;
        }
        let [thread, time, action, pointer, size, stream] = required;
        Ok(Columns {
            thread,
            time,
            action,
            pointer,
            size,
            stream,
            device: find("Device"),
            stream_id: find("StreamId"),
            streamless: find("Streamless"),
            rounded: find("Rounded"),
            result: find("Result"),
            nanos: find("Nanos"),
            width: header.len(),
        })
    }
}

/// Reads a whole RMM log (or a cupool trace, which is one with more columns).
///
/// Events keep the file's order, except in cupool's traces, which are put in the program's
/// order by their `Nanos` ([`order_by_nanos`]); `positions[i]` is the line of `events[i]`
/// (the header is line 1).
pub fn read(r: impl std::io::Read) -> Result<Trace, TraceError> {
    let mut reader = csv_reader(r);
    let mut record = csv::ByteRecord::new();
    if !next_record(&mut reader, &mut record)? {
        return Err(TraceError::new(
            Position::File,
            format!("empty trace: no header line (expected {RMM_HEADER})"),
        ));
    }
    let columns = Columns::from_header(&record)?;
    let mut trace = Trace {
        format: Format::RmmCsv,
        events: Vec::new(),
        positions: Vec::new(),
        prelude: Vec::new(),
        reference: None,
    };
    while next_record(&mut reader, &mut record)? {
        let line = record.position().map_or(0, |p| p.line());
        if record.len() == 1 && record[0].trim_ascii().is_empty() {
            continue; // a blank line
        }
        trace.events.push(parse_row(&record, &columns, line)?);
        trace.positions.push(Position::Line(line));
    }
    order_by_nanos(&mut trace);
    Ok(trace)
}

/// Puts a cupool trace in the program's order. The recorder writes each thread's buffer
/// whole, so rows of different threads interleave by buffer; `Nanos` (one clock for all
/// threads) gives the order. A stable sort, and only when every row has `Nanos` (RMM's
/// logs are in order already). Positions move with their events, so errors still name the
/// file's lines.
fn order_by_nanos(trace: &mut Trace) {
    let in_order = trace
        .events
        .windows(2)
        .all(|w| matches!((w[0].nanos, w[1].nanos), (Some(a), Some(b)) if a <= b));
    if in_order || trace.events.iter().any(|ev| ev.nanos.is_none()) {
        return;
    }
    // Each thread's rows are in that thread's call order in the file, but their `Nanos`
    // may step back a little: the recorder converts clock ticks at a rate measured again
    // at every write, and a thread may move to a CPU whose counter is slightly behind.
    // Sorting on the running maximum per thread keeps every thread's own order.
    let mut newest: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut rows: Vec<(u64, TraceEvent, Position)> = std::mem::take(&mut trace.events)
        .into_iter()
        .zip(std::mem::take(&mut trace.positions))
        .map(|(ev, pos)| {
            let last = newest.entry(ev.thread).or_insert(0);
            *last = (*last).max(ev.nanos.unwrap_or(0));
            (*last, ev, pos)
        })
        .collect();
    rows.sort_by_key(|(key, _, _)| *key);
    (trace.events, trace.positions) = rows.into_iter().map(|(_, ev, pos)| (ev, pos)).unzip();
}

fn csv_reader<R: std::io::Read>(r: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(false) // read by hand, so that line numbers and errors are ours
        .flexible(true) // a short row is reported with its line, not as csv's error
        // Lines end at `\n` (a `\r` before it is trimmed with the field): csv's own CRLF
        // handling counts the lines of CRLF files one short.
        .terminator(csv::Terminator::Any(b'\n'))
        .buffer_capacity(1 << 16)
        .from_reader(r)
}

/// Reads cupool's driver-events file ([`DRIVER_HEADER`]), rows in the pool's order (a
/// stable sort on `Nanos`, as for the trace beside it).
pub fn read_driver(r: impl std::io::Read) -> Result<Vec<DriverRow>, TraceError> {
    let mut reader = csv_reader(r);
    let mut record = csv::ByteRecord::new();
    let names: Vec<&str> = DRIVER_HEADER.split(',').collect();
    let header_ok = next_record(&mut reader, &mut record)?
        && record.len() == names.len()
        && record
            .iter()
            .zip(&names)
            .all(|(f, n)| f.trim_ascii() == n.as_bytes());
    if !header_ok {
        return Err(TraceError::new(
            Position::Line(1),
            format!("not a driver-events file: its header is not {DRIVER_HEADER}"),
        ));
    }
    let mut rows = Vec::new();
    while next_record(&mut reader, &mut record)? {
        let line = record.position().map_or(0, |p| p.line());
        if record.len() == 1 && record[0].trim_ascii().is_empty() {
            continue;
        }
        let at = Position::Line(line);
        if record.len() != names.len() {
            return Err(TraceError::new(
                at,
                format!("{} fields, the header has {}", record.len(), names.len()),
            ));
        }
        let field = |i: usize| record[i].trim_ascii();
        let bad = |i: usize, what: &str| {
            TraceError::new(
                at,
                format!("column {}: bad {what} `{}`", names[i], shorten(field(i))),
            )
        };
        let action = [
            DriverAction::SegmentAlloc,
            DriverAction::SegmentFree,
            DriverAction::Map,
            DriverAction::Unmap,
        ]
        .into_iter()
        .find(|a| a.word().as_bytes() == field(2))
        .ok_or_else(|| bad(2, "driver action"))?;
        let device = std::str::from_utf8(field(5))
            .ok()
            .and_then(|s| s.parse().ok());
        rows.push(DriverRow {
            thread: parse_number(field(0)).ok_or_else(|| bad(0, "thread id"))?,
            time_us: parse_time(field(1)).ok_or_else(|| bad(1, "time"))?,
            action,
            ptr: parse_hex(field(3)).ok_or_else(|| bad(3, "hex pointer"))?,
            size: parse_decimal(field(4)).ok_or_else(|| bad(4, "size"))?,
            device: device.ok_or_else(|| bad(5, "device"))?,
            nanos: parse_decimal(field(6)).ok_or_else(|| bad(6, "nanoseconds"))?,
        });
    }
    rows.sort_by_key(|row| row.nanos);
    Ok(rows)
}

/// Reads the next row; an I/O error (a cut or corrupt compressed stream) names the line
/// reading stopped at.
fn next_record<R: std::io::Read>(
    reader: &mut csv::Reader<R>,
    record: &mut csv::ByteRecord,
) -> Result<bool, TraceError> {
    reader.read_byte_record(record).map_err(|e| {
        let line = reader.position().line();
        let why = match e.kind() {
            csv::ErrorKind::Io(io) => {
                format!("cannot read the trace (cut short or corrupt?): {io}")
            }
            _ => format!("cannot read the trace: {e}"),
        };
        TraceError::new(Position::Line(line), why)
    })
}

fn parse_row(record: &csv::ByteRecord, c: &Columns, line: u64) -> Result<TraceEvent, TraceError> {
    if record.len() != c.width {
        let what = if record.len() < c.width {
            "truncated row"
        } else {
            "too many fields"
        };
        return Err(TraceError::new(
            Position::Line(line),
            format!(
                "{what}: {} fields, the header has {}",
                record.len(),
                c.width
            ),
        ));
    }
    let bad = |column: &str, what: &str, value: &[u8]| {
        TraceError::new(
            Position::Line(line),
            format!("column {column}: bad {what} `{}`", shorten(value)),
        )
    };
    let field = |i: usize| record[i].trim_ascii();
    let action = parse_action(field(c.action)).ok_or_else(|| {
        TraceError::new(
            Position::Line(line),
            format!(
                "column Action: unknown action `{}` (expected allocate, free or allocate failure)",
                shorten(field(c.action))
            ),
        )
    })?;
    let mut ev = TraceEvent::rmm(
        parse_number(field(c.thread)).ok_or_else(|| bad("Thread", "thread id", field(c.thread)))?,
        parse_time(field(c.time)).ok_or_else(|| bad("Time", "time", field(c.time)))?,
        action,
        parse_hex(field(c.pointer))
            .ok_or_else(|| bad("Pointer", "hex pointer", field(c.pointer)))?,
        parse_decimal(field(c.size)).ok_or_else(|| bad("Size", "size", field(c.size)))?,
        parse_hex(field(c.stream)).ok_or_else(|| bad("Stream", "hex stream", field(c.stream)))?,
    );
    // cupool's columns: an empty field means "not known".
    let optional = |i: Option<usize>| i.map(field).filter(|f| !f.is_empty());
    if let Some(f) = optional(c.device) {
        let device = std::str::from_utf8(f)
            .ok()
            .and_then(|s| s.parse::<i32>().ok());
        ev.device = Some(device.ok_or_else(|| bad("Device", "device", f))?);
    }
    if let Some(f) = optional(c.stream_id) {
        ev.stream_id = Some(parse_decimal(f).ok_or_else(|| bad("StreamId", "stream id", f))?);
    }
    if let Some(f) = optional(c.streamless) {
        ev.streamless = match f {
            b"0" | b"false" => false,
            b"1" | b"true" => true,
            _ => return Err(bad("Streamless", "flag (0 or 1)", f)),
        };
    }
    if let Some(f) = optional(c.rounded) {
        ev.rounded = Some(parse_decimal(f).ok_or_else(|| bad("Rounded", "size", f))?);
    }
    if let Some(f) = optional(c.result) {
        if f != b"ok" {
            ev.result = Some(String::from_utf8_lossy(f).into_owned());
        }
    }
    if let Some(f) = optional(c.nanos) {
        ev.nanos = Some(parse_decimal(f).ok_or_else(|| bad("Nanos", "nanoseconds", f))?);
    }
    Ok(ev)
}

fn parse_action(word: &[u8]) -> Option<Action> {
    const WORDS: [(&str, Action); 4] = [
        ("allocate", Action::Allocate),
        ("free", Action::Free),
        ("allocate failure", Action::AllocateFailure),
        ("deallocate", Action::Free), // RMM's docs' word for it
    ];
    WORDS
        .iter()
        .find(|(w, _)| word.eq_ignore_ascii_case(w.as_bytes()))
        .map(|&(_, action)| action)
}

/// Unsigned decimal, no sign, no spaces; `None` when empty, not digits, or over `u64`.
fn parse_decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.iter().try_fold(0u64, |n, &b| {
        let digit = (b as char).to_digit(10)?;
        n.checked_mul(10)?.checked_add(u64::from(digit))
    })
}

/// Hex with or without `0x` (RMM writes pointers with `{}` of `void*`: `0x...`; `(nil)` is
/// glibc's `%p` of null).
fn parse_hex(s: &[u8]) -> Option<u64> {
    if s == b"(nil)" {
        return Some(0);
    }
    let digits = s
        .strip_prefix(b"0x")
        .or_else(|| s.strip_prefix(b"0X"))
        .unwrap_or(s);
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    digits.iter().try_fold(0u64, |n, &b| {
        Some((n << 4) | u64::from((b as char).to_digit(16)?))
    })
}

/// A thread id: decimal as RMM writes it, or hex with `0x`.
fn parse_number(s: &[u8]) -> Option<u64> {
    if s.starts_with(b"0x") || s.starts_with(b"0X") {
        parse_hex(s)
    } else {
        parse_decimal(s)
    }
}

/// `HH:MM:SS.ffffff` as microseconds since midnight, or (as RMM's docs describe it) epoch
/// seconds with a fraction, as microseconds since the epoch.
fn parse_time(s: &[u8]) -> Option<u64> {
    let (whole, fraction) = match s.iter().position(|&b| b == b'.') {
        Some(dot) => (&s[..dot], &s[dot + 1..]),
        None => (s, &b""[..]),
    };
    let seconds = if whole.contains(&b':') {
        let mut parts = whole.split(|&b| b == b':');
        let (h, m, sec) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || m.len() != 2 || sec.len() != 2 {
            return None;
        }
        let (h, m, sec) = (parse_decimal(h)?, parse_decimal(m)?, parse_decimal(sec)?);
        if h > 99 || m > 59 || sec > 60 {
            return None;
        }
        h * 3600 + m * 60 + sec
    } else {
        parse_decimal(whole)?
    };
    if !fraction.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // Microseconds: the first six digits of the fraction, padded with zeros.
    let micros = fraction
        .iter()
        .chain(std::iter::repeat(&b'0'))
        .take(6)
        .fold(0u64, |n, &b| n * 10 + u64::from(b - b'0'));
    seconds.checked_mul(1_000_000)?.checked_add(micros)
}

/// A field for an error message: lossy UTF-8, at most 40 characters.
fn shorten(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    let mut chars = text.chars();
    let mut out: String = chars.by_ref().take(40).collect();
    if chars.next().is_some() {
        out.push_str("...");
    }
    out.escape_debug().to_string()
}

#[cfg(test)]
mod tests;
