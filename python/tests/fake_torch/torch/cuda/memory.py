"""Fake torch.cuda.memory: the pluggable allocator as PyTorch 2.11 drives it."""

import collections
import ctypes

import torch

__all__ = [
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_summary",
    "empty_cache",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "get_per_process_memory_fraction",
    "CUDAPluggableAllocator",
    "change_current_allocator",
]

ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
TYPES = {
    "init": ctypes.CFUNCTYPE(None, ctypes.c_int),
    "reset": ctypes.CFUNCTYPE(None),
    "fraction": ctypes.CFUNCTYPE(None, ctypes.c_double, ctypes.c_int),
    "record_stream": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p),
    "base_alloc": ctypes.CFUNCTYPE(
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
    ),
}

_current = None  # the pluggable allocator in use, None: the native one
init_calls = []


class _Hooks:
    """The C++ CUDAPluggableAllocator: hooks set from integer addresses."""

    def __init__(self, alloc, free):
        self.alloc, self.free = alloc, free
        self.fns = {}
        self.metadata = {}

    def set_init_fn(self, addr):
        self.fns["init"] = TYPES["init"](addr)

    def set_reset_fn(self, addr):
        self.fns["reset"] = TYPES["reset"](addr)

    def set_memory_fraction_fn(self, addr):
        self.fns["fraction"] = TYPES["fraction"](addr)

    def set_record_stream_fn(self, addr):
        self.fns["record_stream"] = TYPES["record_stream"](addr)

    def set_base_alloc_fn(self, addr):
        self.fns["base_alloc"] = TYPES["base_alloc"](addr)


class CUDAPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        allocator = ctypes.CDLL(path_to_so_file)
        alloc_fn = ctypes.cast(getattr(allocator, alloc_fn_name), ctypes.c_void_p).value
        free_fn = ctypes.cast(getattr(allocator, free_fn_name), ctypes.c_void_p).value
        self._allocator = _Hooks(ALLOC(alloc_fn), FREE(free_fn))

    def allocator(self):
        return self._allocator


def change_current_allocator(allocator):
    global _current
    if torch.cuda.is_initialized():
        raise RuntimeError("Can't swap an already initialized allocator")
    _current = allocator.allocator()


def _init_allocator(device_count):
    init_calls.append(device_count)
    if _current is not None and "init" in _current.fns:
        _current.fns["init"](device_count)


# What tensors do, through the allocator in use (PyTorch's C++ side).
def _raw_alloc(size, stream=0):
    device = torch.cuda.current_device()
    ptr = _current.alloc(size, device, stream)
    _current.metadata[ptr] = (size, device, stream)
    return ptr


def _raw_delete(ptr):
    size, device, stream = _current.metadata.pop(ptr)
    _current.free(ptr, size, device, stream)


def _record_stream(ptr, stream):
    if "record_stream" in _current.fns:
        _current.fns["record_stream"](ptr, stream)


def _base_allocation(ptr):
    size = ctypes.c_size_t(0)
    base = _current.fns["base_alloc"](ptr, ctypes.byref(size))
    return base, size.value


def _pluggable_unsupported(what):
    if _current is not None:
        raise RuntimeError(f"CUDAPluggableAllocator does not yet support {what}")


def memory_stats_as_nested_dict(device=None):
    if not torch.cuda.is_initialized():
        return {}
    _pluggable_unsupported("getDeviceStats")
    return {}


def memory_stats(device=None):
    result = []

    def _recurse(prefix, obj):
        if isinstance(obj, dict):
            if prefix:
                prefix += "."
            for k, v in obj.items():
                _recurse(prefix + k, v)
        else:
            result.append((prefix, obj))

    _recurse("", memory_stats_as_nested_dict(device=device))
    result.sort()
    return collections.OrderedDict(result)


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.peak", 0)


def memory_summary(device=None, abbreviated=False):
    stats = memory_stats(device=device)
    return "PyTorch CUDA memory summary " + str(stats["allocated_bytes.large_pool.current"])


def empty_cache():
    if torch.cuda.is_initialized() and _current is not None and "reset" in _current.fns:
        _current.fns["reset"]()


def reset_peak_memory_stats(device=None):
    _pluggable_unsupported("resetPeakStats")


def set_per_process_memory_fraction(fraction, device=None):
    torch.cuda.init()
    device = torch.cuda._get_device_index(device, optional=True)
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    if _current is not None and "fraction" in _current.fns:
        _current.fns["fraction"](fraction, device)


def get_per_process_memory_fraction(device=None):
    _pluggable_unsupported("getMemoryFraction")
    return 1.0


def memory_snapshot(mempool_id=None, include_traces=True):
    _pluggable_unsupported("snapshot")


def _snapshot(device=None, augment_with_fx_traces=False):
    _pluggable_unsupported("snapshot")


def _record_memory_history(enabled="all", *args, **kwargs):
    _pluggable_unsupported("recordHistory")


def _dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
    import pickle

    s = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(s, f)
