//! What the C API libraries must export, read from the sources, and what they do export,
//! read with `nm` and `readelf`. Shared by tests/exported_symbols.rs (libcupool.so) and
//! preload/tests/exported_symbols.rs (libcupool_preload.so) through `#[path]`.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The one export that is not in the header: the table through which the copies of cupool
/// in a process find the one that owns the pool (src/ffi/process_api.rs).
pub const PROCESS_API_SYMBOL: &str = "cupool_process_api_v1";

/// `include/cupool.h` of this workspace.
pub fn header_path() -> PathBuf {
    let mut dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The preload package lives one level down; the header is at the workspace root.
    while !dir.join("include/cupool.h").exists() {
        dir = dir
            .parent()
            .expect("include/cupool.h above CARGO_MANIFEST_DIR");
    }
    dir.join("include/cupool.h")
}

/// Names of the functions `header` declares: every `cupool_*` identifier followed by `(`
/// once comments are removed (the header has no macros or function pointers of that form),
/// so a function added to the API is expected without editing any test.
pub fn header_functions(header: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(header)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", header.display()));
    let code = strip_c_comments(&text);
    let bytes = code.as_bytes();
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut functions = BTreeSet::new();
    let mut at = 0;
    while let Some(found) = code[at..].find("cupool_") {
        let start = at + found;
        let mut end = start;
        while end < bytes.len() && is_ident(bytes[end]) {
            end += 1;
        }
        let after = code[end..].trim_start();
        if (start == 0 || !is_ident(bytes[start - 1])) && after.starts_with('(') {
            functions.insert(code[start..end].to_string());
        }
        at = end;
    }
    assert!(
        !functions.is_empty(),
        "no function declarations found in {}",
        header.display()
    );
    functions
}

/// `text` with `/* */` and `//` comments replaced by a space.
fn strip_c_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                out.push(' ');
                let close = rest[b + 2..]
                    .find("*/")
                    .map_or(rest.len(), |c| b + 2 + c + 2);
                rest = &rest[close..];
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                out.push(' ');
                rest = rest[l..].find('\n').map_or("", |n| &rest[l + n..]);
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// A symbol a library defines and exports.
#[derive(Debug)]
pub struct Export {
    pub name: String,
    /// `nm`'s type letter: `T` for a function in the text section.
    pub kind: char,
}

/// The dynamic symbols `library` defines (`nm -D --defined-only`), symbol versions dropped.
pub fn dynamic_exports(library: &Path) -> Vec<Export> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(library)
        .output()
        .unwrap_or_else(|e| panic!("cannot run nm (binutils) on {}: {e}", library.display()));
    assert!(
        out.status.success(),
        "nm -D {} failed: {}",
        library.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // "<address> <type> <name>[@version]"
            let mut fields = line.split_whitespace();
            let kind = fields.nth(1)?.chars().next()?;
            let name = fields.next()?.split('@').next()?.to_string();
            Some(Export { name, kind })
        })
        .collect()
}

/// The `DT_SONAME` of `library`, if it has one.
pub fn soname(library: &Path) -> Option<String> {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(library)
        .output()
        .unwrap_or_else(|e| panic!("cannot run readelf on {}: {e}", library.display()));
    assert!(
        out.status.success(),
        "readelf -d {} failed",
        library.display()
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains("(SONAME)"))
        .and_then(|l| Some(l[l.find('[')? + 1..l.rfind(']')?].to_string()))
}

/// Compares exports with the expected set; one message listing what is extra and missing.
pub fn assert_exports_exactly(library: &Path, expected: &BTreeSet<String>, why: &str) {
    let exports = dynamic_exports(library);
    let exported: BTreeSet<String> = exports.iter().map(|e| e.name.clone()).collect();
    let extra: Vec<&String> = exported.difference(expected).collect();
    let missing: Vec<&String> = expected.difference(&exported).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "{} exports differ from {why}\n  exported but not expected: {extra:?}\n  expected but not exported: {missing:?}",
        library.display()
    );
    let not_functions: Vec<&Export> = exports
        .iter()
        .filter(|e| !matches!(e.kind, 'T' | 't'))
        .collect();
    assert!(
        not_functions.is_empty(),
        "{} exports symbols that are not functions: {not_functions:?}",
        library.display()
    );
}
