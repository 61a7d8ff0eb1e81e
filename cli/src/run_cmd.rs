//! `cupool run`: runs a program under libcupool_preload.so, or, with `--torch` / `--cupy`,
//! with the Python package's start-up hook putting PyTorch or CuPy on the pool.

use crate::{conf, RunArgs};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const PRELOAD_NAME: &str = "libcupool_preload.so";

/// The places the preload library is looked for, in order: `$CUPOOL_PRELOAD`, next to the
/// `cupool` binary, `../lib/` relative to it (an install prefix's `bin/` and `lib/`).
fn candidates(env_value: Option<OsString>, exe: Option<&Path>) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    if let Some(v) = env_value.filter(|v| !v.is_empty()) {
        out.push(("$CUPOOL_PRELOAD".to_string(), PathBuf::from(v)));
    }
    if let Some(dir) = exe.and_then(Path::parent) {
        out.push(("next to cupool".to_string(), dir.join(PRELOAD_NAME)));
        out.push((
            "../lib of cupool".to_string(),
            dir.join("..").join("lib").join(PRELOAD_NAME),
        ));
    }
    out
}

fn find_preload() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().ok();
    let places = candidates(std::env::var_os("CUPOOL_PRELOAD"), exe.as_deref());
    if let Some((_, path)) = places.iter().find(|(_, p)| p.is_file()) {
        // Absolute, so the program finds it whatever directory it changes to.
        return Ok(std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()));
    }
    let looked: Vec<String> = places
        .iter()
        .map(|(what, p)| format!("{} ({what})", p.display()))
        .collect();
    let env_note = if std::env::var_os("CUPOOL_PRELOAD").is_none() {
        "; CUPOOL_PRELOAD is not set"
    } else {
        ""
    };
    Err(format!(
        "{PRELOAD_NAME} not found; looked in: {}{env_note} (build it with `cargo build --release -p cupool_preload`, or set CUPOOL_PRELOAD to its path)",
        looked.join(", ")
    ))
}

/// `preload` first, then what LD_PRELOAD held already.
fn ld_preload(preload: &Path, existing: Option<OsString>) -> OsString {
    let mut value = OsString::from(preload.as_os_str());
    if let Some(existing) = existing.filter(|e| !e.is_empty()) {
        value.push(":");
        value.push(existing);
    }
    value
}

/// The program's CUPOOL_CONF: the one it would have had, then the `--conf` entries (which
/// win: later entries override earlier ones).
fn merged_conf(existing: Option<OsString>, added: &str) -> OsString {
    match existing.filter(|e| !e.is_empty()) {
        Some(mut e) if !added.is_empty() => {
            e.push(",");
            e.push(added);
            e
        }
        Some(e) => e,
        None => OsString::from(added),
    }
}

pub fn execute(args: &RunArgs) -> Result<(), String> {
    let entries = conf::entries(&args.conf)?;
    let (program, program_args) = args
        .program
        .split_first()
        .ok_or("no program to run (cupool run -- PROGRAM ARGS...)")?;
    let mut cmd = Command::new(program);
    cmd.args(program_args);
    if args.torch || args.cupy {
        // The framework allocates through the Python package's hooks (its start-up file
        // reads these); the interposer would see nothing the package does not.
        if args.torch {
            cmd.env("CUPOOL_TORCH", "1");
        }
        if args.cupy {
            cmd.env("CUPOOL_CUPY", "1");
        }
    } else {
        let preload = find_preload()?;
        cmd.env(
            "LD_PRELOAD",
            ld_preload(&preload, std::env::var_os("LD_PRELOAD")),
        );
    }
    if args.stats {
        cmd.env("CUPOOL_STATS_AT_EXIT", "1");
    }
    if let Some(trace) = &args.trace {
        cmd.env("CUPOOL_TRACE", trace);
    }
    if !entries.is_empty() {
        let added = conf::to_conf_string(&entries);
        cmd.env(
            "CUPOOL_CONF",
            merged_conf(std::env::var_os("CUPOOL_CONF"), &added),
        );
    }
    // Only returns when the program could not be started.
    let e = cmd.exec();
    Err(format!("cannot run {}: {e}", Path::new(program).display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_comes_first_then_the_binary_s_directory() {
        let places = candidates(Some("/opt/x.so".into()), Some(Path::new("/usr/bin/cupool")));
        let paths: Vec<_> = places.iter().map(|(_, p)| p.clone()).collect();
        assert_eq!(
            paths,
            [
                PathBuf::from("/opt/x.so"),
                PathBuf::from("/usr/bin/libcupool_preload.so"),
                PathBuf::from("/usr/bin/../lib/libcupool_preload.so"),
            ]
        );
        assert_eq!(candidates(Some("".into()), None), []);
    }

    #[test]
    fn ld_preload_is_prepended() {
        let p = Path::new("/a/libcupool_preload.so");
        assert_eq!(ld_preload(p, None), "/a/libcupool_preload.so");
        assert_eq!(
            ld_preload(p, Some("libasan.so".into())),
            "/a/libcupool_preload.so:libasan.so"
        );
    }

    #[test]
    fn conf_entries_go_after_the_existing_ones() {
        assert_eq!(merged_conf(None, "a:1"), "a:1");
        assert_eq!(merged_conf(Some("b:2".into()), "a:1"), "b:2,a:1");
        assert_eq!(merged_conf(Some("b:2".into()), ""), "b:2");
    }
}
