"""``cupool.torch.enable()`` against a stand-in for PyTorch (``fake_torch/``, see its
README), in subprocesses: the allocator and its hooks are installed and called through
function pointers of PyTorch's C types, the patched statistics functions report the pool's
figures, and the error paths say what went wrong. The real PyTorch on a GPU is the GPU
suite's part."""

import os
import pathlib
import subprocess
import sys
import textwrap

FAKE = pathlib.Path(__file__).resolve().parent / "fake_torch"


def run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(FAKE))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def check(code: str) -> str:
    done = run(code)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def test_enable_wires_the_allocator_hooks_and_statistics():
    out = check(
        """
        import ctypes, pickle, tempfile, os
        import torch
        import cupool, cupool.torch
        from cupool import _lib

        assert not cupool.torch.enabled()
        cupool.torch.enable()
        cupool.torch.enable()  # a second call does nothing
        assert cupool.torch.enabled()
        mem = torch.cuda.memory
        hooks = mem._current
        for name, fn in [("init", "cupool_torch_init"), ("reset", "cupool_torch_empty_cache"),
                         ("fraction", "cupool_torch_set_memory_fraction"),
                         ("record_stream", "cupool_torch_record_stream"),
                         ("base_alloc", "cupool_torch_base_allocation")]:
            assert ctypes.cast(hooks.fns[name], ctypes.c_void_p).value == _lib.function_address(fn), name

        # Statistics before CUDA starts: PyTorch would say {}; cupool answers, and asking
        # does not initialise CUDA.
        assert torch.cuda.memory_allocated() == cupool.stats(0)["allocated_bytes.all.current"]
        assert not torch.cuda.is_initialized()

        torch.cuda.init()
        assert mem.init_calls == [2]
        before = torch.cuda.memory_allocated()
        ptr = mem._raw_alloc(5000, stream=0x7000)
        assert torch.cuda.memory_allocated() == before + 5120
        assert torch.cuda.memory_allocated(0) == cupool.stats(0)["allocated_bytes.all.current"]
        assert torch.cuda.memory_stats()["requested_bytes.all.current"] >= 5000
        nested = torch.cuda.memory.memory_stats_as_nested_dict()
        assert nested["allocated_bytes"]["all"]["current"] == torch.cuda.memory_allocated()
        assert torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved() > 0
        summary = torch.cuda.memory_summary()
        assert "cupool CUDA memory summary, device ID 0" in summary
        base, size = mem._base_allocation(ptr)
        assert base <= ptr < base + size
        mem._record_stream(ptr, 0x7001)
        mem._raw_delete(ptr)
        assert torch.cuda.memory_allocated() == before

        # Peaks, empty_cache and the memory fraction reach the pool.
        big = mem._raw_alloc(50 << 20, stream=0x7000)
        mem._raw_delete(big)
        assert torch.cuda.max_memory_allocated() >= 50 << 20
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
        reserved = cupool.stats()["reserved_bytes.all.current"]
        torch.cuda.empty_cache()
        assert cupool.stats()["reserved_bytes.all.current"] <= reserved - (50 << 20)
        torch.cuda.set_per_process_memory_fraction(0.5)
        total = cupool.mem_get_info(0)[1]
        assert cupool.get_memory_limit(0) == total // 2
        assert abs(torch.cuda.get_per_process_memory_fraction() - 0.5) < 1e-9
        torch.cuda.set_per_process_memory_fraction(1.0)

        # Snapshots and history through PyTorch's private functions.
        torch.cuda.memory._record_memory_history(max_entries=1000)
        keep = mem._raw_alloc(3000, stream=0x7000)
        path = os.path.join(tempfile.mkdtemp(), "s.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        snap = pickle.load(open(path, "rb"))
        assert any(b["address"] == keep for s in snap["segments"] for b in s["blocks"])
        assert any(e["action"] == "alloc" and e["addr"] == keep for e in snap["device_traces"][0])
        assert torch.cuda.memory.memory_snapshot() == snap["segments"]

        # CUDA graphs are refused, clearly.
        try:
            torch.cuda.CUDAGraph().capture_begin()
        except RuntimeError as e:
            assert "CUDA graphs are not supported with cupool" in str(e)
        else:
            raise AssertionError("capture_begin must fail")
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


def test_enable_after_cuda_started_says_why():
    done = run(
        """
        import torch, cupool.torch
        torch.cuda.init()
        cupool.torch.enable()
        """
    )
    assert done.returncode != 0
    assert "AlreadyInitializedError" in done.stderr
    assert "must run before PyTorch initialises CUDA" in done.stderr


def test_enable_when_pytorch_refuses_the_swap_says_why():
    # PyTorch's own check (its allocator started without torch.cuda noticing).
    done = run(
        """
        import torch, cupool.torch
        torch.cuda.memory.change_current_allocator = lambda a: (_ for _ in ()).throw(
            RuntimeError("Can't swap an already initialized allocator"))
        cupool.torch.enable()
        """
    )
    assert done.returncode != 0
    assert "must run before PyTorch initialises CUDA" in done.stderr
    assert "Can't swap an already initialized allocator" in done.stderr


def test_enable_without_a_pluggable_allocator_says_why():
    done = run(
        """
        import torch, cupool.torch
        del torch.cuda.memory.CUDAPluggableAllocator
        cupool.torch.enable()
        """
    )
    assert done.returncode != 0
    assert "no torch.cuda.memory.CUDAPluggableAllocator" in done.stderr


def test_the_package_imports_without_torch_or_cupy():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, cupool, cupool.torch, cupool.cupy; "
         "print('torch' in sys.modules, 'cupy' in sys.modules)"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert out.strip() == "False False"


def test_without_a_shim_build_enable_falls_back_and_says_what_is_lost():
    # The stand-in has no torch.utils.cpp_extension: the C++ shim cannot be built.
    out = check(
        """
        import warnings, torch, cupool.torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cupool.torch.enable()
        assert cupool.torch.enabled()
        print([str(w.message) for w in caught])
        """
    )
    assert "Falling back to PyTorch's pluggable allocator" in out
    assert "NULL pointer" in out and "cudnn.benchmark" in out


def test_shim_true_fails_clearly_and_shim_off_is_quiet():
    done = run(
        """
        import torch, cupool.torch
        cupool.torch.enable(shim=True)
        """
    )
    assert done.returncode != 0
    assert "the shim needs torch.utils.cpp_extension" in done.stderr
    quiet = check(
        """
        import os, warnings
        os.environ["CUPOOL_TORCH_SHIM"] = "0"
        import torch, cupool.torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cupool.torch.enable()
        print("warnings", len(caught))
        """
    )
    assert "warnings 0" in quiet


def test_enable_puts_large_blocks_in_the_vmm_arena_unless_the_user_chose():
    out = check(
        """
        import torch, cupool, cupool.torch
        from cupool import _lib
        cupool.torch.enable(shim=False)
        print("vmm", cupool.config_get("vmm"))
        import ctypes
        from cupool._stats import raw_stats
        lib = _lib.lib()
        lib.cupool_torch_alloc.restype = ctypes.c_void_p
        lib.cupool_torch_alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        p = lib.cupool_torch_alloc(64 << 20, 0, None)
        assert p
        print("mapped", raw_stats(0)["mapped_bytes"]["current"] >= 64 << 20)
        """
    )
    assert "vmm on" in out and "mapped True" in out
    for code in (
        "import os; os.environ['CUPOOL_CONF'] = 'backend:host,vmm:off'\n"
        "import torch, cupool, cupool.torch; cupool.torch.enable(shim=False)",
        "import torch, cupool, cupool.torch; cupool.torch.enable(shim=False, vmm=False)",
    ):
        assert "vmm off" in check(code + "\nprint('vmm', cupool.config_get('vmm'))")


class _StubExtensions:
    """`torch.utils.cpp_extension` as far as the build guard uses it."""

    def __init__(self, root):
        self.root = root

    def _get_build_directory(self, name, verbose):
        return str(self.root / name)


def test_a_lock_left_by_a_killed_shim_build_is_removed_not_waited_for(tmp_path):
    import warnings

    import cupool.torch as ct

    build_dir = tmp_path / "cupool_torch_shim"
    build_dir.mkdir()
    (build_dir / "lock").write_text("")  # PyTorch's lock, its builder gone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ct._build_guard(_StubExtensions(tmp_path), "cupool_torch_shim"):
            assert not (build_dir / "lock").exists()
    assert len(caught) == 1 and "interrupted" in str(caught[0].message)
    # Nothing to clear: no warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ct._build_guard(_StubExtensions(tmp_path), "cupool_torch_shim"):
            pass
    assert not caught


def test_a_build_in_progress_is_waited_for_and_its_lock_kept(tmp_path):
    import fcntl
    import threading
    import time

    import cupool.torch as ct

    build_dir = tmp_path / "cupool_torch_shim"
    build_dir.mkdir()
    # Another process builds: it holds the flock and PyTorch's lock.
    builder = os.open(build_dir / "cupool.flock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(builder, fcntl.LOCK_EX)
    (build_dir / "lock").write_text("")
    entered = threading.Event()

    def build():
        with ct._build_guard(_StubExtensions(tmp_path), "cupool_torch_shim"):
            entered.set()

    waiter = threading.Thread(target=build)
    waiter.start()
    time.sleep(0.3)
    assert not entered.is_set() and (build_dir / "lock").exists()
    # The build ends: PyTorch deletes its lock, the flock goes with the descriptor.
    (build_dir / "lock").unlink()
    os.close(builder)
    waiter.join(10)
    assert entered.is_set()


def test_without_the_build_directory_the_guard_does_nothing(tmp_path):
    import cupool.torch as ct

    with ct._build_guard(object(), "cupool_torch_shim") as guard:
        assert guard is None
