//! Writing RMM's log CSV (the format: `src/trace/rmm_csv.rs`): cupool's rows and the rows
//! of the driver-events file, without `core::fmt`.

use super::{CUPOOL_COLUMNS, RMM_HEADER};
use crate::trace::{DriverAction, TraceEvent};

/// The full header line cupool writes (no newline).
pub fn header() -> String {
    format!("{RMM_HEADER},{CUPOOL_COLUMNS}")
}

/// Appends `HH:MM:SS.ffffff` for `us` microseconds since midnight (wrapped to one day).
pub fn push_time_of_day(out: &mut String, us: u64) {
    Row::new(out).time_of_day(us);
}

/// Appends one row (with a newline) for `ev`, cupool's columns included.
pub fn push_row(out: &mut String, ev: &TraceEvent) {
    let mut w = Row::new(out);
    w.leading_columns(ev.thread, ev.time_us, ev.action.rmm_word(), ev.ptr, ev.size);
    w.hex(ev.stream);
    w.byte(b',');
    if let Some(d) = ev.device {
        w.signed(d);
    }
    w.byte(b',');
    if let Some(id) = ev.stream_id {
        w.decimal(id);
    }
    w.byte(b',');
    w.byte(if ev.streamless { b'1' } else { b'0' });
    w.byte(b',');
    if let Some(r) = ev.rounded {
        w.decimal(r);
    }
    w.byte(b',');
    w.text(ev.result.as_deref().unwrap_or("ok"));
    w.byte(b',');
    if let Some(n) = ev.nanos {
        w.decimal(n);
    }
    w.byte(b'\n');
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
    let mut w = Row::new(out);
    w.leading_columns(
        row.thread,
        row.time_us,
        row.action.word(),
        row.ptr,
        row.size,
    );
    w.signed(row.device);
    w.byte(b',');
    w.decimal(row.nanos);
    w.byte(b'\n');
}

/// Two decimal digits of every number below 100: `00`, `01`, ..., `99`.
const DIGIT_PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// Writes the fields of a row without `core::fmt` (several times slower per row): the
/// same bytes as `{}` of the integers, `{:#x}` of the hex ones, and `{:02}` / `{:06}` of
/// the parts of the time of day.
struct Row<'a> {
    out: &'a mut String,
}

impl<'a> Row<'a> {
    fn new(out: &'a mut String) -> Self {
        Row { out }
    }

    /// The columns both files start with: thread, time of day, action, pointer, size, and
    /// the comma after them.
    fn leading_columns(&mut self, thread: u64, time_us: u64, action: &str, ptr: u64, size: u64) {
        self.decimal(thread);
        self.byte(b',');
        self.time_of_day(time_us);
        self.byte(b',');
        self.text(action);
        self.byte(b',');
        self.hex(ptr);
        self.byte(b',');
        self.decimal(size);
        self.byte(b',');
    }

    /// Appends ASCII bytes.
    #[inline]
    fn ascii(&mut self, b: &[u8]) {
        debug_assert!(b.is_ascii());
        // SAFETY: callers append ASCII only (digits, `x`, `-`, `:`, `.`, `,`, `\n`): the
        // string stays UTF-8.
        unsafe { self.out.as_mut_vec().extend_from_slice(b) }
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        self.ascii(&[b]);
    }

    #[inline]
    fn text(&mut self, s: &str) {
        self.out.push_str(s);
    }

    /// `{}` of `n`.
    #[inline]
    fn decimal(&mut self, mut n: u64) {
        let mut buf = [0u8; 20];
        let mut i = buf.len();
        while n >= 100 {
            let pair = (n % 100) as usize * 2;
            n /= 100;
            i -= 2;
            buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
        }
        if n >= 10 {
            let pair = n as usize * 2;
            i -= 2;
            buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
        } else {
            i -= 1;
            buf[i] = b'0' + n as u8;
        }
        self.ascii(&buf[i..]);
    }

    /// `{}` of `n`.
    #[inline]
    fn signed(&mut self, n: i32) {
        if n < 0 {
            self.byte(b'-');
        }
        self.decimal(u64::from(n.unsigned_abs()));
    }

    /// `{:#x}` of `n`: `0x`, then lowercase digits without leading zeros (`0x0` for 0).
    #[inline]
    fn hex(&mut self, n: u64) {
        let mut buf = [0u8; 18];
        let digits = (64 - n.leading_zeros() as usize).div_ceil(4).max(1);
        buf[0] = b'0';
        buf[1] = b'x';
        for (k, slot) in buf[2..2 + digits].iter_mut().enumerate() {
            let nibble = (n >> (4 * (digits - 1 - k))) & 0xf;
            *slot = b"0123456789abcdef"[nibble as usize];
        }
        self.ascii(&buf[..2 + digits]);
    }

    /// `HH:MM:SS.ffffff` for `us` microseconds since midnight (wrapped to one day).
    fn time_of_day(&mut self, us: u64) {
        let us = us % (24 * 3600 * 1_000_000);
        let (secs, frac) = (us / 1_000_000, us % 1_000_000);
        let two = |n: u64| {
            let pair = n as usize * 2;
            [DIGIT_PAIRS[pair], DIGIT_PAIRS[pair + 1]]
        };
        let [h0, h1] = two(secs / 3600);
        let [m0, m1] = two(secs / 60 % 60);
        let [s0, s1] = two(secs % 60);
        let [f0, f1] = two(frac / 10_000);
        let [f2, f3] = two(frac / 100 % 100);
        let [f4, f5] = two(frac % 100);
        self.ascii(&[
            h0, h1, b':', m0, m1, b':', s0, s1, b'.', f0, f1, f2, f3, f4, f5,
        ]);
    }
}
