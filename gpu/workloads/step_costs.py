"""What a millisecond of driver calls costs a training step: an offline fit over the
per-step results of one or more `rounds.py` runs (stdlib only).

Each step after the warm-up is one observation. Its log time is explained by its step index
(one seed: the same shapes under every allocator), its allocator's configuration, the log of
the host-speed probe timed right after it (`host_probe_ms`, as `rounds.py` does), and two
shares of the step:
- `injected`: the ms of move cycles `vmm_cycles.py` made in the step, over the step's ms;
- `own`: the ms cupool itself spent in the step in VMM driver calls (create, map with its
  grant, unmap, release) and in waits before growing (`cupool_step_counts`), over the step's
  ms.

A coefficient of 1 on a share means a ms of those calls costs the step a ms: the calls cost
their own time and nothing beside it. Runs whose allocator configuration is the same
(`--mode`, the cupool library and `CUPOOL_CONF`) are one arm whatever was injected, so the injected calls are
compared with the same allocator without them. Each arm's factor is its step against
native's with no calls at all.

    python3 gpu/workloads/step_costs.py OUTDIR [OUTDIR...]   # rounds.py's output folders
"""
import argparse
import glob
import json
import math
import os
import sys

# The fit is rounds.py's host-speed fit with the two shares as further covariates:
# fit(rows) -> ({arm: effect}, [elasticity, injected, own]).
from rounds import PROBE_OUTLIER, backfit as fit

OWN_KEYS = ("vmm_create_ns", "vmm_map_ns", "vmm_unmap_ns", "vmm_release_ns")
# Of those, the time another thread spent (Note [unmaps off the launching thread]): not the
# allocating thread's.
OFF_THREAD_KEYS = ("vmm_deferred_unmap_ns",)


def arm_of(res):
    """The allocator configuration a run's result describes: its mode, its cupool library
    (`CUPOOL_LIBRARY`, or the preloaded one) when it names one, and CUPOOL_CONF."""
    env = res.get("env") or {}
    library = env.get("CUPOOL_LIBRARY") or env.get("LD_PRELOAD")
    conf = env.get("CUPOOL_CONF")
    return (res.get("mode", "?") + (f" {library}" if library else "")
            + (f"@{conf}" if conf else ""))


def observations(results, warmup):
    """(arm, step index, log ms, log probe, injected share, own share) of every step after
    `warmup` of the results that finished, probes over PROBE_OUTLIER times the median left
    out."""
    rows = []
    for res in results:
        if res.get("status") != "ok":
            continue
        ms, probe = res.get("step_ms") or [], res.get("host_probe_ms") or []
        counts = res.get("cupool_step_counts") or []
        cycles = res.get("vmm_cycles") or []
        for i in range(warmup, min(len(ms), len(probe))):
            if ms[i] <= 0 or probe[i] <= 0:
                continue
            c = counts[i] if i < len(counts) else {}
            own = ((sum(c.get(k, 0) for k in OWN_KEYS) - sum(c.get(k, 0) for k in OFF_THREAD_KEYS))
                   / 1e6 + c.get("grow_wait_us", 0) / 1e3)
            injected = cycles[i][1] if i < len(cycles) else 0.0
            rows.append((arm_of(res), i, math.log(ms[i]), math.log(probe[i]),
                         injected / ms[i], own / ms[i]))
    if not rows:
        return []
    probes = sorted(r[3] for r in rows)
    cap = math.log(PROBE_OUTLIER) + probes[len(probes) // 2]
    return [r for r in rows if r[3] <= cap]


def load(outdir):
    results = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        if os.path.basename(path) == "rounds.json":
            continue
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as err:
            print(f"step_costs: {path}: skipped ({err.__class__.__name__})", file=sys.stderr)
    return results


def report(outdir, warmup):
    rows = observations(load(outdir), warmup)
    arms = sorted({r[0] for r in rows})
    if "native" not in arms or len(arms) < 2:
        return [f"{outdir}: no native runs beside others with per-step results"]
    effect, (elasticity, injected, own) = fit(rows)
    lines = [f"{outdir}: {len(rows)} steps after step {warmup}; elasticity on the probe "
             f"{elasticity:.2f}",
             f"  a ms of injected move calls costs {injected:.2f} ms of step; "
             f"a ms of cupool's own VMM calls and waits {own:.2f} ms",
             "  step against native's with no calls (arm: factor; mean ms a step of injected "
             "calls, of cupool's own):"]
    for arm in arms:
        if arm == "native":
            continue
        mine = [r for r in rows if r[0] == arm]
        inj = sum(math.exp(r[2]) * r[4] for r in mine) / len(mine)
        mine_own = sum(math.exp(r[2]) * r[5] for r in mine) / len(mine)
        lines.append(f"  {arm:<32} {math.exp(effect[arm]):.3f}x; {inj:.2f}, {mine_own:.2f}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdirs", nargs="+", help="rounds.py output folders (each fitted alone)")
    p.add_argument("--warmup-steps", type=int, default=10, metavar="N")
    args = p.parse_args(argv)
    for outdir in args.outdirs:
        if not os.path.isdir(outdir):
            p.error(f"no such folder: {outdir}")
        print("\n".join(report(outdir, args.warmup_steps)))


if __name__ == "__main__":
    main()
