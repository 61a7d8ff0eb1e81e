//! cupool: a CUDA device-memory caching allocator behind a C ABI.
//!
//! Layers, top to bottom (arrows point down only):
//! - [`ffi`]: the `extern "C"` boundary (`include/cupool.h`): argument checks, status codes,
//!   no panic crosses it.
//! - [`runtime`]: the process-wide state: configuration, one [`pool::DevicePool`] per
//!   context, the backend, lifecycle (fork, exit).
//! - [`pool`]: device-agnostic caching (size classes, thread caches, segments, split/merge,
//!   stream-ordered reuse, fences). No CUDA calls.
//! - [`backend`]: where memory and ordering come from (`cuda` or `host`).
//!
//! The LD_PRELOAD interposer lives in its own crate (`preload/`) on top of [`runtime`].

// Under Miri the runtime registers no exit or fork handler (`src/runtime.rs`): those
// handlers and their imports are unused there, and only there.
#![cfg_attr(miri, allow(dead_code, unused_imports))]
// The crate's Rust documentation is for its developers (the product's interface is the C
// header): module notes link to the private items they explain, and `cargo doc
// --document-private-items` renders them. CI builds the docs with warnings denied.
#![allow(rustdoc::private_intra_doc_links)]

#[cfg(not(loom))]
pub mod backend;
#[cfg(not(loom))]
pub mod config;
#[cfg(not(loom))]
pub mod dl;
#[cfg(not(loom))]
pub mod ffi;
#[cfg(not(loom))]
pub mod log;
#[cfg(not(loom))]
mod os_memory;
#[cfg(not(loom))]
mod os_time;
#[cfg(not(loom))]
pub mod pool;
#[cfg(not(loom))]
pub mod ptr_map;
#[cfg(not(loom))]
pub mod runtime;
#[cfg(not(loom))]
pub mod stats;
pub mod status;
pub mod sync;
#[cfg(not(loom))]
mod thread_number;
#[cfg(not(loom))]
pub mod trace;

/// Under the model checker (`RUSTFLAGS="--cfg loom"`) only the pool's lock-free parts are
/// built: the address map, the block records' hand-over tag, the per-thread counters, the
/// capture exclusion, the shared thread fences and the parking slots.
#[cfg(loom)]
pub mod pool {
    pub mod address_map;
    pub mod block;
    pub mod capture;
    pub mod counters;
    pub mod fence_clock;
    pub mod parked;
}

pub use status::CupoolStatus;
