"""The device peak of a workload run: memory used on the device the process uses, from NVML,
sampled about every millisecond by a helper process, above its value once the CUDA context
exists (part of the workload harness, `common.py`)."""
import os
import subprocess
import sys
import threading

try:
    import torch
except ImportError:  # imported by tests without torch
    torch = None


def _nvml_index_for(device_index):
    """The NVML index of torch's CUDA device `device_index` (CUDA_VISIBLE_DEVICES and PCI
    order can differ from NVML's order)."""
    import pynvml
    try:
        return int(torch.cuda._get_nvml_device_index(device_index)), "torch"
    except Exception:  # private helper; fall back on the device's UUID
        pass
    try:
        uuid = str(torch.cuda.get_device_properties(device_index).uuid).lower()
        uuid = uuid[4:] if uuid.startswith("gpu-") else uuid
        for i in range(pynvml.nvmlDeviceGetCount()):
            u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            u = (u.decode() if isinstance(u, bytes) else u).lower()
            u = u[4:] if u.startswith("gpu-") else u
            if uuid and (u == uuid or u.startswith(uuid) or uuid.startswith(u)):
                return i, "uuid"
    except Exception:
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if device_index < len(visible) and visible[device_index].strip().isdigit():
        return int(visible[device_index]), "CUDA_VISIBLE_DEVICES"
    return device_index, "index"


# The sampler process: samples the device's used memory every INTERVAL seconds until a line
# arrives on its stdin (or stdin closes), then prints "PEAK SAMPLES". A process of its own, so
# that the workload's GIL never delays a sample and sampling never slows the workload.
SAMPLER_SOURCE = r"""
import select, sys, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
interval = float(sys.argv[2])
peak = samples = 0
print("ready", flush=True)
while True:
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    samples += 1
    if used > peak:
        peak = used
    if select.select([sys.stdin], [], [], interval)[0]:
        break
print(peak, samples, flush=True)
"""


class DevicePeakMonitor:
    """Samples the device's used memory (NVML) about every `interval_s` from `start()` to
    `stop()`, which returns the peak above the value at start.

    The sampling runs in a small Python process of its own (no CUDA, no preload). Where that
    cannot start it runs in a thread, which waits on an Event between samples and so holds
    the GIL only for the instant of a sample, but while the main thread runs Python it gets
    the GIL only every switch interval (5 ms). A last sample is taken at stop either way.
    """

    def __init__(self, device_index, interval_s=0.001):
        self.interval_s = interval_s
        self.source = None
        self.sampler = None
        self.error = None
        self._stop = threading.Event()
        self._thread = None
        self._proc = None
        self._nvml_index = None
        self.samples = 0
        self.start_bytes = self.peak_bytes = self.last_bytes = 0
        self.total_bytes = None
        try:
            import pynvml
            pynvml.nvmlInit()
            index, how = _nvml_index_for(device_index)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._read = lambda: pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
            self.total_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
            self._nvml_index = index
            self.source = f"nvml (device {index}, matched by {how})"
        except Exception as e:  # no pynvml or no NVML: cudaMemGetInfo, wrong under the preload
            self.error = f"NVML unavailable ({type(e).__name__}: {e}); cudaMemGetInfo used"

            def read():
                free, total = torch.cuda.mem_get_info(device_index)
                return total - free

            self._read = read
            self.source = "cudaMemGetInfo (undercounts cached memory under the preload)"

    def start(self):
        self.start_bytes = self.peak_bytes = self.last_bytes = int(self._read())
        if self._nvml_index is not None and self._start_process():
            return
        self.sampler = "thread"
        self._thread = threading.Thread(target=self._run, name="device-peak", daemon=True)
        self._thread.start()

    def _start_process(self):
        # The sampler must not load the preload: it uses no CUDA, and a recorder in it could
        # write over the workload's trace.
        env = {k: v for k, v in os.environ.items()
               if k != "LD_PRELOAD" and not k.startswith("CUPOOL_")}
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", SAMPLER_SOURCE, str(self._nvml_index),
                 repr(self.interval_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            line = self._proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"sampler process said {line!r}")
        except Exception as e:
            self.error = f"sampler process failed ({type(e).__name__}: {e}); thread used"
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            return False
        self.sampler = "process"
        return True

    def _sample(self):
        used = int(self._read())
        self.samples += 1
        self.last_bytes = used
        if used > self.peak_bytes:
            self.peak_bytes = used

    def _run(self):
        while not self._stop.is_set():
            try:
                self._sample()
            except Exception as e:
                self.error = f"sampling stopped: {type(e).__name__}: {e}"
                return
            self._stop.wait(self.interval_s)

    def stop(self):
        if self._proc is not None:
            try:
                out, _ = self._proc.communicate(input="stop\n", timeout=30)
                peak, samples = (int(v) for v in out.split()[:2])
                self.peak_bytes = max(self.peak_bytes, peak)
                self.samples += samples
            except Exception as e:
                self.error = f"sampler process lost ({type(e).__name__}: {e})"
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._sample()
        except Exception:
            pass
        return {
            "device_peak_bytes": self.peak_bytes - self.start_bytes,
            "device_used_at_start_bytes": self.start_bytes,
            "device_used_at_end_bytes": self.last_bytes,
            "device_total_bytes": self.total_bytes,
            "device_peak_source": self.source,
            "device_peak_sampler": self.sampler,
            "device_peak_samples": self.samples,
            "device_peak_error": self.error,
        }
