"""Moves without an arena: the driver calls of the VMM arena's moves, made on their own in a
workload's steps, to tell what the calls cost a step from what the arena's other work does.

Through `cupool.torch.enable()` the GPT loop is 7-12% slower than PyTorch's allocator with the
arena at its default, and at or below it with `reserve:5.7G` (idle memory stays mapped, so the
arena stops moving it). The default makes about 13 map and 15 unmap calls a step, whose driver
time is a third of the gap (docs/BENCHMARKS.md, twelfth session). Running the `reserve` arm
with the same calls added here tells whether the calls cost more than their own time (a
slower driver, CPU or GPU afterwards) or the rest of the gap is the arena's.

`WORKLOAD_VMM_CYCLES=EVERY:BYTES[:WHERE]` (for example `4:8M`): on every EVERY-th module forward
call (a global forward hook, so inside the step's forward pass, on the main thread, where the
arena's calls happen), map a BYTES handle into a reserved range, grant access and unmap it:
the calls of one move (`cuMemMap` + `cuMemSetAccess` + `cuMemUnmap`). The handle and the
ranges are made once. WHERE says which thread makes the calls:
- `main` (the default): all three on the main thread, as the arena does today;
- `unmap-bg`: the main thread maps and grants, and a background thread unmaps. The handle is
  mapped at one of two ranges in turn, so it is mapped at two places while the other range's
  unmap is under way: what an arena that unmaps a stolen chunk later would do;
- `bg`: all three on a background thread; the main thread only hands the cycle over.
The background forms tell whether driver calls off the launching thread cost the step
anything (a driver lock the launches wait for) or nothing. The harness records per step the
cycles, the main thread's ms in them and the background thread's.
"""
import ctypes
import os
import queue
import threading
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


WHERE = ("main", "unmap-bg", "bg")


def parse(text):
    """(every, bytes, where) from `EVERY:BYTES[:WHERE]`, BYTES with an optional K/M/G suffix
    and WHERE one of `WHERE` (`main` when left out); ValueError on anything else."""
    usage = f"{ENV} wants EVERY:BYTES[:{'|'.join(WHERE)}] (like 4:8M), got {text!r}"
    every, sep, rest = text.partition(":")
    size, _, where = rest.partition(":")
    if not sep or not every.isdigit() or int(every) < 1:
        raise ValueError(usage)
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
    digits = size[:-1] if scale > 1 else size
    if not digits.isdigit() or int(digits) == 0 or (where or "main") not in WHERE:
        raise ValueError(usage)
    return int(every), int(digits) * scale, where or "main"


class VmmCycler:
    """Makes move cycles of one handle on the current device; counts them and their time."""

    def __init__(self, every, size, device, where="main"):
        self.every = every
        self.size = size
        self.device = device
        self.where = where
        self.calls = 0          # forward calls seen
        self.cycles = 0         # cycles made since the last `take`
        self.cycle_ns = 0       # the main thread's ns in them
        self.bg_ns = 0          # the background thread's
        self.turn = 0           # which range the next `unmap-bg` cycle maps
        self._cu = None
        self._lock = threading.Lock()
        self._jobs = queue.Queue()
        # Set while a range is unmapped (so the main thread may map it).
        self._unmapped = [threading.Event(), threading.Event()]

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
        self.vas = []
        for _ in range(2):
            va = ctypes.c_uint64()
            self._check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(self.size),
                                               ctypes.c_size_t(0), ctypes.c_uint64(0),
                                               ctypes.c_uint64(0)), "cuMemAddressReserve")
            self.vas.append(va.value)
        self.handle = ctypes.c_uint64()
        self._check(cu.cuMemCreate(ctypes.byref(self.handle), ctypes.c_size_t(self.size),
                                   ctypes.byref(prop), ctypes.c_uint64(0)), "cuMemCreate")
        self.access = _AccessDesc(location=_Location(_ON_DEVICE, self.device), flags=_READ_WRITE)
        self._cu = cu
        for e in self._unmapped:
            e.set()
        if self.where == "unmap-bg":
            # The handle mapped at both ranges at once, as a late unmap leaves it: the driver
            # must allow it, or this form measures nothing.
            self._map(self.vas[0])
            self._map(self.vas[1])
            self._unmap(self.vas[0])
            self._unmap(self.vas[1])
        if self.where != "main":
            threading.Thread(target=self._worker, name="vmm-cycles", daemon=True).start()

    def _map(self, va):
        size = ctypes.c_size_t(self.size)
        self._check(self._cu.cuMemMap(ctypes.c_uint64(va), size, ctypes.c_size_t(0), self.handle,
                                      ctypes.c_uint64(0)), "cuMemMap")
        self._check(self._cu.cuMemSetAccess(ctypes.c_uint64(va), size, ctypes.byref(self.access),
                                            ctypes.c_size_t(1)), "cuMemSetAccess")

    def _unmap(self, va):
        self._check(self._cu.cuMemUnmap(ctypes.c_uint64(va), ctypes.c_size_t(self.size)),
                    "cuMemUnmap")

    def _worker(self):
        while True:
            job = self._jobs.get()
            t = time.perf_counter_ns()
            if job is None:         # `bg`: the whole cycle
                self._map(self.vas[0])
                self._unmap(self.vas[0])
            else:                   # `unmap-bg`: the unmap of range `job`
                self._unmap(self.vas[job])
                self._unmapped[job].set()
            with self._lock:
                self.bg_ns += time.perf_counter_ns() - t

    def cycle(self):
        if self._cu is None:
            self._setup()
        t = time.perf_counter_ns()
        if self.where == "main":
            self._map(self.vas[0])
            self._unmap(self.vas[0])
        elif self.where == "bg":
            self._jobs.put(None)
        else:
            slot, self.turn = self.turn, 1 - self.turn
            self._unmapped[slot].wait()
            self._unmapped[slot].clear()
            self._map(self.vas[slot])
            self._jobs.put(slot)
        self.cycle_ns += time.perf_counter_ns() - t
        self.cycles += 1

    def forward_hook(self, module, inputs, output):
        self.calls += 1
        if self.calls % self.every == 0:
            self.cycle()

    def take(self):
        """[cycles, the main thread's ms in them, the background thread's ms] since the
        last take (a background thread's calls counted when they end)."""
        with self._lock:
            bg_ns, self.bg_ns = self.bg_ns, 0
        out = [self.cycles, round(self.cycle_ns / 1e6, 4), round(bg_ns / 1e6, 4)]
        self.cycles, self.cycle_ns = 0, 0
        return out


def install(torch, device):
    """A `VmmCycler` hooked into every module's forward when `WORKLOAD_VMM_CYCLES` is set,
    else None."""
    text = os.environ.get(ENV)
    if not text:
        return None
    every, size, where = parse(text)
    cycler = VmmCycler(every, size, device, where)
    torch.nn.modules.module.register_module_forward_hook(cycler.forward_hook)
    return cycler
