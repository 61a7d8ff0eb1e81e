//! The `cupool` command: replays allocation traces through the pool (`cupool replay`) and
//! runs programs under the LD_PRELOAD library (`cupool run`).
//!
//! It uses the crate's Rust API, never the C ABI. Every error is one line on stderr that
//! starts with `cupool:`, and the exit status is 1.

mod conf;
mod plot;
mod replay_cmd;
mod run_cmd;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "cupool",
    version,
    about = "Replay allocation traces through cupool, and run programs under it",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Replay(ReplayArgs),
    Run(RunArgs),
}

/// Replays a trace through the pool and reports its footprint.
///
/// TRACE is RMM's log CSV (as RMM or CUPOOL_TRACE writes it) or a PyTorch memory snapshot
/// pickle, plain, gzip or zstd. Events replay in trace order on one thread: each stream of
/// the trace gets a stream of its own, streamless calls stay streamless. The report gives
/// peak requested, allocated and reserved bytes, utilization (peak allocated / peak
/// reserved), driver allocations and frees, fences and their queries, OOMs and time per
/// call. On the host backend (the default) a replay is deterministic and needs no GPU.
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct ReplayArgs {
    /// The trace file.
    pub trace: PathBuf,
    /// Where memory comes from: `host` (host memory, simulated streams) or `cuda` (the GPU).
    #[arg(long, value_parser = ["host", "cuda"], default_value = "host")]
    pub backend: String,
    /// Pool options, as in CUPOOL_CONF (e.g. `memory_limit:16G,fence_batch:32`); applied
    /// after CUPOOL_CONF.
    #[arg(long, value_name = "KEY:VALUE,...")]
    pub conf: Vec<String>,
    /// Simulated memory of the host device (default 1T, so that only `memory_limit` limits
    /// a replay). Host backend only.
    #[arg(long, value_name = "BYTES")]
    pub capacity: Option<String>,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// With --json: include the sampled series (`[event, requested, allocated, reserved]`
    /// rows).
    #[arg(long, requires = "json")]
    pub series: bool,
    /// Draw requested, allocated and reserved bytes over the trace into a PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Replay only the first N events.
    #[arg(long, value_name = "N")]
    pub max_events: Option<usize>,
    /// Host backend: the simulated GPU runs this many microseconds of trace time behind
    /// the program, so blocks freed without a stream wait that long for their fence (0:
    /// fences complete at once). An H100 ran a training loop 0.36-0.78 ms behind. For a
    /// trace recorded under the preload, add `--conf fence_waits:device`, as the preload
    /// runs.
    #[arg(long, value_name = "MICROSECONDS", default_value_t = 0)]
    pub gpu_lag_us: u64,
    /// Host backend: replay each thread of the trace on a thread of its own, one event at
    /// a time in trace order, so each has its own thread cache as in the traced program.
    #[arg(long)]
    pub per_thread: bool,
}

/// Runs a program with its CUDA allocations served by cupool (under libcupool_preload.so,
/// or for Python programs with --torch / --cupy through the `cupool` package's hooks).
///
/// The library is found, in this order, at $CUPOOL_PRELOAD, next to the cupool binary, or
/// in ../lib/ relative to it (an installed prefix). The program replaces cupool (exec), so
/// its exit status is the program's.
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct RunArgs {
    /// Print the pool's statistics on stderr when the program exits
    /// (CUPOOL_STATS_AT_EXIT=1).
    #[arg(long)]
    pub stats: bool,
    /// Record every allocation and free into FILE (CUPOOL_TRACE; zstd when it ends in .zst).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Pool options, added to CUPOOL_CONF (e.g. `memory_limit:16G`).
    #[arg(long, value_name = "KEY:VALUE,...")]
    pub conf: Vec<String>,
    /// A Python program using PyTorch: put PyTorch's allocator on cupool through its
    /// pluggable allocator (CUPOOL_TORCH=1; needs the `cupool` Python package installed)
    /// instead of preloading the interposer. Every allocation then knows its stream.
    #[arg(long)]
    pub torch: bool,
    /// As --torch, for CuPy (CUPOOL_CUPY=1).
    #[arg(long)]
    pub cupy: bool,
    /// The program and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM ARGS")]
    pub program: Vec<std::ffi::OsString>,
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => exit_for_clap_error(e),
    };
    let result = match cli.command {
        Command::Replay(args) => replay_cmd::execute(&args),
        Command::Run(args) => run_cmd::execute(&args),
    };
    if let Err(message) = result {
        eprintln!("cupool: {message}");
        std::process::exit(1);
    }
}

/// Help and version go out as clap writes them (exit 0); a usage error becomes one line.
fn exit_for_clap_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => e.exit(),
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            std::process::exit(1);
        }
        _ => {
            // clap's message spreads over lines (the missing arguments under the first);
            // its usage and tips are left for --help.
            let text = e.render().to_string();
            let message: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:"))
                .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
                .collect();
            let message = message.join(" ");
            let message = message.trim_start_matches("error: ");
            eprintln!("cupool: {message} (see cupool --help)");
            std::process::exit(1);
        }
    }
}
