//! CuPy's allocation objects built in place, for `cupool.cupy.enable()`: a CPython builtin
//! function (`METH_O`) that CuPy calls as its allocator and that returns CuPy's own
//! `MemoryPointer` over a `CFunctionAllocatorMemory`, with no Python-level constructor.
//!
//! Note [CuPy's objects built in place]: through `CFunctionAllocator`, each allocation
//! builds `CFunctionAllocatorMemory(size, param, malloc, free, device)` and
//! `MemoryPointer(mem, 0)` by calling the classes: argument tuples, five boxed integers
//! and two `__init__` argument parsers. On an H100 host that cost 1.0–1.16 µs for
//! `malloc` + `del` against 0.62–0.73 µs for CuPy's own pool, whose compiled code makes
//! the same two objects with `tp_new` and writes their fields directly (docs/BENCHMARKS.md).
//! This does the same from here: `tp_new` of each type with no arguments (neither has
//! `__cinit__`), then the fields written at their byte offsets. Freeing stays CuPy's: the
//! memory object's own `__dealloc__` calls `_free_func(_param, ptr, device_id)`, which is
//! [`super::cupy::cupool_cupy_free`].
//!
//! The offsets are not guessed: `cupool.cupy.enable()` builds one object of each type the
//! ordinary way with marker values, finds each marker at exactly one offset, checks that a
//! bare `tp_new` object differs from it nowhere else, and checks a round trip through this
//! function before it installs it (CPython with the GIL only; otherwise, or on any
//! mismatch, it keeps `CFunctionAllocator`). What is written where a bare object had a
//! reference (the pointer's `mem`, `None` after `tp_new`) drops that reference.

use super::cupy::{allocate_for_cupy, cupool_cupy_free, CupoolCupyHooks, FAILED};
use crate::status::CupoolStatus::{self, *};
use core::ffi::{c_int, c_void};
use core::sync::atomic::{AtomicPtr, Ordering};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// `PyObject *`, opaque here (the header spells it `void *`, so that it never meets
/// CPython's own `PyObject`).
type PyObject = *mut c_void;

/// What [`cupool_cupy_alloc`] needs, filled by `cupool.cupy.enable()` after it has checked
/// the layout (Note [CuPy's objects built in place]); kept alive by the caller while
/// installed.
#[repr(C)]
pub struct CupoolCupyObjects {
    /// Stream source and error reporting (as for `cupool_cupy_malloc`); also the `_param`
    /// each memory object carries.
    pub hooks: *const CupoolCupyHooks,
    /// CuPy's `get_device_id` (`int (int skip_dispatch)`): -1 with an exception set on
    /// failure.
    pub device_id: Option<unsafe extern "C" fn(c_int) -> c_int>,
    /// `PyLong_AsSize_t`.
    pub as_size: Option<unsafe extern "C" fn(*mut c_void) -> usize>,
    /// `PyErr_Occurred`.
    pub error_occurred: Option<unsafe extern "C" fn() -> *mut c_void>,
    /// `Py_DecRef`.
    pub dec_ref: Option<unsafe extern "C" fn(*mut c_void)>,
    /// An empty tuple: the arguments of both `tp_new` calls.
    pub no_args: *mut c_void,
    /// `CFunctionAllocatorMemory` and its `tp_new(type, args, kwargs)`.
    pub memory_type: *mut c_void,
    pub memory_new:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> *mut c_void>,
    /// Byte offsets of its `ptr`, `size`, `device_id` (a C `int`), `_param`, `_free_func`.
    pub memory_ptr: usize,
    pub memory_size: usize,
    pub memory_device: usize,
    pub memory_param: usize,
    pub memory_free: usize,
    /// `MemoryPointer` and its `tp_new`.
    pub pointer_type: *mut c_void,
    pub pointer_new:
        Option<unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void) -> *mut c_void>,
    /// Byte offsets of its `ptr`, `device_id` (a C `int`) and `mem` (a reference).
    pub pointer_ptr: usize,
    pub pointer_device: usize,
    pub pointer_mem: usize,
}

/// What is installed: one CuPy per process.
static INSTALLED: AtomicPtr<CupoolCupyObjects> = AtomicPtr::new(core::ptr::null_mut());

/// Installs `objects` for [`cupool_cupy_alloc`] (NULL uninstalls). Every function must be
/// there and every offset past the object header (16 bytes) and word-aligned, else
/// `CUPOOL_ERROR_INVALID_VALUE` and nothing changes.
///
/// # Safety
/// `objects` is NULL or valid, with the layout checked as Note [CuPy's objects built in
/// place] says, and stays alive while installed.
#[no_mangle]
pub unsafe extern "C" fn cupool_cupy_objects_install(
    objects: *const CupoolCupyObjects,
) -> CupoolStatus {
    if objects.is_null() {
        INSTALLED.store(core::ptr::null_mut(), Ordering::Release);
        return CupoolOk;
    }
    // SAFETY: the caller's contract.
    let o = unsafe { &*objects };
    let word = |off: usize| off >= 16 && off % 8 == 0;
    let int = |off: usize| off >= 16 && off % 4 == 0;
    let complete = !o.hooks.is_null()
        && o.device_id.is_some()
        && o.as_size.is_some()
        && o.error_occurred.is_some()
        && o.dec_ref.is_some()
        && !o.no_args.is_null()
        && !o.memory_type.is_null()
        && o.memory_new.is_some()
        && !o.pointer_type.is_null()
        && o.pointer_new.is_some()
        && [o.memory_ptr, o.memory_size, o.memory_param, o.memory_free]
            .into_iter()
            .chain([o.pointer_ptr, o.pointer_mem])
            .all(word)
        && int(o.memory_device)
        && int(o.pointer_device);
    if !complete {
        return CupoolErrorInvalidValue;
    }
    INSTALLED.store(objects as *mut _, Ordering::Release);
    CupoolOk
}

/// Writes `value` at `offset` bytes into `object`.
///
/// # Safety
/// The field at `offset` is a `T` (Note [CuPy's objects built in place]).
unsafe fn put<T>(object: PyObject, offset: usize, value: T) {
    // SAFETY: the caller's contract; offsets are aligned (checked at install).
    unsafe { (object as *mut u8).add(offset).cast::<T>().write(value) }
}

/// CuPy's allocator, as a CPython `METH_O` function (`self` unused, `size` a Python int):
/// a `MemoryPointer` to `size` bytes of pool memory on CuPy's current device, in stream
/// order on its current stream; NULL with a Python exception set on failure (out of
/// memory: CuPy's `OutOfMemoryError`, as `cupool_cupy_malloc` raises it).
///
/// # Safety
/// Called by CPython with the GIL held, after [`cupool_cupy_objects_install`].
#[no_mangle]
pub unsafe extern "C" fn cupool_cupy_alloc(_self: *mut c_void, size: *mut c_void) -> *mut c_void {
    let installed = INSTALLED.load(Ordering::Acquire);
    if installed.is_null() {
        crate::log::error("cupool: CuPy's allocator called before it was installed");
        return core::ptr::null_mut();
    }
    // SAFETY: installed and alive (the install contract).
    let o = unsafe { &*installed };
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: GIL held; the install contract.
        unsafe { build(o, size) }
    }))
    .unwrap_or_else(|_| {
        crate::log::always("cupool: internal error: a panic was caught in CuPy's allocation");
        core::ptr::null_mut()
    })
}

/// The body of [`cupool_cupy_alloc`].
///
/// # Safety
/// GIL held; `o` installed (every function present, offsets checked by the caller).
unsafe fn build(o: &CupoolCupyObjects, size_obj: PyObject) -> PyObject {
    let (Some(as_size), Some(error_occurred), Some(device_id), Some(dec_ref)) =
        (o.as_size, o.error_occurred, o.device_id, o.dec_ref)
    else {
        return core::ptr::null_mut();
    };
    let (Some(memory_new), Some(pointer_new)) = (o.memory_new, o.pointer_new) else {
        return core::ptr::null_mut();
    };
    // SAFETY: CPython's and CuPy's functions, GIL held.
    let size = unsafe { as_size(size_obj) };
    if size == usize::MAX && !unsafe { error_occurred() }.is_null() {
        return core::ptr::null_mut();
    }
    // SAFETY: as above (1: skip Python-level dispatch, as compiled callers pass).
    let device = unsafe { device_id(1) };
    if device < 0 && !unsafe { error_occurred() }.is_null() {
        return core::ptr::null_mut();
    }
    // SAFETY: `hooks` is alive while installed.
    let hooks = unsafe { &*o.hooks };
    let ptr = if size == 0 {
        core::ptr::null_mut() // as CuPy's own: no allocation, a null pointer
    } else {
        // SAFETY: GIL held.
        match unsafe { allocate_for_cupy(hooks, size, device) } {
            FAILED => return core::ptr::null_mut(),
            // CuPy's stream source may fail with a null stream and an exception set.
            // SAFETY: GIL held; the block was never handed out.
            p if !unsafe { error_occurred() }.is_null() => {
                unsafe { cupool_cupy_free(core::ptr::null_mut(), p, device) };
                return core::ptr::null_mut();
            }
            p => p,
        }
    };
    // SAFETY: the type's own tp_new with no arguments (no __cinit__ to take any).
    let mem = unsafe { memory_new(o.memory_type, o.no_args, core::ptr::null_mut()) };
    if mem.is_null() {
        if !ptr.is_null() {
            // SAFETY: the block just allocated, never handed out.
            unsafe { cupool_cupy_free(core::ptr::null_mut(), ptr, device) };
        }
        return core::ptr::null_mut();
    }
    let free: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int) = cupool_cupy_free;
    // SAFETY: fields at the offsets checked at install; from here the memory object owns
    // the block (its __dealloc__ frees it).
    unsafe {
        put(mem, o.memory_ptr, ptr as isize);
        put(mem, o.memory_size, size);
        put(mem, o.memory_device, device);
        put(mem, o.memory_param, o.hooks as isize);
        put(mem, o.memory_free, free as usize as isize);
    }
    // SAFETY: as for the memory object.
    let pointer = unsafe { pointer_new(o.pointer_type, o.no_args, core::ptr::null_mut()) };
    if pointer.is_null() {
        // SAFETY: our reference; its __dealloc__ gives the block back.
        unsafe { dec_ref(mem) };
        return core::ptr::null_mut();
    }
    // SAFETY: fields at checked offsets; `mem` held a reference (None) after tp_new, which
    // is dropped, and our reference to the memory object moves into the field.
    unsafe {
        put(pointer, o.pointer_ptr, ptr as isize);
        put(pointer, o.pointer_device, device);
        let slot = (pointer as *mut u8).add(o.pointer_mem).cast::<PyObject>();
        let previous = slot.read();
        slot.write(mem);
        if !previous.is_null() {
            dec_ref(previous);
        }
    }
    pointer
}
