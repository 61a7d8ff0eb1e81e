"""PyTorch workloads for the LD_PRELOAD tests.

  torch_train.py losses     50 deterministic training steps of a small MLP; prints losses
                            (6 digits) on stdout, the preloaded pool's stats on stderr.
  torch_train.py steptime LABEL [ROUND]
                            median step time of a 6-layer MLP (batch 64) after warm-up:
                            BENCH torch_step <label> <round> median_ms=.. p90_ms=..
"""
import os
import statistics
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pool_stats import pool_stats_to_stderr  # noqa: E402


def mlp(width, depth):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).cuda()


def losses():
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = mlp(256, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(512, 256, generator=gen).cuda()
    y = torch.randint(0, 10, (512,), generator=gen).cuda()
    for step in range(50):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step:2d} loss {loss.item():.6f}")
    pool_stats_to_stderr("torch_losses")


def steptime(label, round_no):
    torch.manual_seed(0)
    model = mlp(1024, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    for _ in range(20):
        step()
    times = []
    for _ in range(150):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()

    def pct(q):
        return times[int(q * (len(times) - 1))]

    print(f"BENCH torch_step {label} {round_no} median_ms={statistics.median(times):.4f} "
          f"p90_ms={pct(0.9):.4f} min_ms={times[0]:.4f} p10_ms={pct(0.1):.4f} "
          f"p25_ms={pct(0.25):.4f} p75_ms={pct(0.75):.4f} max_ms={times[-1]:.4f} steps={len(times)}")
    pool_stats_to_stderr(f"torch_step_{label}")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "losses"
    if mode == "losses":
        losses()
    elif mode == "steptime":
        steptime(sys.argv[2] if len(sys.argv) > 2 else "run", int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        sys.exit(f"unknown mode {mode}")
