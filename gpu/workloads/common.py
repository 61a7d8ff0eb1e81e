"""The harness shared by the corpus workloads (gpt_train, llm_generate, conv_train).

Every workload runs unchanged under three allocators, and the harness measures each the same
way:

- the device peak from NVML (memory used on the device the process uses, sampled about every
  millisecond by a background thread), above its value once the CUDA context exists. NVML,
  because under the preload `cudaMemGetInfo` counts memory cupool caches but does not use as
  free, and under PyTorch's allocator `max_memory_reserved` misses what the allocator does
  not own;
- PyTorch's own peaks (`max_memory_reserved`/`max_memory_allocated` and a few counters from
  `memory_stats`) when PyTorch's caching allocator is in use (modes `native`, `expandable`);
- cupool's stats (`cupool_stats_json` through ctypes) when the process runs under
  `libcupool_preload.so` (mode `preload`), and what its counts (allocations, misses, driver
  allocations, fences, waits, the VMM arena's mappings) did in each step
  (`cupool_step_counts`, one dict per step of the counts that moved);
- in `native` mode with `--snapshot`, PyTorch's memory history as a snapshot pickle (gzip),
  the trace cupool replays.

Each workload prints its per-step lines, then one JSON line of results, and writes the same
JSON to `--out-json`. A workload that raises still writes its JSON, with `"status": "failed"`
and the error, and exits 1.
"""
import argparse
import ctypes
import hashlib
import json
import math
import os
import random
import resource
import statistics
import sys
import time
import traceback

# Before torch creates a cuBLAS handle: deterministic cuBLAS (PyTorch's documented setting).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

try:
    import torch
except ImportError:  # the shape samplers and the argument parsing still work without torch
    torch = None

# The harness's other parts, in modules of their own beside this one (the workloads put
# this folder on the path).
from allocator_readings import (  # noqa: E402,F401
    SnapshotRecorder, count_deltas, cupool_counts, cupool_json, cupool_stats,
    torch_allocator_stats, torch_caching_allocator_in_use,
)
from device_peak import DevicePeakMonitor  # noqa: E402
from host_speed import host_probe_ms  # noqa: E402
import vmm_cycles  # noqa: E402

DEFAULT_SNAPSHOT_MAX_ENTRIES = 4_000_000


# ---------------------------------------------------------------------------------------
# Arguments and the mode the process runs in


def parser(description):
    """An argument parser with the options every workload takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=None, help="steps (requests for llm_generate)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-json", default=None, help="write the result JSON here too")
    p.add_argument("--mode", default=None,
                   help="label of the allocator (default: detected: native, expandable, "
                        "nocache or preload)")
    p.add_argument("--snapshot", default=None,
                   help="record PyTorch's memory history and write the snapshot here "
                        "(gzip when the name ends in .gz); PyTorch's caching allocator only")
    p.add_argument("--snapshot-max-entries", type=int, default=DEFAULT_SNAPSHOT_MAX_ENTRIES,
                   help="size of PyTorch's trace ring buffer (entries per device)")
    p.add_argument("--sample-interval-ms", type=float, default=1.0,
                   help="NVML sampling period of the device-peak thread")
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes the seed draws and exit (no GPU needed)")
    p.add_argument("--kernel-time", default=None, metavar="FIRST:COUNT",
                   help="trace the GPU's work in steps FIRST..FIRST+COUNT-1 (torch.profiler, "
                        "CUDA activity only) and report its time per step beside the steps' "
                        "wall time (kernel_time in the result): tells whether an allocator "
                        "slows the GPU's work or the host's")
    return p


def parse_kernel_time(text):
    """`FIRST:COUNT` of --kernel-time as (first, count), or None."""
    if text is None:
        return None
    first, _, count = text.partition(":")
    if not (first.isdigit() and count.isdigit() and int(count) > 0):
        raise SystemExit(f"--kernel-time wants FIRST:COUNT, got {text!r}")
    return int(first), int(count)


def preload_active():
    """1 when cupool's preload routes this process's device allocations."""
    try:
        fn = ctypes.CDLL(None).cupool_interposition_active
    except (AttributeError, OSError):
        return False
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn() == 1


def alloc_conf():
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    return ",".join(os.environ.get(k, "") for k in names)


def detect_mode():
    """native | expandable | async | cupool | rmm | nocache | preload, from the environment
    and the process."""
    if preload_active():
        return "preload"
    if os.environ.get("WORKLOAD_ALLOCATOR") in ("cupool", "rmm"):
        return os.environ["WORKLOAD_ALLOCATOR"]
    if "backend:cudamallocasync" in alloc_conf().replace(" ", "").lower():
        return "async"
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        return "nocache"
    if "expandable_segments:true" in alloc_conf().replace(" ", "").lower():
        return "expandable"
    return "native"


def switch_allocator():
    """WORKLOAD_ALLOCATOR=cupool: PyTorch on cupool through `cupool.torch.enable()` (the
    package from python/ on PYTHONPATH, its library from CUPOOL_LIBRARY); =rmm: RMM's pool
    resource through `rmm.allocators.torch` (the pool's initial size is RMM's default, half the
    device's free memory, or WORKLOAD_RMM_INITIAL_POOL bytes; it grows from the driver when
    it runs out).
    Before the first CUDA allocation. Returns what to report, or None."""
    which = os.environ.get("WORKLOAD_ALLOCATOR")
    if which == "cupool":
        import cupool
        import cupool.torch
        cupool.torch.enable()
        return "cupool.torch.enable()"
    if which == "rmm":
        # Only the hooks here: start_rmm_pool() makes the pool, once the context exists.
        from rmm.allocators.torch import rmm_torch_allocator
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    return None


def start_rmm_pool():
    """Makes RMM's pool the device's resource (after switch_allocator() put PyTorch on RMM's
    hooks, before PyTorch's first allocation). Returns what to report."""
    import rmm
    initial = os.environ.get("WORKLOAD_RMM_INITIAL_POOL")
    kwargs = {"initial_pool_size": int(initial)} if initial else {}
    rmm.reinitialize(pool_allocator=True, **kwargs)
    size = "RMM's default initial size" if not initial else f"initial size {initial} B"
    return f"rmm {rmm.__version__} pool resource, {size}"


# ---------------------------------------------------------------------------------------
# Shapes: drawn on the host from the seed, so every allocator sees the same sequence


def shape_rng(seed, salt):
    """A host RNG for a workload's shapes, independent of torch's generators."""
    return random.Random(seed * 1_000_003 + salt)


def log_uniform_int(rng, lo, hi):
    """An integer in [lo, hi], log-uniformly (small values as likely per octave as large)."""
    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))


# ---------------------------------------------------------------------------------------
# The run


def checksum(values):
    """A short hash of a list of numbers, exact to the bit (repr of each float)."""
    text = ",".join(repr(float(v)) for v in values)
    return hashlib.sha256(text.encode()).hexdigest()[:16]



def process_cpu_s():
    """The process's user and system CPU seconds so far, every thread counted, to the
    microsecond (`getrusage`; `os.times` counts in clock ticks, 10 ms, too coarse for a
    step)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class Harness:
    """Sets up determinism, measures, and reports one workload run.

        h = Harness("gpt_train", args, config)
        for i in range(steps):
            h.step_begin()
            ... (ends with a value read back to the host, e.g. loss.item())
            h.step_end(loss, "batch 8 seq 512")
        h.finish({"params": n})
    """

    def __init__(self, name, args, config):
        if torch is None:
            raise SystemExit(f"{name}: torch is not installed")
        if not torch.cuda.is_available():
            raise SystemExit(f"{name}: no CUDA device visible to torch")
        self.name = name
        self.args = args
        self.config = config
        self.mode = args.mode or detect_mode()
        self.losses = []
        self.step_ms = []
        # The process's CPU time in each step, user and system, in ms (every thread: the
        # autograd engine's device thread runs the backward pass; system time holds the
        # driver's ioctls and page faults): a step that is slower with as much CPU time
        # waited, one with more CPU time worked.
        self.step_cpu_ms = []
        # The host-speed probe after each step (`host_probe_ms`), in ms.
        self.host_probe_ms = []
        # When each step ended (CLOCK_MONOTONIC, shared by every process of the machine), to
        # line steps up with `host_canary.py`'s readings.
        self.step_end_s = []
        self._cpu0 = None
        self.notes = []
        self._t0 = None
        self.wall_start = time.perf_counter()
        # cupool's counts at the last step's end, and what moved in each step (a list of
        # dicts, `cupool_step_counts` in the result); None while no cupool is in use.
        self._counts = None
        self.step_counts = []
        self.kernel_steps = parse_kernel_time(getattr(args, "kernel_time", None))
        self._profiler = None
        self.kernel_time = None

        torch.manual_seed(args.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.set_float32_matmul_precision("high")

        # PyTorch takes a new allocator only before its own is initialised (the context's
        # creation does that), but RMM's pool takes its initial size from the driver when it
        # is made: so for RMM the start value is read after the context, before the pool.
        rmm_pool = os.environ.get("WORKLOAD_ALLOCATOR") == "rmm"
        self.allocator = switch_allocator()
        self.device_index = torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        # Create the context before the start value is read: the peak is what the workload
        # adds, not the context (the same under every allocator).
        torch.cuda.init()
        torch.cuda.synchronize()
        self.monitor = DevicePeakMonitor(self.device_index, args.sample_interval_ms / 1000.0)
        if rmm_pool:
            self.monitor.start()
            self.allocator = start_rmm_pool()
        # Move cycles made inside the steps (`vmm_cycles.py`, a diagnostic), and per step
        # [cycles, ms in them] (`vmm_cycles` in the result).
        self.cycler = vmm_cycles.install(torch, self.device_index)
        self.step_vmm_cycles = []
        self.snapshot = None
        if args.snapshot:
            if torch_caching_allocator_in_use():
                self.snapshot = SnapshotRecorder(args.snapshot, args.snapshot_max_entries)
                self.snapshot.start()
            else:
                self.notes.append("--snapshot ignored: PyTorch's caching allocator is off")
        if not rmm_pool:
            self.monitor.start()

    def step_begin(self):
        if not self.step_ms:
            self._counts = self.cupool_counts()
        if self.kernel_steps and len(self.step_ms) == self.kernel_steps[0]:
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA])
            self._profiler.__enter__()
        self._cpu0 = process_cpu_s()
        self._t0 = time.perf_counter()

    def step_end(self, loss, detail=""):
        """Ends a step: `loss` is a float already on the host (its .item() synchronised)."""
        torch.cuda.synchronize()
        ms = (time.perf_counter() - self._t0) * 1e3
        cpu = process_cpu_s()
        self.step_cpu_ms.append([round((cpu[0] - self._cpu0[0]) * 1e3, 3),
                                 round((cpu[1] - self._cpu0[1]) * 1e3, 3)])
        self.step_ms.append(ms)
        if self.cycler is not None:
            self.step_vmm_cycles.append(self.cycler.take())
        self.step_end_s.append(round(time.monotonic(), 6))
        self.losses.append(float(loss))
        print(f"step {len(self.losses) - 1:3d} loss {float(loss):.6f} ms {ms:8.2f} {detail}")
        if self._profiler is not None and len(self.step_ms) == sum(self.kernel_steps):
            self._finish_kernel_time()
        # Read after the step's time is taken, so reading costs the step nothing.
        if self._counts is not None:
            now = self.cupool_counts()
            if now is not None:
                self.step_counts.append(count_deltas(self._counts, now))
                self._counts = now
        self.host_probe_ms.append(round(host_probe_ms(), 4))

    def result(self, status, extra=None, error=None):
        if status == "ok":
            torch.cuda.synchronize()
        peak = self.monitor.stop()
        out = {
            "workload": self.name,
            "mode": self.mode,
            "status": status,
            "error": error,
            "seed": self.args.seed,
            "steps": len(self.losses),
            "config": self.config,
            "step_ms_median": statistics.median(self.step_ms) if self.step_ms else None,
            "step_ms_total": sum(self.step_ms),
            "step_cpu_ms": self.step_cpu_ms,
            "step_ms": [round(ms, 4) for ms in self.step_ms],
            "host_probe_ms": self.host_probe_ms,
            "step_end_s": self.step_end_s,
            "wall_s": time.perf_counter() - self.wall_start,
            "losses": self.losses,
            "loss_checksum": checksum(self.losses),
            **peak,
            "torch": torch_allocator_stats(self.device_index, self.mode == "expandable"),
            "cupool": self.cupool_stats(),
            "cupool_footprint": self.cupool_footprint(),
            "cupool_step_counts": self.step_counts if self._counts is not None else None,
            "kernel_time": self.kernel_time,
            "vmm_cycles": self.step_vmm_cycles if self.cycler is not None else None,
            "allocator": self.allocator,
            "env": {k: os.environ.get(k) for k in (
                "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "LD_PRELOAD", "CUPOOL_TRACE", "CUPOOL_CONF", "CUPOOL_LIBRARY", vmm_cycles.ENV) if os.environ.get(k)},
            "torch_version": torch.__version__,
            "device_name": torch.cuda.get_device_name(self.device_index),
            "notes": self.notes,
        }
        if extra:
            out.update(extra)
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot.finish()
        return out

    def cupool_via(self):
        """How this process reaches cupool: "preload" (its exports, through ctypes),
        "package" (`cupool.torch.enable()`), or None."""
        if self.mode == "preload" or preload_active():
            return "preload"
        return "package" if self.mode == "cupool" else None

    def cupool_stats(self):
        via = self.cupool_via()
        if via == "preload":
            return cupool_stats()
        if via == "package":
            import cupool
            return cupool.stats()
        return None

    def _finish_kernel_time(self):
        """Stops the profiler of --kernel-time; the GPU's time per step (every kernel, copy
        and memset it ran, µs summed) beside the same steps' wall time."""
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        first, count = self.kernel_steps
        device_us = 0.0
        for e in prof.key_averages():
            device_us += getattr(e, "self_device_time_total",
                                 getattr(e, "self_cuda_time_total", 0.0))
        self.kernel_time = {"first_step": first, "steps": count,
                            "device_ms_per_step": device_us / 1e3 / count,
                            "wall_ms_per_step": sum(self.step_ms[first:first + count]) / count}
        print(f"kernel time, steps {first}-{first + count - 1}: device "
              f"{self.kernel_time['device_ms_per_step']:.2f} ms a step, wall "
              f"{self.kernel_time['wall_ms_per_step']:.2f} ms")

    def cupool_counts(self):
        """cupool's monotonic counts now ([`cupool_counts`]), or None without cupool."""
        via = self.cupool_via()
        if via == "preload":
            return cupool_counts(cupool_stats(), (self.cupool_footprint() or {}).get("devices"))
        if via == "package":
            from cupool import _stats
            return cupool_counts(_stats.raw_stats(None), self.cupool_footprint())
        return None

    def cupool_footprint(self):
        """Where cupool's reserved bytes are, and were at their peak, per device."""
        via = self.cupool_via()
        if via == "preload":
            return cupool_json("cupool_footprint_json")
        if via == "package":
            import cupool
            return cupool.footprint()
        return None

    def finish(self, extra=None, status="ok", error=None):
        out = self.result(status, extra, error)
        line = json.dumps(out, sort_keys=True)
        print(line)
        if self.args.out_json:
            tmp = self.args.out_json + ".tmp"
            with open(tmp, "w") as f:
                f.write(line + "\n")
            os.replace(tmp, self.args.out_json)
        return out


def run_workload(name, args, config, body):
    """Runs `body(harness)`; writes the result JSON whether it succeeds or raises."""
    h = Harness(name, args, config)
    try:
        extra = body(h)
    except BaseException as e:  # OOM, a bad shape, Ctrl-C: still report what was measured
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        try:
            h.finish({"traceback_tail": tb[-2000:]}, status="failed",
                     error=f"{type(e).__name__}: {str(e)[:500]}")
        finally:
            sys.exit(1)
    h.finish(extra)
