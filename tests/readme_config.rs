//! The README's configuration table is generated from `cupool::config::OPTIONS`: this test
//! fails when it is out of date (and rewrites it when `CUPOOL_UPDATE_README=1`).

use cupool::config::OPTIONS;
use std::path::Path;

const BEGIN: &str = "<!-- config-table:begin";
const END: &str = "<!-- config-table:end -->";

fn render_table() -> String {
    let mut table = String::from(
        "| key | default | can change after first use | meaning |\n|---|---|---|---|\n",
    );
    for option in OPTIONS.iter() {
        table.push_str(&format!(
            "| `{}` | `{}` | {} | {} |\n",
            option.key,
            option.default,
            if option.runtime { "yes" } else { "no" },
            option.doc.replace('|', "\\|")
        ));
    }
    table
}

/// The README split around the table: (before including the begin marker line, table, rest).
fn split(readme: &str) -> (&str, &str, &str) {
    let begin = readme
        .find(BEGIN)
        .expect("README has a config-table:begin marker");
    let table_start = begin + readme[begin..].find('\n').expect("marker line ends") + 1;
    let end = readme
        .find(END)
        .expect("README has a config-table:end marker");
    assert!(end >= table_start, "config-table markers out of order");
    (
        &readme[..table_start],
        &readme[table_start..end],
        &readme[end..],
    )
}

fn keys_in_table(table: &str) -> Vec<String> {
    table
        .lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`').map(|(key, _)| key.to_string()))
        .collect()
}

#[test]
fn readme_config_table_matches_options() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).expect("read README.md");
    let (head, table, tail) = split(&readme);
    let expected = render_table();
    if table == expected {
        return;
    }
    if std::env::var("CUPOOL_UPDATE_README").as_deref() == Ok("1") {
        std::fs::write(&path, format!("{head}{expected}{tail}")).expect("write README.md");
        return;
    }
    let listed = keys_in_table(table);
    let unknown: Vec<&String> = listed
        .iter()
        .filter(|k| !OPTIONS.iter().any(|o| o.key == k.as_str()))
        .collect();
    let missing: Vec<String> = OPTIONS
        .iter()
        .filter(|o| !table.contains(&format!("| `{}` | `{}` |", o.key, o.default)))
        .map(|o| format!("{} (default {})", o.key, o.default))
        .collect();
    panic!(
        "README.md's configuration table is out of date.\n  missing or wrong default: {missing:?}\n  \
         unknown keys listed: {unknown:?}\nRegenerate it with:\n    \
         CUPOOL_UPDATE_README=1 cargo test --test readme_config\nand commit README.md."
    );
}

#[test]
fn rendered_table_lists_every_option_once() {
    let table = render_table();
    let keys = keys_in_table(&table);
    assert_eq!(keys.len(), OPTIONS.len());
    for option in OPTIONS.iter() {
        assert_eq!(
            keys.iter().filter(|k| *k == option.key).count(),
            1,
            "{}",
            option.key
        );
    }
}

#[test]
fn readme_conf_examples_use_known_keys() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("read README.md");
    let mut examples = 0;
    for (at, _) in readme.match_indices("CUPOOL_CONF=\"") {
        let rest = &readme[at + "CUPOOL_CONF=\"".len()..];
        let conf = &rest[..rest.find('"').expect("closing quote")];
        for entry in conf.split(',') {
            let (key, value) = entry.split_once(':').expect("key:value");
            let option = OPTIONS
                .iter()
                .find(|o| o.key == key)
                .unwrap_or_else(|| panic!("README example uses unknown key {key}"));
            assert!(!value.is_empty(), "{}: empty value", option.key);
        }
        examples += 1;
    }
    assert!(examples > 0, "README shows no CUPOOL_CONF example");
}
