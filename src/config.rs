//! Configuration: one table of option descriptors, read once from `CUPOOL_CONF` and
//! settable at run time with `cupool_config_set`.
//!
//! `CUPOOL_CONF="key:value,key:value"`. An unknown key or a bad value prints one clear
//! line on stderr and keeps the default, so a typo never stops a program. Values are kept
//! in atomics: the pool reads them with relaxed loads, and a change takes effect on the
//! next operation that looks at it. The README's table is checked against [`OPTIONS`] by a
//! test.

use crate::status::{CupoolStatus, Result};
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// How a value is written and parsed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// `true`/`false`/`1`/`0`/`yes`/`no`/`on`/`off`.
    Bool,
    /// Bytes, with an optional `K`, `M`, `G` or `T` suffix (powers of 1024), or `KiB` etc.
    Bytes,
    /// A plain non-negative integer.
    Count,
    /// One of a fixed set of words.
    Choice(&'static [&'static str]),
    /// `reserve`: bytes, or a fraction of the free memory (`0.9`), optionally for one
    /// device only (`1=8G`). Kept as a [`ReserveSpec`] packed in the option's `u64`.
    Reserve,
}

/// How much a `reserve` claims.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum ReserveAmount {
    Bytes(u64),
    /// Of the device's free memory when its pool starts, in (0, 1].
    Fraction(f64),
}

/// The `reserve` option, parsed (Note [reserve at start] in `pool/reserve.rs`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ReserveSpec {
    /// `None`: every device.
    pub device: Option<u16>,
    pub amount: ReserveAmount,
}

// The packing of a ReserveSpec in a u64: bits 0–46 the bytes, or the fraction in millionths
// with bit 47 set; bits 48–63 the device plus one (0: every device).
const RESERVE_FRACTION: u64 = 1 << 47;
const RESERVE_VALUE: u64 = RESERVE_FRACTION - 1;
const PPM: f64 = 1_000_000.0;

impl ReserveSpec {
    fn pack(self) -> u64 {
        let device = self.device.map_or(0, |d| d as u64 + 1) << 48;
        match self.amount {
            ReserveAmount::Bytes(b) => device | b,
            ReserveAmount::Fraction(f) => device | RESERVE_FRACTION | (f * PPM).round() as u64,
        }
    }

    fn unpack(v: u64) -> ReserveSpec {
        let device = match v >> 48 {
            0 => None,
            d => Some((d - 1) as u16),
        };
        let amount = if v & RESERVE_FRACTION != 0 {
            ReserveAmount::Fraction((v & RESERVE_VALUE) as f64 / PPM)
        } else {
            ReserveAmount::Bytes(v & RESERVE_VALUE)
        };
        ReserveSpec { device, amount }
    }

    /// `[DEVICE=]AMOUNT`: a byte count (`8G`) or a fraction with a decimal point in (0, 1].
    pub fn parse(v: &str) -> Option<ReserveSpec> {
        let v = v.trim();
        let (device, amount) = match v.split_once('=') {
            Some((d, a)) => (
                Some(d.trim().parse::<u16>().ok().filter(|&d| d < 0xfffe)?),
                a.trim(),
            ),
            None => (None, v),
        };
        let is_fraction =
            amount.contains('.') && amount.chars().all(|c| c.is_ascii_digit() || c == '.');
        let amount = if is_fraction {
            let f: f64 = amount.parse().ok()?;
            if !(f > 0.0 && f <= 1.0) {
                return None;
            }
            ReserveAmount::Fraction(f)
        } else {
            let b = parse_bytes(amount)?;
            if b > RESERVE_VALUE {
                return None;
            }
            ReserveAmount::Bytes(b)
        };
        Some(ReserveSpec { device, amount })
    }
}

impl core::fmt::Display for ReserveSpec {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if let Some(d) = self.device {
            write!(f, "{d}=")?;
        }
        match self.amount {
            ReserveAmount::Bytes(b) => write!(f, "{b}"),
            ReserveAmount::Fraction(x) => write!(f, "{x}"),
        }
    }
}

/// The `reserve` option; `None` when it is 0 (no reserve).
pub fn reserve() -> Option<ReserveSpec> {
    let spec = ReserveSpec::unpack(get(Key::Reserve));
    (spec.amount != ReserveAmount::Bytes(0)).then_some(spec)
}

/// One option: its key, default, kind and the sentence the README shows.
pub struct OptionDesc {
    pub key: &'static str,
    pub default: &'static str,
    pub kind: ValueKind,
    pub doc: &'static str,
    /// Whether the option can still change once the pool has started.
    pub runtime: bool,
}

/// Index of each option in [`OPTIONS`] and [`VALUES`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Key {
    Backend = 0,
    MemoryLimit,
    ThreadCache,
    ThreadCacheBytes,
    ThreadCacheMaxBlock,
    ThreadCacheStreamless,
    SmallSegment,
    LargeSegment,
    FenceBatch,
    FenceSpareMax,
    GrowWaitUs,
    ReleaseAbovePercent,
    Reserve,
    Vmm,
    VmmChunk,
    VmmChunkSplit,
    VmmChunkDivisor,
    VmmDeferredUnmap,
    LegacyOrder,
    FenceWaits,
    HostAutoComplete,
    Verbose,
}

pub const BACKENDS: &[&str] = &["cuda", "host"];
pub const VMM_MODES: &[&str] = &["off", "on"];
/// Values of `legacy_order`, by index.
pub const LEGACY_ORDER_MODES: &[&str] = &["off", "on"];
/// Values of `fence_waits`, by index.
pub const FENCE_WAIT_MODES: &[&str] = &["auto", "host", "device"];

pub static OPTIONS: [OptionDesc; 22] = [
    OptionDesc {
        key: "backend",
        default: "cuda",
        kind: ValueKind::Choice(BACKENDS),
        doc: "Where memory comes from: `cuda` (the GPU, through the driver) or `host` (host memory with simulated streams, for machines without a GPU). Fixed at first use.",
        runtime: false,
    },
    OptionDesc {
        key: "memory_limit",
        default: "0",
        kind: ValueKind::Bytes,
        doc: "Most bytes the pool may reserve on each device; 0 means no limit. An allocation that would pass it fails with out-of-memory after releasing idle cache.",
        runtime: true,
    },
    OptionDesc {
        key: "thread_cache",
        default: "true",
        kind: ValueKind::Bool,
        doc: "Keep recently freed blocks per thread and stream, so a same-stream reuse takes no lock.",
        runtime: true,
    },
    OptionDesc {
        key: "thread_cache_bytes",
        default: "256M",
        kind: ValueKind::Bytes,
        doc: "Most bytes one thread's cache may hold; beyond it, freed blocks go back to the shared pool.",
        runtime: true,
    },
    OptionDesc {
        key: "thread_cache_max_block",
        default: "64M",
        kind: ValueKind::Bytes,
        doc: "Largest block a thread cache keeps.",
        runtime: true,
    },
    OptionDesc {
        key: "thread_cache_streamless",
        default: "true",
        kind: ValueKind::Bool,
        doc: "Also keep blocks up to 256 KiB freed without a stream (every `cudaFree` under the preload) in the freeing thread (up to 2 MiB a thread, 4 MiB while six or more threads' batches wait on the same fences), in batches that share context fences with every other thread's batches (Note [shared thread fences]), and reuse them there without a lock once a fence recorded after the batch closed has completed. On an H100, 16 threads' streamless pairs went from 0.2× one thread's rate to 3.4-7.8×, and PyTorch steps under the preload got 5-10% faster; replay utilization moved by -0.7 to +1.9 points (docs/BENCHMARKS.md). Only the thread that kept a block reuses it: when a thread's streamless requests keep finding the pool full (four of them served by fencing its own few frees) while other threads (one that stopped allocating, say) keep 512 KiB or more, the pool grows a small segment for it rather than go on with a fence a pair (Note [room beside stranded blocks]). `false` sends every streamless free to the pool's fence queue",
        runtime: true,
    },
    OptionDesc {
        key: "small_segment",
        default: "2M",
        kind: ValueKind::Bytes,
        doc: "Size of the segments that blocks of 1 MiB and less are carved from.",
        runtime: true,
    },
    OptionDesc {
        key: "large_segment",
        default: "20M",
        kind: ValueKind::Bytes,
        doc: "Size of the segments that blocks above 1 MiB and up to half of it are carved from; larger requests get a segment of their own (rounded to 2 MiB).",
        runtime: true,
    },
    OptionDesc {
        key: "fence_batch",
        default: "64",
        kind: ValueKind::Count,
        doc: "Streamless frees collected before one context fence is recorded for them (a miss fences at once).",
        runtime: true,
    },
    OptionDesc {
        key: "fence_spare_max",
        default: "256M",
        kind: ValueKind::Bytes,
        doc: "Largest block of which the pool keeps a second copy when a loop frees and reallocates it without a stream, so that one context fence covers two reuses instead of one (taken after 256 reuses in a row that each needed a fence of their own; released like any idle cache). Blocks of segments only (`vmm:off`, and blocks of 1 MiB and less): a block of the VMM arena keeps one copy, whose reuses each take a fence (a second copy there was measured and rejected for its memory, docs/BENCHMARKS.md). 0 turns it off.",
        runtime: true,
    },
    OptionDesc {
        key: "grow_wait_us",
        default: "50000",
        kind: ValueKind::Count,
        doc: "Before the pool takes more memory from the driver while freed blocks that would cover the request only wait for their fence (the device is behind), it waits up to this many microseconds for the fence instead (what `cudaFree` would have waited for anyway), then grows. With `vmm:on`, blocks freed without a stream or on the requesting stream are enough when they cover half of a large request, or all the memory the pool would create for it: their memory moves to it; blocks freed without a stream are enough when they would save one granule of growth. 0 turns it off.",
        runtime: true,
    },
    OptionDesc {
        key: "release_above_percent",
        default: "0",
        kind: ValueKind::Count,
        doc: "When the pool is about to take more memory from the driver and its reserved bytes would pass this percentage of its capacity (`memory_limit` if set, else the device's total memory), it first gives idle cached memory back (whole idle segments, largest first, then idle VMM memory), so that other processes keep room; thread caches count as idle. Like PyTorch's `garbage_collection_threshold`. 0 turns it off (out of memory still releases everything idle before failing).",
        runtime: true,
    },
    OptionDesc {
        key: "reserve",
        default: "0",
        kind: ValueKind::Reserve,
        doc: "Memory each device's pool takes from the driver when it starts, and keeps: bytes (`8G`), or a fraction of the device's free memory then (`0.9`); `DEVICE=` in front (`1=8G`) limits it to one device. The program's first allocations are then cache hits (no warm-up), and the memory is the program's before other processes take it. `empty_cache` and the other releases never go below it; `cupool_reserve` changes it at run time. With `vmm:on` the memory is held as idle physical memory, mapped where the first blocks need it. 0: no reserve.",
        runtime: true,
    },
    OptionDesc {
        key: "vmm",
        default: "on",
        kind: ValueKind::Choice(VMM_MODES),
        doc: "`on` (the default): blocks above 1 MiB come from one reserved virtual address range per device, and only the 2 MiB granules under blocks in use (or cached and still mapped) are backed by physical memory (`cuMemCreate`/`cuMemMap`, in pieces of up to `vmm_chunk`); idle pieces move to where a block needs them (stitching), so the footprint follows the live bytes. The moves cost driver calls (docs/BENCHMARKS.md). `off`: plain segments, as PyTorch's caching allocator lays them out: fewer driver calls, more memory held for programs whose sizes vary, and legacy CUDA IPC to processes not under cupool for blocks of a segment of their own. Read when a device's pool is created; where the device has no virtual memory management, `on` falls back to segments.",
        runtime: true,
    },
    OptionDesc {
        key: "vmm_chunk",
        default: "8M",
        kind: ValueKind::Bytes,
        doc: "With `vmm:on`: the largest piece of physical memory created at once (one `cuMemCreate`, mapped and unmapped whole; rounded down to the 2 MiB granularity, at least one granule). The driver's cost is per call, not per byte, so larger pieces mean fewer calls, and smaller ones let idle memory move where it is needed in finer steps (docs/BENCHMARKS.md).",
        runtime: true,
    },
    OptionDesc {
        key: "vmm_chunk_split",
        default: "0",
        kind: ValueKind::Count,
        doc: "With `vmm:on`: new physical memory for a run of N unmapped granules is created in pieces of up to N / this many granules when that is more than `vmm_chunk`, so a huge block's memory moves later in a few large pieces (fewer driver calls) while small blocks still get `vmm_chunk` pieces. 0 keeps every piece at `vmm_chunk` (docs/BENCHMARKS.md).",
        runtime: true,
    },
    OptionDesc {
        key: "vmm_chunk_divisor",
        default: "384",
        kind: ValueKind::Count,
        doc: "With `vmm:on`: new physical memory is created in pieces of at most the pool's reserved bytes / this many (at least one granule, at most `vmm_chunk`), so a pool that is still small grows in small pieces, and a piece that a block later covers only in part strands less free memory beside it; the small pieces merge as they move once the pool has grown (Note [merged chunks]). 0: every piece may be `vmm_chunk`. The default, 384, keeps 8 MiB pieces from 3 GiB up (6 MiB at 2.3 GiB, 4 MiB at 1.5 GiB). On an H100 it took the conv net through `cupool.torch.enable()` from 2.52–2.54 GiB (128, level with `expandable_segments`' 2.523) to 2.49–2.51 GiB and LLM generation from 1.715 to 1.697 GiB at the same step time (the GPT loop under the preload: 3% slower); the host replays gained 0.29 points on average over 52 traces at 25–35% more VMM calls (docs/BENCHMARKS.md).",
        runtime: true,
    },
    OptionDesc {
        key: "vmm_deferred_unmap",
        default: "true",
        kind: ValueKind::Bool,
        doc: "With `vmm:on`: when idle memory moves to a new block, it is mapped there at once and unmapped from its old place later, by a worker thread of the pool, so the allocating thread (the one that launches the program's work) makes one driver call per piece instead of two. The old place stays mapped until then (the same physical memory; no memory is added), and any call that needs it unmaps it first (Note [unmaps off the launching thread] in `src/pool/vmm/unmapper.rs`). `false`: both calls on the allocating thread.",
        runtime: true,
    },
    OptionDesc {
        key: "legacy_order",
        default: "off",
        kind: ValueKind::Choice(LEGACY_ORDER_MODES),
        doc: "`on`: while every piece of device work of the process is in the legacy default stream's order (no stream created yet), a streamless free is a free on the legacy stream: the block is reused at once by the next allocation, with no context fence, as a single-stream caching allocator would (Note [legacy order] in `src/runtime/legacy_order.rs`). The first stream created (seen by `libcupool_preload.so`'s hooks) or the first pool call on another stream ends it for good, after one wait for the device's queued work. For programs that never use per-thread default streams (`--default-stream per-thread`, or `cudaStreamPerThread` from several threads), which nothing can detect: off by default for that reason. PyTorch creates a stream inside cuBLASLt at its first matrix product, so it ends there (docs/BENCHMARKS.md). `off`: every streamless free waits for a context fence. Read when the pool starts.",
        runtime: false,
    },
    OptionDesc {
        key: "fence_waits",
        default: "auto",
        kind: ValueKind::Choice(FENCE_WAIT_MODES),
        doc: "Who waits for the work queued before a free when the block is wanted again and its context fence has not completed (the device is behind). `host`: nobody; the pool takes other memory (it remaps or grows) or, before growing, the program waits up to `grow_wait_us`. `device`: the legacy default stream waits for the fence (`cuStreamWaitEvent`, no stall of the program), and the block is reused at once: every later piece of work on the legacy stream or on any blocking stream, per-thread default streams included, runs after that wait; under `libcupool_preload.so`, every live non-blocking stream is made to wait too (its hooks see streams created and destroyed; a new one waits once at creation). Its memory is not unmapped or given back until the fence is seen complete (Note [device waits] in `src/pool/device_waits.rs`). It ends for good, after one wait for the device, when more than 64 non-blocking streams are alive, a green context's stream is created, a context is destroyed or reset, peer access is enabled or a second context gets a pool. `auto`: `device` under the preload; `host` otherwise, where streams are created unseen (forcing `device` there is safe only for programs without non-blocking streams). Read when the pool starts.",
        runtime: false,
    },
    OptionDesc {
        key: "host_auto_complete",
        default: "true",
        kind: ValueKind::Bool,
        doc: "Host backend only: events complete as soon as they are recorded (tests turn this off to hold work in flight).",
        runtime: true,
    },
    OptionDesc {
        key: "verbose",
        default: "false",
        kind: ValueKind::Bool,
        doc: "Print the resolved configuration on stderr at first use.",
        runtime: true,
    },
];

/// The current value of every option, encoded as u64 (bools 0/1, choices by index).
static VALUES: [AtomicU64; OPTIONS.len()] = [const { AtomicU64::new(0) }; OPTIONS.len()];
static LOADED: AtomicBool = AtomicBool::new(false);
/// Bumped whenever a value changes, so hot paths can keep a snapshot and re-read only
/// after a change.
static GENERATION: AtomicU64 = AtomicU64::new(1);
static LOADING: spin::Mutex<()> = spin::Mutex::new(());
/// Set once the pool has started: options with `runtime: false` are frozen then.
static FROZEN: AtomicBool = AtomicBool::new(false);

/// Parses a boolean as options take it: `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`
/// (any case, surrounding blanks ignored). Also used for boolean environment variables.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parses `123`, `64K`, `2M`, `1.5G`, `8GiB`, `512B` into bytes.
pub fn parse_bytes(v: &str) -> Option<u64> {
    let v = v.trim();
    let lower = v.to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(digits_end);
    let mult: u64 = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    if num.is_empty() {
        return None;
    }
    if num.contains('.') {
        let f: f64 = num.parse().ok()?;
        let bytes = f * mult as f64;
        if !(0.0..1.8e19).contains(&bytes) {
            return None;
        }
        Some(bytes as u64)
    } else {
        num.parse::<u64>().ok()?.checked_mul(mult)
    }
}

/// Parses `v` as a value of `kind` (as `set` does); `None` when it is not one.
pub fn parse(kind: ValueKind, v: &str) -> Option<u64> {
    let v = v.trim();
    match kind {
        ValueKind::Bool => parse_bool(v).map(u64::from),
        ValueKind::Bytes => parse_bytes(v),
        ValueKind::Count => v.parse::<u64>().ok(),
        ValueKind::Choice(words) => words
            .iter()
            .position(|w| w.eq_ignore_ascii_case(v))
            .map(|i| i as u64),
        ValueKind::Reserve => ReserveSpec::parse(v).map(ReserveSpec::pack),
    }
}

/// What a value of `kind` looks like, for error messages.
pub fn describe(kind: ValueKind) -> String {
    match kind {
        ValueKind::Bool => "true or false".to_string(),
        ValueKind::Bytes => "a byte count such as 512, 64K, 2M or 8G".to_string(),
        ValueKind::Count => "a non-negative integer".to_string(),
        ValueKind::Choice(words) => format!("one of {}", words.join(", ")),
        ValueKind::Reserve => {
            "a byte count (8G), a fraction of the free memory (0.9), either after DEVICE= (1=8G)"
                .to_string()
        }
    }
}

fn find(key: &str) -> Option<usize> {
    OPTIONS.iter().position(|o| o.key == key.trim())
}

fn warn(msg: &str) {
    crate::log::error(msg);
}

/// Reads `CUPOOL_CONF` once (idempotent, cheap after the first call).
pub fn ensure_loaded() {
    if LOADED.load(core::sync::atomic::Ordering::Acquire) {
        return;
    }
    let _guard = LOADING.lock();
    if LOADED.load(Relaxed) {
        return;
    }
    for (i, o) in OPTIONS.iter().enumerate() {
        let v = parse(o.kind, o.default).unwrap_or(0);
        VALUES[i].store(v, Relaxed);
    }
    if let Ok(conf) = std::env::var("CUPOOL_CONF") {
        apply_string(&conf, "CUPOOL_CONF");
    }
    LOADED.store(true, core::sync::atomic::Ordering::Release);
    if get_bool(Key::Verbose) {
        crate::log::always(&format!("cupool: configuration\n{}", describe_all()));
    }
}

/// Applies `key:value,key:value`; bad entries are reported and skipped. Returns how many
/// entries were rejected.
pub fn apply_string(conf: &str, source: &str) -> usize {
    let mut rejected = 0;
    for entry in conf.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((k, v)) = entry.split_once(':').or_else(|| entry.split_once('=')) else {
            warn(&format!(
                "cupool: {source}: entry '{entry}' is not key:value; ignored"
            ));
            rejected += 1;
            continue;
        };
        if let Err(e) = set_inner(k, v, source) {
            let _ = e;
            rejected += 1;
        }
    }
    rejected
}

fn set_inner(key: &str, value: &str, source: &str) -> Result<()> {
    let Some(i) = find(key) else {
        let known: Vec<&str> = OPTIONS.iter().map(|o| o.key).collect();
        warn(&format!(
            "cupool: {source}: unknown key '{}' (known keys: {}); ignored",
            key.trim(),
            known.join(", ")
        ));
        return Err(CupoolStatus::CupoolErrorUnknownConfigKey);
    };
    let o = &OPTIONS[i];
    let Some(v) = parse(o.kind, value) else {
        warn(&format!(
            "cupool: {source}: bad value '{}' for '{}' (expected {}); keeping {}",
            value.trim(),
            o.key,
            describe(o.kind),
            format_value(i)
        ));
        return Err(CupoolStatus::CupoolErrorInvalidConfigValue);
    };
    if !o.runtime && FROZEN.load(Relaxed) && VALUES[i].load(Relaxed) != v {
        warn(&format!(
            "cupool: {source}: '{}' can only be set before the pool's first use; keeping {}",
            o.key,
            format_value(i)
        ));
        return Err(CupoolStatus::CupoolErrorInvalidConfigValue);
    }
    VALUES[i].store(v, Relaxed);
    GENERATION.fetch_add(1, Relaxed);
    Ok(())
}

/// Changes whenever any option changes (one relaxed load).
#[inline]
pub fn generation() -> u64 {
    GENERATION.load(Relaxed)
}

/// Sets one option at run time (`cupool_config_set`).
pub fn set(key: &str, value: &str) -> Result<()> {
    ensure_loaded();
    set_inner(key, value, "cupool_config_set")
}

/// Freezes the options that cannot change once the pool has started.
pub fn freeze() {
    FROZEN.store(true, Relaxed);
}

pub fn get(key: Key) -> u64 {
    ensure_loaded();
    VALUES[key as usize].load(Relaxed)
}

pub fn get_bool(key: Key) -> bool {
    get(key) != 0
}

/// The value of `key` as text, for `cupool_config_get` and verbose output.
pub fn get_text(key: &str) -> Result<String> {
    ensure_loaded();
    let i = find(key).ok_or(CupoolStatus::CupoolErrorUnknownConfigKey)?;
    Ok(format_value(i))
}

fn format_value(i: usize) -> String {
    let v = VALUES[i].load(Relaxed);
    match OPTIONS[i].kind {
        ValueKind::Bool => (if v != 0 { "true" } else { "false" }).to_string(),
        ValueKind::Bytes | ValueKind::Count => v.to_string(),
        ValueKind::Choice(words) => words.get(v as usize).unwrap_or(&"?").to_string(),
        ValueKind::Reserve => ReserveSpec::unpack(v).to_string(),
    }
}

/// `key = value` lines for every option.
pub fn describe_all() -> String {
    let mut s = String::new();
    for (i, o) in OPTIONS.iter().enumerate() {
        s.push_str(&format!("  {:<24} {}\n", o.key, format_value(i)));
    }
    s
}

#[cfg(test)]
mod tests;
