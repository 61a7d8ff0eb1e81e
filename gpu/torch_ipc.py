"""torch.multiprocessing sharing of CUDA tensors (CUDA IPC), as a program under cupool runs
it: the parent makes tensors of several sizes (small ones share a pool segment), sends them
to a spawned child through a queue; the child checks every element, writes into them, and
the parent checks the child's writes. Prints one line per size and "RESULT ok" or
"RESULT FAILED".

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 LD_PRELOAD=libcupool_preload.so python gpu/torch_ipc.py
    python gpu/torch_ipc.py                      # PyTorch's own allocator, for comparison
    CUPOOL_TORCH=1 python gpu/torch_ipc.py       # through cupool.torch.enable()
"""
import os
import sys

import torch
import torch.multiprocessing as mp

if os.environ.get("CUPOOL_TORCH") == "1":  # in the parent and in the spawned child
    import cupool.torch

    cupool.torch.enable()

SIZES = [1024, 4096, 256 * 1024, 3 << 20, 64 << 20]  # float32 elements x 4 bytes


def child(q_in, q_out):
    tensors = q_in.get()
    ok = []
    for i, t in enumerate(tensors):
        expect = torch.arange(t.numel(), device=t.device, dtype=torch.float32) + i
        ok.append(bool(torch.equal(t, expect)))
        t.mul_(2)  # seen by the parent: the same memory
    torch.cuda.synchronize()
    q_out.put(ok)
    q_in.get()  # hold the tensors until the parent has checked


def main():
    mp.set_start_method("spawn")
    tensors = [torch.arange(n // 4, device="cuda", dtype=torch.float32) + i
               for i, n in enumerate(SIZES)]
    torch.cuda.synchronize()
    q_in, q_out = mp.Queue(), mp.Queue()
    p = mp.Process(target=child, args=(q_in, q_out), daemon=True)
    p.start()
    q_in.put(tensors)  # pickled by a feeder thread: a sharing error shows up there
    try:
        seen = q_out.get(timeout=60)
    except Exception:  # noqa: BLE001 - queue.Empty: the child never got the tensors
        print("RESULT FAILED (the tensors did not reach the child)")
        p.kill()
        sys.exit(1)
    failed = False
    for i, (n, t) in enumerate(zip(SIZES, tensors)):
        expect = (torch.arange(t.numel(), device="cuda", dtype=torch.float32) + i) * 2
        back = bool(torch.equal(t, expect))
        print(f"{n:>10} bytes: child read {'ok' if seen[i] else 'WRONG'}, "
              f"parent sees the child's write {'ok' if back else 'WRONG'}")
        failed |= not (seen[i] and back)
    q_in.put(None)
    p.join(timeout=60)
    print("RESULT", "FAILED" if failed or p.exitcode != 0 else "ok")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
