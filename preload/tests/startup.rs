//! Processes that never touch CUDA but inherit `LD_PRELOAD` (shells, launchers, build
//! tools): 1000 of them start and exit cleanly under the preload, and the library needs no
//! libgcc_s (preload/build.rs: its load is most of what a process pays for the preload).
//! The time per process is measured by `benches/c/preload_startup.c`, not here.

mod support;

use std::process::Command;

#[test]
fn a_thousand_processes_start_and_exit_under_the_preload() {
    let lib = support::preload_library();
    for i in 0..1000 {
        let status = Command::new("/bin/true")
            .env("LD_PRELOAD", &lib)
            .status()
            .expect("spawn /bin/true");
        assert!(status.success(), "process {i} under the preload: {status}");
    }
}

#[test]
fn the_preload_library_does_not_need_libgcc_s() {
    let lib = support::preload_library();
    let out = Command::new("readelf")
        .arg("-d")
        .arg(&lib)
        .output()
        .expect("run readelf");
    assert!(out.status.success());
    let dynamic = String::from_utf8_lossy(&out.stdout);
    assert!(dynamic.contains("(NEEDED)"), "{dynamic}");
    assert!(
        !dynamic.contains("libgcc_s"),
        "{} needs libgcc_s:\n{dynamic}",
        lib.display()
    );
}
