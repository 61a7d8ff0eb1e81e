//! The recorder's 64-byte event record, and how records become rows and files.

use super::clock::Clock;
use crate::status::CupoolStatus;
use crate::trace::io::is_zstd_path;
use crate::trace::rmm_csv::{self, DriverRow};
use crate::trace::{Action, DriverAction, TraceEvent};
use std::fs::File;
use std::io::Write as _;
use std::path::Path;

/// zstd level of the `.zst` frames: fast, and CSV rows compress well anyway.
const ZSTD_LEVEL: i32 = 3;
/// `Record::device` of a call that failed before its device was known.
pub const NO_DEVICE: i32 = -1;
/// `Record::stream_id` of a streamless call, or of one that failed before its stream was
/// known.
pub const NO_STREAM_ID: u64 = u64::MAX;

pub(super) const KIND_ALLOCATE: u8 = 0;
pub(super) const KIND_FREE: u8 = 1;
pub(super) const KIND_ALLOCATE_FAILURE: u8 = 2;
pub(super) const KIND_SEGMENT_ALLOC: u8 = 3;
pub(super) const KIND_SEGMENT_FREE: u8 = 4;
pub(super) const KIND_MAP: u8 = 5;
pub(super) const KIND_UNMAP: u8 = 6;

/// The record kind of a driver event.
pub(super) fn driver_kind(action: DriverAction) -> u8 {
    match action {
        DriverAction::SegmentAlloc => KIND_SEGMENT_ALLOC,
        DriverAction::SegmentFree => KIND_SEGMENT_FREE,
        DriverAction::Map => KIND_MAP,
        DriverAction::Unmap => KIND_UNMAP,
    }
}

/// One event as the hot path stores it: plain data, formatted only when written.
#[derive(Copy, Clone, Debug)]
#[repr(C)]
pub(super) struct Record {
    pub(super) ticks: u64,
    pub(super) ptr: u64,
    /// Requested bytes (segments: the segment's size).
    pub(super) size: u64,
    /// The block's size in the pool; 0 when unknown.
    pub(super) rounded: u64,
    pub(super) stream: u64,
    pub(super) stream_id: u64,
    pub(super) device: i32,
    pub(super) session: u32,
    pub(super) kind: u8,
    /// `CupoolStatus as u8`: 0 for success.
    pub(super) status: u8,
    pub(super) streamless: bool,
}

const _: () = assert!(core::mem::size_of::<Record>() == 64);

/// Writes `r` into `slot` one field at a time (see `push`: no record-sized copy through
/// the stack).
///
/// # Safety
/// `slot` is valid for writes of a `Record` and aligned.
#[inline(always)]
pub(super) unsafe fn write_fields(slot: *mut Record, r: Record) {
    use core::ptr::addr_of_mut;
    // SAFETY: the caller's contract; each field pointer stays inside `*slot`.
    unsafe {
        addr_of_mut!((*slot).ticks).write(r.ticks);
        addr_of_mut!((*slot).ptr).write(r.ptr);
        addr_of_mut!((*slot).size).write(r.size);
        addr_of_mut!((*slot).rounded).write(r.rounded);
        addr_of_mut!((*slot).stream).write(r.stream);
        addr_of_mut!((*slot).stream_id).write(r.stream_id);
        addr_of_mut!((*slot).device).write(r.device);
        addr_of_mut!((*slot).session).write(r.session);
        addr_of_mut!((*slot).kind).write(r.kind);
        addr_of_mut!((*slot).status).write(r.status);
        addr_of_mut!((*slot).streamless).write(r.streamless);
    }
}

/// A trace file and how its chunks are written.
pub(super) struct Sink {
    file: File,
    pub(super) path: String,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    /// The last zstd frame (kept for its capacity).
    frame: Vec<u8>,
    /// Bytes of whole chunks in the file.
    good_len: u64,
}

impl Sink {
    pub(super) fn create(path: &str) -> std::io::Result<Sink> {
        let zstd = if is_zstd_path(Path::new(path)) {
            Some(zstd::bulk::Compressor::new(ZSTD_LEVEL)?)
        } else {
            None
        };
        Ok(Sink {
            file: File::create(path)?,
            path: path.to_string(),
            zstd,
            frame: Vec::new(),
            good_len: 0,
        })
    }

    /// One write of `text` (one zstd frame for `.zst`). On an error (disk full, file size
    /// limit) the part of the chunk that got written is cut off again, best effort, so the
    /// file still ends with a whole row or frame.
    pub(super) fn write_chunk(&mut self, text: &str) -> std::io::Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let bytes = match &mut self.zstd {
            Some(c) => {
                self.frame.clear();
                self.frame
                    .reserve(zstd::zstd_safe::compress_bound(text.len()));
                c.compress_to_buffer(text.as_bytes(), &mut self.frame)?;
                &self.frame[..]
            }
            None => text.as_bytes(),
        };
        match self.file.write_all(bytes) {
            Ok(()) => {
                self.good_len += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                let _ = self.file.set_len(self.good_len);
                Err(e)
            }
        }
    }
}

/// Appends `r` as a row of the trace (`main`) or of the driver file (`driver`).
pub(super) fn format_record(
    clock: &Clock,
    tid: u64,
    r: &Record,
    main: &mut String,
    driver: &mut String,
) {
    let nanos = clock.nanos(r.ticks);
    let time_us = clock.local0_us + nanos / 1000;
    let driver_action = match r.kind {
        KIND_SEGMENT_ALLOC => Some(DriverAction::SegmentAlloc),
        KIND_SEGMENT_FREE => Some(DriverAction::SegmentFree),
        KIND_MAP => Some(DriverAction::Map),
        KIND_UNMAP => Some(DriverAction::Unmap),
        _ => None,
    };
    if let Some(action) = driver_action {
        let row = DriverRow {
            thread: tid,
            time_us,
            action,
            ptr: r.ptr,
            size: r.size,
            device: r.device,
            nanos,
        };
        rmm_csv::push_driver_row(driver, &row);
        return;
    }
    let action = match r.kind {
        KIND_ALLOCATE => Action::Allocate,
        KIND_FREE => Action::Free,
        _ => Action::AllocateFailure,
    };
    let ev = TraceEvent {
        thread: tid,
        time_us,
        action,
        ptr: r.ptr,
        size: r.size,
        stream: r.stream,
        device: (r.device != NO_DEVICE).then_some(r.device),
        stream_id: (r.stream_id != NO_STREAM_ID).then_some(r.stream_id),
        streamless: r.streamless,
        rounded: (r.rounded != 0).then_some(r.rounded),
        result: (r.status != 0).then(|| result_word(r.status).to_string()),
        nanos: Some(nanos),
    };
    rmm_csv::push_row(main, &ev);
}

/// The `Result` column's word for a failed call's status (`CupoolStatus as u8`).
pub fn result_word(status: u8) -> &'static str {
    use CupoolStatus::*;
    const WORDS: [(CupoolStatus, &str); 14] = [
        (CupoolErrorInvalidValue, "invalid_value"),
        (CupoolErrorOutOfMemory, "out_of_memory"),
        (CupoolErrorBackendUnavailable, "backend_unavailable"),
        (CupoolErrorInvalidPointer, "invalid_pointer"),
        (CupoolErrorDoubleFree, "double_free"),
        (CupoolErrorInvalidDevice, "invalid_device"),
        (CupoolErrorUnknownConfigKey, "unknown_config_key"),
        (CupoolErrorInvalidConfigValue, "invalid_config_value"),
        (CupoolErrorCuda, "cuda_error"),
        (CupoolErrorStreamCapture, "stream_capture"),
        (CupoolErrorBufferTooSmall, "buffer_too_small"),
        (CupoolErrorVersionMismatch, "version_mismatch"),
        (CupoolErrorInternal, "internal_error"),
        (CupoolErrorIo, "io_error"),
    ];
    WORDS
        .iter()
        .find(|(s, _)| *s as u8 == status)
        .map_or("error", |(_, w)| w)
}

/// The driver file's path for the trace at `path` (module docs).
pub fn driver_path(path: &str) -> String {
    if let Some(stem) = path.strip_suffix(".csv.zst") {
        format!("{stem}.driver.csv.zst")
    } else if let Some(stem) = path.strip_suffix(".csv") {
        format!("{stem}.driver.csv")
    } else if is_zstd_path(Path::new(path)) {
        format!("{path}.driver.csv.zst")
    } else {
        format!("{path}.driver.csv")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_file_sits_beside_the_trace() {
        assert_eq!(driver_path("run/x.csv"), "run/x.driver.csv");
        assert_eq!(driver_path("x.csv.zst"), "x.driver.csv.zst");
        assert_eq!(driver_path("x.log"), "x.log.driver.csv");
        assert_eq!(driver_path("x.zst"), "x.zst.driver.csv.zst");
    }

    #[test]
    fn every_failure_has_its_own_word() {
        let words: Vec<&str> = (1..=14).map(result_word).collect();
        let mut unique = words.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), words.len());
        assert_eq!(
            result_word(CupoolStatus::CupoolErrorOutOfMemory as u8),
            "out_of_memory"
        );
        assert_eq!(
            result_word(CupoolStatus::CupoolErrorDoubleFree as u8),
            "double_free"
        );
    }
}
