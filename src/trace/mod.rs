//! Allocation traces: recording, the formats they are read from and written in, and replay.
//!
//! - [`record`]: `CUPOOL_TRACE=path` / `cupool_trace_start`: every allocation and free of the
//!   process, buffered per thread, written as RMM's log CSV (zstd when the path ends in
//!   `.zst`), plus a second file of driver segment events.
//! - [`rmm_csv`]: RMM's `logging_resource_adaptor` CSV (header
//!   `Thread,Time,Action,Pointer,Size,Stream`), with cupool's own columns after RMM's.
//! - [`snapshot`]: PyTorch memory snapshots (`torch.cuda.memory._snapshot()` pickles,
//!   plain or gzip).
//! - [`io`]: opening and creating trace files (zstd, gzip, plain), by name and magic bytes.
//! - [`replay`]: drives a [`crate::runtime::Runtime`] through a trace and reports the
//!   footprint (peak requested, allocated, reserved) and the time per operation.
//!
//! Every reader returns a [`Trace`]: the program's allocation events in the order they
//! happened, each with the position it came from, so a bad trace gets an error that says
//! where ([`TraceError`]).

pub mod io;
pub mod record;
pub mod replay;
pub mod rmm_csv;
pub mod snapshot;

use core::fmt;

/// What one program call did, in RMM's words.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A successful allocation (`allocate`).
    Allocate,
    /// A free (`free`).
    Free,
    /// An allocation that failed (`allocate failure`); `ptr` is 0.
    AllocateFailure,
}

impl Action {
    /// The word RMM's log writes for it.
    pub fn rmm_word(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::Free => "free",
            Action::AllocateFailure => "allocate failure",
        }
    }
}

/// One allocation event of a program.
///
/// RMM's columns are `thread`, `time_us`, `action`, `ptr`, `size`, `stream`; the others are
/// cupool's and are `None`/default when the trace came from elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    /// The calling thread (RMM: the OS thread id).
    pub thread: u64,
    /// Time of day in microseconds since midnight (RMM's `HH:MM:SS.ffffff`), or for
    /// snapshots PyTorch's `time_us`. Replay follows the order of events, not this.
    pub time_us: u64,
    pub action: Action,
    /// The block's address (0 for an allocation failure).
    pub ptr: u64,
    /// Bytes the program asked for (for a free: what it asked for when allocating, when the
    /// trace knows; RMM writes the size passed to `deallocate`).
    pub size: u64,
    /// The stream handle as the program passed it (0: the legacy default stream).
    pub stream: u64,
    /// Device ordinal (cupool column `Device`), when known.
    pub device: Option<i32>,
    /// The stream's unique id (`cuStreamGetId`, cupool column `StreamId`), when known:
    /// handles are reused after a stream is destroyed, ids never.
    pub stream_id: Option<u64>,
    /// Whether the call had no stream (`cupool_alloc`/`cupool_free`, `cudaMalloc`/`cudaFree`
    /// under the preload). Cupool column `Streamless`.
    pub streamless: bool,
    /// The block's size after the pool's rounding (cupool column `Rounded`), when known.
    pub rounded: Option<u64>,
    /// The call's result when it failed (cupool column `Result`; `ok` otherwise), e.g.
    /// `out_of_memory`, `invalid_pointer`, `double_free`.
    pub result: Option<String>,
    /// Nanoseconds since the recording started (cupool column `Nanos`), when known.
    pub nanos: Option<u64>,
}

impl TraceEvent {
    /// An event with RMM's columns only.
    pub fn rmm(
        thread: u64,
        time_us: u64,
        action: Action,
        ptr: u64,
        size: u64,
        stream: u64,
    ) -> Self {
        TraceEvent {
            thread,
            time_us,
            action,
            ptr,
            size,
            stream,
            device: None,
            stream_id: None,
            streamless: false,
            rounded: None,
            result: None,
            nanos: None,
        }
    }
}

/// A driver-level event of the pool itself (segments obtained and given back, VMM
/// mappings), recorded beside the program's events.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DriverAction {
    SegmentAlloc,
    SegmentFree,
    Map,
    Unmap,
}

impl DriverAction {
    pub fn word(self) -> &'static str {
        match self {
            DriverAction::SegmentAlloc => "segment_alloc",
            DriverAction::SegmentFree => "segment_free",
            DriverAction::Map => "map",
            DriverAction::Unmap => "unmap",
        }
    }
}

/// Where an event came from in its file: a CSV line (1-based, the header is line 1) or a
/// snapshot trace entry (device and 0-based index).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Position {
    Line(u64),
    Entry {
        device: usize,
        index: usize,
    },
    /// The whole file (bad magic, unreadable compression, missing header).
    File,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Position::Line(n) => write!(f, "line {n}"),
            Position::Entry { device, index } => {
                write!(f, "device {device} trace entry {index}")
            }
            Position::File => write!(f, "file"),
        }
    }
}

/// Why a trace could not be read or replayed: one line, with the position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    pub position: Position,
    pub message: String,
}

impl TraceError {
    pub fn new(position: Position, message: impl Into<String>) -> Self {
        TraceError {
            position,
            message: message.into(),
        }
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.position {
            Position::File => write!(f, "{}", self.message),
            p => write!(f, "{p}: {}", self.message),
        }
    }
}

impl std::error::Error for TraceError {}

/// The format a trace was read from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// RMM's log CSV (written by RMM or by cupool).
    RmmCsv,
    /// A PyTorch memory snapshot pickle.
    TorchSnapshot,
}

/// What the program that made the trace reserved, when the trace tells (a PyTorch snapshot's
/// `segment_alloc`/`segment_free` entries, or cupool's driver events).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Reference {
    /// Peak bytes of segments held at once.
    pub peak_reserved_bytes: u64,
    /// Segment allocations seen.
    pub segment_allocs: u64,
}

/// A trace read into memory: events in program order.
#[derive(Clone, Debug)]
pub struct Trace {
    pub format: Format,
    pub events: Vec<TraceEvent>,
    /// `events[i]` came from `positions[i]` (for errors found while replaying).
    pub positions: Vec<Position>,
    /// Blocks alive before the first event (a snapshot whose trace ring buffer lost its
    /// oldest entries frees blocks it never saw allocated): replay allocates these first.
    /// Each is (address, size, stream).
    pub prelude: Vec<(u64, u64, u64)>,
    pub reference: Option<Reference>,
}

impl Trace {
    /// A trace built in code, as if read from cupool's CSV: event `i` at line `i + 2` (the
    /// header is line 1), with `prelude` blocks alive before it.
    pub fn from_events(events: Vec<TraceEvent>, prelude: Vec<(u64, u64, u64)>) -> Trace {
        let positions = (0..events.len() as u64)
            .map(|i| Position::Line(i + 2))
            .collect();
        Trace {
            format: Format::RmmCsv,
            events,
            positions,
            prelude,
            reference: None,
        }
    }
}
