//! The `cupool` binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const CUPOOL: &str = env!("CARGO_BIN_EXE_cupool");
const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// An RMM log with these rows after the header (line 1).
fn csv(name: &str, rows: &[&str]) -> PathBuf {
    let path = scratch(name);
    let mut text = format!("{HEADER}\n");
    for row in rows {
        text.push_str(row);
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    path
}

/// Two 1000-byte blocks on the legacy stream, both freed.
fn two_blocks(name: &str) -> PathBuf {
    csv(
        name,
        &[
            "1,10:00:00.000001,allocate,0x7f0000000000,1000,0x0",
            "1,10:00:00.000002,allocate,0x7f0000000400,1000,0x0",
            "1,10:00:00.000003,free,0x7f0000000000,1000,0x0",
            "1,10:00:00.000004,free,0x7f0000000400,1000,0x0",
        ],
    )
}

fn cupool(args: &[&str]) -> Output {
    Command::new(CUPOOL)
        .args(args)
        .env_remove("CUPOOL_CONF")
        .env_remove("CUPOOL_PRELOAD")
        .output()
        .expect("run cupool")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The run failed with exit status 1 and one line on stderr, starting `cupool:`; returns it.
fn one_line_error(o: &Output) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "one line expected: {err}");
    assert!(err.starts_with("cupool: "), "{err}");
    err
}

#[test]
fn help_works_on_every_subcommand() {
    for args in [
        &["--help"][..],
        &["replay", "--help"],
        &["run", "--help"],
        &["help", "replay"],
    ] {
        let o = cupool(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(
            stdout(&o).contains("Usage: cupool"),
            "{args:?}: {}",
            stdout(&o)
        );
    }
    let o = cupool(&["replay", "--help"]);
    for option in ["--backend", "--conf", "--json", "--plot", "--capacity"] {
        assert!(stdout(&o).contains(option), "{option} missing from help");
    }
}

#[test]
fn a_missing_file_is_one_line() {
    let o = cupool(&["replay", "/no/such/trace.csv"]);
    let err = one_line_error(&o);
    assert!(err.contains("/no/such/trace.csv"), "{err}");
}

#[test]
fn a_bad_trace_names_its_line() {
    let path = csv(
        "bad_action.csv",
        &[
            "1,10:00:00.000001,allocate,0x7f0000000000,1000,0x0",
            "1,10:00:00.000002,frobnicate,0x7f0000000000,1000,0x0",
        ],
    );
    let err = one_line_error(&cupool(&["replay", path.to_str().unwrap()]));
    assert!(err.contains("line 3"), "{err}");

    let path = csv(
        "unknown_free.csv",
        &[
            "1,10:00:00.000001,allocate,0x7f0000000000,1000,0x0",
            "1,10:00:00.000002,free,0x7f0000000000,1000,0x0",
            "1,10:00:00.000003,free,0x7f00000abc00,1000,0x0",
        ],
    );
    let err = one_line_error(&cupool(&["replay", path.to_str().unwrap()]));
    assert!(err.contains("line 4"), "{err}");
    assert!(err.contains("0x7f00000abc00"), "{err}");
}

#[test]
fn bad_options_are_one_line() {
    let trace = two_blocks("options.csv");
    let t = trace.to_str().unwrap();
    for (args, expect) in [
        (vec!["replay", t, "--conf", "no_such_key:1"], "unknown key"),
        (
            vec!["replay", t, "--conf", "memory_limit:lots"],
            "bad value",
        ),
        (vec!["replay", t, "--conf", "fence_batch"], "KEY:VALUE"),
        (vec!["replay", t, "--backend", "tpu"], "tpu"),
        (vec!["replay", t, "--capacity", "much"], "--capacity"),
        (vec!["replay", t, "--no-such-option"], "--no-such-option"),
        (vec!["replay"], "TRACE"),
    ] {
        let err = one_line_error(&cupool(&args));
        assert!(err.contains(expect), "{args:?}: {err}");
    }
}

#[test]
fn json_report_has_the_figures() {
    let trace = two_blocks("json.csv");
    let o = cupool(&["replay", trace.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("one JSON object");
    for key in [
        "peak_requested_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "utilization",
        "requested_utilization",
        "device_allocs",
        "device_frees",
        "fences",
        "ops",
        "ooms",
        "alloc_ns_median",
        "free_ns_mean",
        "wall_seconds",
        "reserved_after_empty_cache",
    ] {
        assert!(v.get(key).is_some(), "{key} missing: {v}");
    }
    // Two 1000-byte blocks: 1024 bytes each, in one 2 MiB small segment.
    assert_eq!(v["peak_requested_bytes"], 2000);
    assert_eq!(v["peak_allocated_bytes"], 2048);
    assert_eq!(v["peak_reserved_bytes"], 2 << 20);
    assert_eq!(v["ops"], 4);
    assert_eq!(v["ooms"], 0);
    assert_eq!(v["reserved_after_empty_cache"], 0);
    assert_eq!(v["backend"], "host");
    let u = v["utilization"].as_f64().unwrap();
    assert!((u - 2048.0 / (2 << 20) as f64).abs() < 1e-6, "{u}");
    assert!(v.get("series").is_none(), "the series only with --series");
    // Where the reserved bytes were: the segment came with the first block (event 1), and
    // the rest of it was free.
    let p = &v["at_peak"];
    assert_eq!(p["events"], 1, "{p}");
    assert_eq!(p["reserved_bytes"], 2 << 20);
    assert_eq!(p["in_use_bytes"], 1024);
    assert_eq!(p["segments_partly_free_bytes"], (2 << 20) - 1024);
    for key in [
        "awaiting_fence_bytes",
        "stream_only_bytes",
        "arena_hole_ends_bytes",
        "arena_in_busy_chunks_bytes",
        "arena_stealable_bytes",
        "arena_idle_bytes",
        "segments_free_bytes",
        "segments_free",
        "other_bytes",
    ] {
        assert_eq!(p[key], 0, "{key}: {p}");
    }

    let o = cupool(&["replay", trace.to_str().unwrap(), "--json", "--series"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["series"].as_array().unwrap().len(), 4);
}

#[test]
fn conf_reaches_the_pool() {
    // A 1 MiB limit: the 2 MiB small segment does not fit, so both allocations fail.
    let trace = two_blocks("limited.csv");
    let o = cupool(&[
        "replay",
        trace.to_str().unwrap(),
        "--json",
        "--conf",
        "memory_limit:1M",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["ooms"], 2);
    assert_eq!(v["peak_reserved_bytes"], 0);
}

#[test]
fn the_human_report_reads() {
    let trace = two_blocks("human.csv");
    let o = cupool(&["replay", trace.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for text in [
        "human.csv: RMM CSV, 4 events",
        "peak allocated       2.00 KiB",
        "peak reserved        2.00 MiB",
        "utilization 0.1%",
        "1 allocations, 0 frees",
        "at the peak          2.00 MiB reserved after event 1:",
        "1.00 KiB   0.0%  in use by the program",
        "2.00 MiB 100.0%  free in segments partly in use",
    ] {
        assert!(out.contains(text), "{text:?} missing from:\n{out}");
    }
}

#[test]
fn plot_writes_a_png() {
    let rows: Vec<String> = (0..500u64)
        .flat_map(|i| {
            let p = 0x7f00_0000_0000u64 + (i << 24);
            let size = (i % 37 + 1) << 16;
            [
                format!("1,10:00:00.{i:06},allocate,{p:#x},{size},0x0"),
                format!("1,10:00:00.{i:06},free,{p:#x},{size},0x0"),
            ]
        })
        .collect();
    let rows: Vec<&str> = rows.iter().map(String::as_str).collect();
    let trace = csv("plotted.csv", &rows);
    let png = scratch("plotted.png");
    let _ = std::fs::remove_file(&png);
    let o = cupool(&[
        "replay",
        trace.to_str().unwrap(),
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let bytes = std::fs::read(&png).expect("the PNG was written");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "PNG signature");
    assert!(
        bytes.len() > 10_000,
        "a real picture, not an empty one: {} bytes",
        bytes.len()
    );
}

/// `target/<profile>` of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// The preload library cargo built for these tests (a dev-dependency): the newer of the
/// copies in `target/<profile>` and `target/<profile>/deps`.
fn preload_library() -> PathBuf {
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let dir = profile_dir();
    [
        dir.join("libcupool_preload.so"),
        dir.join("deps").join("libcupool_preload.so"),
    ]
    .into_iter()
    .filter_map(|p| modified(&p).map(|t| (t, p)))
    .max_by_key(|(t, _)| *t)
    .map(|(_, p)| p)
    .expect("libcupool_preload.so built as a dev-dependency")
}

fn run_with_preload(preload: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(CUPOOL);
    cmd.arg("run")
        .args(args)
        .env("CUPOOL_PRELOAD", preload)
        .env_remove("LD_PRELOAD")
        .env_remove("CUPOOL_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run cupool run")
}

#[test]
fn run_gives_the_program_its_environment() {
    // Any existing file will do to check what the program sees: the loader only warns
    // about a preload entry that is not a library.
    let fake = scratch("libnot_a_preload.so");
    std::fs::write(&fake, b"not a library").unwrap();
    let show = "echo \"$LD_PRELOAD|$CUPOOL_STATS_AT_EXIT|$CUPOOL_TRACE|$CUPOOL_CONF\"";
    let o = run_with_preload(
        &fake,
        &[
            "--stats",
            "--trace",
            "t.csv.zst",
            "--conf",
            "fence_batch:8",
            "--",
            "sh",
            "-c",
            show,
        ],
        &[
            ("LD_PRELOAD", "libother.so"),
            ("CUPOOL_CONF", "verbose:false"),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let fake = std::fs::canonicalize(&fake).unwrap();
    assert_eq!(
        stdout(&o).trim(),
        format!(
            "{}:libother.so|1|t.csv.zst|verbose:false,fence_batch:8",
            fake.display()
        )
    );
    // Without the options, nothing but LD_PRELOAD is set.
    let o = run_with_preload(&fake, &["--", "sh", "-c", show], &[]);
    assert_eq!(stdout(&o).trim(), format!("{}|||", fake.display()));
}

#[test]
fn run_torch_and_cupy_enable_the_python_hooks_instead_of_the_preload() {
    // No preload library anywhere: --torch must not look for it.
    let show = "echo \"$LD_PRELOAD|$CUPOOL_TORCH|$CUPOOL_CUPY\"";
    let missing = Path::new("/no/such/libcupool_preload.so");
    let o = run_with_preload(missing, &["--torch", "--", "sh", "-c", show], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "|1|");
    let o = run_with_preload(
        missing,
        &["--cupy", "--torch", "--", "sh", "-c", show],
        &[("LD_PRELOAD", "libother.so")],
    );
    assert_eq!(
        stdout(&o).trim(),
        "libother.so|1|1",
        "LD_PRELOAD left as it was"
    );
}

#[test]
fn run_exits_with_the_program_s_status() {
    let fake = scratch("libstatus_preload.so");
    std::fs::write(&fake, b"").unwrap();
    let o = run_with_preload(&fake, &["--", "sh", "-c", "exit 7"], &[]);
    assert_eq!(o.status.code(), Some(7));
    let o = run_with_preload(&fake, &["--", "/no/such/program"], &[]);
    let err = one_line_error(&o);
    assert!(err.contains("/no/such/program"), "{err}");
}

#[test]
fn run_loads_the_real_preload_library() {
    let preload = preload_library();
    let o = run_with_preload(&preload, &["--", "cat", "/proc/self/maps"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("libcupool_preload.so"),
        "the program has the library mapped"
    );
    assert!(
        stderr(&o).is_empty(),
        "inert in a program that never uses CUDA: {}",
        stderr(&o)
    );
}

#[test]
fn run_says_where_it_looked_when_the_library_is_missing() {
    // A copy of the binary in a directory of its own, with no library beside it.
    let dir = scratch("lonely/bin");
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("cupool");
    std::fs::copy(CUPOOL, &exe).unwrap();
    // Another test thread that forks while the copy's file is open for writing hands the
    // descriptor to its child until that child's exec, and running the copy meanwhile
    // fails with ETXTBSY ("Text file busy"; once in a workspace run): try again.
    let o = (0..100)
        .find_map(|_| {
            match Command::new(&exe)
                .args(["run", "--", "true"])
                .env_remove("CUPOOL_PRELOAD")
                .output()
            {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    None
                }
                other => Some(other.unwrap()),
            }
        })
        .expect("the copy runs once no child holds it open");
    let err = one_line_error(&o);
    assert!(err.contains("libcupool_preload.so not found"), "{err}");
    assert!(
        err.contains(&dir.join("libcupool_preload.so").display().to_string()),
        "{err}"
    );
    assert!(err.contains("../lib/libcupool_preload.so"), "{err}");
    assert!(err.contains("CUPOOL_PRELOAD is not set"), "{err}");

    let o = Command::new(&exe)
        .args(["run", "--", "true"])
        .env("CUPOOL_PRELOAD", "/no/such/libcupool_preload.so")
        .output()
        .unwrap();
    let err = one_line_error(&o);
    assert!(
        err.contains("/no/such/libcupool_preload.so ($CUPOOL_PRELOAD)"),
        "{err}"
    );
}
