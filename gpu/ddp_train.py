"""PyTorch DDP over NCCL on two GPUs: the variable-shape GPT of gpt_train.py, one process per
GPU, each rank drawing its own batch sizes and sequence lengths every step.

The allocator is the environment's: PyTorch's own (native, or PYTORCH_CUDA_ALLOC_CONF), the
preload (LD_PRELOAD=libcupool_preload.so with PYTORCH_NO_CUDA_MEMORY_CACHING=1, inherited
by the ranks), or WORKLOAD_ALLOCATOR=cupool (each rank calls cupool.torch.enable() before
CUDA starts). Rank 0 prints one JSON line: the all-reduced loss of every step, the median
step time, and per GPU the device peak (NVML, above the value once the context existed).

    python gpu/ddp_train.py --steps 20 --out-json out.json
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads"))
import common  # noqa: E402
from common import torch  # noqa: E402
import gpt_train  # noqa: E402


def nvml_sampler(index):
    """Starts a thread sampling the memory used on GPU `index`; returns (stop, result)."""
    import pynvml  # noqa: PLC0415

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    state = {"base": pynvml.nvmlDeviceGetMemoryInfo(handle).used, "peak": 0, "run": True}

    def loop():
        while state["run"]:
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            state["peak"] = max(state["peak"], used - state["base"])
            time.sleep(0.001)

    t = threading.Thread(target=loop, daemon=True)
    t.start()

    def stop():
        state["run"] = False
        t.join()
        return state["peak"]

    return stop


def rank_main(rank, world, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    allocator = common.switch_allocator() or "torch"
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the corpus workloads
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("high")
    torch.cuda.set_device(rank)
    torch.zeros(1, device=f"cuda:{rank}")  # the context exists: the NVML baseline
    stop = nvml_sampler(rank)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    model = gpt_train.build_model(args.vocab, args.d_model, args.heads, args.layers,
                                  args.seq_max).to(f"cuda:{rank}")
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1)
    shapes = gpt_train.draw_shapes(args.seed + rank, args.steps, 4, 32, 64, args.seq_max, 6144)
    gen = torch.Generator(device=f"cuda:{rank}").manual_seed(args.seed + 100 * rank)
    F = torch.nn.functional
    losses, times = [], []
    for batch, seq in shapes:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (batch, seq + 1), device=f"cuda:{rank}",
                               generator=gen)
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    peak = stop()
    peaks = [torch.zeros(1, dtype=torch.float64, device=f"cuda:{rank}") for _ in range(world)]
    torch.distributed.all_gather(peaks, torch.tensor([float(peak)], dtype=torch.float64,
                                                     device=f"cuda:{rank}"))
    torch.distributed.barrier()
    if rank == 0:
        result = {
            "allocator": allocator,
            "preload": common.preload_active(),
            "world": world,
            "steps": args.steps,
            "losses": losses,
            "step_ms_median": statistics.median(times[2:] or times),
            "device_peak_bytes": [int(p.item()) for p in peaks],
        }
        print(json.dumps(result))
        if args.out_json:
            with open(args.out_json, "w") as f:
                json.dump(result, f, indent=1)
    torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq-max", type=int, default=1024)
    p.add_argument("--out-json")
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print(f"SKIPPED: {world} GPU(s); DDP needs two")
        return
    world = 2
    port = 29500 + os.getpid() % 1000
    torch.multiprocessing.spawn(rank_main, args=(world, args, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
