//! Generates the C header from the `extern "C"` API.
//!
//! The header is written to `$OUT_DIR/cupool.h` on every build; `include/cupool.h`, the
//! committed copy, is only rewritten when `CUPOOL_UPDATE_HEADER=1` (a build never edits the
//! source tree on its own). `tests/header_fresh.rs` fails when the two differ.

use std::env;
use std::path::{Path, PathBuf};

/// The files that declare everything the header shows: the exports, the status enum and
/// the stats struct. Parsing only these (not the whole crate) keeps unrelated `pub const`s
/// of the pool out of the public header.
const HEADER_SOURCES: [&str; 11] = [
    "src/ffi.rs",
    "src/ffi/capture.rs",
    "src/ffi/cupy.rs",
    "src/ffi/cupy_objects.rs",
    "src/ffi/device.rs",
    "src/ffi/ipc.rs",
    "src/ffi/pinned.rs",
    "src/ffi/torch.rs",
    "src/status.rs",
    "src/stats.rs",
    "src/stats/pinned.rs",
];

fn main() {
    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let config_path = manifest_dir.join("cbindgen.toml");

    println!("cargo:rerun-if-changed=build.rs");
    set_versioned_soname(&out_dir);
    println!("cargo:rerun-if-changed={}", config_path.display());
    println!("cargo:rerun-if-env-changed=CUPOOL_UPDATE_HEADER");
    for source in HEADER_SOURCES {
        println!(
            "cargo:rerun-if-changed={}",
            manifest_dir.join(source).display()
        );
    }

    let config = cbindgen::Config::from_file(&config_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", config_path.display()));
    let mut builder = cbindgen::Builder::new().with_config(config);
    for source in HEADER_SOURCES {
        builder = builder.with_src(manifest_dir.join(source));
    }
    let bindings = builder
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen could not generate the header: {e}"));

    let generated = out_dir.join("cupool.h");
    bindings.write_to_file(&generated);
    println!(
        "cargo:rustc-env=CUPOOL_GENERATED_HEADER={}",
        generated.display()
    );

    let committed = manifest_dir.join("include").join("cupool.h");
    // Re-run when the committed copy is edited by hand, so the update below restores it.
    println!("cargo:rerun-if-changed={}", committed.display());
    if env::var("CUPOOL_UPDATE_HEADER").as_deref() == Ok("1") {
        let fresh = std::fs::read(&generated).expect("the header was just written");
        // Writing an identical file would only change its mtime and re-run this script.
        if std::fs::read(&committed).ok().as_deref() != Some(fresh.as_slice()) {
            std::fs::create_dir_all(committed.parent().expect("include/ has a parent"))
                .expect("cannot create include/");
            std::fs::write(&committed, fresh)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", committed.display()));
        }
    }
}

/// Gives `libcupool.so` the versioned soname `libcupool.so.<major>` (ELF targets), so that
/// programs linked against it record `libcupool.so.<major>` and keep working across
/// compatible upgrades of an installed library (scripts/install lays out the usual links).
///
/// A program linked against the build tree's `target/<profile>/libcupool.so` then looks for
/// `libcupool.so.<major>` at run time, so the same link is made next to cargo's output (in
/// `target/<profile>` and its `deps/`): the README's link line, the C tests and
/// scripts/example keep working unchanged. libcupool_preload.so keeps no soname (it is
/// loaded by path).
fn set_versioned_soname(out_dir: &Path) {
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let is_elf = env::var("CARGO_CFG_TARGET_FAMILY").as_deref() == Ok("unix")
        && !matches!(
            target_os.as_str(),
            "macos" | "ios" | "tvos" | "watchos" | "visionos"
        );
    if !is_elf {
        return;
    }
    let major = env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets CARGO_PKG_VERSION_MAJOR");
    let soname = format!("libcupool.so.{major}");
    // `rustc-link-arg`, not `rustc-cdylib-link-arg`: cargo passes cdylib link arguments on
    // to the cdylibs of dependent packages too (rust-lang/cargo#9562), which would give
    // libcupool_preload.so this soname, and a process that links libcupool.so.0 and also
    // preloads it would then take the preload for libcupool.so.0. This one stays in this
    // package; its test and example executables get the soname too, which nothing reads.
    println!("cargo:rustc-link-arg=-Wl,-soname,{soname}");
    link_soname_in_build_tree(out_dir, &soname);
}

/// Makes `<profile dir>/<soname>` and `<profile dir>/deps/<soname>` relative links to
/// `libcupool.so`. Cargo gives build scripts no path to the profile directory; `OUT_DIR`
/// is `<profile dir>/build/cupool-<hash>/out`, and when it is not (another layout, such as
/// a separate build directory), nothing is made. A link already there is kept; a link made
/// before the library exists dangles until cargo writes it, moments later.
fn link_soname_in_build_tree(out_dir: &Path, soname: &str) {
    #[cfg(unix)]
    {
        let package_dir = out_dir.parent().filter(|d| {
            d.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("cupool-"))
        });
        let Some(profile_dir) = package_dir
            .and_then(Path::parent)
            .filter(|build| build.file_name().is_some_and(|n| n == "build"))
            .and_then(Path::parent)
        else {
            return;
        };
        for dir in [profile_dir.to_path_buf(), profile_dir.join("deps")] {
            let link = dir.join(soname);
            if dir.is_dir() && std::fs::symlink_metadata(&link).is_err() {
                // Best effort: another build racing to make the same link is fine.
                let _ = std::os::unix::fs::symlink("libcupool.so", &link);
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (out_dir, soname);
}
