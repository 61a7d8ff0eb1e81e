//! The interposer's modules import each other without cycles, but for the one edge that
//! has to stay: `cuGetProcAddress` answers with hooks from the slot table, and the table
//! lists its own hook (`table` ↔ `proc_address`, written down in `table.rs`). A module that
//! needs something done at exit registers it with `lifecycle::at_exit` instead of being
//! imported by `lifecycle`, and the re-entry guard lives in `guard`, beside the panic guard.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module → the crate modules its source names (`crate::x`), from `src/*.rs` and
/// `src/*/*.rs` (a submodule counts as its top module).
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(src).expect("preload/src") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            for sub in std::fs::read_dir(&path).expect("a module directory") {
                files.push(sub.expect("a directory entry").path());
            }
        } else {
            files.push(path);
        }
    }
    for path in files
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
    {
        let rel = path.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a name");
        let module = Path::new(first.as_os_str())
            .file_stem()
            .expect("a file name")
            .to_string_lossy()
            .into_owned();
        // Code only: a comment naming a module is no import.
        let text: String = std::fs::read_to_string(path)
            .expect("a source file")
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let deps = graph.entry(module.clone()).or_default();
        for (at, _) in text.match_indices("crate::") {
            let name: String = text[at + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                deps.insert(name);
            }
        }
    }
    graph
}

/// A cycle through `from`, as the path of modules, if any.
fn cycle_from(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    fn walk(
        graph: &BTreeMap<String, BTreeSet<String>>,
        target: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in graph.get(at).into_iter().flatten() {
            if next == target {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(graph, target, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![from.to_string()];
    walk(graph, from, from, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn hook_modules_import_each_other_without_cycles_but_the_one_written_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = imports(&src);
    assert!(
        graph["proc_address"].contains("table") && graph["table"].contains("proc_address"),
        "the known edge moved: update this test and table.rs's note"
    );
    graph
        .get_mut("proc_address")
        .expect("proc_address.rs")
        .remove("table");
    let cycles: Vec<Vec<String>> = graph.keys().filter_map(|m| cycle_from(&graph, m)).collect();
    assert!(cycles.is_empty(), "import cycles: {cycles:?}");
}
