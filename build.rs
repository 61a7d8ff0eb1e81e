//! Generates the C header from the `extern "C"` API.
//!
//! The header is written to `$OUT_DIR/cupool.h` on every build; `include/cupool.h`, the
//! committed copy, is only rewritten when `CUPOOL_UPDATE_HEADER=1` (a build never edits the
//! source tree on its own). `tests/header_fresh.rs` fails when the two differ.

use std::env;
use std::path::PathBuf;

/// The files that declare everything the header shows: the exports, the status enum and
/// the stats struct. Parsing only these (not the whole crate) keeps unrelated `pub const`s
/// of the pool out of the public header.
const HEADER_SOURCES: [&str; 3] = ["src/ffi.rs", "src/status.rs", "src/stats.rs"];

fn main() {
    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let config_path = manifest_dir.join("cbindgen.toml");

    println!("cargo:rerun-if-changed=build.rs");
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
