//! `--conf KEY:VALUE,...`: checked against the library's option table before anything
//! starts, so a typo stops the command with one clear line instead of a warning.

use cupool::config::{self, OPTIONS};

/// The entries of every `--conf` argument, in order, each checked.
pub fn entries(args: &[String]) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for entry in args
        .iter()
        .flat_map(|a| a.split(','))
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let Some((key, value)) = entry.split_once(':').or_else(|| entry.split_once('=')) else {
            return Err(format!("--conf: '{entry}' is not KEY:VALUE"));
        };
        let (key, value) = (key.trim(), value.trim());
        let Some(option) = OPTIONS.iter().find(|o| o.key == key) else {
            let known: Vec<&str> = OPTIONS.iter().map(|o| o.key).collect();
            return Err(format!(
                "--conf: unknown key '{key}' (known keys: {})",
                known.join(", ")
            ));
        };
        if config::parse(option.kind, value).is_none() {
            return Err(format!(
                "--conf: bad value '{value}' for {key} (expected {})",
                config::describe(option.kind)
            ));
        }
        out.push((key.to_string(), value.to_string()));
    }
    Ok(out)
}

/// Sets each entry in this process's configuration (before the pool starts).
pub fn apply(entries: &[(String, String)]) -> Result<(), String> {
    for (key, value) in entries {
        config::set(key, value)
            .map_err(|e| format!("--conf: cannot set {key} to '{value}': {}", e.as_str()))?;
    }
    Ok(())
}

/// `key:value,...` for CUPOOL_CONF.
pub fn to_conf_string(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",")
}
