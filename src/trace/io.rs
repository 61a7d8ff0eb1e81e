//! Opening and creating trace files: zstd (`.zst`, or zstd magic), gzip (gzip magic, as
//! `_dump_snapshot` may write), or plain; and reading a whole trace whatever its format.
//!
//! - [`open`] decompresses by magic bytes, not by name, so a renamed file still reads.
//! - [`read_trace`] then tells the formats apart by the first decompressed byte: a pickle
//!   (`0x80`, protocol 2 and later) is a PyTorch snapshot, anything else RMM's CSV.
//! - [`write_trace`] writes cupool's CSV, zstd-compressed when the name ends in `.zst`.
//! - [`check_consistency`] finds frees of unknown pointers, double frees and allocations of
//!   addresses already live, with the position of the offending event.

use super::{rmm_csv, snapshot, Action, DriverAction, Position, Reference, Trace, TraceError};
use crate::ptr_map::PtrMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::Path;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
const GZIP_MAGIC: [u8; 2] = [0x1F, 0x8B];
/// The first byte of a pickle of protocol 2 or later (`PROTO`).
const PICKLE_PROTO: u8 = 0x80;
const BUFFER_BYTES: usize = 1 << 16;

/// Whether [`write_trace`] (and the recorder) compress a file of this name: `.zst`.
pub fn is_zstd_path(path: &Path) -> bool {
    path.extension()
        .is_some_and(|ext| ext.eq_ignore_ascii_case("zst"))
}

/// Opens `path` and decompresses it by its magic bytes: zstd (any number of concatenated
/// frames: the recorder writes one complete frame per flush), gzip (any number of
/// members), or plain.
pub fn open(path: &Path) -> Result<Box<dyn Read + Send>, TraceError> {
    let cannot_open = |e: io::Error| {
        TraceError::new(
            Position::File,
            format!("cannot open {}: {e}", path.display()),
        )
    };
    let file = File::open(path).map_err(cannot_open)?;
    let mut file = BufReader::with_capacity(BUFFER_BYTES, file);
    let head = file.fill_buf().map_err(cannot_open)?;
    if head.starts_with(&ZSTD_MAGIC) {
        let decoder = zstd::stream::read::Decoder::with_buffer(file).map_err(|e| {
            TraceError::new(
                Position::File,
                format!("cannot start a zstd decoder for {}: {e}", path.display()),
            )
        })?;
        Ok(Box::new(decoder))
    } else if head.starts_with(&GZIP_MAGIC) {
        Ok(Box::new(flate2::bufread::MultiGzDecoder::new(file)))
    } else {
        Ok(Box::new(file))
    }
}

/// Reads the trace in `path`, whatever its format and compression.
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let mut reader = BufReader::with_capacity(BUFFER_BYTES, open(path)?);
    let cannot_read = |e: io::Error| {
        TraceError::new(
            Position::File,
            format!(
                "cannot read {} (cut short or corrupt?): {e}",
                path.display()
            ),
        )
    };
    let first = reader.fill_buf().map_err(cannot_read)?.first().copied();
    match first {
        None => Err(TraceError::new(
            Position::File,
            format!("{} is empty: not a trace", path.display()),
        )),
        Some(PICKLE_PROTO) => {
            let mut bytes = Vec::new();
            reader.read_to_end(&mut bytes).map_err(cannot_read)?;
            snapshot::read(&bytes)
        }
        Some(_) => rmm_csv::read(reader),
    }
}

/// What the pool reserved while a trace was recorded, from the driver-events file the
/// recorder writes beside it (`x.driver.csv[.zst]` for `x.csv[.zst]`): the peak of segment
/// bytes held and the segments obtained. Segments held before the recording started count
/// only as far as the file frees them. Mappings inside segments (`map`, `unmap`) do not
/// change what is reserved.
pub fn read_driver_reference(path: &Path) -> Result<Reference, TraceError> {
    let rows = rmm_csv::read_driver(open(path)?)?;
    let (mut held, mut lowest, mut highest, mut segment_allocs) = (0i128, 0i128, 0i128, 0u64);
    for row in &rows {
        match row.action {
            DriverAction::SegmentAlloc => {
                held += i128::from(row.size);
                segment_allocs += 1;
            }
            DriverAction::SegmentFree => held -= i128::from(row.size),
            DriverAction::Map | DriverAction::Unmap => {}
        }
        lowest = lowest.min(held);
        highest = highest.max(held);
    }
    Ok(Reference {
        peak_reserved_bytes: u64::try_from(highest - lowest).unwrap_or(u64::MAX),
        segment_allocs,
    })
}

/// Writes `trace` as cupool's CSV (RMM's columns, then cupool's), zstd-compressed when the
/// name ends in `.zst` ([`is_zstd_path`]).
///
/// CSV has no prelude: blocks alive before the trace (`trace.prelude`) are written first as
/// `allocate` rows, so that the file replays the same. Times are RMM's time of day, so a
/// snapshot's epoch times keep only their time of day (UTC).
pub fn write_trace(path: &Path, trace: &Trace) -> io::Result<()> {
    let file = File::create(path)?;
    if is_zstd_path(path) {
        let mut encoder = zstd::stream::write::Encoder::new(file, 3)?;
        write_rows(&mut encoder, trace)?;
        encoder.finish()?.sync_all()
    } else {
        let mut writer = io::BufWriter::with_capacity(BUFFER_BYTES, file);
        write_rows(&mut writer, trace)?;
        writer.into_inner().map_err(|e| e.into_error())?.sync_all()
    }
}

fn write_rows(out: &mut impl Write, trace: &Trace) -> io::Result<()> {
    let mut text = rmm_csv::header();
    text.push('\n');
    let start_us = trace.events.first().map_or(0, |ev| ev.time_us);
    for &(ptr, size, stream) in &trace.prelude {
        let ev = super::TraceEvent::rmm(0, start_us, Action::Allocate, ptr, size, stream);
        rmm_csv::push_row(&mut text, &ev);
    }
    for ev in &trace.events {
        rmm_csv::push_row(&mut text, ev);
        if text.len() >= BUFFER_BYTES {
            out.write_all(text.as_bytes())?;
            text.clear();
        }
    }
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// What [`check_consistency`] knows of an address: live since an event, or freed by one
/// (`None`: the prelude).
#[derive(Copy, Clone)]
enum Block {
    Live(Option<usize>),
    Freed(usize),
}

/// Checks that every free frees a live block and every allocation returns an address that
/// is not live. Blocks of the prelude are live at the start. Calls that failed (a `Result`
/// other than `ok`) changed nothing and are not checked; nor are null pointers (a
/// zero-byte allocation may return null, and freeing null is a no-op).
pub fn check_consistency(trace: &Trace) -> Result<(), TraceError> {
    let mut blocks: PtrMap<Block> = PtrMap::default();
    blocks.reserve(trace.prelude.len() + trace.events.len() / 2);
    for &(ptr, _, _) in &trace.prelude {
        if blocks.insert(ptr, Block::Live(None)).is_some() {
            return Err(TraceError::new(
                Position::File,
                format!("block {ptr:#x} is listed twice among the blocks alive at the start"),
            ));
        }
    }
    let position = |i: usize| trace.positions.get(i).copied().unwrap_or(Position::File);
    let origin = |since: Option<usize>| match since {
        Some(i) => position(i).to_string(),
        None => "the start of the trace".to_string(),
    };
    for (i, ev) in trace.events.iter().enumerate() {
        if ev.result.is_some() || ev.ptr == 0 {
            continue;
        }
        let ptr = ev.ptr;
        match ev.action {
            Action::AllocateFailure => {}
            Action::Allocate => {
                if let Some(Block::Live(since)) = blocks.insert(ptr, Block::Live(Some(i))) {
                    return Err(TraceError::new(
                        position(i),
                        format!(
                            "allocate returned {ptr:#x}, which is already allocated (allocated \
                             at {} and not freed since)",
                            origin(since)
                        ),
                    ));
                }
            }
            Action::Free => match blocks.insert(ptr, Block::Freed(i)) {
                Some(Block::Live(_)) => {}
                Some(Block::Freed(at)) => {
                    return Err(TraceError::new(
                        position(i),
                        format!(
                            "free of {ptr:#x}, which is not allocated at this point (double \
                             free: it was freed at {})",
                            position(at)
                        ),
                    ))
                }
                None => {
                    return Err(TraceError::new(
                        position(i),
                        format!("free of {ptr:#x}, which was never allocated (unknown pointer)"),
                    ))
                }
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceEvent;

    fn trace(events: Vec<TraceEvent>, prelude: Vec<(u64, u64, u64)>) -> Trace {
        Trace::from_events(events, prelude)
    }

    fn ev(action: Action, ptr: u64) -> TraceEvent {
        TraceEvent::rmm(1, 0, action, ptr, 64, 0)
    }

    #[test]
    fn consistency_follows_each_address() {
        use Action::*;
        let ok = trace(
            vec![
                ev(Allocate, 0x10),
                ev(Free, 0x10),
                ev(Allocate, 0x10),
                ev(Free, 0x20),
            ],
            vec![(0x20, 64, 0)],
        );
        assert_eq!(check_consistency(&ok), Ok(()));

        let double = trace(
            vec![ev(Allocate, 0x10), ev(Free, 0x10), ev(Free, 0x10)],
            vec![],
        );
        let err = check_consistency(&double).unwrap_err();
        assert_eq!(err.position, Position::Line(4));
        assert!(
            err.message.contains("double free: it was freed at line 3"),
            "{err}"
        );

        let unknown = trace(vec![ev(Free, 0xabc)], vec![]);
        let err = check_consistency(&unknown).unwrap_err();
        assert_eq!(
            err.to_string(),
            "line 2: free of 0xabc, which was never allocated (unknown pointer)"
        );

        let twice = trace(vec![ev(Allocate, 0x20)], vec![(0x20, 64, 0)]);
        let err = check_consistency(&twice).unwrap_err();
        assert!(err.message.contains("the start of the trace"), "{err}");

        // A failed free (recorded with its result) changes nothing.
        let mut failed = ev(Free, 0x30);
        failed.result = Some("invalid_pointer".into());
        assert_eq!(check_consistency(&trace(vec![failed], vec![])), Ok(()));
    }

    #[test]
    fn zstd_names() {
        assert!(is_zstd_path(Path::new("a/b.csv.zst")));
        assert!(is_zstd_path(Path::new("b.ZST")));
        assert!(!is_zstd_path(Path::new("b.csv")));
        assert!(!is_zstd_path(Path::new("zst")));
    }
}
