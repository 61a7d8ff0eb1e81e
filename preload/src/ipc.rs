//! CUDA IPC of pool blocks: `cuIpcGetMemHandle`, `cuIpcOpenMemHandle(_v2)`,
//! `cuIpcCloseMemHandle` (what `cudaIpcGetMemHandle`, `cudaIpcOpenMemHandle` and
//! `cudaIpcCloseMemHandle` become).
//!
//! Note [ipc registry]: the driver gives every pointer of an allocation the allocation's
//! handle, and the importer maps the allocation's base. A block carved out of a larger
//! segment therefore cannot travel in the driver's handle alone: its offset must go with
//! it, and the 64 bytes of `CUipcMemHandle` are the driver's. So the exporter puts the
//! segment's real handle, the block's offset and size in a record of its **registry**, a
//! file `/dev/shm/cupool-ipc-<uid>-<pid>` (mode 0600, one 128-byte record per export,
//! removed at exit), and gives the program a handle of its own: `cupoolIP`, its pid, the
//! record's index, a nonce, the offset and the size. An importer under cupool recognises
//! the tag, reads the record, opens the real handle (once per segment, counted) and
//! returns the segment's mapping plus the offset; `cuIpcCloseMemHandle` of that pointer
//! closes the segment's mapping when its last block is closed. An importer without cupool
//! hands the tagged handle to the driver, which does not know it and fails: it never maps
//! the wrong bytes. A block that is a whole segment exports the driver's own handle, which
//! any importer can open.
//!
//! What an importer can reach: the whole segment of the block (2 MiB for blocks up to
//! 1 MiB, 20 MiB up to 10 MiB), neighbours included, as with any legacy IPC mapping of a
//! sub-allocating allocator. The exporter keeps exported segments for good (Note
//! [exported segments] in `cupool::pool`). Blocks of the VMM arena (`vmm:on`) travel
//! differently, as their chunks' file descriptors (Note [ipc of arena blocks] in
//! `ipc/arena.rs`).

mod arena;

use crate::cuda::*;
use crate::guard::cuda_call;
use crate::lifecycle;
use crate::memory::{is_whole_segment, pool_block_containing};
use crate::real;
use crate::slots::{sig, IpcOpenFn, RealFn};
use core::ffi::{c_uint, c_void};
use core::sync::atomic::{AtomicI32, AtomicU32, Ordering::Relaxed};
use std::ffi::CString;
use std::sync::Mutex;

const NO_DRIVER: CuResult = CUDA_ERROR_NOT_INITIALIZED;
const TAG: [u8; 8] = *b"cupoolIP";
const RECORD_BYTES: usize = 128;

/// What the handle cupool hands out carries (Note [ipc registry]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Tagged {
    pid: u32,
    uid: u32,
    index: u32,
    nonce: u64,
    offset: u64,
    size: u64,
    kind: Kind,
}

/// What a tagged handle's record describes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// A block of a segment: the segment's legacy handle and the block's offset.
    Segment = 0,
    /// An arena block: the descriptors of its chunks (Note [ipc of arena blocks]).
    Arena = 1,
}

impl Tagged {
    fn write(&self, h: &mut CuIpcMemHandle) {
        let r = &mut h.reserved;
        *r = [0; 64];
        r[0..8].copy_from_slice(&TAG);
        r[8..12].copy_from_slice(&self.pid.to_le_bytes());
        r[12..16].copy_from_slice(&self.index.to_le_bytes());
        r[16..24].copy_from_slice(&self.nonce.to_le_bytes());
        r[24..32].copy_from_slice(&self.offset.to_le_bytes());
        r[32..40].copy_from_slice(&self.size.to_le_bytes());
        r[40..44].copy_from_slice(&self.uid.to_le_bytes());
        r[44..48].copy_from_slice(&(self.kind as u32).to_le_bytes());
    }

    fn read(h: &CuIpcMemHandle) -> Option<Tagged> {
        let r = &h.reserved;
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

/// One registry record: what the importer needs beyond the tag.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Record {
    nonce: u64,
    offset: u64,
    size: u64,
    segment: [u8; 64],
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

/// Appends a record; returns its index.
fn append(record: Record) -> Option<u32> {
    append_bytes(&record.to_bytes())
}

/// Appends `bytes` (whole records) at the next free records; returns the first's index.
fn append_bytes(bytes: &[u8]) -> Option<u32> {
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
            cupool::log::warn(&format!(
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
        lifecycle::at_exit(remove_registry);
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
fn read_records(uid: u32, pid: u32, index: u32, out: &mut [u8]) -> bool {
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

/// The record a tagged handle names, from its exporter's registry.
fn lookup(t: &Tagged) -> Option<Record> {
    let mut bytes = [0u8; RECORD_BYTES];
    if !read_records(t.uid, t.pid, t.index, &mut bytes) {
        return None;
    }
    let r = Record::from_bytes(&bytes);
    (r.nonce == t.nonce && r.offset == t.offset && r.size == t.size).then_some(r)
}

/// Removes this process's registry (at exit, asked for when the registry is made; no CUDA
/// call). Importers that have not opened their handles yet can no longer: the exporter is
/// gone, so its memory is too.
fn remove_registry() {
    // SAFETY: plain libc calls.
    let (pid, uid) = unsafe { (libc::getpid() as u32, libc::getuid()) };
    if REGISTRY_PID.load(Relaxed) == pid {
        // SAFETY: a NUL-terminated path.
        unsafe { libc::unlink(registry_path(uid, pid).as_ptr()) };
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

// ---- cuIpcGetMemHandle ---------------------------------------------------------------

/// `cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)` (Note [ipc registry]).
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut c_void, dptr: CuDevicePtr) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcGetMemHandle", || unsafe {
        get_mem_handle(handle, dptr)
    })
}

unsafe fn get_mem_handle(handle: *mut c_void, dptr: CuDevicePtr) -> CuResult {
    // SAFETY: the slot's exported function has this signature.
    let Some(real) = real::get::<sig::IpcGetMemHandle>() else {
        return NO_DRIVER;
    };
    let block = pool_block_containing(dptr);
    let rt = lifecycle::runtime_if_started();
    let (Some(block), Some(rt), false) = (block, rt, handle.is_null()) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(handle, dptr) };
    };
    match rt.export_arena_block(block.ptr) {
        // SAFETY: the caller's out-parameter, non-NULL.
        Ok(Some((block, export))) => return unsafe { arena::export(handle, &block, &export) },
        Ok(None) => {}
        Err(e) => return arena::code_of(e),
    }
    let mut segment = CuIpcMemHandle { reserved: [0; 64] };
    // SAFETY: `segment` is a valid out-parameter.
    let rc = unsafe {
        real(
            (&mut segment as *mut CuIpcMemHandle).cast(),
            block.segment_base,
        )
    };
    if rc != CUDA_SUCCESS {
        return rc;
    }
    rt.keep_exported(block.ptr);
    if is_whole_segment(&block) {
        // SAFETY: the caller's out-parameter, non-NULL.
        unsafe { handle.cast::<CuIpcMemHandle>().write_unaligned(segment) };
        return CUDA_SUCCESS;
    }
    let record = Record {
        nonce: nonce(),
        offset: block.ptr - block.segment_base,
        size: block.size,
        segment: segment.reserved,
    };
    let Some(index) = append(record) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let mut out = CuIpcMemHandle { reserved: [0; 64] };
    Tagged {
        // SAFETY: plain libc calls.
        pid: unsafe { libc::getpid() } as u32,
        uid: unsafe { libc::getuid() },
        index,
        nonce: record.nonce,
        offset: record.offset,
        size: record.size,
        kind: Kind::Segment,
    }
    .write(&mut out);
    // SAFETY: the caller's out-parameter, non-NULL.
    unsafe { handle.cast::<CuIpcMemHandle>().write_unaligned(out) };
    CUDA_SUCCESS
}

// ---- cuIpcOpenMemHandle(_v2), cuIpcCloseMemHandle ------------------------------------

/// Segments this process opened for tagged handles, and the block pointers handed out.
struct Opened {
    /// (segment's real handle, its mapping here, blocks open in it).
    segments: Vec<([u8; 64], CuDevicePtr, u32)>,
    /// (block pointer handed out, segment's real handle).
    blocks: Vec<(CuDevicePtr, [u8; 64])>,
}

static OPENED: Mutex<Opened> = Mutex::new(Opened {
    segments: Vec::new(),
    blocks: Vec::new(),
});

/// `cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcOpenMemHandle", || unsafe {
        open_mem_handle::<sig::IpcOpenMemHandle>(pdptr, handle, flags)
    })
}

/// `cuIpcOpenMemHandle_v2`: the same signature.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcOpenMemHandle_v2", || unsafe {
        open_mem_handle::<sig::IpcOpenMemHandleV2>(pdptr, handle, flags)
    })
}

unsafe fn open_mem_handle<S: RealFn<Fn = IpcOpenFn>>(
    pdptr: *mut CuDevicePtr,
    handle: CuIpcMemHandle,
    flags: c_uint,
) -> CuResult {
    let Some(real) = real::get::<S>() else {
        return NO_DRIVER;
    };
    let tagged = Tagged::read(&handle);
    let (Some(t), false) = (tagged, pdptr.is_null() || lifecycle::pass_through()) else {
        // SAFETY: forwarded unchanged.
        return unsafe { real(pdptr, handle, flags) };
    };
    if t.kind == Kind::Arena {
        // SAFETY: non-NULL out-parameter supplied by the caller.
        return unsafe { arena::open(pdptr, &t) };
    }
    let Some(record) = lookup(&t) else {
        // The exporter is gone (its registry with it), or the handle is not one it made.
        return CUDA_ERROR_INVALID_VALUE;
    };
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    let base = match opened.segments.iter_mut().find(|s| s.0 == record.segment) {
        Some(s) => {
            s.2 += 1;
            s.1
        }
        None => {
            let mut base: CuDevicePtr = 0;
            let segment = CuIpcMemHandle {
                reserved: record.segment,
            };
            // SAFETY: `base` is a valid out-parameter; the handle is the exporter's real one.
            let rc = unsafe { real(&mut base, segment, flags) };
            if rc != CUDA_SUCCESS {
                return rc;
            }
            opened.segments.push((record.segment, base, 1));
            base
        }
    };
    let ptr = base + record.offset;
    opened.blocks.push((ptr, record.segment));
    // SAFETY: non-NULL out-parameter supplied by the caller.
    unsafe { *pdptr = ptr };
    CUDA_SUCCESS
}

/// `cuIpcCloseMemHandle(CUdeviceptr dptr)`.
#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: CuDevicePtr) -> CuResult {
    // SAFETY: arguments forwarded as received.
    cuda_call("cuIpcCloseMemHandle", || unsafe {
        let Some(real) = real::get::<sig::IpcCloseMemHandle>() else {
            return NO_DRIVER;
        };
        if let Some(rc) = arena::close(dptr) {
            return rc;
        }
        let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
        let Some(i) = opened.blocks.iter().position(|b| b.0 == dptr) else {
            drop(opened);
            return real(dptr);
        };
        let (_, key) = opened.blocks.swap_remove(i);
        let Some(j) = opened.segments.iter().position(|s| s.0 == key) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        opened.segments[j].2 -= 1;
        if opened.segments[j].2 > 0 {
            return CUDA_SUCCESS;
        }
        let (_, base, _) = opened.segments.swap_remove(j);
        real(base)
    })
}

const _: () = assert!(core::mem::size_of::<CuIpcMemHandle>() == 64);

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
        let mut h = CuIpcMemHandle { reserved: [0; 64] };
        tag().write(&mut h);
        assert_eq!(Tagged::read(&h), Some(tag()));
        let mut driver = CuIpcMemHandle {
            reserved: [0x5a; 64],
        };
        assert_eq!(Tagged::read(&driver), None);
        driver.reserved[..8].copy_from_slice(&TAG);
        assert_eq!(
            Tagged::read(&driver),
            None,
            "bytes past the tag's fields must be zero"
        );
    }

    #[test]
    fn records_round_trip_through_the_registry_and_a_wrong_nonce_finds_nothing() {
        let segment: [u8; 64] = core::array::from_fn(|i| i as u8);
        let r = Record {
            nonce: nonce(),
            offset: 3 << 20,
            size: 8192,
            segment,
        };
        let index = append(r).expect("registry in /dev/shm");
        let (pid, uid) = unsafe { (libc::getpid() as u32, libc::getuid()) };
        let t = Tagged {
            pid,
            uid,
            index,
            nonce: r.nonce,
            offset: r.offset,
            size: r.size,
            kind: Kind::Segment,
        };
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
