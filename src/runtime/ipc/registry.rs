//! The handles cupool hands out for blocks the driver's own handle cannot describe, and the
//! registry file behind them (Note [ipc registry] in [`super`]).

use core::ffi::c_uint;
use core::sync::atomic::{AtomicI32, AtomicU32, Ordering::Relaxed};
use std::ffi::CString;
use std::sync::Mutex;

/// The first bytes of every handle cupool makes.
const TAG: [u8; 8] = *b"cupoolIP";
/// Bytes of one registry record.
pub(super) const RECORD_BYTES: usize = 128;

/// What a tagged handle describes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// A block of a segment: the segment's legacy handle and the block's offset.
    Segment = 0,
    /// An arena block: the descriptors of its chunks (Note [ipc of arena blocks]).
    Arena = 1,
}

/// What a tagged handle carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Tagged {
    pub pid: u32,
    pub uid: u32,
    pub index: u32,
    pub nonce: u64,
    pub offset: u64,
    pub size: u64,
    pub kind: Kind,
}

impl Tagged {
    /// A handle of this process (its pid and uid) with a fresh nonce; `index` is set once
    /// the record is written.
    pub fn new(kind: Kind, offset: u64, size: u64) -> Tagged {
        // SAFETY: plain libc calls.
        let (pid, uid) = unsafe { (libc::getpid() as u32, libc::getuid()) };
        Tagged {
            pid,
            uid,
            index: 0,
            nonce: nonce(),
            offset,
            size,
            kind,
        }
    }

    pub fn to_bytes(self) -> [u8; 64] {
        let mut r = [0u8; 64];
        r[0..8].copy_from_slice(&TAG);
        r[8..12].copy_from_slice(&self.pid.to_le_bytes());
        r[12..16].copy_from_slice(&self.index.to_le_bytes());
        r[16..24].copy_from_slice(&self.nonce.to_le_bytes());
        r[24..32].copy_from_slice(&self.offset.to_le_bytes());
        r[32..40].copy_from_slice(&self.size.to_le_bytes());
        r[40..44].copy_from_slice(&self.uid.to_le_bytes());
        r[44..48].copy_from_slice(&(self.kind as u32).to_le_bytes());
        r
    }

    /// The handle's fields when cupool made it; `None` for any other 64 bytes (a
    /// driver's handle).
    pub fn read(r: &[u8; 64]) -> Option<Tagged> {
        if r[0..8] != TAG || r[48..].iter().any(|&b| b != 0) {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap());
        let kind = match u32_at(44) {
            0 => Kind::Segment,
            1 => Kind::Arena,
            _ => return None,
        };
        Some(Tagged {
            kind,
            pid: u32_at(8),
            index: u32_at(12),
            nonce: u64_at(16),
            offset: u64_at(24),
            size: u64_at(32),
            uid: u32_at(40),
        })
    }
}

/// One registry record of a segment block: what the importer needs beyond the tag.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Record {
    pub nonce: u64,
    pub offset: u64,
    pub size: u64,
    pub segment: [u8; 64],
}

impl Record {
    fn to_bytes(self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..8].copy_from_slice(&self.nonce.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.size.to_le_bytes());
        b[24..88].copy_from_slice(&self.segment);
        b
    }

    fn from_bytes(b: &[u8; RECORD_BYTES]) -> Record {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Record {
            nonce: u64_at(0),
            offset: u64_at(8),
            size: u64_at(16),
            segment: b[24..88].try_into().unwrap(),
        }
    }
}

fn registry_path(uid: u32, pid: u32) -> CString {
    CString::new(format!("/dev/shm/cupool-ipc-{uid}-{pid}")).expect("no NUL in the path")
}

/// This process's registry: its file descriptor, the pid that created it (a fork child
/// makes its own), and the next record's index.
static REGISTRY_FD: AtomicI32 = AtomicI32::new(-1);
static REGISTRY_PID: AtomicU32 = AtomicU32::new(0);
static NEXT_RECORD: AtomicU32 = AtomicU32::new(0);
static REGISTRY_LOCK: Mutex<()> = Mutex::new(());
static REMOVE_AT_EXIT: std::sync::Once = std::sync::Once::new();

/// Appends a segment block's record; returns its index.
pub(super) fn append(record: Record) -> Option<u32> {
    append_bytes(&record.to_bytes())
}

/// Appends `bytes` (whole records) at the next free records; returns the first's index.
pub(super) fn append_bytes(bytes: &[u8]) -> Option<u32> {
    debug_assert_eq!(bytes.len() % RECORD_BYTES, 0);
    let _g = REGISTRY_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: plain libc calls on values we own.
    let (pid, uid) = unsafe { (libc::getpid() as u32, libc::getuid()) };
    if REGISTRY_PID.load(Relaxed) != pid {
        let path = registry_path(uid, pid);
        // SAFETY: a NUL-terminated path; the flags create a private file.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                0o600 as c_uint,
            )
        };
        if fd < 0 {
            crate::log::warn(&format!(
                "cupool: CUDA IPC of a sub-allocated block needs {}, which cannot be created: {}",
                path.to_string_lossy(),
                std::io::Error::last_os_error()
            ));
            return None;
        }
        // A fork child's copy of its parent's descriptor (the parent's registry).
        let old = REGISTRY_FD.swap(fd, Relaxed);
        if old >= 0 {
            // SAFETY: this process's copy of the descriptor; nothing else uses it.
            unsafe { libc::close(old) };
        }
        REGISTRY_PID.store(pid, Relaxed);
        NEXT_RECORD.store(0, Relaxed);
        // Once per process image: a fork child inherits the handler, which removes the
        // registry of the process it runs in.
        REMOVE_AT_EXIT.call_once(|| {
            // SAFETY: registering a handler that makes no CUDA call.
            unsafe { libc::atexit(remove_registry_at_exit) };
        });
    }
    let index = NEXT_RECORD.fetch_add((bytes.len() / RECORD_BYTES) as u32, Relaxed);
    let at = index as libc::off_t * RECORD_BYTES as libc::off_t;
    // SAFETY: `bytes` is valid for its length.
    let n = unsafe {
        libc::pwrite(
            REGISTRY_FD.load(Relaxed),
            bytes.as_ptr().cast(),
            bytes.len(),
            at,
        )
    };
    (n == bytes.len() as isize).then_some(index)
}

/// Reads `out.len()` bytes of records from the record `index` of the registry of
/// (`uid`, `pid`); whether they were all there.
pub(super) fn read_records(uid: u32, pid: u32, index: u32, out: &mut [u8]) -> bool {
    let path = registry_path(uid, pid);
    // SAFETY: a NUL-terminated path.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    let at = index as libc::off_t * RECORD_BYTES as libc::off_t;
    // SAFETY: `out` is valid for its length; `fd` is ours and closed below.
    let n = unsafe { libc::pread(fd, out.as_mut_ptr().cast(), out.len(), at) };
    // SAFETY: as above.
    unsafe { libc::close(fd) };
    n == out.len() as isize
}

/// The segment block record a tagged handle names, from its exporter's registry.
pub(super) fn lookup(t: &Tagged) -> Option<Record> {
    let mut bytes = [0u8; RECORD_BYTES];
    if !read_records(t.uid, t.pid, t.index, &mut bytes) {
        return None;
    }
    let r = Record::from_bytes(&bytes);
    (r.nonce == t.nonce && r.offset == t.offset && r.size == t.size).then_some(r)
}

extern "C" fn remove_registry_at_exit() {
    remove_registry();
}

/// Removes this process's registry (at exit; no CUDA call). Importers that have not
/// opened their handles yet can no longer: the exporter is gone, so its memory is too.
pub(super) fn remove_registry() {
    // SAFETY: plain libc calls.
    let (pid, uid) = unsafe { (libc::getpid() as u32, libc::getuid()) };
    // Not waited for: at exit another thread may be stopped inside an export.
    let _g = REGISTRY_LOCK.try_lock();
    if REGISTRY_PID.load(Relaxed) == pid {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::unlink(registry_path(uid, pid).as_ptr()) };
        // A later export makes a new one.
        REGISTRY_PID.store(0, Relaxed);
    }
}

fn nonce() -> u64 {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Relaxed) as u64;
    // SplitMix64 of the time and a counter: distinct per export, not guessable by accident.
    let mut z = t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag() -> Tagged {
        Tagged {
            pid: 4242,
            uid: 1000,
            index: 7,
            nonce: 0xDEAD_BEEF_0123_4567,
            offset: 2 << 20,
            size: 4096,
            kind: Kind::Segment,
        }
    }

    #[test]
    fn a_tagged_handle_reads_back_and_a_driver_handle_is_not_tagged() {
        let h = tag().to_bytes();
        assert_eq!(Tagged::read(&h), Some(tag()));
        let arena = Tagged {
            kind: Kind::Arena,
            ..tag()
        };
        assert_eq!(Tagged::read(&arena.to_bytes()), Some(arena));
        let mut driver = [0x5a; 64];
        assert_eq!(Tagged::read(&driver), None);
        driver[..8].copy_from_slice(&TAG);
        assert_eq!(
            Tagged::read(&driver),
            None,
            "bytes past the tag's fields must be zero"
        );
        let mut unknown_kind = h;
        unknown_kind[44] = 9;
        assert_eq!(Tagged::read(&unknown_kind), None);
    }

    #[test]
    #[cfg_attr(miri, ignore)] // files in /dev/shm through libc
    fn records_round_trip_through_the_registry_and_a_wrong_nonce_finds_nothing() {
        let segment: [u8; 64] = core::array::from_fn(|i| i as u8);
        let t = Tagged::new(Kind::Segment, 3 << 20, 8192);
        let r = Record {
            nonce: t.nonce,
            offset: t.offset,
            size: t.size,
            segment,
        };
        let index = append(r).expect("registry in /dev/shm");
        let t = Tagged { index, ..t };
        assert_eq!(lookup(&t), Some(r));
        assert_eq!(
            lookup(&Tagged {
                nonce: r.nonce ^ 1,
                ..t
            }),
            None
        );
        assert_eq!(
            lookup(&Tagged {
                index: index + 1000,
                ..t
            }),
            None
        );
        remove_registry();
        assert_eq!(lookup(&t), None, "gone with the registry");
    }
}
