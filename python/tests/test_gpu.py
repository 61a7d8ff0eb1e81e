"""Checks that need a GPU with a CUDA build of PyTorch (and CuPy for the last one); skipped
elsewhere. Each PyTorch check runs in its own process: ``cupool.torch.enable()`` must come
before CUDA starts. Run on a GPU machine with ``python -m pytest -rs python/tests/test_gpu.py``
(not on the host backend: conftest sets it, so these tests clear CUPOOL_CONF)."""

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _torch_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True, text=True, timeout=300,
    )
    return probe.stdout.strip() == "True"


needs_torch_gpu = pytest.mark.skipif(not _torch_cuda(), reason="needs PyTorch with a GPU")


def run(code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CUPOOL_CONF"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


TRAIN = """
import sys, torch
if sys.argv[1] == "cupool":
    import cupool.torch
    cupool.torch.enable()
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    n = 8 + (step * 53) % 300
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(n, 128, device="cuda", generator=g)
    y = torch.randint(0, 10, (n,), device="cuda", generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    print(f"{loss.item():.6f}")
"""


@needs_torch_gpu
def test_training_losses_match_pytorchs_allocator():
    assert run(TRAIN, "cupool") == run(TRAIN, "native")


@needs_torch_gpu
def test_memory_stats_agree_with_cupool():
    run(
        """
        import torch, cupool, cupool.torch
        cupool.torch.enable()
        xs = [torch.empty(n, device="cuda") for n in (100, 10_000, 3_000_000)]
        s = cupool.stats(0)
        assert torch.cuda.memory_allocated() == s["allocated_bytes.all.current"] > 0
        assert torch.cuda.memory_reserved() == s["reserved_bytes.all.current"]
        assert torch.cuda.max_memory_allocated() == s["allocated_bytes.all.peak"]
        assert "cupool CUDA memory summary" in torch.cuda.memory_summary()
        del xs
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() < s["reserved_bytes.all.current"]
        """
    )


@needs_torch_gpu
def test_record_stream_keeps_the_block_from_early_reuse():
    # If reuse ignored record_stream, `y` would take x's memory and be filled with 5 while
    # the side stream is still asleep, and the side stream would read 5s instead of 1s.
    run(
        """
        import torch, cupool.torch
        cupool.torch.enable()
        n = 1 << 22
        side = torch.cuda.Stream()
        x = torch.ones(n, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # about a second of GPU time
            out = x * 2
        x.record_stream(side)
        del x
        y = torch.empty(n, device="cuda")
        y.fill_(5)
        side.synchronize()
        assert bool((out == 2).all()), "the side stream read memory reused too early"
        """
    )


@needs_torch_gpu
def test_snapshot_renders_with_memory_viz(tmp_path):
    snap = tmp_path / "snap.pickle"
    run(
        """
        import sys, torch, cupool.torch
        cupool.torch.enable()
        torch.cuda.memory._record_memory_history()
        keep = [torch.empty(n, device="cuda") for n in (1000, 1 << 20, 1 << 24)]
        del keep[1]
        torch.cuda.memory._dump_snapshot(sys.argv[1])
        """,
        str(snap),
    )
    stats = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(snap)],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "segments:" in stats
    html = tmp_path / "trace.html"
    subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snap), "-o", str(html)],
        check=True, timeout=300,
    )
    assert html.stat().st_size > 0


@needs_torch_gpu
def test_cuda_graphs_are_refused_clearly():
    out = run(
        """
        import torch, cupool.torch
        cupool.torch.enable()
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(10, device="cuda")
        try:
            with torch.cuda.graph(g):
                y = x + 1
        except RuntimeError as e:
            print(e)
        """
    )
    assert "CUDA graphs are not supported with cupool" in out


@needs_torch_gpu
def test_shim_makes_cudnn_benchmark_work_and_matches_pytorch():
    code = """
        import sys, torch
        if sys.argv[1] == "shim":
            import cupool.torch
            cupool.torch.enable(shim=True)
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        m = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
        for hw in (32, 48, 64):
            y = m(torch.randn(8, 16, hw, hw, device="cuda"))
            y.sum().backward()
        print(f"{float(y.float().abs().sum()):.4f}")
        """
    assert run(code, "shim").split()[-1] == run(code, "native").split()[-1]


MULTIPROCESSING = """
import sys, torch, torch.multiprocessing as mp
import cupool.torch


def child(tensors, sums, consumer):
    if consumer == "cupool":
        cupool.torch.enable(shim=True)
    while True:
        try:
            t = tensors.get()
        except RuntimeError as e:  # the consumer could not open the handle
            sums.put("refused " + str(e).splitlines()[0])
            continue
        if t is None:
            break
        t.add_(1)  # through the mapping of the producer's memory
        torch.cuda.synchronize()
        sums.put(float(t.double().sum()))
        del t


if __name__ == "__main__":
    vmm, consumer = sys.argv[1], sys.argv[2]
    cupool.torch.enable(shim=True, vmm=(vmm == "on"))
    ctx = mp.get_context("spawn")
    tensors, sums = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(tensors, sums, consumer))
    p.start()
    # A small block (shared 2 MiB segment); with vmm:off a block of a 20 MiB segment and a
    # whole segment, with vmm:on two blocks of the VMM arena.
    for n in (1000, 700_000, 6_000_000):
        t = torch.arange(n, device="cuda", dtype=torch.float32)
        before = float(t.double().sum())
        tensors.put(t)
        theirs = sums.get(timeout=120)
        torch.cuda.synchronize()
        ours = float(t.double().sum())
        if isinstance(theirs, str):
            assert ours == before, (n, "changed though refused")
            print("refused", n, theirs)
            continue
        assert theirs == ours == before + n, (n, before, theirs, ours)
        print("shared", n)
    tensors.put(None)
    p.join(timeout=120)
    assert p.exitcode == 0, p.exitcode
"""


def share(tmp_path, vmm: str, consumer: str) -> list[str]:
    script = tmp_path / "share.py"
    script.write_text(MULTIPROCESSING)
    env = {k: v for k, v in os.environ.items() if k != "CUPOOL_CONF"}
    done = subprocess.run([sys.executable, str(script), vmm, consumer], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout.splitlines()


@needs_torch_gpu
@pytest.mark.parametrize(("vmm", "consumer"), [("off", "cupool"), ("off", "native"),
                                               ("on", "cupool")])
def test_multiprocessing_shares_cuda_tensors(tmp_path, vmm, consumer):
    assert share(tmp_path, vmm, consumer) == ["shared 1000", "shared 700000", "shared 6000000"]


@needs_torch_gpu
def test_multiprocessing_of_vmm_blocks_to_pytorchs_allocator_fails_cleanly(tmp_path):
    """A VMM block travels as a cupool handle, which PyTorch's own allocator cannot open:
    the consumer gets CUDA's error, maps nothing, and the producer's bytes stay."""
    lines = share(tmp_path, "on", "native")
    assert lines[0] == "shared 1000", lines
    assert [line.split()[:2] for line in lines[1:]] == [["refused", "700000"],
                                                        ["refused", "6000000"]], lines


@needs_torch_gpu
def test_shim_raises_pytorchs_out_of_memory_error():
    out = run(
        """
        import torch, cupool.torch
        cupool.torch.enable(shim=True)
        keep = torch.ones(10, device="cuda")
        try:
            torch.empty(300 << 30, dtype=torch.uint8, device="cuda")
            print("no error")
        except torch.OutOfMemoryError as e:
            print("raised", str(e).splitlines()[0])
        print("still works", float(keep.sum()))
        """
    )
    assert "raised CUDA out of memory (cupool)" in out, out
    assert "still works 10.0" in out


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy")
def test_cupy_checksums_match_cupys_pool():
    example = str(REPO / "examples" / "python_cupy.py")
    env = {k: v for k, v in os.environ.items() if k != "CUPOOL_CONF"}
    ours = subprocess.run([sys.executable, example], capture_output=True, text=True, env=env)
    theirs = subprocess.run(
        [sys.executable, example, "--cupy-pool"], capture_output=True, text=True, env=env
    )
    if ours.stdout.startswith("SKIPPED"):
        pytest.skip(ours.stdout.strip())
    checksum = [line for line in ours.stdout.splitlines() if line.startswith("checksum")]
    assert checksum and checksum[0] in theirs.stdout
