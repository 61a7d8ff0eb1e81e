"""Diagnostic: per-step CPU-side phase times and GPU time of the steptime workload."""
import os, sys, time, statistics
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_train import mlp

label = sys.argv[1]
torch.manual_seed(0)
model = mlp(1024, 6)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 1024, device="cuda")
y = torch.randint(0, 10, (64,), device="cuda")
rows = []
for i in range(170):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    e0.record()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    e1.record()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    rows.append(((t4 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, e0.elapsed_time(e1)))
rows = rows[20:]
med = lambda k: statistics.median(r[k] for r in rows)
print(f"{label}: step {med(0):.3f} fwd {med(1):.3f} bwd {med(2):.3f} opt {med(3):.3f} sync {med(4):.3f} gpu {med(5):.3f}")
slow = [r for r in rows if r[0] > med(0) * 1.15]
if slow:
    print(f"  {len(slow)} slow steps; their mean: " + " ".join(f"{sum(r[k] for r in slow)/len(slow):.3f}" for k in range(6)))
print("  series:", " ".join(f"{r[0]:.2f}" for r in rows[:60]))
