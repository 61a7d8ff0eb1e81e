//! End-to-end tests of `libcupool_preload.so`'s process lifecycle on the CPU, with the
//! fake libcuda (tests/fake_cuda/): fork children, exits with work in flight, what the
//! library prints and records at exit.

mod support;

use support::{run, run_ok, Reach};

#[test]
fn a_fork_child_passes_through_to_the_driver() {
    for reach in [Reach::GetProcAddress, Reach::Linked] {
        let exe = support::driver_program(reach);
        let pre = run_ok(&exe, &["fork"], true, &[]);
        assert_eq!(pre.get("child.exit"), "0", "{reach:?}");
        assert_eq!(
            pre.num("child.driver_allocs"),
            pre.num("child.program_allocs"),
            "{reach:?}"
        );
        assert_eq!(
            pre.get("child.pool_stats_ok"),
            "0",
            "{reach:?}: the child reached the pool"
        );
        assert_eq!(pre.get("parent.free"), "0", "{reach:?}");
    }
}

/// Issue 14's lifecycle: 1000 process exits under the preload, each with blocks live and
/// four threads in the middle of allocating and freeing (exit at a different moment each
/// time): every one ends with status 0, and none crashes.
#[test]
fn a_thousand_exits_with_live_blocks_and_allocating_threads() {
    let exe = support::driver_program(Reach::Linked);
    let runs: usize = std::env::var("CUPOOL_EXIT_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    for i in 0..runs {
        let seed = i.to_string();
        let out = run(&exe, &["exit-busy", &seed], true, &[]);
        assert!(
            out.status.success(),
            "run {i}: {:?}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// 100 children forked from a process whose pool is live use CUDA themselves (through the
/// driver: a fork child never touches the parent's pool), and the parent's pool keeps
/// working between the forks.
#[test]
fn a_hundred_fork_children_use_cuda_themselves() {
    for reach in [Reach::GetProcAddress, Reach::Linked] {
        let exe = support::driver_program(reach);
        let out = run_ok(&exe, &["forks"], true, &[]);
        assert_eq!(out.get("children_ok"), "100", "{reach:?}");
        assert_eq!(out.get("parent.free"), "0", "{reach:?}");
    }
}

/// Nothing reaches the driver from cupool once exit has started, whether the program
/// leaves blocks allocated or frees them from exit handlers and destructors.
#[test]
fn no_driver_call_after_exit_starts() {
    for scenario in ["exit-nofree", "exit-free-late"] {
        let exe = support::driver_program(Reach::Linked);
        let (out, logged) = support::run_ok_logging_calls(
            &exe,
            &[scenario],
            true,
            &format!("{scenario}.log"),
            // A fence per free: any free that reached the pool's ordering would show.
            &[("CUPOOL_CONF", "fence_batch:1")],
        );
        if scenario == "exit-free-late" {
            let frees: Vec<_> = out.0.iter().filter(|(k, _)| k.ends_with("_free")).collect();
            assert_eq!(frees.len(), 4, "{frees:?}");
            assert!(frees.iter().all(|(_, v)| v == "0"), "{frees:?}");
        }
        // The program's marker is the last cuDriverGetVersion (the backend also calls it).
        let after = support::calls_after_last(&logged, "cuDriverGetVersion");
        assert!(
            after.is_empty(),
            "{scenario}: driver calls during exit: {after:?}"
        );
    }
}

#[test]
fn stats_at_exit_prints_a_summary() {
    let exe = support::driver_program(Reach::Linked);
    let out = run(&exe, &["loop"], true, &[("CUPOOL_STATS_AT_EXIT", "1")]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cupool: statistics at exit"), "stderr:\n{err}");
    assert!(err.contains("num_allocs"), "stderr:\n{err}");
    // Note [fence call times]: the loop's streamless frees were fenced, and timed.
    assert!(
        err.contains("device 0: fence calls (estimated from one in 8): records "),
        "stderr:\n{err}"
    );
    let quiet = run(&exe, &["loop"], true, &[]);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("statistics at exit"));
    // One parser, the options' booleans: `FALSE` is off, `2` is no boolean (off, said once).
    for (value, on) in [
        ("TRUE", true),
        ("yes", true),
        ("FALSE", false),
        ("off", false),
    ] {
        let out = run(&exe, &["loop"], true, &[("CUPOOL_STATS_AT_EXIT", value)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.contains("statistics at exit"), on, "{value}: {err}");
    }
    let out = run(&exe, &["loop"], true, &[("CUPOOL_STATS_AT_EXIT", "2")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("statistics at exit"), "{err}");
    assert!(
        err.contains("CUPOOL_STATS_AT_EXIT='2' is not a boolean"),
        "{err}"
    );
}

#[test]
fn cupool_trace_records_the_programs_driver_calls() {
    let exe = support::driver_program(Reach::Linked);
    let dir = support::scratch().join("preload-trace");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("loop.csv.zst");
    let results = run_ok(
        &exe,
        &["loop"],
        true,
        &[("CUPOOL_TRACE", path.to_str().unwrap())],
    );
    let trace = cupool::trace::io::read_trace(&path).unwrap_or_else(|e| panic!("{e}"));
    let allocs: u64 = results.get("program_allocs").parse().unwrap();
    let count = |a| trace.events.iter().filter(|e| e.action == a).count() as u64;
    assert_eq!(count(cupool::trace::Action::Allocate), allocs);
    assert_eq!(count(cupool::trace::Action::Free), allocs);
    assert!(trace
        .events
        .iter()
        .all(|e| e.streamless && e.result.is_none()));
    // The pool's segments are in the driver file, one row per driver allocation.
    let driver = dir.join("loop.driver.csv.zst");
    let mut text = String::new();
    std::io::Read::read_to_string(&mut cupool::trace::io::open(&driver).unwrap(), &mut text)
        .unwrap();
    let segments = text
        .lines()
        .filter(|l| l.contains(",segment_alloc,"))
        .count();
    let driver_allocs: usize = results.get("driver_allocs").parse().unwrap();
    assert_eq!(segments, driver_allocs, "{text}");
}
