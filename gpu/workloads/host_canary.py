"""The host's speed over time, read from outside the measured processes (stdlib only).

    python3 gpu/workloads/host_canary.py OUT.json [--period-ms 20]

Times `host_speed.host_probe_ms` (a fixed pure-Python loop) every PERIOD ms until SIGTERM or
SIGINT, then writes [[monotonic_s, probe_ms], ...] to OUT.json. `rounds.py --canary-cpus`
runs one pinned to each CPU given, beside the workloads: their readings do not depend on
the allocator the workload runs under, which the workload's own probe after each step might.
"""
import argparse
import json
import signal
import sys
import time

from host_speed import host_probe_ms


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--period-ms", type=float, default=20.0)
    args = p.parse_args(argv)
    readings = []
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    while not stop:
        t = time.monotonic()
        readings.append([round(t, 6), round(host_probe_ms(), 4)])
        time.sleep(max(0.0, args.period_ms / 1e3 - (time.monotonic() - t)))
    with open(args.out, "w") as f:
        json.dump(readings, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
