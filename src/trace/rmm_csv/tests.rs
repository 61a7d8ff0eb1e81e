//! Tests of the RMM CSV reader and writer (`src/trace/rmm_csv.rs`).

use super::*;

#[test]
fn rows_have_rmm_columns_first() {
    let mut ev = TraceEvent::rmm(7, 50_607_123_456, Action::Allocate, 0x7f00, 1000, 0);
    ev.device = Some(0);
    ev.stream_id = Some(3);
    ev.rounded = Some(1024);
    ev.nanos = Some(99);
    let mut s = String::new();
    push_row(&mut s, &ev);
    assert_eq!(
        s,
        "7,14:03:27.123456,allocate,0x7f00,1000,0x0,0,3,0,1024,ok,99\n"
    );
    let mut s = String::new();
    push_row(
        &mut s,
        &TraceEvent::rmm(1, 0, Action::AllocateFailure, 0, 5, 0x10),
    );
    assert_eq!(
        s,
        "1,00:00:00.000000,allocate failure,0x0,5,0x10,,,0,,ok,\n"
    );
}

#[test]
fn fields_parse_as_rmm_writes_them() {
    assert_eq!(parse_time(b"14:03:27.123456"), Some(50_607_123_456));
    assert_eq!(parse_time(b"00:00:00.5"), Some(500_000));
    assert_eq!(parse_time(b"23:59:59.1234567"), Some(86_399_123_456));
    assert_eq!(
        parse_time(b"1700000000.000001"),
        Some(1_700_000_000_000_001)
    );
    assert_eq!(parse_time(b"12"), Some(12_000_000));
    for bad in [
        &b""[..],
        b"1:2:3",
        b"10:60:00",
        b"10:00",
        b"10:00:00:00",
        b"1.x",
        b"a.1",
    ] {
        assert_eq!(parse_time(bad), None, "{}", String::from_utf8_lossy(bad));
    }
    assert_eq!(parse_hex(b"0x7f8a40000000"), Some(0x7f8a_4000_0000));
    assert_eq!(parse_hex(b"7F8A"), Some(0x7f8a));
    assert_eq!(parse_hex(b"(nil)"), Some(0));
    assert_eq!(parse_hex(b"0xffffffffffffffff"), Some(u64::MAX));
    for bad in [&b""[..], b"0x", b"0x1g", b"0x10000000000000000", b"-1"] {
        assert_eq!(parse_hex(bad), None, "{}", String::from_utf8_lossy(bad));
    }
    assert_eq!(parse_decimal(b"18446744073709551615"), Some(u64::MAX));
    assert_eq!(parse_decimal(b"18446744073709551616"), None);
    assert_eq!(parse_number(b"0x10"), Some(16));
    assert_eq!(
        parse_action(b"allocate failure"),
        Some(Action::AllocateFailure)
    );
    assert_eq!(parse_action(b"deallocate"), Some(Action::Free));
    assert_eq!(parse_action(b"alloc"), None);
    assert_eq!(shorten("x".repeat(50).as_bytes()).len(), 43);
}

/// `HH:MM:SS.ffffff` of a time in microseconds (RMM's `Time`, wrapping at a day).
fn clock(time_us: u64) -> String {
    let us = time_us % (24 * 3600 * 1_000_000);
    let secs = us / 1_000_000;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60,
        us % 1_000_000
    )
}

/// The rows as `core::fmt` wrote them before the hand-written writers.
fn fmt_row(ev: &TraceEvent) -> String {
    use core::fmt::Write as _;
    let mut out = String::new();
    let _ = write!(
        out,
        "{},{},{},{:#x},{},{:#x},",
        ev.thread,
        clock(ev.time_us),
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
    out
}

fn fmt_driver_row(row: &DriverRow) -> String {
    format!(
        "{},{},{},{:#x},{},{},{}\n",
        row.thread,
        clock(row.time_us),
        row.action.word(),
        row.ptr,
        row.size,
        row.device,
        row.nanos
    )
}

#[test]
fn rows_are_the_bytes_core_fmt_wrote() {
    // xorshift64*; each number has a random bit length, so every digit count occurs.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut number = || {
        let bits = next() % 65;
        let n = next();
        match bits {
            0 => 0,
            64 => n,
            b => n & ((1u64 << b) - 1),
        }
    };
    let edges = [0, 1, 9, 10, 99, 100, 1 << 63, u64::MAX, u64::MAX - 1];
    let actions = [Action::Allocate, Action::Free, Action::AllocateFailure];
    let driver_actions = [
        DriverAction::SegmentAlloc,
        DriverAction::SegmentFree,
        DriverAction::Map,
        DriverAction::Unmap,
    ];
    // Miri interprets every digit written (300 rows took 89 s of CI's Miri step): 40 rows,
    // every other one of edges, still reach each edge in each field many times over.
    let (rows, edge_every) = if cfg!(miri) {
        (40, 2)
    } else {
        (20_000usize, 7)
    };
    for i in 0..rows {
        let mut pick = || {
            if i % edge_every == 0 {
                edges[(number() % edges.len() as u64) as usize]
            } else {
                number()
            }
        };
        let (thread, time_us, ptr, size, stream) = (pick(), pick(), pick(), pick(), pick());
        let (stream_id, rounded, nanos, extra) = (pick(), pick(), pick(), pick());
        let device = match i % 5 {
            0 => i32::MIN,
            1 => i32::MAX,
            _ => extra as i32,
        };
        let mut ev = TraceEvent::rmm(thread, time_us, actions[i % 3], ptr, size, stream);
        ev.device = (extra & 1 != 0).then_some(device);
        ev.stream_id = (extra & 2 != 0).then_some(stream_id);
        ev.streamless = extra & 4 != 0;
        ev.rounded = (extra & 8 != 0).then_some(rounded);
        ev.result = (extra & 16 != 0).then(|| "out_of_memory".to_string());
        ev.nanos = (extra & 32 != 0).then_some(nanos);
        let mut row = String::from("prefix,");
        push_row(&mut row, &ev);
        assert_eq!(row, format!("prefix,{}", fmt_row(&ev)), "{ev:?}");

        let driver = DriverRow {
            thread,
            time_us,
            action: driver_actions[i % 4],
            ptr,
            size,
            device,
            nanos,
        };
        let mut row = String::new();
        push_driver_row(&mut row, &driver);
        assert_eq!(row, fmt_driver_row(&driver), "{driver:?}");

        let mut time = String::new();
        push_time_of_day(&mut time, time_us);
        assert_eq!(time, fmt_row(&ev).split(',').nth(1).unwrap());
    }
}

#[test]
fn rows_written_read_back() {
    let mut ev = TraceEvent::rmm(7, 50_607_123_456, Action::Free, 0x7f00, 1000, 0x20);
    ev.device = Some(1);
    ev.streamless = true;
    ev.result = Some("double_free".into());
    let plain = TraceEvent::rmm(1, 0, Action::AllocateFailure, 0, 5, 0x10);
    let mut text = header();
    text.push('\n');
    push_row(&mut text, &ev);
    push_row(&mut text, &plain);
    let trace = read(text.as_bytes()).unwrap();
    assert_eq!(trace.events, vec![ev, plain]);
    assert_eq!(trace.positions, vec![Position::Line(2), Position::Line(3)]);
}
