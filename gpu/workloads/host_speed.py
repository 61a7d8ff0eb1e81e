"""The host's speed at a moment: a fixed pure-Python loop, timed (stdlib only; no torch, so
`host_canary.py` can use it in a process of its own)."""
import time

# Iterations of the host-speed probe: about 1 ms of pure Python on the H100 machines' host in
# its fast state (see `host_probe_ms`).
HOST_PROBE_ITERS = 30_000


def host_probe_ms(iters=HOST_PROBE_ITERS):
    """Milliseconds a fixed pure-Python loop takes now: how fast the CPU the caller runs on
    is at this moment.

    The device machines' CPUs run the same code at about one or about 1.5 to 2.3 times
    their fastest speed, flipping every few tens of ms, each CPU on its own (a canary per CPU
    found no correlation between them; docs/BENCHMARKS.md, twelfth session), and a
    host-bound training step slows with them. The harness times this after each step,
    outside the step, and `rounds.py` fits step times on it to compare allocators with the
    host's speed taken out."""
    t = time.perf_counter()
    s = 0
    for i in range(iters):
        s += i
    return (time.perf_counter() - t) * 1e3
