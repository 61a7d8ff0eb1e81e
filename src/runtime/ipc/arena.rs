//! CUDA IPC of blocks of the VMM arena (`vmm:on`).
//!
//! Note [ipc of arena blocks]: the driver refuses legacy IPC on memory from `cuMemCreate`,
//! and an arena block is backed by one or more chunks of such memory (Note [arena chunks] in
//! `pool/arena`). The exporter therefore exports each chunk under the block as a POSIX file
//! descriptor (kept open, the chunk kept in place for good: Note [exported chunks]) and
//! writes one registry record with the block's offset in the first chunk and the chunk
//! count, followed by records of (descriptor, bytes) pairs. The tagged handle says
//! `Kind::Arena`. An importer under cupool reads the records, takes copies of the
//! descriptors from the exporter with `pidfd_getfd` (Linux 5.6 or later), and maps the
//! chunks back to back in a range of its own, readable and writable by its current
//! device; opening the same handle again returns the same pointer, counted, and the last
//! close unmaps it.
//!
//! `pidfd_getfd` needs the right to ptrace the exporter. Where Yama allows only ancestors
//! to do that (`kernel.yama.ptrace_scope = 1`, so a worker could not import from the
//! process that started it), the exporter declares any process of its user a permitted
//! tracer (`PR_SET_PTRACER_ANY`) at its first arena export: the same-user rule still holds.
//! Where the system forbids it altogether (scope 2 or 3, or a seccomp filter), the import
//! fails with [`BackendError::Unavailable`] (`CUDA_ERROR_NOT_SUPPORTED` under the
//! interposer) and one line saying why.

use super::registry::{append_bytes, read_records, Kind, Tagged, RECORD_BYTES};
use super::{ArenaExport, Imported};
use crate::backend::{BackendError, BackendResult, DevicePtr};
use crate::runtime::{BlockInfo, Runtime};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Mutex;

/// Bytes of one (descriptor, bytes) entry; entries fill the records after the header.
const ENTRY_BYTES: usize = 16;
/// More chunks than this under one block is not a record this code wrote.
const MAX_CHUNKS: u32 = 1 << 16;

/// The registry records of an export: the header, then the entries.
fn records(t: &Tagged, export: &ArenaExport) -> Vec<u8> {
    let n = export.chunks.len();
    let mut bytes =
        vec![0u8; RECORD_BYTES + (n * ENTRY_BYTES).div_ceil(RECORD_BYTES) * RECORD_BYTES];
    bytes[0..8].copy_from_slice(&t.nonce.to_le_bytes());
    bytes[8..16].copy_from_slice(&t.offset.to_le_bytes());
    bytes[16..24].copy_from_slice(&t.size.to_le_bytes());
    bytes[24..28].copy_from_slice(&(n as u32).to_le_bytes());
    for (i, &(fd, len)) in export.chunks.iter().enumerate() {
        let at = RECORD_BYTES + i * ENTRY_BYTES;
        bytes[at..at + 4].copy_from_slice(&fd.to_le_bytes());
        bytes[at + 8..at + 16].copy_from_slice(&len.to_le_bytes());
    }
    bytes
}

/// The exporter's (descriptor, bytes) pairs a tagged handle names, from its registry.
fn lookup(t: &Tagged) -> Option<Vec<(i32, u64)>> {
    let mut header = [0u8; RECORD_BYTES];
    if !read_records(t.uid, t.pid, t.index, &mut header) {
        return None;
    }
    let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let n = u32::from_le_bytes(header[24..28].try_into().unwrap());
    if u64_at(&header, 0) != t.nonce
        || u64_at(&header, 8) != t.offset
        || u64_at(&header, 16) != t.size
        || n == 0
        || n > MAX_CHUNKS
    {
        return None;
    }
    let mut entries = vec![0u8; (n as usize * ENTRY_BYTES).div_ceil(RECORD_BYTES) * RECORD_BYTES];
    if !read_records(t.uid, t.pid, t.index + 1, &mut entries) {
        return None;
    }
    Some(
        entries
            .chunks_exact(ENTRY_BYTES)
            .take(n as usize)
            .map(|e| {
                let fd = i32::from_le_bytes(e[0..4].try_into().unwrap());
                (fd, u64_at(e, 8))
            })
            .collect(),
    )
}

/// Lets a process of this user that is not an ancestor take descriptors from this one
/// where Yama would refuse it (Note [ipc of arena blocks]); once per process.
fn allow_importers() {
    static DONE_FOR_PID: AtomicU32 = AtomicU32::new(0);
    // SAFETY: plain libc call.
    let pid = unsafe { libc::getpid() } as u32;
    if DONE_FOR_PID.swap(pid, Relaxed) == pid {
        return;
    }
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
    if scope.is_ok_and(|s| s.trim() == "1") {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    }
}

/// The tagged handle of an exported arena block.
pub(super) fn export(block: &BlockInfo, export: &ArenaExport) -> BackendResult<[u8; 64]> {
    allow_importers();
    let mut t = Tagged::new(Kind::Arena, export.offset, block.size);
    t.index = append_bytes(&records(&t, export)).ok_or(BackendError::InvalidValue)?;
    Ok(t.to_bytes())
}

/// An arena block this process opened.
struct Opened {
    /// (exporter's pid, record index, nonce): the handle.
    key: (u32, u32, u64),
    mapped: Imported,
    /// The pointer handed out (the mapping's start + the block's offset).
    ptr: DevicePtr,
    opens: u32,
}

static OPENED: Mutex<Vec<Opened>> = Mutex::new(Vec::new());

/// Copies of the exporter's descriptors in this process, closed when dropped.
struct Borrowed(Vec<i32>);

impl Drop for Borrowed {
    fn drop(&mut self) {
        for &fd in &self.0 {
            // SAFETY: descriptors this process got from pidfd_getfd, closed once.
            unsafe { libc::close(fd) };
        }
    }
}

/// Takes copies of `fds` from process `pid` (Note [ipc of arena blocks]).
fn borrow_descriptors(pid: u32, fds: &[i32]) -> BackendResult<Borrowed> {
    // SAFETY: the pidfd_open system call with integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
    if pidfd < 0 {
        // The exporter is gone: so is its memory.
        return Err(BackendError::InvalidValue);
    }
    let mut out = Borrowed(Vec::with_capacity(fds.len()));
    let mut failure = None;
    for &fd in fds {
        // SAFETY: the pidfd_getfd system call on the descriptor just opened.
        let local = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as i32;
        if local < 0 {
            failure = Some(std::io::Error::last_os_error());
            break;
        }
        out.0.push(local);
    }
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(pidfd) };
    match failure {
        None => Ok(out),
        Some(e) => {
            crate::log::warn(&format!(
                "cupool: CUDA IPC of a VMM block needs the exporter's memory descriptors \
                 (pidfd_getfd from process {pid}), which the system refused: {e}"
            ));
            Err(BackendError::Unavailable)
        }
    }
}

/// Opens a tagged arena handle: the block's pointer in this process.
pub(super) fn open(rt: &Runtime, t: &Tagged) -> BackendResult<DevicePtr> {
    let key = (t.pid, t.index, t.nonce);
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(o) = opened.iter_mut().find(|o| o.key == key) {
        o.opens += 1;
        return Ok(o.ptr);
    }
    // The exporter is gone (its registry with it), or the handle is not one it made.
    let chunks = lookup(t).ok_or(BackendError::InvalidValue)?;
    let fds: Vec<i32> = chunks.iter().map(|c| c.0).collect();
    let borrowed = borrow_descriptors(t.pid, &fds)?;
    let local: Vec<(i32, u64)> = borrowed
        .0
        .iter()
        .zip(&chunks)
        .map(|(&fd, c)| (fd, c.1))
        .collect();
    let mapped = rt.import_chunks(&local)?;
    drop(borrowed);
    let ptr = mapped.base + t.offset;
    opened.push(Opened {
        key,
        mapped,
        ptr,
        opens: 1,
    });
    Ok(ptr)
}

/// Closes a pointer [`open`] handed out; `None` for any other pointer.
pub(super) fn close(rt: &Runtime, ptr: DevicePtr) -> Option<BackendResult<()>> {
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    let i = opened.iter().position(|o| o.ptr == ptr)?;
    opened[i].opens -= 1;
    if opened[i].opens > 0 {
        return Some(Ok(()));
    }
    let o = opened.swap_remove(i);
    Some(rt.close_imported(&o.mapped))
}
