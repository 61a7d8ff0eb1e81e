#!/usr/bin/env python3
"""PyTorch on cupool: a small training loop whose batch size changes every step.

Usage: pip install ./python && python3 examples/python_torch.py
Needs a CUDA build of PyTorch and a GPU; without them it says SKIPPED and exits 0.
"""

import sys

try:
    import torch
except ImportError:
    print("SKIPPED: PyTorch is not installed (pip install torch)")
    sys.exit(0)

import cupool
import cupool.torch

if not torch.cuda.is_available():
    print("SKIPPED: PyTorch sees no CUDA device")
    sys.exit(0)

# Before the first CUDA tensor: PyTorch cannot swap an allocator it has started.
cupool.torch.enable()

torch.manual_seed(0)
device = torch.device("cuda")
model = torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(50):
    batch = 16 + (step * 37) % 240  # a different shape every step
    x = torch.randn(batch, 256, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 10 == 0:
        print(f"step {step:2d} batch {batch:3d} loss {loss.item():.4f}")

torch.cuda.synchronize()
print(torch.cuda.memory_summary())
allocated = torch.cuda.memory_allocated()
assert allocated == cupool.stats(0)["allocated_bytes.all.current"], "PyTorch's figure is cupool's"
print(f"memory_allocated {allocated} bytes, max_memory_reserved {torch.cuda.max_memory_reserved()} bytes")
torch.cuda.empty_cache()
print(f"after empty_cache: reserved {torch.cuda.memory_reserved()} bytes")
