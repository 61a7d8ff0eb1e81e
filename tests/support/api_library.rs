//! Builds `libcupool.so` and `libcupool.a` for tests that link or inspect them (`cargo test`
//! builds only the rlib for integration tests), into this test binary's own target dir and
//! profile.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `target/<profile>` of this test binary, after `cargo build --lib -p cupool` has put the
/// shared and static libraries there (built once per test process).
pub fn profile_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary is in <target>/<profile>/deps")
            .to_path_buf();
        let target_dir = profile_dir.parent().expect("profile dir has a parent");
        let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--lib", "-p", "cupool", "--target-dir"])
            .arg(target_dir);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => {}
            Some("release") => {
                build.arg("--release");
            }
            Some(other) => {
                build.args(["--profile", other]);
            }
        }
        assert!(
            build.status().expect("run cargo build").success(),
            "cargo build --lib -p cupool failed"
        );
        for lib in ["libcupool.so", "libcupool.a"] {
            assert!(
                profile_dir.join(lib).exists(),
                "{lib} missing in {}",
                profile_dir.display()
            );
        }
        profile_dir
    })
}
