//! Logging to stderr, gated by `CUPOOL_LOG` (`off`, `error`, `warn`, `info`, `debug`; default
//! `error`). Lines go out with one `write(2)` each: no stdout lock, no buffering, safe from
//! any thread and at exit.

use core::sync::atomic::{AtomicU8, Ordering::Relaxed};

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Level {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
}

const UNREAD: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNREAD);

/// Parses a `CUPOOL_LOG` value; `None` for an unknown word.
pub fn parse_level(v: &str) -> Option<Level> {
    match v.trim().to_ascii_lowercase().as_str() {
        "off" | "none" | "0" => Some(Level::Off),
        "error" | "1" => Some(Level::Error),
        "warn" | "warning" | "2" => Some(Level::Warn),
        "info" | "3" => Some(Level::Info),
        "debug" | "4" | "trace" => Some(Level::Debug),
        _ => None,
    }
}

/// The level in force, read from `CUPOOL_LOG` on first use.
pub fn level() -> Level {
    let v = LEVEL.load(Relaxed);
    if v != UNREAD {
        return level_from(v);
    }
    let (lvl, bad) = match std::env::var("CUPOOL_LOG") {
        Ok(s) => match parse_level(&s) {
            Some(l) => (l, None),
            None => (Level::Error, Some(s)),
        },
        Err(_) => (Level::Error, None),
    };
    LEVEL.store(lvl as u8, Relaxed);
    if let Some(s) = bad {
        always(&format!(
            "cupool: CUPOOL_LOG='{s}' is not one of off, error, warn, info, debug; using error"
        ));
    }
    lvl
}

fn level_from(v: u8) -> Level {
    match v {
        0 => Level::Off,
        1 => Level::Error,
        2 => Level::Warn,
        3 => Level::Info,
        _ => Level::Debug,
    }
}

pub fn enabled(l: Level) -> bool {
    l != Level::Off && level() >= l
}

/// Writes `msg` and a newline to stderr with a single `write(2)`, whatever the level.
pub fn always(msg: &str) {
    let mut line = Vec::with_capacity(msg.len() + 1);
    line.extend_from_slice(msg.as_bytes());
    line.push(b'\n');
    write_stderr(&line);
}

/// Writes raw bytes to fd 2, retrying on short writes; errors are ignored (nowhere to report).
pub fn write_stderr(mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the pointer and length describe a live slice.
        let n = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
        if n <= 0 {
            return;
        }
        bytes = &bytes[n as usize..];
    }
}

pub fn error(msg: &str) {
    if enabled(Level::Error) {
        always(msg);
    }
}

pub fn warn(msg: &str) {
    if enabled(Level::Warn) {
        always(msg);
    }
}

pub fn info(msg: &str) {
    if enabled(Level::Info) {
        always(msg);
    }
}

pub fn debug(msg: &str) {
    if enabled(Level::Debug) {
        always(msg);
    }
}
