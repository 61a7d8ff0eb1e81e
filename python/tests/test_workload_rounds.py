"""gpu/workloads/rounds.py on a stand-in workload (no GPU, no PyTorch): the allocators take
turns round after round (each round starting one allocator later), pinned to the CPUs asked
for, and the table gives each one's steps per round, their median, the median of its per-round
ratios to native's, the same for the steps after the warm-up (from the runs' step lines), its
device peak range and whether the losses are native's."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import cupool
from conftest import REPO

ROUNDS = REPO / "gpu" / "workloads" / "rounds.py"

# Its step time and peak depend on the mode, its losses and failure on CUPOOL_CONF, as a real
# workload's would depend on the allocator; it writes the result JSON the harness writes.
STAND_IN = textwrap.dedent(
    """
    import argparse, json, os, re
    p = argparse.ArgumentParser()
    for flag in ("--steps", "--seed"):
        p.add_argument(flag, type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--name")
    p.add_argument("--mode")
    p.add_argument("--out-json")
    a = p.parse_args()
    conf = os.environ.get("CUPOOL_CONF", "")
    if conf == "fail:1":
        raise SystemExit(3)
    step = {"native": 10.0, "expandable": 9.0, "preload": 12.0, "rmm": 11.0}[a.mode]
    # RMM's pool is 2 ms slower in the second round: its ratios to native spread.
    if a.mode == "rmm" and re.search(r"[.]r2[.]json$", a.out_json):
        step += 2.0
    peak = {"native": 4, "expandable": 3, "preload": 2, "rmm": 5}[a.mode] << 30
    # 12 step lines, the first 7 twice as slow (a pool growing): the median of every step is
    # the slow one, after step 10 the steady one.
    for i in range(12):
        print(f"step {i:3d} loss 1.000000 ms {step * (2 if i < 7 else 1):8.2f}")
    with open(a.out_json + ".env", "w") as f:
        json.dump({"cpus": sorted(os.sched_getaffinity(0)),
                   "allocator": os.environ.get("WORKLOAD_ALLOCATOR"),
                   "rmm_initial": os.environ.get("WORKLOAD_RMM_INITIAL_POOL"),
                   "cycles": os.environ.get("WORKLOAD_VMM_CYCLES"),
                   "layers": a.layers, "name": a.name}, f)
    losses = [1.0, 0.6] if conf == "other_losses:1" else [1.0, 0.5]
    # cupool's counts per step: waits in the 7 slow steps, two map calls every other step.
    counts = None
    if a.mode == "preload":
        counts = [dict({"num_allocs": 100}, **({"grow_waits": 1} if i < 7 else {}),
                       **({"vmm_map_calls": 2} if i % 2 else {})) for i in range(12)]
    # The process's CPU per step, user and system ms: the slow steps worked twice as long;
    # cupool's system time is 2 ms every step, native's comes in ticks, 4 ms every fourth
    # step from step 2 (1 ms a step in all, though most steps read 0).
    cpu = [[step * 0.5 * (2 if i < 7 else 1),
            2.0 if a.mode == "preload" else (4.0 if i % 4 == 2 else 0.0)]
           for i in range(12)]
    # 24 steps timed with the host-speed probe after each: the host runs at half speed (the
    # probe twice as long, the step twice as long) at steps 0-5 of native's first round, at
    # 18-23 of the preload's first round and at 0-15 of its second.
    rnd = 1 if re.search(r"[.]r1[.]json$", a.out_json) else 2
    slow = {("native", 1): range(0, 6), ("preload", 1): range(18, 24),
            ("preload", 2): range(0, 16)}.get((a.mode, rnd), range(0))
    factor = [2.0 if i in slow else 1.0 for i in range(24)]
    with open(a.out_json, "w") as f:
        json.dump({"status": "ok", "step_ms_median": step, "device_peak_bytes": peak,
                   "loss_checksum": repr(losses), "cupool": None,
                   "cupool_step_counts": counts, "step_cpu_ms": cpu,
                   "step_ms": [step * x for x in factor], "host_probe_ms": factor,
                   # vmm_cycles.py's injected cycles: i in step i, 0.1 ms each.
                   "vmm_cycles": ([[i, 0.1 * i] for i in range(12)]
                                  if os.environ.get("WORKLOAD_VMM_CYCLES") else None)}, f)
    """
)


def run_rounds(tmp_path, *args):
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    out = tmp_path / "out"
    lib = cupool.library_path()
    done = subprocess.run(
        [sys.executable, str(ROUNDS), str(out), "--workload-dir", str(tmp_path),
         "--workloads", "stand_in", "--rounds", "2",
         "--preload", f"same={lib}@same_losses:1",
         "--preload", f"differs={lib}@other_losses:1",
         "--preload", f"fails={lib}@fail:1", *args],
        capture_output=True, text=True, timeout=120,
    )
    return done, out


def usage_error(tmp_path, *args):
    """rounds.py's stderr for arguments it must refuse as a usage error (exit 2)."""
    done, _ = run_rounds(tmp_path, *args)
    assert done.returncode == 2, done.stderr
    return done.stderr


def row(table, label):
    return next(line for line in table.splitlines() if line.split()[:1] == [label])


def workload_module(name):
    """gpu/workloads/NAME.py, imported as the workloads import it (their folder on the
    path)."""
    sys.path.insert(0, str(REPO / "gpu" / "workloads"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def assert_rejected(parse, values, error, words):
    """`parse` raises `error`, its message holding `words`, for each of `values`."""
    for bad in values:
        try:
            parse(bad)
        except error as err:
            assert words in str(err)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_rounds_table(tmp_path):
    done, out = run_rounds(tmp_path)
    assert done.returncode == 1, "a failed run makes the exit status 1"
    table = (out / "table.txt").read_text()
    assert row(table, "native").split("|")[1:] == [" 10.0 ", " - ", " 10.0 ", " 4.00-4.00 ",
                                                   " yes"]
    assert row(table, "expandable").split("|")[2:4] == [" 0.90x (0.90-0.90); 2 of 2 ",
                                                        " 9.0, 0.90x (0.90-0.90); 2 of 2 "]
    same = row(table, "same")
    assert same.startswith("  same         12.0 / 12.0 |")
    assert same.split("|")[1:] == [" 12.0 ", " 1.20x (1.20-1.20); 0 of 2 ",
                                   " 12.0, 1.20x (1.20-1.20); 0 of 2 ", " 2.00-2.00 ", " yes"]
    assert row(table, "differs").endswith("| NO")
    assert "no result" in row(table, "fails")
    results = json.loads((out / "rounds.json").read_text())["results"]
    # Round after round, each allocator once per round, the second round starting one later.
    order = [(r["round"], r["label"]) for r in results]
    labels = ["native", "expandable", "same", "differs", "fails"]
    assert order == [(1, label) for label in labels] + [(2, label) for label in
                                                         labels[1:] + labels[:1]]
    assert [r["rc"] for r in results if r["label"] == "fails"] == [3, 3]


def test_runs_are_pinned_and_rmm_gets_its_environment(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    done, out = run_rounds(tmp_path, "--cpus", str(cpu), "--rmm", "rmm=@1048576")
    assert done.returncode == 1  # the failing preload
    for result in out.glob("*.json"):
        if result.name == "rounds.json":
            continue
        env = json.loads(result.with_name(result.name + ".env").read_text())
        assert env["cpus"] == [cpu], result.name
        if result.name.startswith("rmm."):
            assert env["allocator"] == "rmm" and env["rmm_initial"] == "1048576"
    rmm_row = row((out / "table.txt").read_text(), "rmm")
    # 11 and 13 ms a step against native's 10: the median ratio and the rounds' spread.
    assert rmm_row.split("|")[1:] == [" 12.0 ", " 1.20x (1.10-1.30); 0 of 2 ",
                                      " 12.0, 1.20x (1.10-1.30); 0 of 2 ", " 5.00-5.00 ", " yes"]
    assert json.loads((out / "rounds.json").read_text())["cpus"] == str(cpu)


def test_the_steady_column_leaves_out_the_warm_up_steps(tmp_path):
    # Every step counted: 7 of 12 at twice the step, so the median is the slow one.
    _, out = run_rounds(tmp_path, "--warmup-steps", "0")
    assert row((out / "table.txt").read_text(), "native").split("|")[3] == " 20.0 "
    # More warm-up steps than the runs logged: no steady figure.
    _, out = run_rounds(tmp_path, "--warmup-steps", "12")
    assert row((out / "table.txt").read_text(), "native").split("|")[3] == " - "


def counts_row(table, label):
    head = table.index("cupool's counts per step")
    return row(table[head:], label)


def test_the_pools_counts_per_step_leave_out_the_warm_up_steps(tmp_path):
    _, out = run_rounds(tmp_path)
    table = (out / "table.txt").read_text()
    assert "cupool's counts per step after step 10 (median over rounds):" in table
    # Steps 10 and 11: 100 allocations each, map calls in one of the two, no wait.
    assert counts_row(table, "same") == "  same         num_allocs 100, vmm_map_calls 1"
    assert counts_row(table, "differs") == "  differs      num_allocs 100, vmm_map_calls 1"
    assert "native " not in table[table.index("cupool's counts"):], "no cupool, no counts"
    _, out = run_rounds(tmp_path, "--warmup-steps", "0")
    assert counts_row((out / "table.txt").read_text(), "same") == (
        "  same         grow_waits 0.5833, num_allocs 100, vmm_map_calls 1")


def test_counts_come_from_the_stats_and_the_footprints_vmm(monkeypatch):
    common = workload_module("common")
    stats = {"num_allocs": 5, "grow_waits": 1, "allocated_bytes": {"current": 1, "peak": 2},
             "version": 5}
    devices = [{"device": 0, "vmm": {"map_calls": 3, "map_ns": 900, "enabled": True},
                "fences": {"query_ns": 50, "query_sampled": 2}},
               {"device": 1, "vmm": {"map_calls": 4, "map_ns": 100},
                "fences": {"query_ns": 70, "record_ns": 10}}]
    counts = common.cupool_counts(stats, devices)
    assert counts["num_allocs"] == 5 and counts["grow_waits"] == 1
    assert counts["vmm_map_calls"] == 7 and counts["vmm_map_ns"] == 1000
    # The fence calls' time estimates, summed over devices (the sample counts left out).
    assert counts["fence_query_ns"] == 120 and counts["fence_record_ns"] == 10
    assert counts["fence_device_wait_ns"] == 0 and "fence_query_sampled" not in counts
    assert "version" not in counts and "allocated_bytes" not in counts
    # A library whose footprint has no `vmm`: the stats' counts alone.
    assert common.cupool_counts(stats, [{"device": 0}]) == {"num_allocs": 5, "grow_waits": 1}
    assert common.cupool_counts({"error": "x"}, devices) is None
    assert common.cupool_counts(stats, None) is None
    later = dict(counts, num_allocs=9)
    assert common.count_deltas(counts, later) == {"num_allocs": 4}


def test_kernel_time_takes_first_and_count():
    common = workload_module("common")
    assert common.parse_kernel_time(None) is None
    assert common.parse_kernel_time("20:10") == (20, 10)
    assert_rejected(common.parse_kernel_time, ("20", "20:0", "a:3", "-1:3", "3:"), SystemExit,
                    "--kernel-time wants FIRST:COUNT")
    args = common.parser("x").parse_args(["--kernel-time", "5:2"])
    assert args.kernel_time == "5:2"


def test_cpus_not_available_are_a_usage_error(tmp_path):
    stderr = usage_error(tmp_path, "--cpus", str(max(os.sched_getaffinity(0)) + 1))
    assert "not all of these CPUs" in stderr


def test_no_run_starts_after_the_deadline(tmp_path):
    done, out = run_rounds(tmp_path, "--deadline-s", "0")
    assert done.returncode == 1
    results = json.loads((out / "rounds.json").read_text())["results"]
    assert results and all(r["status"] == "skipped (deadline)" for r in results)


def test_a_missing_library_is_a_usage_error(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROUNDS), str(tmp_path / "out"), "--preload",
         f"x={tmp_path / 'nope.so'}"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "no such library" in done.stderr


def test_host_cpu_per_step_leaves_out_the_warm_up_steps(tmp_path):
    _, out = run_rounds(tmp_path)
    table = (out / "table.txt").read_text()
    head = table.index("host CPU per step after step 10")
    # Steps 10 and 11: one tick of 4 ms between them.
    assert row(table[head:], "native") == "  native       10.0 (10.0-10.0) | 5.0 (5.0-5.0) | 2.0 (2.0-2.0)"
    assert row(table[head:], "same") == "  same         12.0 (12.0-12.0) | 6.0 (6.0-6.0) | 2.0 (2.0-2.0)"
    _, out = run_rounds(tmp_path, "--warmup-steps", "0")
    table = (out / "table.txt").read_text()
    head = table.index("host CPU per step after step 0")
    # User time over all twelve steps: seven of 10 ms and five of 5 ms.
    assert row(table[head:], "native").split("|")[1] == " 7.9 (7.9-7.9) "
    # Three ticks in twelve steps: the mean, where the median step read 0.
    assert row(table[head:], "native").split("|")[2] == " 1.0 (1.0-1.0)"


def test_the_hosts_speed_is_taken_out_of_the_comparison(tmp_path):
    _, out = run_rounds(tmp_path, "--warmup-steps", "0")
    table = (out / "table.txt").read_text()
    head = table.index("host-speed adjusted, after step 0")
    # Every step takes twice as long where the probe does: elasticity 1, found exactly.
    assert "elasticity 1.00" in table[head:].splitlines()[0]
    adjusted = table[head:]
    # Native's slow steps 0-5 (round 1) and the preload's 18-23 and 0-15 do not move the
    # factors: 12 ms against 10 in every round, 9 for expandable (never slow).
    assert row(adjusted, "same") == "  same         1.20x | 1.20x (1.20-1.20); 0 of 2"
    assert row(adjusted, "expandable") == "  expandable   0.90x | 0.90x (0.90-0.90); 2 of 2"
    # The runs' steps and probes are kept in rounds.json: the preload's second round ran 16
    # of its 24 steps at half speed, twice native's time over the run before adjustment.
    raw = json.loads((out / "rounds.json").read_text())["results"]
    second = next(r for r in raw if r["label"] == "same" and r["round"] == 2)
    assert second["probed"][1].count(2.0) == 16
    assert sum(second["probed"][0]) == 2 * 10.0 * 24
    # With the warm-up left out, the same.
    _, out = run_rounds(tmp_path, "--warmup-steps", "10")
    table = (out / "table.txt").read_text()
    adjusted = table[table.index("host-speed adjusted, after step 10"):]
    assert row(adjusted, "same") == "  same         1.20x | 1.20x (1.20-1.20); 0 of 2"


def test_canaries_read_the_hosts_speed_for_the_whole_call(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    done, out = run_rounds(tmp_path, "--canary-cpus", str(cpu))
    assert done.returncode == 1  # the failing preload
    readings = json.loads((out / f"canary.{cpu}.json").read_text())
    assert readings, "a canary that ran for the whole call read the host at least once"
    times = [t for t, _ in readings]
    assert times == sorted(times) and all(ms > 0 for _, ms in readings)
    stderr = usage_error(tmp_path, "--canary-cpus", str(max(os.sched_getaffinity(0)) + 1))
    assert "not all of these CPUs" in stderr


def test_the_speed_fit_finds_known_effects():
    rounds = workload_module("rounds")
    import math
    # Steps of three shapes under two allocators, the host's speed varying: log step =
    # shape + effect + 0.5 * log probe exactly.
    shapes = [1.0, 2.0, 3.0]
    effects = {"native": 0.0, "other": math.log(1.1)}
    obs = [(label, i, shapes[i] + effects[label] + 0.5 * math.log(p), math.log(p))
           for label in effects for i in range(3) for p in (0.8, 1.3, 1.9 + i / 10)]
    effect, elasticity = rounds.speed_fit(obs)
    assert abs(elasticity - 0.5) < 1e-6
    assert abs(math.exp(effect["other"]) - 1.1) < 1e-6 and effect["native"] == 0.0
    # Rounds whose runs logged no step past the warm-up: nothing to fit, no error.
    assert rounds.speed_fit([]) == ({}, 0.0)


def test_env_reaches_only_its_label_and_the_cycles_are_tabled(tmp_path):
    done, out = run_rounds(tmp_path, "--env", "same:WORKLOAD_VMM_CYCLES=4:8M")
    assert done.returncode == 1  # the failing preload
    for result in out.glob("*.json.env"):
        cycles = json.loads(result.read_text())["cycles"]
        assert cycles == ("4:8M" if result.name.startswith("same.") else None), result.name
    table = (out / "table.txt").read_text()
    head = table.index("injected move cycles per step after step 10")
    # Steps 10 and 11: 10.5 cycles and 1.05 ms a step; no other label has cycles.
    assert row(table[head:], "same") == "  same         10.50 | 1.050"
    assert not any(line.split()[:1] == ["native"] for line in table[head:].splitlines())


def test_workload_args_reach_every_run_of_their_workload(tmp_path):
    done, out = run_rounds(tmp_path, "--workload-args", "stand_in=--layers 12",
                           "--workload-args", "stand_in=--name 'two words'")
    assert done.returncode == 1  # the failing preload
    runs = list(out.glob("*.json.env"))
    assert runs
    for result in runs:
        env = json.loads(result.read_text())
        assert (env["layers"], env["name"]) == (12, "two words"), result.name


def test_workload_args_without_a_workload_are_a_usage_error(tmp_path):
    stderr = usage_error(tmp_path, "--workload-args", "--layers 12")
    assert "--workload-args wants WORKLOAD=ARGS" in stderr
    stderr = usage_error(tmp_path, "--workload-args", "other=--layers 3")
    assert "not among --workloads" in stderr


def test_env_for_a_label_not_run_is_a_usage_error(tmp_path):
    assert "--env wants LABEL:KEY=VALUE" in usage_error(tmp_path, "--env", "nobody:X=1")
    usage_error(tmp_path, "--env", "same:NOVALUE")


def test_vmm_cycles_reads_every_and_bytes():
    vmm_cycles = workload_module("vmm_cycles")
    assert vmm_cycles.parse("4:8M") == (4, 8 << 20, "main")
    assert vmm_cycles.parse("1:2097152") == (1, 2 << 20, "main")
    assert vmm_cycles.parse("3:1g") == (3, 1 << 30, "main")
    assert vmm_cycles.parse("2:8M:unmap-bg") == (2, 8 << 20, "unmap-bg")
    assert vmm_cycles.parse("2:8M:bg") == (2, 8 << 20, "bg")
    assert_rejected(vmm_cycles.parse, ("4", "0:8M", "x:8M", "4:", "4:0", "4:M", "4:8Q", "4:8M:gpu"),
                    ValueError, "EVERY:BYTES")


def test_step_costs_recovers_what_calls_cost_a_step(tmp_path):
    """Steps made of a shape, an allocator factor, the host's speed and calls: the fit gives
    back each call kind's cost per ms and each configuration's factor with no calls."""
    import math
    import random

    rng = random.Random(5)
    shapes = [20.0 + 10.0 * rng.random() for _ in range(40)]
    arms = [("native", None, 1.00, 0.0), ("cupool", None, 1.03, 0.0),
            ("cupool", "reserve:5G", 1.01, 0.0), ("cupool", "reserve:5G", 1.01, 2.0),
            ("cupool/other", None, 1.08, 0.0)]
    for k, (mode, conf, factor, injected) in enumerate(arms):
        mode, _, library = mode.partition("/")
        for rnd in range(3):
            ms, probe, counts, cycles = [], [], [], []
            for i, shape in enumerate(shapes):
                p = rng.choice([1.0, 1.6])
                # The calls' shares of the step: a step's ms of calls over its ms.
                own = 0.0 if mode == "native" else rng.choice([0.0, 0.02, 0.06])
                inj = injected * rng.choice([0.02, 0.04, 0.06])
                # Own calls cost 0.5 ms per ms, injected ones 1 ms per ms; elasticity 0.3.
                step = shape * factor * p ** 0.3 * math.exp(0.5 * own + 1.0 * inj)
                ms.append(step)
                probe.append(p)
                counts.append({"vmm_map_ns": own * step * 1e6})
                cycles.append([4, inj * step])
            env = {"CUPOOL_CONF": conf} if conf else {}
            if library:
                env["CUPOOL_LIBRARY"] = library
            res = {"status": "ok", "mode": mode, "env": env,
                   "step_ms": ms, "host_probe_ms": probe,
                   "cupool_step_counts": counts if mode != "native" else None,
                   "vmm_cycles": cycles if injected else None}
            (tmp_path / f"{k}.r{rnd}.json").write_text(json.dumps(res))
    step_costs = workload_module("step_costs")
    rows = step_costs.observations([json.loads(p.read_text()) for p in tmp_path.glob("*.json")], 0)
    effect, (elasticity, injected, own) = step_costs.fit(rows)
    assert abs(elasticity - 0.3) < 0.02
    assert abs(injected - 1.0) < 0.01 and abs(own - 0.5) < 0.01
    assert abs(math.exp(effect["cupool"]) - 1.03) < 0.001
    # The injected runs are the same arm as their configuration without them; another
    # library is another arm.
    assert set(effect) == {"native", "cupool", "cupool@reserve:5G", "cupool other"}
    assert abs(math.exp(effect["cupool other"]) - 1.08) < 0.001
    assert abs(math.exp(effect["cupool@reserve:5G"]) - 1.01) < 0.001
    lines = step_costs.report(str(tmp_path), 0)
    assert any("a ms of injected move calls costs 1.0" in line for line in lines), lines


def test_step_costs_leaves_out_vmm_time_of_other_threads():
    """The unmaps a pool's worker thread made (`vmm_deferred_unmap_ns`, also inside
    `vmm_unmap_ns`) are not the allocating thread's time: a step's own share leaves them out."""
    step_costs = workload_module("step_costs")
    res = {"status": "ok", "mode": "cupool", "env": {}, "step_ms": [10.0, 10.0],
           "host_probe_ms": [1.0, 1.0],
           "cupool_step_counts": [{}, {"vmm_map_ns": 1e6, "vmm_unmap_ns": 3e6,
                                       "vmm_deferred_unmap_ns": 2e6}]}
    rows = step_costs.observations([res], 1)
    assert len(rows) == 1
    assert abs(rows[0][5] - 0.2) < 1e-9, rows
