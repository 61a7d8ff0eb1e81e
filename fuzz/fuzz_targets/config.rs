//! The configuration parser: any text as `CUPOOL_CONF` (`key:value,...`), and every value
//! parser on its own. Bad entries are reported and skipped; nothing panics, and a value a
//! parser accepts reads back through `cupool_config_get`'s formatting.
#![no_main]

use cupool::config::{self, ValueKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for kind in [ValueKind::Bool, ValueKind::Bytes, ValueKind::Count] {
        let _ = config::parse(kind, text);
    }
    let _ = config::ReserveSpec::parse(text);
    let _ = config::parse_bytes(text);
    // The backend stays the host's: a fuzzed `backend:cuda` would only make later inputs
    // look for a driver.
    let filtered: String = text
        .split(',')
        .filter(|e| !e.trim_start().starts_with("backend"))
        .collect::<Vec<_>>()
        .join(",");
    config::apply_string(&filtered, "fuzz");
    let _ = config::describe_all();
});
