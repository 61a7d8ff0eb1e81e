//! The C API exercised from C: each `tests/c/<name>.c` is compiled with AddressSanitizer
//! and UBSan, linked once against `libcupool.so` and once against `libcupool.a`, and run.
//! A program passes when it exits 0 and prints `PASS <name>` (or `SKIP <name>: why`).
//!
//! `cargo test` does not build the cdylib/staticlib for integration tests, so the driver
//! first runs `cargo build --lib` with the same profile and target directory.

#[path = "support/api_library.rs"]
mod api_library;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// Where this test binary's profile puts its artifacts (`target/debug`).
struct Artifacts {
    profile_dir: PathBuf,
    c_out_dir: PathBuf,
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Builds `libcupool.{so,a}` once per test process.
fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let profile_dir = api_library::profile_dir().to_path_buf();
        let target_dir = profile_dir
            .parent()
            .expect("profile dir has a parent")
            .to_path_buf();
        let profile = profile_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("debug");
        let c_out_dir = target_dir.join("c-tests").join(profile);
        std::fs::create_dir_all(&c_out_dir).expect("create c-tests dir");
        Artifacts {
            profile_dir,
            c_out_dir,
        }
    })
}

#[derive(Copy, Clone, Debug)]
enum Linkage {
    Shared,
    Static,
}

/// Compiles `source` against the library; returns the executable.
fn compile(source: &Path, name: &str, linkage: Linkage) -> PathBuf {
    let art = artifacts();
    let exe = art
        .c_out_dir
        .join(format!("{name}-{linkage:?}").to_lowercase());
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let mut cmd = Command::new(cc);
    cmd.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
    ])
    .arg(format!("-I{}", manifest_dir().join("include").display()))
    .arg(source)
    .arg("-o")
    .arg(&exe);
    match linkage {
        Linkage::Shared => {
            cmd.arg(format!("-L{}", art.profile_dir.display()))
                .arg("-lcupool")
                .arg(format!("-Wl,-rpath,{}", art.profile_dir.display()));
        }
        Linkage::Static => {
            cmd.arg(art.profile_dir.join("libcupool.a"))
                .args(["-lpthread", "-ldl", "-lm"]);
        }
    }
    cmd.arg("-ldl");
    let out = cmd.output().expect("run cc");
    assert!(
        out.status.success(),
        "compiling {name} ({linkage:?}) failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// LeakSanitizer cannot run under ptrace (a debugger, some sandboxes); it then aborts with
/// one of these lines, and the program is run again without leak checking.
fn lsan_unavailable(out: &Output) -> bool {
    let stderr = String::from_utf8_lossy(&out.stderr);
    stderr.contains("LeakSanitizer does not work under ptrace")
        || stderr.contains("LeakSanitizer has encountered a fatal error")
}

fn run(exe: &Path, conf: Option<&str>, detect_leaks: bool) -> Output {
    run_with_args(exe, &[], conf, detect_leaks)
}

fn run_with_args(exe: &Path, args: &[&str], conf: Option<&str>, detect_leaks: bool) -> Output {
    let mut cmd = Command::new(exe);
    cmd.args(args);
    cmd.env_remove("CUPOOL_CONF")
        .env_remove("CUPOOL_LOG")
        .env_remove("CUPOOL_STATS_AT_EXIT")
        .env_remove("CUPOOL_TRACE")
        .env_remove("LD_PRELOAD")
        .env(
            "ASAN_OPTIONS",
            format!(
                "detect_leaks={}:allocator_may_return_null=1:abort_on_error=0:exitcode=66",
                u8::from(detect_leaks)
            ),
        )
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    if let Some(conf) = conf {
        cmd.env("CUPOOL_CONF", conf);
    }
    cmd.output().expect("run C test program")
}

/// Compiles and runs `tests/c/<name>.c` both ways; returns the shared build's stdout.
fn run_c_test(name: &str, conf: Option<&str>) -> String {
    run_c_test_with_args(name, conf, |_| Vec::new())
}

/// As [`run_c_test`], with command-line arguments chosen per linkage.
fn run_c_test_with_args(
    name: &str,
    conf: Option<&str>,
    args_for: impl Fn(Linkage) -> Vec<String>,
) -> String {
    let source = manifest_dir().join("tests/c").join(format!("{name}.c"));
    let mut first_stdout = None;
    for linkage in [Linkage::Shared, Linkage::Static] {
        let exe = compile(&source, name, linkage);
        let args = args_for(linkage);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut out = run_with_args(&exe, &args, conf, true);
        if lsan_unavailable(&out) {
            eprintln!(
                "note: LeakSanitizer cannot run here (ptrace?); {name} runs without leak checks"
            );
            out = run_with_args(&exe, &args, conf, false);
        }
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last_line = stdout.lines().last().unwrap_or("");
        assert!(
            out.status.success()
                && (last_line == format!("PASS {name}")
                    || last_line.starts_with(&format!("SKIP {name}"))),
            "{name} ({linkage:?}) failed with {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
            out.status
        );
        if last_line.starts_with("SKIP") {
            eprintln!("{last_line}");
        }
        first_stdout.get_or_insert(stdout);
    }
    first_stdout.unwrap_or_default()
}

const HOST: Option<&str> = Some("backend:host");

#[test]
fn alloc_free_round_trip_on_streams() {
    run_c_test("roundtrip", HOST);
}

#[test]
fn stats_struct_json_peaks_and_empty_cache() {
    run_c_test("stats", HOST);
}

#[test]
fn memory_limit_gives_out_of_memory() {
    run_c_test("limits", HOST);
}

#[test]
fn config_status_strings_and_version() {
    let stdout = run_c_test("config", HOST);
    let version_line = format!("version {}", env!("CARGO_PKG_VERSION"));
    assert!(
        stdout.lines().any(|l| l == version_line),
        "no '{version_line}' in:\n{stdout}"
    );
    assert!(stdout.contains("status 0: success"));
}

#[test]
fn bad_input_is_refused_without_harm() {
    run_c_test("bad_input", HOST);
}

#[test]
fn pinned_host_memory_from_c() {
    run_c_test("pinned", HOST);
}

#[test]
fn trace_start_and_stop_record_to_files() {
    let dir_for = |linkage: Linkage| {
        let dir = artifacts()
            .c_out_dir
            .join(format!("trace-files-{linkage:?}").to_lowercase());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the trace directory");
        dir
    };
    run_c_test_with_args("trace", HOST, |linkage| {
        vec![dir_for(linkage).to_string_lossy().into_owned()]
    });
    // What the C program wrote reads back as a trace.
    for linkage in [Linkage::Shared, Linkage::Static] {
        let dir = artifacts()
            .c_out_dir
            .join(format!("trace-files-{linkage:?}").to_lowercase());
        let trace = cupool::trace::io::read_trace(&dir.join("trace.csv"))
            .unwrap_or_else(|e| panic!("{linkage:?}: {e}"));
        assert_eq!(trace.events.len(), 6, "{linkage:?}");
    }
}

#[test]
fn cuda_header_and_cupool_header_compile_together() {
    run_c_test("cuda_header_compat", HOST);
}

#[test]
fn cuda_backend_without_driver_is_unavailable() {
    run_c_test("no_backend", None);
}

#[test]
fn two_copies_of_the_library_share_one_pool() {
    // A second copy under another file name is a separate load, with its own statics, as
    // the copy inside libcupool_preload.so is.
    let art = artifacts();
    let second_copy = art.c_out_dir.join("libcupool_second_copy.so");
    std::fs::copy(art.profile_dir.join("libcupool.so"), &second_copy).expect("copy libcupool.so");
    let second_copy = second_copy.to_string_lossy().into_owned();
    run_c_test_with_args("one_pool", HOST, |linkage| {
        let mode = match linkage {
            Linkage::Shared => "local",
            Linkage::Static => "global",
        };
        vec![second_copy.clone(), mode.to_string()]
    });
}

#[test]
fn example_picks_the_host_backend_without_a_gpu() {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine may have a GPU; the example would run on it");
        return;
    }
    let source = manifest_dir().join("examples/streams.c");
    let exe = compile(&source, "example-streams", Linkage::Shared);
    let mut out = run(&exe, None, true);
    if lsan_unavailable(&out) {
        out = run(&exe, None, false);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "example failed with {}\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("no GPU found: running on the host backend"),
        "{stdout}"
    );
    let released: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("empty_cache released "))
        .and_then(|rest| rest.strip_suffix(" bytes"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no 'empty_cache released N bytes' line in:\n{stdout}"));
    assert!(
        released > 0,
        "the example freed everything, so emptying must release memory"
    );
}
