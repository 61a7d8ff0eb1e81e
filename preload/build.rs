//! Links the unwinder into the preload library instead of depending on `libgcc_s.so.1`.
//!
//! Every process that inherits `LD_PRELOAD` loads this library, CUDA or not (shells,
//! launchers, build tools). Rust's standard library names `-lgcc_s` for unwinding, and
//! loading libgcc_s costs a process more than the rest of the preload together: on the
//! development machine (a VM) /bin/true took 0.13 ms more with an empty preloaded library
//! that needs libgcc_s, most of it in libgcc_s's constructor (`__cpu_indicator_init`, whose
//! `cpuid` instructions trap to the hypervisor). The unwinder itself is in `libgcc_eh.a`,
//! the static part of libgcc: a linker script named `libgcc_s.so`, found first on the
//! search path, turns `-lgcc_s` into it. Its symbols stay inside the library (the export
//! list is cupool's C API and the hooks), so the program's own unwinder is untouched, and
//! panics are still caught at every hook (they never cross the C boundary).
//!
//! Skipped, with the usual dynamic libgcc_s, when the C compiler has no `libgcc_eh.a`,
//! off glibc, or with `CUPOOL_PRELOAD_DYNAMIC_LIBGCC=1`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CUPOOL_PRELOAD_DYNAMIC_LIBGCC");
    println!("cargo:rerun-if-changed=build.rs");
    let linux_gnu = env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    if !linux_gnu || env::var("CUPOOL_PRELOAD_DYNAMIC_LIBGCC").as_deref() == Ok("1") {
        return;
    }
    let cc = env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let found = Command::new(&cc)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| PathBuf::from(s.trim()))
        .filter(|p| p.is_absolute() && p.is_file());
    let Some(gcc_eh) = found else {
        println!(
            "cargo:warning=libgcc_eh.a not found: the preload library will need libgcc_s.so.1"
        );
        return;
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dir = out.join("static-libgcc");
    std::fs::create_dir_all(&dir).expect("create the linker script's folder");
    std::fs::write(
        dir.join("libgcc_s.so"),
        format!("INPUT({})\n", gcc_eh.display()),
    )
    .expect("write the linker script");
    println!("cargo:rustc-link-search=native={}", dir.display());
}
