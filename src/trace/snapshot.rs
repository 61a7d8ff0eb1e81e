//! PyTorch memory snapshots: the pickles of `torch.cuda.memory._snapshot()` and
//! `_dump_snapshot()` (which `read_trace` decompresses first when gzipped).
//!
//! A snapshot is a dict: `segments` (the allocator's state when it was taken: each segment
//! with its `total_size` and `blocks`), `device_traces` (one list per device of the last
//! entries of the allocator's history, oldest first) and `allocator_settings`. Each trace
//! entry is a dict with `action`, `addr` (`device_free` for `oom`), `size`, `stream`,
//! `time_us` and `frames`.
//!
//! What becomes what:
//! - `alloc` → [`Action::Allocate`]; `free_requested` → [`Action::Free`] (the program's free;
//!   PyTorch's free is stream-ordered on the block's stream); `oom` →
//!   [`Action::AllocateFailure`]. Devices' entries are merged by `time_us`, each device's
//!   own order kept.
//! - `free_completed` (the block became reusable), `snapshot` and actions this reader does
//!   not know are not program calls and are skipped.
//! - `segment_alloc`/`segment_free` and, for expandable segments, `segment_map`/
//!   `segment_unmap` give what PyTorch reserved over the trace ([`Reference`]).
//! - The history is a ring buffer that drops its oldest entries, and recording may start
//!   late, so blocks can be alive before the first entry: a `free_requested` of an address
//!   the trace never allocated, and a block `active_allocated` in `segments` that no entry
//!   touches. Both go to [`Trace::prelude`].
//!
//! serde-pickle decodes nested containers recursively (1 to 3 KiB of stack a level in a
//! release build, up to 10 KiB in a debug one), and a crafted pickle nests one level a byte, so
//! decoding runs on a thread whose stack grows with the input (up to 1 GiB, reserved, not
//! touched): a real snapshot nests six deep, and a crafted one cannot overflow the caller's
//! stack unless it is hundreds of KiB of nothing but nesting.

use super::{Action, Format, Position, Reference, Trace, TraceError, TraceEvent};
use crate::ptr_map::PtrMap;
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::BTreeMap;

type Dict = BTreeMap<HashableValue, Value>;

/// What a trace entry did, for the entries that matter here.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Alloc,
    FreeRequested,
    Oom,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
}

/// One trace entry, read.
#[derive(Copy, Clone, Debug)]
struct Entry {
    kind: Kind,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: u64,
    device: usize,
    index: usize,
}

/// A block alive when the snapshot was taken.
struct LiveBlock {
    addr: u64,
    size: u64,
    stream: u64,
}

/// Stack for decoding, per byte of pickle (bounds the nesting a pickle can hold).
const STACK_PER_INPUT_BYTE: usize = 16 << 10;
const MIN_STACK: usize = 16 << 20;
const MAX_STACK: usize = 1 << 30;

/// Reads a snapshot pickle (already decompressed).
pub fn read(bytes: &[u8]) -> Result<Trace, TraceError> {
    let wanted = bytes
        .len()
        .saturating_mul(STACK_PER_INPUT_BYTE)
        .clamp(MIN_STACK, MAX_STACK);
    std::thread::scope(|scope| {
        for stack in [wanted, MIN_STACK] {
            let spawned = std::thread::Builder::new()
                .name("cupool-snapshot".into())
                .stack_size(stack)
                .spawn_scoped(scope, || read_on_this_thread(bytes));
            if let Ok(reader) = spawned {
                return reader.join().unwrap_or_else(|_| {
                    Err(file_error(
                        "the snapshot reader panicked: a bug in cupool, please report it",
                    ))
                });
            }
        }
        read_on_this_thread(bytes) // no thread to be had: decode here
    })
}

fn read_on_this_thread(bytes: &[u8]) -> Result<Trace, TraceError> {
    let options = DeOptions::new()
        .decode_strings()
        .replace_unresolved_globals()
        .replace_recursive_structures();
    let root = serde_pickle::value_from_slice(bytes, options).map_err(|e| {
        TraceError::new(
            Position::File,
            format!("not a readable PyTorch snapshot pickle: {e}"),
        )
    })?;
    let Value::Dict(root) = &root else {
        return Err(file_error(format!(
            "not a PyTorch memory snapshot: the pickle holds {}, not a dict with `segments` \
             and `device_traces`",
            type_name(&root)
        )));
    };
    let Some(device_traces) = get(root, "device_traces") else {
        return Err(file_error(
            "not a PyTorch memory snapshot: no `device_traces` (was it taken with \
             torch.cuda.memory._snapshot()?)",
        ));
    };
    let device_traces = as_list(device_traces).ok_or_else(|| {
        file_error(format!(
            "`device_traces` is {}, not a list",
            type_name(device_traces)
        ))
    })?;
    let mut per_device = Vec::with_capacity(device_traces.len());
    for (device, list) in device_traces.iter().enumerate() {
        let entries = as_list(list).ok_or_else(|| {
            file_error(format!(
                "device_traces[{device}] is {}, not a list",
                type_name(list)
            ))
        })?;
        per_device.push(device_entries(device, entries)?);
    }
    let segments = match get(root, "segments") {
        None => None,
        Some(v) => Some(
            as_list(v)
                .ok_or_else(|| file_error(format!("`segments` is {}, not a list", type_name(v))))?,
        ),
    };
    let (segment_bytes, live_blocks) = match segments {
        Some(segments) => read_segments(segments)?,
        None => (0, Vec::new()),
    };
    let entries = merge_by_time(per_device);

    let mut trace = Trace {
        format: Format::TorchSnapshot,
        events: Vec::with_capacity(entries.len()),
        positions: Vec::with_capacity(entries.len()),
        prelude: Vec::new(),
        reference: None,
    };
    // Addresses some alloc or free of the trace names, so far.
    let mut seen: PtrMap<()> = PtrMap::default();
    let mut reserved = ReservedCurve::default();
    for e in &entries {
        let action = match e.kind {
            Kind::Alloc => {
                seen.insert(e.addr, ());
                Action::Allocate
            }
            Kind::FreeRequested => {
                if seen.insert(e.addr, ()).is_none() {
                    trace.prelude.push((e.addr, e.size, e.stream)); // allocated before the trace
                }
                Action::Free
            }
            Kind::Oom => Action::AllocateFailure,
            Kind::SegmentAlloc | Kind::SegmentMap => {
                reserved.add(i128::from(e.size));
                continue;
            }
            Kind::SegmentFree | Kind::SegmentUnmap => {
                reserved.add(-i128::from(e.size));
                continue;
            }
        };
        let mut ev = TraceEvent::rmm(0, e.time_us, action, e.addr, e.size, e.stream);
        ev.device = i32::try_from(e.device).ok();
        trace.events.push(ev);
        trace.positions.push(Position::Entry {
            device: e.device,
            index: e.index,
        });
    }
    // Blocks alive at the snapshot that no entry touches were alive all along.
    for block in live_blocks {
        if !seen.contains_key(&block.addr) {
            trace.prelude.push((block.addr, block.size, block.stream));
        }
    }
    if segments.is_some() || reserved.segment_allocs > 0 {
        trace.reference = Some(reserved.reference(segment_bytes));
    }
    Ok(trace)
}

/// PyTorch's reserved bytes over the trace, relative to the start.
#[derive(Default)]
struct ReservedCurve {
    now: i128,
    lowest: i128,
    highest: i128,
    segment_allocs: u64,
}

impl ReservedCurve {
    fn add(&mut self, bytes: i128) {
        self.now += bytes;
        self.lowest = self.lowest.min(self.now);
        self.highest = self.highest.max(self.now);
        if bytes > 0 {
            self.segment_allocs += 1;
        }
    }

    /// `at_end`: what the snapshot's segments hold. What was reserved at the start is that
    /// less the trace's net change (never less than what the trace frees).
    fn reference(&self, at_end: u128) -> Reference {
        let at_end = i128::try_from(at_end).unwrap_or(i128::MAX / 2);
        let at_start = (at_end - self.now).max(-self.lowest);
        let peak = at_start + self.highest;
        Reference {
            peak_reserved_bytes: u64::try_from(peak).unwrap_or(u64::MAX),
            segment_allocs: self.segment_allocs,
        }
    }
}

/// Reads one device's trace entries, skipping those that are not program calls or
/// segment changes.
fn device_entries(device: usize, list: &[Value]) -> Result<Vec<Entry>, TraceError> {
    let mut entries = Vec::with_capacity(list.len());
    let mut last_time_us = 0;
    for (index, value) in list.iter().enumerate() {
        let at = Position::Entry { device, index };
        let Value::Dict(dict) = value else {
            return Err(TraceError::new(
                at,
                format!("a trace entry is a dict; this one is {}", type_name(value)),
            ));
        };
        let (mut action, mut addr, mut size, mut stream, mut time_us, mut device_free) =
            (None, None, None, None, None, None);
        for (key, value) in dict {
            let slot = match key_str(key) {
                Some("action") => &mut action,
                Some("addr") => &mut addr,
                Some("size") => &mut size,
                Some("stream") => &mut stream,
                Some("time_us") => &mut time_us,
                Some("device_free") => &mut device_free,
                _ => continue, // frames, compile_context, user_metadata, pool_id, ...
            };
            *slot = Some(value);
        }
        let action = action.ok_or_else(|| TraceError::new(at, "trace entry has no `action`"))?;
        let kind = match as_str(action) {
            Some("alloc") => Kind::Alloc,
            Some("free_requested") => Kind::FreeRequested,
            Some("oom") => Kind::Oom,
            Some("segment_alloc") => Kind::SegmentAlloc,
            Some("segment_free") => Kind::SegmentFree,
            Some("segment_map") => Kind::SegmentMap,
            Some("segment_unmap") => Kind::SegmentUnmap,
            Some(_) => continue, // free_completed, snapshot, and kinds newer than this reader
            None => {
                return Err(TraceError::new(
                    at,
                    format!("`action` is {}, not a string", type_name(action)),
                ))
            }
        };
        let int = |value: Option<&Value>, key: &str| -> Result<Option<i128>, TraceError> {
            value
                .map(|v| {
                    as_int(v).ok_or_else(|| {
                        TraceError::new(at, format!("`{key}` is {}, not an int", type_name(v)))
                    })
                })
                .transpose()
        };
        // An `oom` has no block: it carries the device's free bytes instead.
        let addr = if kind == Kind::Oom {
            0
        } else {
            let addr = int(addr, "addr")?.ok_or_else(|| {
                TraceError::new(at, format!("`{}` entry has no `addr`", kind_word(kind)))
            })?;
            as_address(addr).ok_or_else(|| TraceError::new(at, format!("bad `addr` {addr}")))?
        };
        let size = int(size, "size")?.ok_or_else(|| {
            TraceError::new(at, format!("`{}` entry has no `size`", kind_word(kind)))
        })?;
        let size =
            u64::try_from(size).map_err(|_| TraceError::new(at, format!("bad `size` {size}")))?;
        // Streams are pointers PyTorch casts to int64: negative ones wrap back.
        let stream = match int(stream, "stream")? {
            None => 0,
            Some(s) => {
                as_address(s).ok_or_else(|| TraceError::new(at, format!("bad `stream` {s}")))?
            }
        };
        // Snapshots before PyTorch 2.1 have no `time_us`: keep the order then.
        let time_us = match int(time_us, "time_us")? {
            None => last_time_us,
            Some(t) => {
                u64::try_from(t).map_err(|_| TraceError::new(at, format!("bad `time_us` {t}")))?
            }
        };
        int(device_free, "device_free")?;
        last_time_us = time_us;
        entries.push(Entry {
            kind,
            addr,
            size,
            stream,
            time_us,
            device,
            index,
        });
    }
    Ok(entries)
}

/// The bytes the segments hold, and the blocks alive in them.
fn read_segments(segments: &[Value]) -> Result<(u128, Vec<LiveBlock>), TraceError> {
    let mut total: u128 = 0;
    let mut live = Vec::new();
    for (i, segment) in segments.iter().enumerate() {
        let bad = |what: String| file_error(format!("segments[{i}]: {what}"));
        let Value::Dict(segment) = segment else {
            return Err(bad(format!("is {}, not a dict", type_name(segment))));
        };
        let number = |dict: &Dict, key: &str| -> Result<Option<u64>, String> {
            match get(dict, key) {
                None => Ok(None),
                Some(v) => match as_int(v).and_then(as_address) {
                    Some(n) => Ok(Some(n)),
                    None => Err(format!(
                        "`{key}` is {}, not an address or size",
                        type_name(v)
                    )),
                },
            }
        };
        let total_size = number(segment, "total_size")
            .map_err(&bad)?
            .ok_or_else(|| bad("no `total_size`".into()))?;
        total += u128::from(total_size);
        let stream = number(segment, "stream").map_err(&bad)?.unwrap_or(0);
        let Some(blocks) = get(segment, "blocks") else {
            continue;
        };
        let blocks = as_list(blocks)
            .ok_or_else(|| bad(format!("`blocks` is {}, not a list", type_name(blocks))))?;
        // PyTorch writes each block's address; older snapshots leave it to be summed up.
        let mut next_addr = number(segment, "address").map_err(&bad)?.unwrap_or(0);
        for (j, block) in blocks.iter().enumerate() {
            let bad = |what: String| bad(format!("blocks[{j}]: {what}"));
            let Value::Dict(block) = block else {
                return Err(bad(format!("is {}, not a dict", type_name(block))));
            };
            let size = number(block, "size")
                .map_err(&bad)?
                .ok_or_else(|| bad("no `size`".into()))?;
            let addr = number(block, "address").map_err(&bad)?.unwrap_or(next_addr);
            next_addr = addr.wrapping_add(size);
            let allocated = get(block, "state").and_then(as_str) == Some("active_allocated");
            if allocated {
                let requested = number(block, "requested_size").map_err(&bad)?;
                live.push(LiveBlock {
                    addr,
                    size: requested.unwrap_or(size),
                    stream,
                });
            }
        }
    }
    Ok((total, live))
}

/// Merges the devices' entries by time, each device's own order kept (ties: the lower
/// device first).
fn merge_by_time(mut per_device: Vec<Vec<Entry>>) -> Vec<Entry> {
    if per_device.len() <= 1 {
        return per_device.pop().unwrap_or_default();
    }
    let total = per_device.iter().map(Vec::len).sum();
    let mut merged = Vec::with_capacity(total);
    let mut next = vec![0usize; per_device.len()];
    while merged.len() < total {
        let mut best: Option<(u64, usize)> = None;
        for (device, entries) in per_device.iter().enumerate() {
            if let Some(e) = entries.get(next[device]) {
                if best.is_none_or(|(t, _)| e.time_us < t) {
                    best = Some((e.time_us, device));
                }
            }
        }
        let Some((_, device)) = best else { break };
        merged.push(per_device[device][next[device]]);
        next[device] += 1;
    }
    merged
}

fn kind_word(kind: Kind) -> &'static str {
    match kind {
        Kind::Alloc => "alloc",
        Kind::FreeRequested => "free_requested",
        Kind::Oom => "oom",
        Kind::SegmentAlloc => "segment_alloc",
        Kind::SegmentFree => "segment_free",
        Kind::SegmentMap => "segment_map",
        Kind::SegmentUnmap => "segment_unmap",
    }
}

fn file_error(message: impl Into<String>) -> TraceError {
    TraceError::new(Position::File, message)
}

fn key_str(key: &HashableValue) -> Option<&str> {
    match key {
        HashableValue::String(s) => Some(s),
        HashableValue::Bytes(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

fn get<'a>(dict: &'a Dict, key: &str) -> Option<&'a Value> {
    dict.iter()
        .find(|(k, _)| key_str(k) == Some(key))
        .map(|(_, v)| v)
}

fn as_list(value: &Value) -> Option<&[Value]> {
    match value {
        Value::List(items) | Value::Tuple(items) => Some(items),
        _ => None,
    }
}

fn as_str(value: &Value) -> Option<&str> {
    match value {
        Value::String(s) => Some(s),
        Value::Bytes(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

/// Python ints arrive as `I64`, or as `Int` when they do not fit.
fn as_int(value: &Value) -> Option<i128> {
    match value {
        Value::I64(n) => Some(i128::from(*n)),
        Value::Int(n) => i128::try_from(n).ok(),
        Value::Bool(b) => Some(i128::from(*b)),
        _ => None,
    }
}

/// An address (or stream handle) as PyTorch writes it: unsigned, or an unsigned value cast
/// to int64 (negative when its top bit is set).
fn as_address(n: i128) -> Option<u64> {
    u64::try_from(n)
        .ok()
        .or_else(|| i64::try_from(n).ok().map(|n| n as u64))
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::I64(_) | Value::Int(_) => "an int",
        Value::F64(_) => "a float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "a string",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Dict(_) => "a dict",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(device: usize, index: usize, time_us: u64) -> Entry {
        Entry {
            kind: Kind::Alloc,
            addr: 0,
            size: 0,
            stream: 0,
            time_us,
            device,
            index,
        }
    }

    #[test]
    fn merging_keeps_each_devices_order() {
        // Device 0's clock steps back (entry 2): its order still holds.
        let merged = merge_by_time(vec![
            vec![entry(0, 0, 5), entry(0, 1, 20), entry(0, 2, 10)],
            vec![entry(1, 0, 5), entry(1, 1, 15)],
        ]);
        let order: Vec<_> = merged.iter().map(|e| (e.device, e.index)).collect();
        assert_eq!(order, vec![(0, 0), (1, 0), (1, 1), (0, 1), (0, 2)]);
    }

    #[test]
    fn reserved_at_start_is_the_end_less_the_net_change() {
        let mut curve = ReservedCurve::default();
        for bytes in [10, 30, -30, 5] {
            curve.add(bytes);
        }
        // 100 at the end, +15 net: 85 at the start, 125 at the peak.
        assert_eq!(curve.reference(100).peak_reserved_bytes, 125);
        assert_eq!(curve.reference(100).segment_allocs, 3);
        // Segments that cannot account for the frees: never below zero.
        let mut curve = ReservedCurve::default();
        curve.add(-50);
        curve.add(20);
        assert_eq!(curve.reference(0).peak_reserved_bytes, 50);
    }

    #[test]
    fn addresses_and_ints() {
        assert_eq!(as_address(-1), Some(u64::MAX));
        assert_eq!(as_address(i128::from(u64::MAX)), Some(u64::MAX));
        assert_eq!(as_address(i128::from(u64::MAX) + 1), None);
        assert_eq!(as_int(&Value::String("1".into())), None);
    }
}
