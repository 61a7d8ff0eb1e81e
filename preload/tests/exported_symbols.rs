//! `libcupool_preload.so` exports exactly its hooks and the cupool C API: the driver entry
//! points of the hook table (`table::HOOKS`, read from the crate itself, so a hook added
//! there is expected at once), `dlsym`, every function of `include/cupool.h` and the
//! process handshake `cupool_process_api_v1`. Anything else exported would interpose on
//! the program it is preloaded into. Its soname must not be the API library's.

mod support;

#[path = "../../tests/support/api_symbols.rs"]
mod api_symbols;

use std::collections::BTreeSet;
use std::ffi::CStr;

use api_symbols::{assert_exports_exactly, header_functions, header_path, soname};
use cupool_preload::slots::Slot;
use cupool_preload::table::HOOKS;

/// The exported name of each hooked driver entry point.
fn hooked_names() -> BTreeSet<String> {
    HOOKS
        .iter()
        .map(|hook| {
            CStr::from_bytes_with_nul(hook.slot.exported_name())
                .expect("exported names are NUL-terminated")
                .to_str()
                .expect("exported names are ASCII")
                .to_string()
        })
        .collect()
}

#[test]
fn exports_are_the_hook_table_dlsym_and_the_cupool_api() {
    let mut expected = hooked_names();
    // The one hook outside the table: it answers dlsym lookups of the hooked names
    // (src/dlsym_hook.rs).
    expected.insert("dlsym".to_string());
    expected.extend(header_functions(&header_path()));
    expected.insert(api_symbols::PROCESS_API_SYMBOL.to_string());
    assert_exports_exactly(
        &support::preload_library(),
        &expected,
        "table::HOOKS, dlsym, the functions of include/cupool.h and cupool_process_api_v1",
    );
}

#[test]
fn unhooked_slots_are_not_exported() {
    // CtxGetCurrent is resolved for the hooks' own use; exporting it would replace the
    // program's cuCtxGetCurrent.
    let hooked = hooked_names();
    let exported: BTreeSet<String> = api_symbols::dynamic_exports(&support::preload_library())
        .into_iter()
        .map(|e| e.name)
        .collect();
    for slot in Slot::ALL {
        let name = CStr::from_bytes_with_nul(slot.exported_name())
            .expect("NUL-terminated")
            .to_str()
            .expect("ASCII");
        assert_eq!(
            exported.contains(name),
            hooked.contains(name),
            "{name}: exported iff the hook table replaces it"
        );
    }
}

#[test]
fn soname_is_not_the_api_library_s() {
    // A process that links libcupool.so.N and preloads this library must load both: the
    // loader would take this one for libcupool.so.N if it carried that soname.
    let library = support::preload_library();
    let name = soname(&library);
    assert!(
        name.as_deref().is_none_or(|n| n == "libcupool_preload.so"),
        "{} has soname {name:?}; expected none or libcupool_preload.so",
        library.display()
    );
}
