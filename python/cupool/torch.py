"""PyTorch on cupool: ``cupool.torch.enable()``.

It installs cupool as PyTorch's CUDA allocator through ``CUDAPluggableAllocator`` (every
allocation stream-ordered on PyTorch's current stream, every free on the stream it was
allocated on) with the optional hooks wired: ``torch.cuda.empty_cache()``,
``set_per_process_memory_fraction()`` and ``Tensor.record_stream()`` reach the pool, and
``getBaseAllocation`` (IPC) answers with the block's segment. PyTorch's pluggable allocator
cannot answer statistics or snapshots itself, so the functions that ask for them are
replaced by ones that ask cupool: ``memory_stats``, ``memory_stats_as_nested_dict``,
``memory_allocated`` and the other figures built on ``memory_stats``, ``memory_summary``,
``reset_peak_memory_stats``, ``get_per_process_memory_fraction``, ``memory_snapshot``,
``_snapshot`` / ``_dump_snapshot`` and ``_record_memory_history``.

CUDA graphs are refused with a clear error (``torch.cuda.graph``,
``torch.compile(mode="reduce-overhead")``): PyTorch's pluggable allocator hooks for graph
pools take C++ types, and without a private pool a graph's memory could be handed out again
while the graph still uses it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import warnings
from typing import Any, Iterator

from . import _lib, _snapshot, _stats

_lock = threading.Lock()
_allocator: Any = None  # kept alive: PyTorch holds only the C++ side

# PyTorch's setter → cupool's hook (torch/csrc/cuda/CUDAPluggableAllocator.h).
_HOOKS = (
    ("set_init_fn", "cupool_torch_init"),
    ("set_reset_fn", "cupool_torch_empty_cache"),
    ("set_memory_fraction_fn", "cupool_torch_set_memory_fraction"),
    ("set_record_stream_fn", "cupool_torch_record_stream"),
    ("set_base_alloc_fn", "cupool_torch_base_allocation"),
)

GRAPHS_MESSAGE = (
    "CUDA graphs are not supported with cupool.torch.enable() yet: PyTorch's pluggable "
    "allocator cannot give a graph a private memory pool, so memory the graph uses could "
    "be handed to other tensors while the graph is alive. Run without cupool.torch.enable() "
    "(or without CUDA graphs / torch.compile(mode='reduce-overhead'))."
)


class AlreadyInitializedError(RuntimeError):
    """``enable()`` came after PyTorch had started its own CUDA allocator."""


def enabled() -> bool:
    """Whether PyTorch allocates through cupool in this process."""
    return _allocator is not None


def _user_chose_vmm() -> bool:
    """Whether ``CUPOOL_CONF`` sets ``vmm`` (the user's choice wins over ``enable()``'s)."""
    conf = os.environ.get("CUPOOL_CONF", "")
    return any(item.split(":", 1)[0].strip() == "vmm" for item in conf.split(","))


def enable(shim: bool | None = None, vmm: bool | None = None) -> None:
    """Makes cupool PyTorch's CUDA allocator. Call it before the first CUDA allocation
    (right after ``import torch``): PyTorch cannot swap an allocator it has started. A
    second call does nothing.

    ``shim``: a small C++ extension (``_torch_shim.cpp``, built once against the installed
    PyTorch with ``torch.utils.cpp_extension``, which needs a C++ compiler and the CUDA
    headers; the first build takes about a minute, later calls reuse it) stands in for
    PyTorch's pluggable allocator and adds what plain C hooks cannot: out of memory raises
    ``torch.OutOfMemoryError`` (PyTorch's pluggable allocator would give the tensor a NULL
    pointer), and ``cudnn.benchmark = True`` works (the pluggable allocator raises "does
    not yet support cacheInfo"), and tensors skip the pluggable allocator's per-tensor
    bookkeeping (their deleter frees the block on its allocation stream directly).
    ``None`` (the default, or ``CUPOOL_TORCH_SHIM=1``/``0``):
    the shim when it builds, else the pluggable allocator with a warning saying what is
    lost. ``True``: the shim or an error. ``False``: the pluggable allocator.

    ``vmm``: blocks above 1 MiB come from cupool's VMM arena (the option ``vmm:on``), whose
    footprint follows the live bytes: on an H100 it held less than PyTorch's
    ``expandable_segments`` at PyTorch's own step time on variable-shape training
    (docs/BENCHMARKS.md). ``None`` (the default): on, unless ``CUPOOL_CONF`` sets ``vmm``.
    ``False``: plain segments. ``torch.multiprocessing`` shares CUDA tensors through the
    shim: with ``vmm=False`` in PyTorch's own handle format, which a consumer on PyTorch's
    allocator opens too; with ``vmm:on`` a block above 1 MiB (VMM memory, which legacy CUDA
    IPC cannot export) travels as a cupool handle, which a consumer on cupool opens (this
    shim, or the preload) and PyTorch's own allocator refuses with a CUDA error."""
    global _allocator
    import torch  # noqa: PLC0415 - torch is optional: imported only here

    with _lock:
        if _allocator is not None:
            return
        memory = getattr(getattr(torch, "cuda", None), "memory", None)
        if memory is None or not hasattr(memory, "CUDAPluggableAllocator"):
            raise RuntimeError(
                "cupool.torch.enable(): this PyTorch has no torch.cuda.memory."
                "CUDAPluggableAllocator (a CUDA build of PyTorch 2.x is needed)"
            )
        if torch.cuda.is_initialized():
            raise AlreadyInitializedError(_too_late_message())
        if vmm is not None or not _user_chose_vmm():
            from . import config_set  # noqa: PLC0415 - the package imports this module

            config_set("vmm", "off" if vmm is False else "on")
        if shim is None and os.environ.get("CUPOOL_TORCH_SHIM") in ("0", "1"):
            shim = os.environ["CUPOOL_TORCH_SHIM"] == "1"
        if shim is not False:
            try:
                _allocator = _install_shim(torch)
            except RuntimeError as e:
                if shim:
                    raise
                warnings.warn(
                    f"{e}. Falling back to PyTorch's pluggable allocator: out of memory "
                    "then gives a tensor a NULL pointer instead of raising, and "
                    "cudnn.benchmark = True fails.",
                    stacklevel=2,
                )
            if _allocator is not None:
                _patch(torch)
                return
        allocator = memory.CUDAPluggableAllocator(
            _lib.loaded_path(), "cupool_torch_alloc", "cupool_torch_free"
        )
        raw = allocator.allocator()
        for setter, hook in _HOOKS:
            set_hook = getattr(raw, setter, None)
            if set_hook is not None:
                set_hook(_lib.function_address(hook))
        try:
            memory.change_current_allocator(allocator)
        except RuntimeError as e:
            if "initialized" in str(e):
                raise AlreadyInitializedError(_too_late_message()) from e
            raise
        _allocator = allocator
        _patch(torch)


_SHIM_NAME = "cupool_torch_shim"


@contextlib.contextmanager
def _build_guard(cpp_extension: Any, name: str) -> Iterator[int | None]:
    """Note [stale build lock]: PyTorch's ``cpp_extension.load`` builds under a lock file
    (``lock`` in the build directory) that the building process deletes when it is done. A
    process killed during the build leaves it behind, and every later ``load`` of the same
    extension then waits for it forever: ``enable()`` hung on an H100 after an earlier run
    was killed while it built the shim (docs/BENCHMARKS.md, twelfth session). So cupool's
    builds also take an ``flock`` on ``cupool.flock`` beside it, which the kernel releases
    when its holder dies. Whoever holds the flock knows no other cupool process is building,
    so a ``lock`` it finds is stale: it removes it, with a warning, and builds. Builds of
    several processes at once (the ranks of a job starting together) still take turns.
    Yields the flock's descriptor, or None where there is no guard: without PyTorch's
    (private) ``_get_build_directory``, or when the flock cannot be taken."""
    import fcntl  # noqa: PLC0415 - POSIX only, like the library

    get_dir = getattr(cpp_extension, "_get_build_directory", None)
    fd = -1
    try:
        build_dir = get_dir(name, False) if get_dir else None
        if build_dir is not None:
            os.makedirs(build_dir, exist_ok=True)
            fd = os.open(os.path.join(build_dir, "cupool.flock"), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except Exception:  # noqa: BLE001 - no guard beats a failed enable()
        if fd >= 0:
            os.close(fd)
        fd = -1
    try:
        stale = os.path.join(build_dir, "lock") if fd >= 0 else None
        if stale is not None and os.path.exists(stale):
            try:
                os.remove(stale)
                warnings.warn(
                    f"cupool: removed {stale}, left by a build of the PyTorch allocator shim "
                    "that was interrupted (PyTorch would wait for it forever)",
                    stacklevel=3,
                )
            except OSError:
                pass
        yield fd if fd >= 0 else None
    finally:
        if fd >= 0:
            os.close(fd)  # closing the last descriptor releases the flock


def _install_shim(torch: Any) -> Any:
    """Builds (once; PyTorch caches the build) and installs the C++ allocator of
    ``_torch_shim.cpp``; returns its module."""
    import pathlib  # noqa: PLC0415

    try:
        from torch.utils import cpp_extension  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError(f"cupool: the shim needs torch.utils.cpp_extension ({e})") from e

    source = pathlib.Path(__file__).with_name("_torch_shim.cpp")
    started = time.monotonic()
    try:
        with _build_guard(cpp_extension, _SHIM_NAME):
            module = cpp_extension.load(
                name=_SHIM_NAME,
                sources=[str(source)],
                extra_cflags=["-O2"],
                with_cuda=True,
                verbose=False,
            )
    except Exception as e:
        raise RuntimeError(
            f"cupool.torch.enable(shim=True): building {source.name} against PyTorch "
            f"{torch.__version__} failed ({type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}); "
            "enable() without shim=True works without a compiler"
        ) from e
    took = time.monotonic() - started
    if took > 5:  # a build, not a load of the cached one: say once why start-up was slow
        print(
            f"cupool: built the PyTorch allocator shim in {took:.0f} s (once: later runs reuse "
            "it; CUPOOL_TORCH_SHIM=0 skips it)",
            file=sys.stderr,
        )
    hooks = dict(_HOOKS)
    module.install(
        _lib.function_address("cupool_torch_alloc"),
        _lib.function_address("cupool_torch_free"),
        _lib.function_address(hooks["set_init_fn"]),
        _lib.function_address(hooks["set_reset_fn"]),
        _lib.function_address(hooks["set_memory_fraction_fn"]),
        _lib.function_address(hooks["set_record_stream_fn"]),
        _lib.function_address(hooks["set_base_alloc_fn"]),
        _lib.function_address("cupool_mem_get_info"),
        _lib.function_address("cupool_torch_delete"),
        _lib.function_address("cupool_ipc_get_handle"),
        _lib.function_address("cupool_ipc_open_handle"),
        _lib.function_address("cupool_ipc_close_handle"),
    )
    return module


def _too_late_message() -> str:
    return (
        "cupool.torch.enable() must run before PyTorch initialises CUDA (before the first "
        "CUDA tensor, torch.cuda.init() or anything else that starts PyTorch's CUDA "
        "allocator): PyTorch cannot swap an allocator that is in use. Call it right after "
        "`import torch`."
    )


def _device_index(torch: Any, device: Any) -> int:
    """PyTorch's meaning of a ``device`` argument: ``None`` is the current device (0 while
    CUDA is not initialised, so that asking for statistics does not initialise it)."""
    if device is None and not torch.cuda.is_initialized():
        return 0
    return torch.cuda._get_device_index(device, optional=True)


def _patch(torch: Any) -> None:
    """Replaces PyTorch's statistics and snapshot functions by cupool's (in
    ``torch.cuda.memory``, where PyTorch's own helpers look them up, and in ``torch.cuda``)."""

    def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
        return _stats.nested(_stats.stats(_device_index(torch, device)))

    def memory_stats(device: Any = None) -> dict[str, Any]:
        return collections.OrderedDict(_stats.stats(_device_index(torch, device)))

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        return _stats.memory_summary(_device_index(torch, device), abbreviated)

    def reset_peak_memory_stats(device: Any = None) -> None:
        from . import reset_peak_stats

        reset_peak_stats(_device_index(torch, device))

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        warnings.warn(
            "cupool keeps no resettable totals: reset_accumulated_memory_stats does nothing",
            stacklevel=2,
        )

    def get_per_process_memory_fraction(device: Any = None) -> float:
        from . import get_memory_limit, mem_get_info

        index = _device_index(torch, device)
        limit = get_memory_limit(index)
        total = mem_get_info(index)[1]
        return 1.0 if limit == 0 or total == 0 else min(limit / total, 1.0)

    def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list:
        return _snapshot.segments()

    def _snapshot_fn(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return _snapshot.snapshot()

    def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
        _snapshot.record_memory_history(
            enabled, max_entries=kwargs.get("max_entries") or 1_000_000
        )

    replacements = {
        "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_stats": memory_stats,
        "memory_summary": memory_summary,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "memory_snapshot": memory_snapshot,
        "_snapshot": _snapshot_fn,
        "_record_memory_history": _record_memory_history,
    }
    for module in (torch.cuda.memory, torch.cuda):
        for name, fn in replacements.items():
            if hasattr(module, name):
                setattr(module, name, fn)

    graphs = getattr(torch.cuda, "graphs", None)
    graph_class = getattr(graphs, "CUDAGraph", None) or getattr(torch.cuda, "CUDAGraph", None)
    if graph_class is not None:

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(GRAPHS_MESSAGE)

        graph_class.capture_begin = capture_begin
