//! The hooks of PyTorch's `CUDAPluggableAllocator` (torch/csrc/cuda/CUDAPluggableAllocator.h),
//! with the plain C signatures PyTorch calls them through:
//!
//! | hook | PyTorch's type | set with |
//! |---|---|---|
//! | `cupool_torch_alloc` | `void*(size_t, int, cudaStream_t)` | `CUDAPluggableAllocator(lib, alloc, free)` |
//! | `cupool_torch_free` | `void(void*, size_t, int, cudaStream_t)` | the same |
//! | `cupool_torch_delete` | `void(void*)` | the C++ shim's deleter (Note [shim deleter]) |
//! | `cupool_torch_init` | `void(int device_count)` | `set_init_fn` |
//! | `cupool_torch_empty_cache` | `void()` | `set_reset_fn` |
//! | `cupool_torch_set_memory_fraction` | `void(double, int)` | `set_memory_fraction_fn` |
//! | `cupool_torch_record_stream` | `void(void*, cudaStream_t)` | `set_record_stream_fn` |
//! | `cupool_torch_base_allocation` | `void*(void*, size_t*)` | `set_base_alloc_fn` |
//!
//! PyTorch gives these hooks no way to report an error (no status, and a C function must
//! not throw into C++), so each one says what went wrong in one line on stderr and returns
//! what PyTorch treats as "nothing" (NULL from the allocation). They are built on the
//! exported API, so they reach the copy of cupool that owns the process's pool like every
//! other call, and no panic leaves them.
//!
//! Note [record stream]: `Tensor.record_stream(s)` says that work on `s` uses the block
//! besides its allocation stream. PyTorch frees the block on its allocation stream, and a
//! stream-ordered free would let that stream reuse it at once, before `s` is done with it.
//! A block recorded on another stream is therefore freed without a stream: it is reused
//! only after a context fence recorded after the free has completed, and that fence
//! follows all work submitted to any stream of the context before the free, the work on
//! `s` included. The blocks recorded so far are kept here, in a map looked at only while
//! it is not empty (one relaxed load per free otherwise).

use super::cupool_free_in_allocation_order;
use super::device::{cupool_alloc_async_device, cupool_mem_get_info, cupool_segment_of};
use super::{cupool_empty_cache, cupool_free, cupool_free_async, cupool_get_stats};
use super::{cupool_set_memory_limit, CUstream_st};
use crate::stats::CupoolStats;
use crate::status::CupoolStatus::{self, *};
use core::ffi::{c_int, c_void};
use core::ptr::null_mut;
use core::sync::atomic::{AtomicUsize, Ordering};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// Runs a hook's body; a panic becomes `fallback` after one line on stderr (the hooks
/// return no status, so this is their `guard`).
fn hook<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        crate::log::always("cupool: internal error: a panic was caught in a PyTorch hook");
        fallback
    })
}

/// Blocks recorded on streams other than the one they were allocated on: block → the
/// stream handles recorded (Note [record stream]).
static RECORDED: Mutex<Option<HashMap<usize, Vec<usize>>>> = Mutex::new(None);
/// How many blocks `RECORDED` holds, so that frees skip its lock while it is empty.
static RECORDED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Whether `ptr` was recorded on a stream other than `alloc_stream` (on any stream, when
/// `alloc_stream` is `None`); forgets it.
fn take_recorded(ptr: usize, alloc_stream: Option<usize>) -> bool {
    if RECORDED_COUNT.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let mut map = RECORDED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(streams) = map.as_mut().and_then(|m| m.remove(&ptr)) else {
        return false;
    };
    RECORDED_COUNT.fetch_sub(1, Ordering::Relaxed);
    streams.iter().any(|&s| Some(s) != alloc_stream)
}

/// Allocates `size` bytes for PyTorch on `device`, in stream order on `stream` (its current
/// stream); see `cupool_alloc_async_device` for how the device is chosen. Returns NULL for
/// `size` 0 (PyTorch's empty tensors hold no memory) and on failure: after out of memory
/// (once idle cached memory was released and the allocation retried) one line on stderr
/// gives the request and the pool's figures.
///
/// PyTorch 2.11 does not check the pointer its pluggable allocator returns: a tensor made
/// after a NULL has no memory, and the first kernel that touches it fails with an illegal
/// address; the line on stderr says why.
///
/// # Safety
/// `stream` is NULL, a special handle, or a live stream of `device`.
#[no_mangle]
pub unsafe extern "C" fn cupool_torch_alloc(
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) -> *mut c_void {
    if size == 0 {
        return null_mut();
    }
    hook(null_mut(), || {
        let mut ptr = null_mut();
        match cupool_alloc_async_device(&mut ptr, size, device, stream) {
            CupoolOk => ptr,
            CupoolErrorOutOfMemory => {
                report_out_of_memory(size, device);
                null_mut()
            }
            status => {
                crate::log::error(&format!(
                    "cupool: cannot allocate {size} bytes on device {device} for PyTorch: {}",
                    status.as_str()
                ));
                null_mut()
            }
        }
    })
}

/// One line with PyTorch's figures after an allocation ran out of memory.
fn report_out_of_memory(size: usize, device: c_int) {
    let mut stats = CupoolStats::new();
    // SAFETY: a stats struct with its header set.
    let known = unsafe { cupool_get_stats(device, &mut stats) } == CupoolOk;
    let mut limit = 0usize;
    // SAFETY: a valid out-pointer.
    let _ = unsafe { super::cupool_get_memory_limit(device, &mut limit) };
    let figures = if known {
        format!(
            "; {} allocated, {} reserved, {} in idle cache",
            size_text(stats.allocated_bytes.current),
            size_text(stats.reserved_bytes.current),
            size_text(stats.cached_bytes.current)
        )
    } else {
        String::new()
    };
    let limit_text = if limit != 0 {
        format!(", memory limit {}", size_text(limit as u64))
    } else {
        String::new()
    };
    crate::log::error(&format!(
        "cupool: CUDA out of memory: tried to allocate {} on device {device}{figures}{limit_text}",
        size_text(size as u64)
    ));
}

/// `bytes` as PyTorch's out-of-memory message writes sizes (B, KiB, MiB, GiB, 2 decimals).
fn size_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

/// Frees a block `cupool_torch_alloc` returned, as PyTorch does when a tensor's storage
/// dies: in stream order on `stream`, the stream PyTorch allocated it on (`size` and
/// `device` are the allocation's; the block itself knows both). A block recorded on
/// another stream with `cupool_torch_record_stream` is freed without a stream instead, so
/// it is reused only once that stream's work is done. Should the stream not be usable
/// from the calling thread (no current context), the block is freed without a stream.
/// `ptr` NULL does nothing; a pointer cupool did not hand out, or one freed twice, is
/// reported on stderr and otherwise ignored.
///
/// # Safety
/// Any `ptr` value may be passed (it is looked up, never dereferenced); `stream` is NULL,
/// a special handle or a live stream.
#[no_mangle]
pub unsafe extern "C" fn cupool_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: c_int,
    stream: *mut CUstream_st,
) {
    if ptr.is_null() {
        return;
    }
    hook((), || {
        let status = if take_recorded(ptr as usize, Some(stream as usize)) {
            cupool_free(ptr)
        } else {
            match cupool_free_async(ptr, stream) {
                // The stream could not be identified: the block is still the program's.
                CupoolErrorCuda | CupoolErrorBackendUnavailable | CupoolErrorInvalidValue => {
                    cupool_free(ptr)
                }
                status => status,
            }
        };
        if status != CupoolOk {
            crate::log::error(&format!(
                "cupool: PyTorch freed {ptr:p} ({size} bytes, device {device}): {}",
                status.as_str()
            ));
        }
    })
}

/// Frees a block `cupool_torch_alloc` returned, on the stream it was allocated on, without
/// being told that stream: the deleter of the C++ shim's tensors (Note [shim deleter]).
/// A block recorded with `cupool_torch_record_stream` (on any stream) is freed without a
/// stream instead (Note [record stream]). `ptr` NULL does nothing; a pointer cupool did not
/// hand out, or one freed twice, is reported on stderr and otherwise ignored.
///
/// Note [shim deleter]: PyTorch's pluggable allocator keeps, for every block, the size,
/// device and stream to pass to the free hook: a map entry under a mutex and a deleter
/// context on the heap, made at each allocation and dropped at each free. The pool knows
/// all three already, so the shim hands its tensors this function as their deleter, with
/// the block as the context, and the pair skips that bookkeeping.
///
/// # Safety
/// Any `ptr` value may be passed (it is looked up, never dereferenced).
#[no_mangle]
pub unsafe extern "C" fn cupool_torch_delete(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    hook((), || {
        let status = if take_recorded(ptr as usize, None) {
            cupool_free(ptr)
        } else {
            cupool_free_in_allocation_order(ptr)
        };
        if status != CupoolOk {
            crate::log::error(&format!(
                "cupool: PyTorch freed {ptr:p}: {}",
                status.as_str()
            ));
        }
    })
}

/// PyTorch's allocator initialisation (`device_count` devices): starts the pool, so that a
/// backend that cannot start is reported here, once, instead of at the first tensor.
#[no_mangle]
pub extern "C" fn cupool_torch_init(device_count: c_int) {
    hook((), || {
        let mut stats = CupoolStats::new();
        // SAFETY: a stats struct with its header set.
        let status = unsafe { cupool_get_stats(-1, &mut stats) };
        if status != CupoolOk {
            crate::log::error(&format!(
                "cupool: PyTorch initialised its allocator ({device_count} devices), but cupool cannot start: {}",
                status.as_str()
            ));
        }
    })
}

/// `torch.cuda.empty_cache()`: gives the idle cached memory of every device back to the
/// driver (`cupool_empty_cache`).
#[no_mangle]
pub extern "C" fn cupool_torch_empty_cache() {
    hook((), || {
        // SAFETY: NULL is allowed for the released bytes.
        let status = unsafe { cupool_empty_cache(null_mut()) };
        if status != CupoolOk {
            crate::log::error(&format!("cupool: empty_cache failed: {}", status.as_str()));
        }
    })
}

/// `torch.cuda.set_per_process_memory_fraction(fraction, device)`: caps the bytes the pool
/// may reserve on `device` at `fraction` of its total memory (`cupool_set_memory_limit`;
/// fraction 0 lets nothing more be reserved). A fraction outside [0, 1] is refused with
/// one line on stderr (PyTorch checks it before calling).
#[no_mangle]
pub extern "C" fn cupool_torch_set_memory_fraction(fraction: f64, device: c_int) {
    hook((), || {
        let status = set_memory_fraction(fraction, device);
        if status != CupoolOk {
            crate::log::error(&format!(
                "cupool: cannot set the memory fraction {fraction} on device {device}: {}",
                status.as_str()
            ));
        }
    })
}

fn set_memory_fraction(fraction: f64, device: c_int) -> CupoolStatus {
    if !(0.0..=1.0).contains(&fraction) {
        return CupoolErrorInvalidValue;
    }
    let mut total = 0usize;
    // SAFETY: a valid out-pointer; NULL for the free bytes.
    let status = unsafe { cupool_mem_get_info(device, null_mut(), &mut total) };
    if status != CupoolOk {
        return status;
    }
    // A limit of 0 means none: the smallest real limit stands for "nothing more".
    let limit = ((total as f64 * fraction) as usize).max(1);
    cupool_set_memory_limit(device, limit)
}

/// `Tensor.record_stream(stream)`: the block at `ptr` is also used by work on `stream`.
/// When PyTorch frees it, it is freed without a stream, so it is reused only after a
/// context fence shows that all work submitted before the free (that on `stream`
/// included) has completed. A pointer in no live cupool block is reported on stderr and
/// ignored.
///
/// # Safety
/// Any `ptr` value may be passed (it is looked up, never dereferenced).
#[no_mangle]
pub unsafe extern "C" fn cupool_torch_record_stream(ptr: *mut c_void, stream: *mut CUstream_st) {
    if ptr.is_null() {
        return;
    }
    hook((), || {
        let status = cupool_segment_of(ptr, null_mut(), null_mut());
        if status != CupoolOk {
            crate::log::error(&format!(
                "cupool: record_stream on {ptr:p}: {}",
                status.as_str()
            ));
            return;
        }
        let mut map = RECORDED.lock().unwrap_or_else(|e| e.into_inner());
        let streams = map.get_or_insert_with(HashMap::new).entry(ptr as usize);
        let streams = streams.or_insert_with(|| {
            RECORDED_COUNT.fetch_add(1, Ordering::Relaxed);
            Vec::new()
        });
        if !streams.contains(&(stream as usize)) {
            streams.push(stream as usize);
        }
    })
}

/// PyTorch's `getBaseAllocation` (CUDA IPC shares what this names, and PyTorch adds the
/// tensor's offset from it): for the live block containing `ptr`, the segment (driver
/// allocation) that holds it, or with `vmm:on` the block itself when it lies in the VMM
/// arena (exported chunk by chunk: Note [ipc of arena blocks]); its size goes to
/// `*size_out`. For a pointer cupool did not hand out, `ptr` itself, and `*size_out` is
/// left alone (what PyTorch does without this hook).
///
/// # Safety
/// Any `ptr` value may be passed; `size_out` is NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cupool_torch_base_allocation(
    ptr: *mut c_void,
    size_out: *mut usize,
) -> *mut c_void {
    hook(ptr, || {
        let mut base = null_mut();
        let mut size = 0usize;
        if super::ipc::shareable_range(ptr, &mut base, &mut size) != CupoolOk {
            return ptr;
        }
        if !size_out.is_null() {
            size_out.write(size);
        }
        base
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_blocks_are_taken_once() {
        {
            let mut map = RECORDED.lock().unwrap();
            let m = map.get_or_insert_with(HashMap::new);
            m.insert(0x1000, vec![7]);
            m.insert(0x2000, vec![5]);
            RECORDED_COUNT.fetch_add(2, Ordering::Relaxed);
        }
        assert!(
            take_recorded(0x1000, Some(5)),
            "recorded on 7, allocated on 5"
        );
        assert!(!take_recorded(0x1000, Some(5)), "forgotten after the free");
        assert!(
            !take_recorded(0x2000, Some(5)),
            "recorded on its own stream only"
        );
        assert!(!take_recorded(0x3000, Some(5)));
    }

    #[test]
    fn fractions_outside_zero_to_one_are_refused() {
        assert_eq!(set_memory_fraction(1.5, 0), CupoolErrorInvalidValue);
        assert_eq!(set_memory_fraction(-0.1, 0), CupoolErrorInvalidValue);
        assert_eq!(set_memory_fraction(f64::NAN, 0), CupoolErrorInvalidValue);
    }

    #[test]
    fn size_zero_and_null_pointers_do_nothing() {
        unsafe {
            assert!(cupool_torch_alloc(0, 0, null_mut()).is_null());
            cupool_torch_free(null_mut(), 0, 0, null_mut());
            cupool_torch_record_stream(null_mut(), null_mut());
        }
    }
}
