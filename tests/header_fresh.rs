//! The committed header must be exactly what cbindgen generates from the current sources.

use std::path::Path;

#[test]
fn committed_header_matches_generated_one() {
    let generated_path = env!("CUPOOL_GENERATED_HEADER");
    let committed_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/cupool.h");
    let generated = std::fs::read_to_string(generated_path)
        .unwrap_or_else(|e| panic!("cannot read the generated header {generated_path}: {e}"));
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    if committed != generated {
        let first_difference = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "include/cupool.h is stale (first difference at line {}).\n\
             Regenerate it with:\n    CUPOOL_UPDATE_HEADER=1 cargo build\nand commit the result.",
            first_difference + 1
        );
    }
}
