//! `libcupool.so` exports the C API and nothing else: every function `include/cupool.h`
//! declares (read from the header, so a new API function is expected at once) plus the
//! process handshake `cupool_process_api_v1`; no Rust symbol, no dependency's symbol. It
//! carries the versioned soname `libcupool.so.<major>`, and `libcupool.a` defines the same
//! API. (libcupool_preload.so: preload/tests/exported_symbols.rs.)

#[path = "support/api_library.rs"]
mod api_library;
#[path = "support/api_symbols.rs"]
mod api_symbols;

use std::collections::BTreeSet;
use std::process::Command;

use api_library::profile_dir;
use api_symbols::{assert_exports_exactly, header_functions, header_path, soname};

fn expected_api() -> BTreeSet<String> {
    let mut expected = header_functions(&header_path());
    expected.insert(api_symbols::PROCESS_API_SYMBOL.to_string());
    expected
}

#[test]
fn shared_library_exports_only_the_c_api() {
    assert_exports_exactly(
        &profile_dir().join("libcupool.so"),
        &expected_api(),
        "the functions of include/cupool.h plus cupool_process_api_v1",
    );
}

#[test]
fn shared_library_has_the_versioned_soname_and_its_link() {
    let library = profile_dir().join("libcupool.so");
    let want = format!("libcupool.so.{}", env!("CARGO_PKG_VERSION_MAJOR"));
    assert_eq!(
        soname(&library).as_deref(),
        Some(want.as_str()),
        "soname of {} (build.rs sets it)",
        library.display()
    );
    // Programs linked against the build tree look for the soname at run time: build.rs
    // links it to libcupool.so next to cargo's output.
    let link = profile_dir().join(&want);
    let resolved = std::fs::canonicalize(&link)
        .unwrap_or_else(|e| panic!("{} does not resolve: {e}", link.display()));
    assert_eq!(
        resolved,
        std::fs::canonicalize(&library).expect("libcupool.so exists"),
        "{} must lead to libcupool.so",
        link.display()
    );
}

#[test]
fn static_library_defines_the_whole_c_api() {
    let archive = profile_dir().join("libcupool.a");
    // readelf, not nm: where a linker plugin is installed (Debian's llvm-*-linker-tools put
    // one in /usr/lib/bfd-plugins), nm hands the archive's objects to it because they carry
    // embedded bitcode, and an older LLVM than rustc's then lists no symbols at all.
    let out = Command::new("readelf")
        .args(["--syms", "--wide"])
        .arg(&archive)
        .output()
        .expect("run readelf");
    assert!(out.status.success(), "readelf {} failed", archive.display());
    // A static archive holds Rust's symbols too (no linker has hidden them yet), so only
    // the cupool_ functions are compared. Columns: Num, Value, Size, Type, Bind, Vis, Ndx,
    // Name.
    let defined: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let [_, _, _, kind, bind, _, section, name] = fields[..] else {
                return None;
            };
            let defined_function = kind == "FUNC" && bind == "GLOBAL" && section != "UND";
            (defined_function && name.starts_with("cupool_")).then(|| name.to_string())
        })
        .collect();
    assert_eq!(
        defined,
        expected_api(),
        "cupool_ functions of {}",
        archive.display()
    );
}
