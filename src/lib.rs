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

pub mod backend;
pub mod config;
pub mod ffi;
pub mod log;
pub mod pool;
pub mod runtime;
pub mod stats;
pub mod status;
pub(crate) mod sync;

pub use status::CupoolStatus;
