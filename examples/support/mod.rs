//! What the timing examples share: the median of their rounds, and their list of numbers
//! from the command line. Each example uses part of it (`mod support;`); a folder without a
//! `main.rs`, so Cargo does not take it for an example of its own.
#![allow(dead_code)]

/// The median of a round's figures (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The numbers given on the command line, `default` when none; a word that is not a number
/// ends the program with status 2 and "`program`: `what` are numbers (the error)".
pub fn numbers_or(program: &str, what: &str, default: &[usize]) -> Vec<usize> {
    match std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(v) if !v.is_empty() => v,
        Ok(_) => default.to_vec(),
        Err(e) => {
            eprintln!("{program}: {what} are numbers ({e})");
            std::process::exit(2);
        }
    }
}
