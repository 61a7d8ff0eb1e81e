"""Step time and device peak of the corpus workloads, allocators taking turns (stdlib only).

    python3 gpu/workloads/rounds.py OUTDIR [--rounds 3] [--workloads gpt_train ...]
        [--steps gpt_train=90 ...] [--workload-args gpt_train="--layers 12" ...] [--preload LABEL=LIBRARY[@CUPOOL_CONF] ...]
        [--cupool LABEL=LIBRARY[@CUPOOL_CONF] ...] [--rmm LABEL=PYTHONPATH[@INITIAL_BYTES] ...]
        [--async] [--no-expandable] [--cpus 2-9] [--warmup-steps 10] [--deadline-s 540]

One process on this machine differs from the next by up to ±25% in step time, so a single
run per allocator says little. Here every round runs each workload once per allocator, in
turn (PyTorch native, PyTorch `expandable_segments:True`, with `--async` PyTorch's
`backend:cudaMallocAsync`, then each `--cupool` library through `cupool.torch.enable()` and
each `--preload` library with `PYTORCH_NO_CUDA_MEMORY_CACHING=1`, and each `--rmm` install
through RMM's pool resource), each a fresh process. Each round starts one allocator later
than the round before, so no allocator always runs first. `--cpus` pins every run to the same
CPUs: a process's step otherwise depends on where the host placed it.

The table gives each round's median step, the median over rounds, the median of the
per-round ratios to native's step (each round's run against native's run of the same round)
with the number of rounds below native, the same for the steps after the first
`--warmup-steps` (from each run's step lines: an allocator that pays while its pool grows
shows it in the first and not in the second), the device peak range (NVML, above the value
once the context existed) and whether the losses are bit-identical to native's. For each
allocator it gives the process's CPU time per step after the warm-up, user and system (every
thread, from the runs' `step_cpu_ms`), beside the wall time: a step that is slower with as
much CPU time waited, one with more CPU time worked. Under each
cupool library it then gives what the pool did per step after the warm-up (the mean per step
of each count in the run's `cupool_step_counts`, median over rounds): misses, driver
allocations, fences, waits before growing, the VMM arena's map and unmap calls and their
driver time.

The device machines' CPUs run at about one or about 1.5 to 2.3 times their fastest speed,
flipping every few tens of ms, each CPU on its own (docs/BENCHMARKS.md): a host-bound step
slows with them, and a run's share of slow time is most of the spread between two runs of one
allocator. The workloads time a fixed pure-Python probe after every step (`host_probe_ms`),
and a second table gives each allocator's factor on native's step with the host's speed
taken out (a fit of log step time on the step's index and the log of its probe).
`--canary-cpus` runs `host_canary.py` on other CPUs for the whole call, a record of each
CPU's speed over time (OUTDIR/canary.CPU.json).

Writes OUTDIR/LABEL.WORKLOAD.rROUND.json (each run's result JSON), OUTDIR/logs/, and
OUTDIR/rounds.json; prints the table (also OUTDIR/table.txt). Exit status 0 when every run
succeeded. No run starts after --deadline-s.
"""
import argparse
import json
import math
import re
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = float(1 << 30)
DEFAULT_STEPS = {"gpt_train": 60, "conv_train": 40, "llm_generate": 5}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_STEPS))
    p.add_argument("--steps", action="append", default=[], metavar="WORKLOAD=N")
    p.add_argument("--workload-args", action="append", default=[], metavar="WORKLOAD=ARGS",
                   help="more arguments for one workload's runs, split as a shell would "
                        "(gpt_train='--d-model 1536 --layers 12': a larger model)")
    p.add_argument("--preload", action="append", default=[],
                   metavar="LABEL=LIBRARY[@CUPOOL_CONF]",
                   help="a cupool preload library to run under (repeatable)")
    p.add_argument("--cupool", action="append", default=[],
                   metavar="LABEL=LIBRARY[@CUPOOL_CONF]",
                   help="libcupool.so to put PyTorch on through cupool.torch.enable() "
                        "(the package from python/; repeatable)")
    p.add_argument("--rmm", action="append", default=[],
                   metavar="LABEL=PYTHONPATH[@INITIAL_BYTES]",
                   help="RMM's pool resource through rmm.allocators.torch, the rmm package "
                        "found on PYTHONPATH (empty: installed); INITIAL_BYTES the pool's "
                        "initial size (default RMM's, half the free memory)")
    p.add_argument("--env", action="append", default=[], metavar="LABEL:KEY=VALUE",
                   help="set KEY=VALUE in the environment of LABEL's runs only (a diagnostic "
                        "such as vmm_cycles.py's WORKLOAD_VMM_CYCLES)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="CPU list every run is pinned to, as taskset takes it (2-9 or 2,4,6)")
    p.add_argument("--canary-cpus", default=None, metavar="LIST",
                   help="run host_canary.py pinned to each of these CPUs for the whole call "
                        "(OUTDIR/canary.CPU.json): the host's speed over time, read outside "
                        "the workloads")
    p.add_argument("--async", dest="use_async", action="store_true",
                   help="also PyTorch's backend:cudaMallocAsync")
    p.add_argument("--no-expandable", action="store_true")
    p.add_argument("--warmup-steps", type=int, default=10, metavar="N",
                   help="steps left out of the steady-state column (default 10)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--workload-dir", default=HERE,
                   help="where WORKLOAD.py lives (default: this folder)")
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--proc-timeout-s", type=float, default=150.0)
    args = p.parse_args(argv)
    args.extra = {}
    for item in args.workload_args:
        name, eq, rest = item.partition("=")
        if not eq:
            p.error(f"--workload-args wants WORKLOAD=ARGS, got {item!r}")
        if name not in args.workloads:
            p.error(f"--workload-args for {name!r}, which is not among --workloads")
        args.extra.setdefault(name, []).extend(shlex.split(rest))
    steps = dict(DEFAULT_STEPS)
    for item in args.steps:
        name, _, n = item.partition("=")
        if not n.isdigit():
            p.error(f"--steps wants WORKLOAD=N, got {item!r}")
        steps[name] = int(n)
    modes = [("native", "native", {}, {})]
    if not args.no_expandable:
        modes.append(("expandable", "expandable",
                      {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, {}))
    if args.use_async:
        modes.append(("async", "async",
                      {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, {}))
    python_dir = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")
    for option, kind in (("--cupool", "cupool"), ("--preload", "preload")):
        for item in getattr(args, option[2:]):
            label, _, rest = item.partition("=")
            lib, _, conf = rest.partition("@")
            if not label or not lib:
                p.error(f"{option} wants LABEL=LIBRARY[@CUPOOL_CONF], got {item!r}")
            if not os.path.exists(lib):
                p.error(f"{option} {label}: no such library: {lib}")
            if kind == "preload":
                env = {"LD_PRELOAD": os.path.abspath(lib), "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
            else:
                env = {"WORKLOAD_ALLOCATOR": "cupool", "CUPOOL_LIBRARY": os.path.abspath(lib),
                       "PYTHONPATH": python_dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
            if conf:
                env["CUPOOL_CONF"] = conf
            modes.append((label, kind, env, {}))
    for item in args.rmm:
        label, _, rest = item.partition("=")
        path, _, initial = rest.partition("@")
        if not label or (initial and not initial.isdigit()):
            p.error(f"--rmm wants LABEL=PYTHONPATH[@INITIAL_BYTES], got {item!r}")
        env = {"WORKLOAD_ALLOCATOR": "rmm"}
        if path:
            env["PYTHONPATH"] = os.path.abspath(path) + os.pathsep + os.environ.get("PYTHONPATH", "")
        if initial:
            env["WORKLOAD_RMM_INITIAL_POOL"] = initial
        modes.append((label, "rmm", env, {}))
    if len({m[0] for m in modes}) != len(modes):
        p.error("every mode needs its own label")
    by_label = {m[0]: m[2] for m in modes}
    for item in args.env:
        label, _, assignment = item.partition(":")
        key, eq, value = assignment.partition("=")
        if not eq or not key or label not in by_label:
            p.error(f"--env wants LABEL:KEY=VALUE with a LABEL of this run "
                    f"({', '.join(by_label)}), got {item!r}")
        by_label[label][key] = value
    args.cpu_set = None
    if args.cpus:
        try:
            args.cpu_set = parse_cpu_list(args.cpus)
        except ValueError:
            p.error(f"--cpus wants a CPU list like 2-9 or 2,4,6, got {args.cpus!r}")
        if not args.cpu_set <= os.sched_getaffinity(0):
            p.error(f"--cpus {args.cpus}: not all of these CPUs are available here")
    args.canary_set = []
    if args.canary_cpus:
        try:
            args.canary_set = sorted(parse_cpu_list(args.canary_cpus))
        except ValueError:
            p.error(f"--canary-cpus wants a CPU list like 11,13, got {args.canary_cpus!r}")
        if not set(args.canary_set) <= os.sched_getaffinity(0):
            p.error(f"--canary-cpus {args.canary_cpus}: not all of these CPUs are available here")
    return args, steps, modes


def parse_cpu_list(text):
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(text)
    return cpus


STEP_LINE = re.compile(r"^step +\d+ loss \S+ ms +([\d.]+)", re.M)


def steady_median(out_log, warmup):
    """The median step time after the first `warmup` steps, from a run's step lines
    (`step N loss X ms Y`); None when it logged no more steps than that."""
    try:
        with open(out_log) as f:
            ms = [float(m.group(1)) for m in STEP_LINE.finditer(f.read())]
    except OSError:
        return None
    return statistics.median(ms[warmup:]) if len(ms) > warmup else None


def steady_counts(step_counts, warmup):
    """cupool's counts per step after the first `warmup` steps (the mean of each count over
    those steps, from the result's `cupool_step_counts`); None without them."""
    if not isinstance(step_counts, list) or len(step_counts) <= warmup:
        return None
    after = step_counts[warmup:]
    keys = sorted({k for d in after for k in d})
    return {k: sum(d.get(k, 0) for d in after) / len(after) for k in keys}


def steady_pair_means(pairs, warmup):
    """The mean of each member of a run's per-step pairs (or longer tuples, as long as the
    shortest) after the first `warmup` steps; None without them."""
    if not isinstance(pairs, list) or len(pairs) <= warmup:
        return None
    after = pairs[warmup:]
    width = min(len(c) for c in after)
    return [sum(c[k] for c in after) / len(after) for k in range(width)]


def steady_cpu(step_cpu_ms, warmup):
    """The process's mean user and system CPU ms per step after the first `warmup` steps
    (from the result's `step_cpu_ms` pairs); None without them. Means, not medians: the
    kernel counts CPU time in ticks (4 ms here), so most steps of a 30 ms loop read 0 ms of
    system time and one in several reads 4, and only the mean over many steps tells how
    much there was (a median read 0.0 for every allocator)."""
    return steady_pair_means(step_cpu_ms, warmup)


# A probe this many times the median of all of them was preempted, not slow: left out.
PROBE_OUTLIER = 4.0
# Rounds of backfitting for the host-speed model (it converges in a few dozen).
FIT_ITERATIONS = 300


def probed_steps(res):
    """A run's step times and the host-speed probe after each (`step_ms`, `host_probe_ms`
    of its result), as two lists of one length; None without them."""
    ms, probe = res.get("step_ms"), res.get("host_probe_ms")
    if not isinstance(ms, list) or not isinstance(probe, list) or len(ms) != len(probe):
        return None
    return [ms, probe]


def run(args, steps, modes):
    os.makedirs(os.path.join(args.outdir, "logs"), exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if k not in (
        "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
        "LD_PRELOAD", "CUPOOL_CONF", "CUPOOL_TRACE", "WORKLOAD_ALLOCATOR", "CUPOOL_LIBRARY")}
    base_env["PYTHONUNBUFFERED"] = "1"
    started = time.monotonic()
    results = []
    pin = (lambda: os.sched_setaffinity(0, args.cpu_set)) if args.cpu_set else None
    for rnd in range(1, args.rounds + 1):
        turn = (rnd - 1) % len(modes)
        for name in args.workloads:
            for label, kind, env, _ in modes[turn:] + modes[:turn]:
                left = args.deadline_s - (time.monotonic() - started)
                tag = f"{label}.{name}.r{rnd}"
                if left < 20:
                    results.append({"label": label, "workload": name, "round": rnd,
                                    "status": "skipped (deadline)"})
                    continue
                out_json = os.path.join(args.outdir, tag + ".json")
                cmd = [sys.executable, os.path.join(args.workload_dir, name + ".py"),
                       "--seed", str(args.seed), "--mode", kind, "--out-json", out_json]
                if name in steps:
                    cmd += ["--steps", str(steps[name])]
                cmd += args.extra.get(name, [])
                log = os.path.join(args.outdir, "logs", tag)
                t0 = time.monotonic()
                with open(log + ".out", "w") as o, open(log + ".err", "w") as e:
                    try:
                        rc = subprocess.run(cmd, env={**base_env, **env}, stdout=o, stderr=e,
                                            timeout=min(left, args.proc_timeout_s),
                                            preexec_fn=pin).returncode
                    except subprocess.TimeoutExpired:
                        rc = "timeout"
                rec = {"label": label, "workload": name, "round": rnd, "rc": rc,
                       "seconds": round(time.monotonic() - t0, 1),
                       "steady_ms": steady_median(log + ".out", args.warmup_steps)}
                try:
                    with open(out_json) as f:
                        res = json.load(f)
                    rec.update(status=res.get("status"), step_ms=res.get("step_ms_median"),
                               peak=res.get("device_peak_bytes"),
                               checksum=res.get("loss_checksum"),
                               cupool=res.get("cupool"),
                               steady_counts=steady_counts(res.get("cupool_step_counts"),
                                                           args.warmup_steps),
                               steady_cpu=steady_cpu(res.get("step_cpu_ms"),
                                                     args.warmup_steps),
                               probed=probed_steps(res),
                               steady_vmm_cycles=steady_pair_means(res.get("vmm_cycles"),
                                                                   args.warmup_steps))
                except (OSError, ValueError) as err:
                    rec["status"] = f"no result ({err.__class__.__name__})"
                results.append(rec)
                print(f"== {tag}: {rec.get('status')} rc {rc} "
                      f"step {rec.get('step_ms')} ms, peak {fmt_gib(rec.get('peak'))} GiB",
                      flush=True)
    return results


def fmt_gib(v):
    return "-" if v is None else f"{v / GIB:.2f}"


def table(results, args, modes):
    lines = []
    for name in args.workloads:
        mine = [r for r in results if r["workload"] == name]
        native = [r for r in mine if r["label"] == "native" and r.get("status") == "ok"]
        native_sums = {r.get("checksum") for r in native}
        native_by_round = {r["round"]: r["step_ms"] for r in native
                           if r.get("step_ms") is not None}
        native_steady = {r["round"]: r["steady_ms"] for r in native if r.get("steady_ms")}
        lines.append(f"{name}: step ms per round | median | vs native (median of the rounds' "
                     f"ratios (their range); rounds below native) | after step "
                     f"{args.warmup_steps}: median, vs native | device peak GiB (min-max) | "
                     f"losses as native")
        for label, *_ in modes:
            runs = [r for r in mine if r["label"] == label]
            ok = [r for r in runs if r.get("status") == "ok" and r.get("step_ms") is not None]
            per_round = " / ".join(f"{r['step_ms']:.1f}" if r in ok else str(r.get("status"))
                                   for r in runs)
            med = statistics.median(r["step_ms"] for r in ok) if ok else None
            ratios = [r["step_ms"] / native_by_round[r["round"]] for r in ok
                      if native_by_round.get(r["round"])]
            ratio = ratio_text(ratios) if ratios and label != "native" else "-"
            steady = [r["steady_ms"] for r in ok if r.get("steady_ms")]
            steady_ratios = [r["steady_ms"] / native_steady[r["round"]] for r in ok
                             if r.get("steady_ms") and native_steady.get(r["round"])]
            steady_text = "-" if not steady else f"{statistics.median(steady):.1f}"
            if steady_ratios and label != "native":
                steady_text += ", " + ratio_text(steady_ratios)
            peaks = [r["peak"] for r in ok if r.get("peak") is not None]
            peak = f"{fmt_gib(min(peaks))}-{fmt_gib(max(peaks))}" if peaks else "-"
            same = ("-" if not ok or not native_sums else
                    "yes" if all(r.get("checksum") in native_sums for r in ok) else "NO")
            med_text = "-" if med is None else f"{med:.1f}"
            lines.append(f"  {label:<12} {per_round} | {med_text} | {ratio} | "
                         f"{steady_text} | {peak} | {same}")
        lines.extend(speed_adjusted_lines(mine, modes, args.warmup_steps))
        lines.extend(cpu_lines(mine, modes, args.warmup_steps))
        lines.extend(counts_lines(mine, modes, args.warmup_steps))
        lines.extend(cycles_lines(mine, modes, args.warmup_steps))
    return "\n".join(lines)


def ratio_text(ratios):
    """The rounds' ratios to native: their median, their range (a spread as wide as the
    difference between two allocators means the rounds cannot tell them apart), and how
    many rounds were below native."""
    return (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); "
            f"{sum(x < 1 for x in ratios)} of {len(ratios)}")


def runs_by_label(runs, modes, *fields):
    """For each allocator label in `modes` order, its runs that finished ok with every one
    of `fields` set; labels without such runs left out."""
    for label, *_ in modes:
        ok = [r for r in runs if r["label"] == label and r.get("status") == "ok"
              and all(r.get(f) for f in fields)]
        if ok:
            yield label, ok


def solve(a, b):
    """x with a x = b for a small square system (Gaussian elimination, partial pivoting);
    a variable with no spread gets 0."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-12 else 0.0 for i in range(n)]


def backfit(rows, base="native"):
    """Least squares of `y = shape[i] + effect[label] + b . x` over (label, step index i,
    y, x...) rows with the same number of covariates x each, `base`'s effect 0, by
    backfitting (stdlib only). Returns ({label: effect}, [b...]); ({}, []) without rows."""
    if not rows:
        return {}, []
    k = len(rows[0]) - 3
    effect = {r[0]: 0.0 for r in rows}
    coef = [0.0] * k
    xs = [r[3:] for r in rows]
    means = [sum(x[j] for x in xs) / len(xs) for j in range(k)]
    cov = [[sum((x[j] - means[j]) * (x[m] - means[m]) for x in xs) for m in range(k)]
           for j in range(k)]
    for _ in range(FIT_ITERATIONS):
        sums = {}
        for label, i, y, *x in rows:
            acc = sums.setdefault(i, [0.0, 0])
            acc[0] += y - effect[label] - sum(c * v for c, v in zip(coef, x))
            acc[1] += 1
        shape = {i: t / n for i, (t, n) in sums.items()}
        sums = {}
        for label, i, y, *x in rows:
            acc = sums.setdefault(label, [0.0, 0])
            acc[0] += y - shape[i] - sum(c * v for c, v in zip(coef, x))
            acc[1] += 1
        effect = {label: (t / n if label != base else 0.0) for label, (t, n) in sums.items()}
        rest = [y - shape[i] - effect[label] for label, i, y, *_ in rows]
        r_mean = sum(rest) / len(rest)
        coef = solve(cov, [sum((x[j] - means[j]) * (r - r_mean) for x, r in zip(xs, rest))
                           for j in range(k)])
    return effect, coef


def speed_fit(observations):
    """Least squares of `log step = shape[i] + effect[label] + elasticity * log probe` over
    (label, step index i, log step, log probe) tuples, native's effect 0 ([`backfit`]).
    Returns ({label: effect}, elasticity); ({}, 0.0) without observations."""
    effect, coef = backfit(observations)
    return effect, (coef[0] if coef else 0.0)


def speed_adjusted_lines(runs, modes, warmup):
    """Each allocator against native with the host's speed taken out: each step after the
    warm-up is one observation, its log time explained by its step index (the same shapes
    under every allocator: one seed), the allocator, and the log of the host-speed probe
    timed right after it (`host_probe_ms`), which says how fast the CPU the process ran on
    was then. The device machines' CPUs run at about one or about 1.5 to 2.3 times their
    fastest speed, flipping every few tens of ms, each CPU on its own (docs/BENCHMARKS.md), so
    a run's share of slow time differs from the next run's and is most of their spread. The
    fit over every round gives each allocator's factor on native's step; one fit per round
    gives the rounds' spread. Probes over `PROBE_OUTLIER` times the median (preempted) are
    left out."""
    probed = list(runs_by_label(runs, modes, "probed"))
    if "native" not in dict(probed) or len(probed) < 2:
        return []
    probes = sorted(p for _, ok in probed for r in ok for p in r["probed"][1][warmup:])
    if not probes:
        return []
    cap = PROBE_OUTLIER * probes[len(probes) // 2]

    def observations(rounds):
        return [(label, i, math.log(ms), math.log(probe))
                for label, ok in probed for r in ok if r["round"] in rounds
                for i, (ms, probe) in enumerate(zip(*r["probed"]))
                if i >= warmup and ms > 0 and 0 < probe <= cap]

    every = sorted({r["round"] for _, ok in probed for r in ok})
    pooled, elasticity = speed_fit(observations(set(every)))
    per_round = [speed_fit(observations({rnd}))[0] for rnd in every]
    out = [f"  host-speed adjusted, after step {warmup} (log step on log probe and step index; "
           f"elasticity {elasticity:.2f}): vs native, all rounds | one fit per round"]
    for label, _ in probed:
        if label == "native":
            continue
        ratios = [math.exp(e[label]) for e in per_round if label in e]
        out.append(f"  {label:<12} {math.exp(pooled[label]):.2f}x | "
                   + (ratio_text(ratios) if ratios else "-"))
    return out


def cpu_lines(runs, modes, warmup):
    """For each allocator, the process's CPU time per step after the warm-up: user and
    system ms (each run's mean per step, then the median over rounds, with the rounds'
    range), beside the same runs' wall time per step (each run's median step)."""
    out = []
    for label, ok in runs_by_label(runs, modes, "steady_cpu", "steady_ms"):
        if not out:
            out.append(f"  host CPU per step after step {warmup} (median over rounds, "
                       f"range): wall ms (median step) | user ms | system ms (mean)")
        cols = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                for v in ([r["steady_ms"] for r in ok], [r["steady_cpu"][0] for r in ok],
                          [r["steady_cpu"][1] for r in ok])]
        out.append(f"  {label:<12} " + " | ".join(cols))
    return out


def cycles_lines(runs, modes, warmup):
    """For each allocator run with `vmm_cycles.py`'s move cycles injected, the cycles and
    their ms per step after the warm-up (each run's mean, then the median over rounds)."""
    out = []
    for label, ok in runs_by_label(runs, modes, "steady_vmm_cycles"):
        if not out:
            out.append(f"  injected move cycles per step after step {warmup} (median over "
                       f"rounds): cycles | main thread's ms in them | background thread's ms")
        cols = [statistics.median(r['steady_vmm_cycles'][k] for r in ok)
                for k in range(min(len(r['steady_vmm_cycles']) for r in ok))]
        out.append(f"  {label:<12} {cols[0]:.2f} | "
                   + " | ".join(f"{c:.3f}" for c in cols[1:]))
    return out


def counts_lines(runs, modes, warmup):
    """For each cupool allocator, what its pool did per step after the warm-up: the median
    over rounds of each count's mean per step (counts that never moved left out)."""
    out = []
    for label, ok in runs_by_label(runs, modes, "steady_counts"):
        per_run = [r["steady_counts"] for r in ok]
        keys = sorted({k for c in per_run for k in c})
        text = ", ".join(f"{k} {statistics.median(c.get(k, 0) for c in per_run):.4g}"
                         for k in keys)
        if not out:
            out.append(f"  cupool's counts per step after step {warmup} (median over "
                       f"rounds):")
        out.append(f"  {label:<12} {text or 'none moved'}")
    return out


def start_canaries(args):
    """One `host_canary.py` per CPU of `--canary-cpus`, pinned there."""
    procs = []
    for cpu in args.canary_set:
        out = os.path.join(args.outdir, f"canary.{cpu}.json")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "host_canary.py"), out],
            preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu})))
    return procs


def stop_canaries(procs):
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv):
    args, steps, modes = parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    canaries = start_canaries(args)
    try:
        results = run(args, steps, modes)
    finally:
        stop_canaries(canaries)
    text = table(results, args, modes)
    print(text)
    with open(os.path.join(args.outdir, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.outdir, "rounds.json"), "w") as f:
        json.dump({"steps": steps, "rounds": args.rounds, "cpus": args.cpus,
                   "warmup_steps": args.warmup_steps,
                   "results": results}, f, indent=1)
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
