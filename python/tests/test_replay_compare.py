"""scripts/replay-compare on a stand-in `cupool` binary (no build needed): which traces it
replays, the changes it reports per family and lag, and its failures."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import REPO

COMPARE = REPO / "scripts" / "replay-compare"

# Answers `replay --backend host --json [--gpu-lag-us N] [--conf C] TRACE` as `cupool` does,
# with a utilization that depends on the trace, the lag and the options.
STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    args = sys.argv[1:]
    trace = os.path.basename(args[-1])
    conf = args[args.index("--conf") + 1] if "--conf" in args else ""
    lag = int(args[args.index("--gpu-lag-us") + 1])
    if "--per-thread" in args:
        lag += 1000  # the replay per thread holds a little more in this stand-in
    if trace.startswith("bad"):
        sys.exit("cupool: bad.csv line 3: no such pointer")
    util = {{"a.csv": 0.90, "b.csv.zst": 0.95}}[trace] - lag / 1e6
    calls = 10
    if conf == "better:1":
        util += 0.02 if trace == "a.csv" else -0.01
        calls = 13
    print(json.dumps({{"utilization": util, "peak_reserved_bytes": 1 << 30, "map_calls": calls,
                      "unmap_calls": calls, "device_allocs": 4, "device_frees": 1}}))
    """
)


def setup(tmp_path, bad=False):
    binary = tmp_path / "cupool"
    binary.write_text(STAND_IN.format(python=sys.executable))
    os.chmod(binary, 0o755)
    corpus = tmp_path / "traces"
    (corpus / "gpu").mkdir(parents=True)
    (corpus / "synthetic").mkdir()
    (corpus / "gpu" / "a.csv").write_text("")
    (corpus / "gpu" / "a.driver.csv.zst").write_text("")  # the pool's own events: skipped
    (corpus / "gpu" / "a.peaks.json").write_text("{}")  # not a trace
    (corpus / "synthetic" / "b.csv.zst").write_text("")
    if bad:
        (corpus / "synthetic" / "bad.csv").write_text("")
    return binary, corpus


def compare(binary, corpus, *args):
    return subprocess.run(
        [sys.executable, str(COMPARE), str(binary), f"{binary}@better:1", "--seeds", "0",
         "--corpus", str(corpus), "--jobs", "2", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_changes_per_family_and_lag(tmp_path):
    binary, corpus = setup(tmp_path)
    done = compare(binary, corpus, "--lag-us", "0", "--lag-us", "5000", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    traces = sorted({os.path.basename(r["trace"]) for r in report["traces"]})
    assert traces == ["a.csv", "b.csv.zst"]
    assert report["errors"] == []
    by_lag = {s["lag_us"]: s for s in report["summary"]}
    assert sorted(by_lag) == [0, 5000]
    for lag, s in by_lag.items():
        assert (s["family"], s["traces"], s["better"], s["worse"]) == ("corpus", 2, 1, 1)
        assert abs(s["mean_change"] - 0.5) < 1e-9, "(+2 - 1) / 2 points"
        assert abs(s["least"] + 1) < 1e-9 and abs(s["most"] - 2) < 1e-9
        assert abs(s["before_mean"] - (92.5 - lag / 1e4)) < 1e-9
        assert s["vmm_calls_change"] == 2 * 6 and s["driver_calls_change"] == 0


def test_table_and_a_failed_replay(tmp_path):
    binary, corpus = setup(tmp_path, bad=True)
    done = compare(binary, corpus)
    assert done.returncode == 1, "a failed replay makes the exit status 1"
    assert "gpu/a.csv" in done.stdout and "90.00 ->  92.00  (20 -> 26)" in done.stdout
    assert "error: " in done.stdout and "bad.csv line 3: no such pointer" in done.stdout
    corpus_row = next(line for line in done.stdout.splitlines() if " corpus " in line)
    assert corpus_row.split()[:3] == ["0", "corpus", "2"], "the bad trace counts nowhere"


def test_a_missing_binary_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, str(COMPARE), str(tmp_path / "nothing"),
                           str(tmp_path / "nothing")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "is not an executable file" in done.stderr


def test_per_thread_reaches_the_replays(tmp_path):
    binary, corpus = setup(tmp_path)
    one = json.loads(compare(binary, corpus, "--json").stdout)
    per = compare(binary, corpus, "--per-thread", "--json")
    assert per.returncode == 0, per.stderr
    per = json.loads(per.stdout)
    assert per["errors"] == []
    before = {s["lag_us"]: s["before_mean"] for s in one["summary"]}
    after = {s["lag_us"]: s["before_mean"] for s in per["summary"]}
    assert abs(before[0] - after[0] - 0.1) < 1e-9, "every replay got --per-thread"
