//! Trace formats: RMM's CSV (as RMM writes it and as cupool writes it), zstd and gzip
//! files, PyTorch snapshot pickles; and bad traces, which must give an error with their
//! position, never a panic. No GPU.

use cupool::trace::io::{check_consistency, is_zstd_path, open, read_trace, write_trace};
use cupool::trace::{
    rmm_csv, snapshot, Action, Format, Position, Reference, Trace, TraceError, TraceEvent,
};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/traces/fixtures")
        .join(name)
}

fn bad(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/traces/bad")
        .join(name)
}

/// A scratch file path, one per test name.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("trace_formats");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn write_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn read_err(path: &Path) -> TraceError {
    match read_trace(path) {
        Ok(t) => panic!("{} read as {} events", path.display(), t.events.len()),
        Err(e) => e,
    }
}

/// Seconds since midnight as `time_us`.
fn tod(h: u64, m: u64, s: u64, us: u64) -> u64 {
    ((h * 60 + m) * 60 + s) * 1_000_000 + us
}

/// A trace using every cupool column, failures included.
fn cupool_trace() -> Trace {
    cupool_trace_of(500)
}

/// `pairs` allocations and their frees, and an allocation failure every 50.
fn cupool_trace_of(pairs: u64) -> Trace {
    let mut events = Vec::new();
    for i in 0..pairs {
        let ptr = 0x7f00_0000_0000 + (i % 7) * 0x10_0000;
        let mut alloc = TraceEvent::rmm(
            1000 + i % 3,
            tod(9, 0, 0, i * 17),
            Action::Allocate,
            ptr,
            100 + i,
            i % 2 * 0x55d0_c0a3_b2c0,
        );
        alloc.device = Some((i % 2) as i32);
        alloc.stream_id = (i % 2 == 1).then_some(3 + i);
        alloc.streamless = i % 2 == 0;
        alloc.rounded = Some(512);
        alloc.nanos = Some(i * 1000 + 7);
        let mut free = alloc.clone();
        free.action = Action::Free;
        free.time_us += 5;
        free.nanos = None;
        events.push(alloc);
        events.push(free);
        if i % 50 == 0 {
            let mut oom =
                TraceEvent::rmm(7, tod(9, 0, 1, i), Action::AllocateFailure, 0, 1 << 40, 0);
            oom.result = Some("out_of_memory".into());
            oom.device = Some(0);
            events.push(oom);
        }
    }
    Trace::from_events(events, Vec::new())
}

#[test]
fn cupool_csv_round_trips_plain_and_zstd() {
    let trace = cupool_trace();
    for name in ["round_trip.csv", "round_trip.csv.zst"] {
        let path = scratch(name);
        write_trace(&path, &trace).unwrap();
        let head = std::fs::read(&path).unwrap()[..4].to_vec();
        assert_eq!(
            head == [0x28, 0xB5, 0x2F, 0xFD],
            is_zstd_path(&path),
            "{name}"
        );
        let back = read_trace(&path).unwrap();
        assert_eq!(back.format, Format::RmmCsv);
        assert_eq!(back.events, trace.events, "{name}");
        assert_eq!(back.positions, trace.positions, "{name}");
        assert!(back.prelude.is_empty() && back.reference.is_none());
        check_consistency(&back).unwrap();
    }
    // The header is RMM's, then cupool's.
    let mut text = String::new();
    open(&scratch("round_trip.csv.zst"))
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    assert!(text.starts_with(&format!(
        "{},{}\n",
        rmm_csv::RMM_HEADER,
        rmm_csv::CUPOOL_COLUMNS
    )));
}

#[test]
fn reads_a_log_as_rmm_writes_it() {
    let trace = read_trace(&fixture("rmm_log.csv")).unwrap();
    let (t1, t2) = (140573312345856, 140573303953152);
    let expected = vec![
        TraceEvent::rmm(
            t1,
            tod(14, 3, 27, 123456),
            Action::Allocate,
            0x7f8a40000000,
            1024,
            0,
        ),
        TraceEvent::rmm(
            t1,
            tod(14, 3, 27, 123501),
            Action::Allocate,
            0x7f8a40000400,
            256,
            0x55d0c0a3b2c0,
        ),
        TraceEvent::rmm(
            t2,
            tod(14, 3, 27, 124010),
            Action::Free,
            0x7f8a40000000,
            1024,
            0,
        ),
        TraceEvent::rmm(
            t2,
            tod(14, 3, 27, 124100),
            Action::AllocateFailure,
            0,
            68719476736,
            0,
        ),
        TraceEvent::rmm(
            t1,
            tod(14, 3, 28, 7),
            Action::Free,
            0x7f8a40000400,
            256,
            0x55d0c0a3b2c0,
        ),
    ];
    assert_eq!(trace.events, expected);
    assert_eq!(
        trace.positions,
        (2..=6).map(Position::Line).collect::<Vec<_>>()
    );
    assert_eq!(trace.format, Format::RmmCsv);
    check_consistency(&trace).unwrap();
}

#[test]
fn reads_columns_by_name_and_is_lenient_where_rmm_writers_differ() {
    // Columns reordered, an unknown one, RMM's docs' `deallocate`, epoch seconds, no `0x`,
    // a blank line, CRLF line ends, cupool columns left empty.
    let text = "Size,Stream,Action,Extra,Pointer,Time,Thread,Device,Result\r\n\
                64,0,allocate,x,7f00,1700000000.25,9,,ok\r\n\
                \r\n\
                64,0x0,deallocate,y,0x7f00,1700000000.5,9,1,\r\n";
    let trace = rmm_csv::read(text.as_bytes()).unwrap();
    let mut free = TraceEvent::rmm(9, 1_700_000_000_500_000, Action::Free, 0x7f00, 64, 0);
    free.device = Some(1);
    assert_eq!(
        trace.events,
        vec![
            TraceEvent::rmm(9, 1_700_000_000_250_000, Action::Allocate, 0x7f00, 64, 0),
            free
        ]
    );
    assert_eq!(trace.positions, vec![Position::Line(2), Position::Line(4)]);
}

/// Compresses `bytes` as two zstd frames, split in the middle of a line.
fn two_zstd_frames(bytes: &[u8]) -> Vec<u8> {
    let cut = bytes.len() / 2 + 3;
    let mut out = zstd::encode_all(&bytes[..cut], 3).unwrap();
    out.extend(zstd::encode_all(&bytes[cut..], 3).unwrap());
    out
}

#[test]
fn reads_every_frame_of_a_multi_frame_zstd_file_and_every_gzip_member() {
    let plain = scratch("frames.csv");
    write_trace(&plain, &cupool_trace()).unwrap();
    let bytes = std::fs::read(&plain).unwrap();
    let expected = read_trace(&plain).unwrap().events;

    let zst = write_file("frames.csv.zst", &two_zstd_frames(&bytes));
    assert_eq!(read_trace(&zst).unwrap().events, expected);

    // gzip, found by magic bytes (the name says nothing), two members.
    let mut gz = Vec::new();
    for part in [&bytes[..100], &bytes[100..]] {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(part).unwrap();
        gz.extend(encoder.finish().unwrap());
    }
    assert_eq!(
        read_trace(&write_file("frames_gzip.trace", &gz))
            .unwrap()
            .events,
        expected
    );
}

#[test]
fn bad_csv_traces_say_which_line_and_column() {
    let cases: [(&str, Position, &str); 6] = [
        (
            "truncated_line.csv",
            Position::Line(4),
            "truncated row: 4 fields, the header has 6",
        ),
        (
            "missing_column.csv",
            Position::Line(1),
            "missing column Pointer",
        ),
        (
            "wrong_columns.csv",
            Position::Line(1),
            "missing column Thread: an RMM log's header names Thread,Time,Action,Pointer,Size,Stream (this one has 3 fields: name,size,when)",
        ),
        (
            "bad_pointer.csv",
            Position::Line(3),
            "column Pointer: bad hex pointer `0x7f8g40000400`",
        ),
        (
            "unknown_action.csv",
            Position::Line(4),
            "column Action: unknown action `reallocate`",
        ),
        (
            "garbage.bin",
            Position::Line(1),
            "not an RMM CSV log or a PyTorch snapshot",
        ),
    ];
    for (name, position, words) in cases {
        let err = read_err(&bad(name));
        assert_eq!(err.position, position, "{name}: {err}");
        assert!(err.message.contains(words), "{name}: {err}");
        assert!(
            err.to_string().starts_with(&format!("{position}: ")),
            "{err}"
        );
    }
    // Each bad field of a row, built here.
    let header = format!("{},{}\n", rmm_csv::RMM_HEADER, rmm_csv::CUPOOL_COLUMNS);
    let good = "1,10:00:00.000001,allocate,0x10,8,0x0,0,,1,16,ok,5";
    let fields: Vec<&str> = good.split(',').collect();
    for (column, value, words) in [
        (0, "12a", "column Thread: bad thread id `12a`"),
        (1, "10:0:00.1", "column Time: bad time `10:0:00.1`"),
        (1, "10:00:00.12x", "column Time: bad time"),
        (4, "-8", "column Size: bad size `-8`"),
        (4, "99999999999999999999", "column Size: bad size"),
        (5, "0xfffffffffffffffff", "column Stream: bad hex stream"),
        (6, "zero", "column Device: bad device `zero`"),
        (8, "2", "column Streamless: bad flag (0 or 1) `2`"),
        (9, "1k", "column Rounded: bad size `1k`"),
        (11, "5.5", "column Nanos: bad nanoseconds `5.5`"),
    ] {
        let mut row = fields.clone();
        row[column] = value;
        let text = format!("{header}{good}\n{}\n{good}\n", row.join(","));
        let err = rmm_csv::read(text.as_bytes()).unwrap_err();
        assert_eq!(err.position, Position::Line(3), "{err}");
        assert!(err.message.contains(words), "{value}: {err}");
    }
    // A result other than `ok` is kept; `ok` is not.
    let text = format!(
        "{header}{good}\n{}\n",
        good.replace(",ok,", ",out_of_memory,")
    );
    let trace = rmm_csv::read(text.as_bytes()).unwrap();
    assert_eq!(trace.events[0].result, None);
    assert_eq!(trace.events[1].result.as_deref(), Some("out_of_memory"));
}

#[test]
fn files_that_are_not_traces() {
    let missing = scratch("no_such_trace.csv");
    let err = read_err(&missing);
    assert_eq!(err.position, Position::File);
    assert!(
        err.message
            .starts_with(&format!("cannot open {}: ", missing.display())),
        "{err}"
    );
    assert!(open(&missing).is_err());

    let err = read_err(&write_file("empty.csv", b""));
    assert!(err.message.contains("is empty"), "{err}");

    // Invalid UTF-8 in a row (not the header).
    let text = b"Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00.0,allo\xffcate,0x1,1,0x0\n";
    let err = read_err(&write_file("invalid_utf8.csv", text));
    assert_eq!(err.position, Position::Line(2));
    assert!(
        err.message.contains("unknown action `allo\u{fffd}cate`"),
        "{err}"
    );

    // A pickle that is not a snapshot, and bytes after a pickle's first byte.
    let err = read_err(&write_file("list.pickle", &[0x80, 4, b']', b'.']));
    assert!(err.message.contains("holds a list, not a dict"), "{err}");
    let err = read_err(&write_file("garbage.pickle", &[0x80, 4, 0xff, 0xfe, 0x00]));
    assert!(
        err.message
            .contains("not a readable PyTorch snapshot pickle"),
        "{err}"
    );
    // Compressed garbage.
    let mut zstd_garbage = vec![0x28, 0xB5, 0x2F, 0xFD];
    zstd_garbage.extend(std::fs::read(bad("garbage.bin")).unwrap());
    let err = read_err(&write_file("garbage.zst", &zstd_garbage));
    assert!(err.message.contains("corrupt"), "{err}");
    let err = read_err(&write_file("garbage.gz", &[0x1F, 0x8B, 8, 0, 1, 2, 3]));
    assert!(err.message.contains("corrupt"), "{err}");
}

#[test]
fn a_truncated_zstd_file_is_an_error_with_the_line_it_stopped_at() {
    // Large enough for several zstd blocks (128 KiB each): those before the cut decode.
    let plain = scratch("to_truncate.csv");
    write_trace(&plain, &cupool_trace_of(6000)).unwrap();
    let lines = std::fs::read_to_string(&plain).unwrap().lines().count() as u64;
    let compressed = zstd::encode_all(std::fs::read(&plain).unwrap().as_slice(), 3).unwrap();
    for keep in [compressed.len() - 1, compressed.len() * 2 / 3] {
        let err = read_err(&write_file("truncated.csv.zst", &compressed[..keep]));
        let Position::Line(line) = err.position else {
            panic!("{err}")
        };
        assert!(line > lines / 3 && line <= lines, "{err}");
        assert!(err.message.contains("cut short or corrupt"), "{err}");
    }
    // Cut inside the first block: nothing decodes, the file as a whole is bad.
    let err = read_err(&write_file("truncated_early.csv.zst", &compressed[..100]));
    assert_eq!(err.position, Position::File);
    assert!(err.message.contains("cut short or corrupt"), "{err}");
    // Two frames, the second cut: the first frame's lines were read, then the error.
    let mut frames = two_zstd_frames(&std::fs::read(&plain).unwrap());
    frames.truncate(frames.len() - 10);
    let err = read_err(&write_file("truncated_frames.csv.zst", &frames));
    assert!(
        matches!(err.position, Position::Line(n) if n > lines / 3),
        "{err}"
    );
}

#[test]
fn unknown_pointers_and_double_frees_are_found_with_their_line() {
    let trace = read_trace(&bad("unknown_free.csv")).unwrap();
    let err = check_consistency(&trace).unwrap_err();
    assert_eq!(
        err.to_string(),
        "line 3: free of 0x7f8a40000400, which was never allocated (unknown pointer)"
    );
    let trace = read_trace(&bad("double_free.csv")).unwrap();
    let err = check_consistency(&trace).unwrap_err();
    assert_eq!(
        err.to_string(),
        "line 5: free of 0x7f8a40000000, which is not allocated at this point (double free: it \
         was freed at line 3)"
    );
    // Allocating an address that is live.
    let text = "Thread,Time,Action,Pointer,Size,Stream\n\
                1,00:00:00.0,allocate,0x40,8,0x0\n1,00:00:00.0,allocate,0x40,8,0x0\n";
    let err = check_consistency(&rmm_csv::read(text.as_bytes()).unwrap()).unwrap_err();
    assert_eq!(err.position, Position::Line(3));
    assert!(
        err.message
            .contains("already allocated (allocated at line 2"),
        "{err}"
    );
}

#[test]
fn cupool_rows_are_put_in_the_programs_order_by_nanos() {
    // Thread 2's buffer reached the file first: its free of thread 1's block comes before
    // the allocation in the file, and Nanos says which came first.
    let header = format!("{},{}\n", rmm_csv::RMM_HEADER, rmm_csv::CUPOOL_COLUMNS);
    let text = format!(
        "{header}\
         2,10:00:00.000030,free,0x100,8,0x0,0,,1,16,ok,3000\n\
         2,10:00:00.000040,allocate,0x200,8,0x0,0,,1,16,ok,4000\n\
         1,10:00:00.000010,allocate,0x100,8,0x0,0,,1,16,ok,1000\n\
         1,10:00:00.000020,allocate,0x300,8,0x0,0,,1,16,ok,2000\n\
         1,10:00:00.000050,free,0x300,8,0x0,0,,1,16,ok,4000\n"
    );
    let trace = rmm_csv::read(text.as_bytes()).unwrap();
    let order: Vec<_> = trace.events.iter().map(|e| e.nanos.unwrap()).collect();
    assert_eq!(order, vec![1000, 2000, 3000, 4000, 4000]);
    // Positions moved with their rows; equal times keep the file's order.
    assert_eq!(
        trace.positions,
        [4, 5, 2, 3, 6].map(Position::Line).to_vec()
    );
    check_consistency(&trace).unwrap();
    // RMM's logs (no Nanos) keep the file's order.
    let rmm: String = text
        .lines()
        .map(|l| l.split(',').take(6).collect::<Vec<_>>().join(",") + "\n")
        .collect();
    let trace = rmm_csv::read(rmm.as_bytes()).unwrap();
    assert_eq!(
        trace.positions,
        (2..=6).map(Position::Line).collect::<Vec<_>>()
    );
    assert!(check_consistency(&trace).is_err());
}

#[test]
fn a_thread_whose_nanos_step_back_keeps_its_own_order() {
    // The recorder's tick rate is measured again at every write, and a thread may move to
    // a CPU whose counter is a little behind: thread 1's free reads 900 after its
    // allocation's 1000. Its order in the file is its call order, and sorting keeps it.
    let header = format!("{},{}\n", rmm_csv::RMM_HEADER, rmm_csv::CUPOOL_COLUMNS);
    let text = format!(
        "{header}\
         1,10:00:00.000010,allocate,0x100,8,0x0,0,,1,16,ok,1000\n\
         1,10:00:00.000009,free,0x100,8,0x0,0,,1,16,ok,900\n\
         2,10:00:00.000009,allocate,0x200,8,0x0,0,,1,16,ok,950\n"
    );
    let trace = rmm_csv::read(text.as_bytes()).unwrap();
    assert_eq!(
        trace.positions,
        [4, 2, 3].map(Position::Line).to_vec(),
        "thread 2's earlier row first; thread 1's allocation before its free"
    );
    check_consistency(&trace).unwrap();
}

#[test]
fn driver_events_give_what_the_pool_reserved() {
    use cupool::trace::io::read_driver_reference;
    use cupool::trace::rmm_csv::DriverRow;
    use cupool::trace::DriverAction::*;
    let mut text = format!("{}\n", rmm_csv::DRIVER_HEADER);
    // Rows out of order across buffers; a segment from before the recording is freed.
    for (action, size, nanos) in [
        (SegmentAlloc, 4 * MIB, 30),
        (SegmentFree, MIB, 10),
        (SegmentAlloc, 2 * MIB, 20),
        (Map, 64 * MIB, 35),
        (SegmentFree, 2 * MIB, 40),
    ] {
        let row = DriverRow {
            thread: 1,
            time_us: nanos,
            action,
            ptr: 0x1000 * nanos,
            size,
            device: 0,
            nanos,
        };
        rmm_csv::push_driver_row(&mut text, &row);
    }
    let path = scratch("events.driver.csv.zst");
    std::fs::write(&path, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
    // 1 MiB before; −1, +2, +4: peak 6 MiB.
    let reference = read_driver_reference(&path).unwrap();
    assert_eq!(
        reference,
        Reference {
            peak_reserved_bytes: 6 * MIB,
            segment_allocs: 2
        }
    );
    // It is not a trace, and says so.
    let err = read_err(&path);
    assert_eq!(err.position, Position::Line(1));
    assert!(err.message.contains("driver-events file"), "{err}");
    // A bad row.
    let bad_row = text.replacen("segment_free,", "segment_frees,", 1);
    let err = rmm_csv::read_driver(bad_row.as_bytes()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "line 3: column Action: bad driver action `segment_frees`"
    );
}

const MIB: u64 = 1 << 20;
const T0: u64 = 1_763_900_000_000_000;
const A0: u64 = 0x7F00_0000_0000;
const S1: u64 = 0x7F00_0020_0000;
const S2: u64 = 0x7F00_0040_0000;
const S3: u64 = 0x7E00_0000_0000;
const SIDE_STREAM: u64 = 0x5555_A0B0_C0D0;

/// What make_snapshot_fixture.py wrote (see its docstring).
fn check_fixture_snapshot(trace: &Trace) {
    let ev = |device: i32, dt: u64, action, ptr, size, stream| {
        let mut e = TraceEvent::rmm(0, T0 + dt, action, ptr, size, stream);
        e.device = Some(device);
        e
    };
    use Action::*;
    let expected = vec![
        ev(0, 100, Free, A0, 512, 0),
        ev(0, 111, Allocate, S1, 1000, 0),
        ev(1, 116, Allocate, S3, 4096, 0),
        ev(0, 120, Allocate, S1 + 1024, 3000, SIDE_STREAM),
        ev(1, 120, Allocate, S3 + 4096, 256, 0),
        ev(0, 130, Free, S1, 1000, 0),
        ev(0, 140, AllocateFailure, 0, 1 << 34, 0),
        ev(0, 151, Allocate, S2, 20_000_000, 0),
        ev(0, 160, Free, S2, 20_000_000, 0),
    ];
    assert_eq!(trace.format, Format::TorchSnapshot);
    assert_eq!(trace.events, expected);
    let entry = |device, index| Position::Entry { device, index };
    assert_eq!(
        trace.positions,
        vec![
            entry(0, 0),
            entry(0, 3),
            entry(1, 1),
            entry(0, 4),
            entry(1, 2),
            entry(0, 6),
            entry(0, 8),
            entry(0, 10),
            entry(0, 11)
        ]
    );
    assert_eq!(trace.prelude, vec![(A0, 512, 0), (A0 + 512, 500, 0)]);
    assert_eq!(
        trace.reference,
        Some(Reference {
            peak_reserved_bytes: 26 * MIB,
            segment_allocs: 3
        })
    );
    check_consistency(trace).unwrap();
}

#[test]
fn imports_a_pytorch_snapshot_plain_and_gzipped() {
    for name in ["torch_snapshot.pickle", "torch_snapshot.pickle.gz"] {
        check_fixture_snapshot(&read_trace(&fixture(name)).unwrap());
    }
    let bytes = std::fs::read(fixture("torch_snapshot.pickle")).unwrap();
    check_fixture_snapshot(&snapshot::read(&bytes).unwrap());
}

#[test]
fn a_snapshot_converts_to_csv_that_replays_the_same() {
    let trace = read_trace(&fixture("torch_snapshot.pickle.gz")).unwrap();
    let path = scratch("from_snapshot.csv.zst");
    write_trace(&path, &trace).unwrap();
    let csv = read_trace(&path).unwrap();
    // The prelude comes first, as allocations; then the same events.
    let n = trace.prelude.len();
    for (ev, &(ptr, size, stream)) in csv.events.iter().zip(&trace.prelude) {
        assert_eq!(
            (ev.action, ev.ptr, ev.size, ev.stream),
            (Action::Allocate, ptr, size, stream)
        );
    }
    // Times become RMM's time of day.
    let day_us = 24 * 3600 * 1_000_000;
    let mut expected = trace.events.clone();
    expected.iter_mut().for_each(|ev| ev.time_us %= day_us);
    assert_eq!(csv.events[n..], expected[..]);
    check_consistency(&csv).unwrap();
}

mod pickles {
    //! Snapshots built here with serde-pickle, to reach what the fixture does not.
    use serde_pickle::{HashableValue, SerOptions, Value};

    pub fn s(text: &str) -> Value {
        Value::String(text.into())
    }

    pub fn i(n: i64) -> Value {
        Value::I64(n)
    }

    pub fn dict(pairs: Vec<(&str, Value)>) -> Value {
        Value::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| (HashableValue::String(k.into()), v))
                .collect(),
        )
    }

    pub fn entry(action: &str, addr: Value, size: i64, time_us: i64) -> Value {
        dict(vec![
            ("action", s(action)),
            ("addr", addr),
            ("size", i(size)),
            ("stream", i(0)),
            ("time_us", i(time_us)),
            ("frames", Value::List(vec![])),
        ])
    }

    pub fn snapshot_of(segments: Vec<Value>, device_traces: Vec<Vec<Value>>) -> Vec<u8> {
        let root = dict(vec![
            ("segments", Value::List(segments)),
            (
                "device_traces",
                Value::List(device_traces.into_iter().map(Value::List).collect()),
            ),
            ("allocator_settings", dict(vec![])),
        ]);
        serde_pickle::value_to_vec(&root, SerOptions::new()).unwrap()
    }

    /// A Python int too big for i64, as serde-pickle decodes it.
    pub fn big(n: u64) -> Value {
        let bytes = serde_pickle::to_vec(&n, SerOptions::new()).unwrap();
        let value = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap();
        assert!(matches!(value, Value::Int(_)), "{value:?}");
        value
    }
}

#[test]
fn snapshots_with_expandable_segments_big_ints_and_bad_entries() {
    use pickles::*;
    use serde_pickle::Value;
    // Expandable segments: reserved moves with segment_map/segment_unmap. A pointer with its
    // top bit set arrives as a big int, or as a negative int64 (PyTorch casts).
    let high = 0xFFFF_8000_0000_0000u64;
    let bytes = snapshot_of(
        vec![dict(vec![
            ("total_size", i(4 << 20)),
            ("blocks", Value::List(vec![])),
        ])],
        vec![vec![
            entry("segment_map", i(0x1000_0000), 6 << 20, 10),
            entry("alloc", big(high), 100, 11),
            entry("alloc", i(0x1000_0000), 200, 12),
            entry("free_requested", i(high as i64), 100, 13),
            entry("segment_unmap", i(0x1020_0000), 2 << 20, 14),
            entry("free_requested", i(0x1000_0000), 200, 15),
        ]],
    );
    let trace = snapshot::read(&bytes).unwrap();
    assert_eq!(trace.events.len(), 4);
    assert_eq!((trace.events[0].ptr, trace.events[2].ptr), (high, high));
    assert!(trace.prelude.is_empty());
    // 4 MiB at the end, +6 −2 in the trace: nothing before it, 6 MiB at the peak.
    assert_eq!(
        trace.reference,
        Some(Reference {
            peak_reserved_bytes: 6 << 20,
            segment_allocs: 1
        })
    );
    check_consistency(&trace).unwrap();

    let good = entry("alloc", i(0x10), 8, 1);
    let cases: Vec<(Value, &str)> = vec![
        (i(5), "a trace entry is a dict; this one is an int"),
        (dict(vec![("addr", i(1))]), "trace entry has no `action`"),
        (
            dict(vec![("action", i(1))]),
            "`action` is an int, not a string",
        ),
        (
            entry("alloc", s("0x10"), 8, 1),
            "`addr` is a string, not an int",
        ),
        (
            dict(vec![("action", s("alloc")), ("size", i(8))]),
            "`alloc` entry has no `addr`",
        ),
        (entry("free_requested", i(0x10), -8, 1), "bad `size` -8"),
        (entry("alloc", i(0x20), 8, -1), "bad `time_us` -1"),
        (
            dict(vec![
                ("action", s("alloc")),
                ("addr", i(1)),
                ("size", Value::None),
            ]),
            "`size` is None",
        ),
    ];
    for (bad_entry, words) in cases {
        let bytes = snapshot_of(vec![], vec![vec![], vec![good.clone(), bad_entry.clone()]]);
        let err = snapshot::read(&bytes).unwrap_err();
        assert_eq!(
            err.position,
            Position::Entry {
                device: 1,
                index: 1
            },
            "{bad_entry:?}: {err}"
        );
        assert!(err.message.contains(words), "{err}");
        assert!(
            err.to_string().starts_with("device 1 trace entry 1: "),
            "{err}"
        );
    }
    // Wrong shapes at the top.
    for (root, words) in [
        (Value::List(vec![]), "holds a list"),
        (
            dict(vec![("segments", Value::List(vec![]))]),
            "no `device_traces`",
        ),
        (
            dict(vec![("device_traces", i(3))]),
            "`device_traces` is an int",
        ),
        (
            dict(vec![("device_traces", Value::List(vec![s("x")]))]),
            "device_traces[0] is a string",
        ),
        (
            dict(vec![
                ("device_traces", Value::List(vec![])),
                ("segments", Value::List(vec![i(1)])),
            ]),
            "segments[0]: is an int",
        ),
        (
            dict(vec![
                ("device_traces", Value::List(vec![])),
                ("segments", Value::List(vec![dict(vec![])])),
            ]),
            "segments[0]: no `total_size`",
        ),
    ] {
        let bytes = serde_pickle::value_to_vec(&root, serde_pickle::SerOptions::new()).unwrap();
        let err = snapshot::read(&bytes).unwrap_err();
        assert_eq!(err.position, Position::File, "{err}");
        assert!(err.message.contains(words), "{err}");
    }
}

#[test]
fn deeply_nested_pickles_are_an_error_not_a_stack_overflow() {
    // `)` then TUPLE1 (0x85) over and over: one level of nesting per byte.
    let mut bytes = vec![0x80, 4, b')'];
    bytes.extend(std::iter::repeat_n(0x85u8, 5_000));
    bytes.push(b'.');
    let err = snapshot::read(&bytes).unwrap_err();
    assert!(err.message.contains("holds a tuple"), "{err}");
}

mod no_panics {
    //! Random bytes and random edits of valid files, through every reader: an error or a
    //! trace, never a panic.
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngSeed};

    /// The valid files to mutate: RMM's log, cupool's CSV plain and zstd, the snapshot
    /// plain and gzip.
    fn valid_files() -> &'static [Vec<u8>] {
        static FILES: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
        FILES.get_or_init(read_valid_files)
    }

    fn read_valid_files() -> Vec<Vec<u8>> {
        let plain = scratch("mutate.csv");
        let mut trace = cupool_trace();
        trace.events.truncate(40);
        write_trace(&plain, &trace).unwrap();
        let zst = scratch("mutate.csv.zst");
        write_trace(&zst, &trace).unwrap();
        [
            fixture("rmm_log.csv"),
            plain,
            zst,
            fixture("torch_snapshot.pickle"),
            fixture("torch_snapshot.pickle.gz"),
        ]
        .iter()
        .map(|p| std::fs::read(p).unwrap())
        .collect()
    }

    fn every_reader(bytes: &[u8], file_name: &str) {
        let results = [
            rmm_csv::read(bytes),
            snapshot::read(bytes),
            read_trace(&write_file(file_name, bytes)),
        ];
        for trace in results.iter().flatten() {
            assert_eq!(trace.events.len(), trace.positions.len());
            let _ = check_consistency(trace);
        }
    }

    fn config() -> Config {
        Config {
            cases: 48,
            failure_persistence: None,
            rng_seed: RngSeed::Fixed(0x00C0_FFEE),
            ..Config::default()
        }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn random_bytes(magic in 0usize..4, body in proptest::collection::vec(any::<u8>(), 0..600)) {
            let prefixes: [&[u8]; 4] = [b"", &[0x28, 0xB5, 0x2F, 0xFD], &[0x1F, 0x8B], &[0x80, 4]];
            let mut bytes = prefixes[magic].to_vec();
            bytes.extend(body);
            every_reader(&bytes, "random_bytes.bin");
        }

        #[test]
        fn mutated_files(
            which in 0usize..5,
            edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..6),
        ) {
            let mut bytes = valid_files()[which].clone();
            for (at, byte, how) in edits {
                let i = at.index(bytes.len().max(1));
                match how {
                    0 if i < bytes.len() => bytes[i] = byte,
                    1 => bytes.insert(i.min(bytes.len()), byte),
                    2 if i < bytes.len() => { bytes.remove(i); }
                    _ => bytes.truncate(i),
                }
            }
            every_reader(&bytes, "mutated.bin");
        }
    }
}
