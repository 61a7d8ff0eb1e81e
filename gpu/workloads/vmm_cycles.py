"""Moves without an arena: the driver calls of the VMM arena's moves, made on their own in a
workload's steps, to tell what the calls cost a step from what the arena's other work does.

Through `cupool.torch.enable()` the GPT loop is 7-12% slower than PyTorch's allocator with the
arena at its default, and at or below it with `reserve:5.7G` (idle memory stays mapped, so the
arena stops moving it). The default makes about 13 map and 15 unmap calls a step, whose driver
time is a third of the gap (docs/BENCHMARKS.md, twelfth session). Running the `reserve` arm
with the same calls added here tells whether the calls cost more than their own time (a
slower driver, CPU or GPU afterwards) or the rest of the gap is the arena's.

`WORKLOAD_VMM_CYCLES=EVERY:BYTES` (for example `4:8M`): on every EVERY-th module forward call
(a global forward hook, so inside the step's forward pass, on the main thread, where the
arena's calls happen), map a BYTES handle into a reserved range, grant access and unmap it:
the calls of one move (`cuMemMap` + `cuMemSetAccess` + `cuMemUnmap`). The handle and the
range are made once. The harness records the calls made and their time per step.
"""
import ctypes
import os
import time

ENV = "WORKLOAD_VMM_CYCLES"

# Driver enums (cuda.h).
_PINNED = 1              # CU_MEM_ALLOCATION_TYPE_PINNED
_ON_DEVICE = 1           # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3          # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", ctypes.c_uint8 * 8)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def parse(text):
    """(every, bytes) from `EVERY:BYTES`, BYTES with an optional K/M/G suffix; ValueError on
    anything else."""
    every, sep, size = text.partition(":")
    if not sep or not every.isdigit() or int(every) < 1:
        raise ValueError(f"{ENV} wants EVERY:BYTES (like 4:8M), got {text!r}")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
    digits = size[:-1] if scale > 1 else size
    if not digits.isdigit() or int(digits) == 0:
        raise ValueError(f"{ENV} wants EVERY:BYTES (like 4:8M), got {text!r}")
    return int(every), int(digits) * scale


class VmmCycler:
    """Makes move cycles of one handle on the current device; counts them and their time."""

    def __init__(self, every, size, device):
        self.every = every
        self.size = size
        self.device = device
        self.calls = 0          # forward calls seen
        self.cycles = 0         # cycles made since the last `take`
        self.cycle_ns = 0
        self._cu = None

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{ENV}: {what} failed with CUresult {rc}")

    def _setup(self):
        cu = ctypes.CDLL("libcuda.so.1")
        prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, self.device))
        granule = ctypes.c_size_t()
        self._check(cu.cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), 0),
                    "cuMemGetAllocationGranularity")
        self.size = -(-self.size // granule.value) * granule.value
        self.va = ctypes.c_uint64()
        self._check(cu.cuMemAddressReserve(ctypes.byref(self.va), ctypes.c_size_t(self.size),
                                           ctypes.c_size_t(0), ctypes.c_uint64(0),
                                           ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.handle = ctypes.c_uint64()
        self._check(cu.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(self.size),
                                   ctypes.byref(prop), ctypes.c_uint64(0)), "cuMemCreate")
        self.access = _AccessDesc(location=_Location(_ON_DEVICE, self.device), flags=_READ_WRITE)
        self._cu = cu

    def cycle(self):
        if self._cu is None:
            self._setup()
        cu, va, size = self._cu, ctypes.c_uint64(self.va.value), ctypes.c_size_t(self.size)
        t = time.perf_counter_ns()
        self._check(cu.cuMemMap(va, size, ctypes.c_size_t(0), self.handle, ctypes.c_uint64(0)),
                    "cuMemMap")
        self._check(cu.cuMemSetAccess(va, size, ctypes.byref(self.access), ctypes.c_size_t(1)),
                    "cuMemSetAccess")
        self._check(cu.cuMemUnmap(va, size), "cuMemUnmap")
        self.cycle_ns += time.perf_counter_ns() - t
        self.cycles += 1

    def forward_hook(self, module, inputs, output):
        self.calls += 1
        if self.calls % self.every == 0:
            self.cycle()

    def take(self):
        """[cycles, ms in them] since the last take."""
        out = [self.cycles, round(self.cycle_ns / 1e6, 4)]
        self.cycles, self.cycle_ns = 0, 0
        return out


def install(torch, device):
    """A `VmmCycler` hooked into every module's forward when `WORKLOAD_VMM_CYCLES` is set,
    else None."""
    text = os.environ.get(ENV)
    if not text:
        return None
    every, size = parse(text)
    cycler = VmmCycler(every, size, device)
    torch.nn.modules.module.register_module_forward_hook(cycler.forward_hook)
    return cycler
