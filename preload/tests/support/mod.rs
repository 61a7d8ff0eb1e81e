//! Test support for the preload library: builds it (and the fake libcuda TEST DOUBLE, and
//! the C caller programs), and runs programs with and without `LD_PRELOAD`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

/// The workspace root (the `cupool` crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("preload/ has a parent")
        .to_path_buf()
}

/// Scratch directory of this test binary.
pub fn scratch() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("preload-tests");
    std::fs::create_dir_all(&dir).expect("create scratch directory");
    dir
}

/// `target/<profile>`: where cargo puts the libraries this test binary was built with.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current test binary");
    // target/<profile>/deps/<test binary>
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf()
}

fn cargo_build(package: &str) {
    let release = profile_dir().file_name().is_some_and(|n| n == "release");
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root())
        .args(["build", "-p", package]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "cargo build -p {package} failed");
}

/// The newest of `name` in `target/<profile>` and `target/<profile>/deps`. `cargo test`
/// builds a library target into `deps/` and copies it up only for `cargo build`, so the
/// copy in `deps/` is the fresh one after a source change.
fn newest_library(name: &str) -> Option<PathBuf> {
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    [
        profile_dir().join(name),
        profile_dir().join("deps").join(name),
    ]
    .into_iter()
    .filter_map(|p| modified(&p).map(|t| (t, p)))
    .max_by_key(|(t, _)| *t)
    .map(|(_, p)| p)
}

/// `libcupool_preload.so` of this profile, built first when missing.
pub fn preload_library() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        if let Some(lib) = newest_library("libcupool_preload.so") {
            return lib;
        }
        cargo_build("cupool_preload");
        newest_library("libcupool_preload.so").expect("libcupool_preload.so was not built")
    })
    .clone()
}

/// Directory holding `libcupool.so` of this profile, built first when missing.
pub fn cupool_library_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let lib = newest_library("libcupool.so").unwrap_or_else(|| {
            cargo_build("cupool");
            newest_library("libcupool.so").expect("libcupool.so was not built")
        });
        lib.parent().expect("a directory").to_path_buf()
    })
    .clone()
}

fn run_cc(args: &[&std::ffi::OsStr], what: &str) {
    let out = Command::new("cc").args(args).output().expect("run cc");
    assert!(
        out.status.success(),
        "compiling {what} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Directory with the fake `libcuda.so.1` (TEST DOUBLE, tests/fake_cuda/) and a
/// `libcuda.so` link for `-lcuda`.
pub fn fake_libcuda_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("fake_cuda");
        std::fs::create_dir_all(&dir).unwrap();
        let source = workspace_root().join("tests/fake_cuda/fake_libcuda.c");
        let include = workspace_root().join("tests/fake_cuda");
        let lib = dir.join("libcuda.so.1");
        run_cc(
            &[
                "-shared".as_ref(),
                "-fPIC".as_ref(),
                "-O1".as_ref(),
                "-pthread".as_ref(),
                "-I".as_ref(),
                include.as_os_str(),
                "-o".as_ref(),
                lib.as_os_str(),
                source.as_os_str(),
            ],
            "the fake libcuda",
        );
        let link = dir.join("libcuda.so");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("libcuda.so.1", &link).expect("libcuda.so link");
        dir
    })
    .clone()
}

/// How a test program reaches the driver (see tests/c/driver_program.c).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Like a static CUDA runtime: `dlsym(libcuda, "cuGetProcAddress_v2")` + queries.
    GetProcAddress,
    /// Like XLA: `dlsym(libcuda, "cuMemAlloc_v2")`.
    Dlsym,
    /// Linked with `-lcuda`.
    Linked,
}

const C_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/c");

fn warnings() -> [&'static std::ffi::OsStr; 4] {
    [
        "-Wall".as_ref(),
        "-Wextra".as_ref(),
        "-Werror".as_ref(),
        "-g".as_ref(),
    ]
}

/// The driver client built for `reach`.
pub fn driver_program(reach: Reach) -> PathBuf {
    reach_program("driver_program", reach)
}

/// The pinned host memory client (tests/c/pinned_program.c) built for `reach`.
pub fn pinned_program(reach: Reach) -> PathBuf {
    reach_program("pinned_program", reach)
}

/// `tests/c/<program>.c`, a driver client that reaches the driver the way `reach` says,
/// built once per test binary.
fn reach_program(program: &'static str, reach: Reach) -> PathBuf {
    static BUILT: Mutex<BTreeMap<String, PathBuf>> = Mutex::new(BTreeMap::new());
    let (suffix, define) = match reach {
        Reach::GetProcAddress => ("gpa", "-DREACH_GPA"),
        Reach::Dlsym => ("dlsym", "-DREACH_DLSYM"),
        Reach::Linked => ("linked", "-DREACH_LINKED"),
    };
    let name = format!("{program}_{suffix}");
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = built.get(&name) {
        return p.clone();
    }
    let exe = scratch().join(&name);
    let source = Path::new(C_DIR).join(format!("{program}.c"));
    let include_api = workspace_root().join("include");
    let include_fake = workspace_root().join("tests/fake_cuda");
    let fake = fake_libcuda_dir();
    let mut args: Vec<&std::ffi::OsStr> = warnings().to_vec();
    args.extend([
        define.as_ref(),
        "-I".as_ref(),
        include_api.as_os_str(),
        "-I".as_ref(),
        include_fake.as_os_str(),
        "-o".as_ref(),
        exe.as_os_str(),
        source.as_os_str(),
        "-ldl".as_ref(),
        "-lpthread".as_ref(),
    ]);
    let lib_dir = format!("-L{}", fake.display());
    if reach == Reach::Linked {
        args.push(lib_dir.as_ref());
        args.push("-lcuda".as_ref());
    }
    run_cc(&args, &name);
    built.insert(name, exe.clone());
    exe
}

/// `rtld_next_program` linked with `libnext.so` (tests/c/libnext.c).
pub fn rtld_next_program() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = scratch().join("rtld_next");
            std::fs::create_dir_all(&dir).unwrap();
            let lib = dir.join("libnext.so");
            let lib_src = Path::new(C_DIR).join("libnext.c");
            let mut args = warnings().to_vec();
            args.extend([
                "-shared".as_ref(),
                "-fPIC".as_ref(),
                "-o".as_ref(),
                lib.as_os_str(),
                lib_src.as_os_str(),
                "-ldl".as_ref(),
            ]);
            run_cc(&args, "libnext.so");
            let exe = dir.join("rtld_next_program");
            let src = Path::new(C_DIR).join("rtld_next_program.c");
            let l = format!("-L{}", dir.display());
            let rpath = format!("-Wl,-rpath,{}", dir.display());
            let mut args = warnings().to_vec();
            args.extend([
                "-o".as_ref(),
                exe.as_os_str(),
                src.as_os_str(),
                l.as_ref(),
                rpath.as_ref(),
                "-lnext".as_ref(),
                "-ldl".as_ref(),
            ]);
            run_cc(&args, "rtld_next_program");
            exe
        })
        .clone()
}

/// `api_program` linked with `libcupool.so` only.
pub fn api_program() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = scratch().join("api_program");
            let src = Path::new(C_DIR).join("api_program.c");
            let include_api = workspace_root().join("include");
            let dir = cupool_library_dir();
            let l = format!("-L{}", dir.display());
            let rpath = format!("-Wl,-rpath,{}", dir.display());
            let mut args = warnings().to_vec();
            args.extend([
                "-I".as_ref(),
                include_api.as_os_str(),
                "-o".as_ref(),
                exe.as_os_str(),
                src.as_os_str(),
                l.as_ref(),
                rpath.as_ref(),
                "-lcupool".as_ref(),
            ]);
            run_cc(&args, "api_program");
            exe
        })
        .clone()
}

/// Runs `program args` with the fake driver on `LD_LIBRARY_PATH`, preloaded or not, with a
/// clean cupool environment plus `env`.
pub fn run(program: &Path, args: &[&str], preload: bool, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("LD_LIBRARY_PATH", fake_libcuda_dir())
        .env_remove("LD_PRELOAD")
        .env_remove("CUPOOL_CONF")
        .env_remove("CUPOOL_LOG")
        .env_remove("CUPOOL_STATS_AT_EXIT")
        .env_remove("CUPOOL_TRACE")
        .env_remove("FAKE_CUDA_LOG")
        .env_remove("FAKE_CUDA_TOTAL_BYTES");
    if preload {
        cmd.env("LD_PRELOAD", preload_library());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the test program")
}

/// Like [`run`], and asserts a clean exit; returns the `key=value` lines of stdout.
pub fn run_ok(program: &Path, args: &[&str], preload: bool, env: &[(&str, &str)]) -> Results {
    let out = run(program, args, preload, env);
    assert!(
        out.status.success(),
        "{} {args:?} (preload: {preload}) failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Results::parse(&String::from_utf8_lossy(&out.stdout))
}

/// A fresh path `name` in the scratch directory, for the fake driver's call log
/// (`FAKE_CUDA_LOG`): whatever an earlier run left there is gone.
pub fn fresh_log(name: &str) -> PathBuf {
    let log = scratch().join(name);
    let _ = std::fs::remove_file(&log);
    log
}

/// [`run_ok`] with `env` and the fake driver logging its calls to a fresh file `name` of
/// the scratch directory: the program's results and the log.
pub fn run_ok_logging_calls(
    program: &Path,
    args: &[&str],
    preload: bool,
    name: &str,
    env: &[(&str, &str)],
) -> (Results, String) {
    let log = fresh_log(name);
    let mut with_log = vec![("FAKE_CUDA_LOG", log.to_str().unwrap())];
    with_log.extend_from_slice(env);
    let out = run_ok(program, args, preload, &with_log);
    let logged = std::fs::read_to_string(&log).expect("the fake wrote its log");
    (out, logged)
}

/// [`run_ok_logging_calls`] without more environment: the program's results, and how many
/// calls of each name the log holds.
pub fn run_ok_counting_calls(
    program: &Path,
    args: &[&str],
    preload: bool,
    name: &str,
) -> (Results, impl Fn(&str) -> usize) {
    let (out, logged) = run_ok_logging_calls(program, args, preload, name, &[]);
    let count = move |call: &str| logged.lines().filter(|l| l.starts_with(call)).count();
    (out, count)
}

/// The calls a fake driver's log holds after the last one starting with `marker` (a call
/// the program makes on purpose, last before what the test watches).
pub fn calls_after_last<'a>(logged: &'a str, marker: &str) -> Vec<&'a str> {
    let lines: Vec<&str> = logged.lines().collect();
    let at = lines
        .iter()
        .rposition(|l| l.starts_with(marker))
        .expect("marker call in the log");
    lines[at + 1..].to_vec()
}

/// `key=value` lines of a program's output, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Results(pub Vec<(String, String)>);

impl Results {
    pub fn parse(text: &str) -> Results {
        Results(
            text.lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// The value of `key` (the last one when repeated); panics when absent.
    pub fn get(&self, key: &str) -> &str {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {key} in {:#?}", self.0))
    }

    pub fn num(&self, key: &str) -> u64 {
        self.get(key)
            .parse()
            .unwrap_or_else(|_| panic!("{key}={} is not a number", self.get(key)))
    }

    /// The lines whose key does not start with any of `prefixes`.
    pub fn without(&self, prefixes: &[&str]) -> Results {
        Results(
            self.0
                .iter()
                .filter(|(k, _)| !prefixes.iter().any(|p| k.starts_with(p)))
                .cloned()
                .collect(),
        )
    }
}
