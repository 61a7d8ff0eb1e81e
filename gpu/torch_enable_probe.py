"""What works under `cupool.torch.enable()` on a GPU: one fresh process per feature, each
compared with PyTorch's own allocator where a result can be compared. Prints one line per
check (`PASS`, `FAIL` or `REFUSED` with the error's last line) and, with --out-json, the
same as JSON.

  CUPOOL_LIBRARY=.../libcupool.so PYTHONPATH=python python3 gpu/torch_enable_probe.py \
      [--modes cupool cupool-shim] [CHECK ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

PRELUDE = """
import sys, torch
if sys.argv[1].startswith("cupool"):
    import cupool.torch
    cupool.torch.enable(shim=sys.argv[1] == "cupool-shim")
"""

CHECKS = {
    # cuDNN's benchmark mode asks the allocator for its largest cached block (cacheInfo).
    "cudnn_benchmark": """
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
m = torch.nn.Conv2d(16, 32, 3, padding=1).cuda()
for hw in (32, 48, 64):
    x = torch.randn(8, 16, hw, hw, device="cuda")
    y = m(x); y.sum().backward()
torch.cuda.synchronize()
print("ok", float(y.float().abs().sum()))
""",
    "torch_compile_default": """
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
f = torch.compile(m)
x = torch.randn(32, 64, device="cuda")
print("ok", round(float(f(x).sum()), 4))
""",
    "dataloader_pin_memory_workers": """
from torch.utils.data import DataLoader, TensorDataset
ds = TensorDataset(torch.arange(4096, dtype=torch.float32).reshape(1024, 4))
dl = DataLoader(ds, batch_size=64, num_workers=2, pin_memory=True)
total = 0.0
for (b,) in dl:
    total += float(b.cuda(non_blocking=True).sum())
print("ok", total)
""",
    "multiprocessing_share_cuda_tensor": """
import torch.multiprocessing as mp
def child(q, r):
    t = q.get()
    r.put(float(t.sum()))
    del t
if __name__ == "__main__":
    mp.set_start_method("spawn")
    q, r = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(q, r)); p.start()
    t = torch.arange(1000, dtype=torch.float32, device="cuda") * 0.5
    q.put(t)
    print("ok", r.get(timeout=120))
    p.join()
""",
    "out_of_memory_raises": """
try:
    x = torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("no error; data_ptr", x.data_ptr())
except torch.OutOfMemoryError as e:
    print("ok OutOfMemoryError")
except RuntimeError as e:
    print("ok RuntimeError", str(e).splitlines()[0][:120])
""",
    "cuda_graph": """
s = torch.cuda.Stream()
x = torch.ones(1024, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    y = x * 2
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        y = x * 2
g.replay(); torch.cuda.synchronize()
print("ok", float(y.sum()))
""",
}


def run(name, mode, timeout):
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(CHECKS[name])
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    # A file, not -c: torch.multiprocessing's spawned children import the parent's main.
    with tempfile.NamedTemporaryFile("w", suffix=f"_{name}.py", delete=False) as f:
        f.write(code)
    try:
        r = subprocess.run([sys.executable, f.name, mode], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    finally:
        os.unlink(f.name)
    out = (r.stdout.strip().splitlines() or [""])[-1]
    err = (r.stderr.strip().splitlines() or [""])[-1]
    if r.returncode == 0 and out.startswith("ok"):
        return {"status": "ok", "out": out}
    return {"status": "failed", "rc": r.returncode, "out": out[:200], "error": err[:300]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-json")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--modes", nargs="+", default=["cupool"],
                   help="cupool (enable()) and/or cupool-shim (enable(shim=True))")
    p.add_argument("checks", nargs="*", default=list(CHECKS))
    args = p.parse_args()
    results = {}
    for name in args.checks:
        native = run(name, "native", args.timeout)
        results[name] = {"native": native}
        for mode in args.modes:
            ours = run(name, mode, args.timeout)
            same = native.get("out") == ours.get("out")
            if ours["status"] == "ok":
                raised = name == "out_of_memory_raises" and not ours["out"].startswith("ok no")
                verdict = "PASS" if same or raised else "DIFFERS"
            elif "not supported with cupool" in ours.get("error", ""):
                verdict = "REFUSED"
            else:
                verdict = "FAIL"
            results[name][mode] = dict(ours, verdict=verdict)
            print(f"{verdict:8} {name} [{mode}]: native {native.get('out') or native.get('error')}; "
                  f"{mode} {ours.get('out') or ours.get('error')}", flush=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
