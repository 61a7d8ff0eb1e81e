//! `libcupool_preload.so`: `LD_PRELOAD` it into any CUDA program and the program's device
//! allocations and frees go through cupool's pool, with nothing else changed.
//!
//! How calls reach us (research/preload-interception.md): every CUDA runtime, static or
//! shared, loads `libcuda.so.1` with `dlopen`, fetches `cuGetProcAddress_v2` with `dlsym`
//! and asks it for every other entry point; XLA-style loaders `dlsym` each driver function
//! from libcuda's handle; `-lcuda` programs bind to exported symbols. So this library
//! exports `dlsym` ([`dlsym_hook`]), `cuGetProcAddress`/`_v2` ([`proc_address`]) and the
//! hooked driver functions themselves ([`memory`], [`pinned`], [`capture`], [`peer`]), all
//! listed once
//! in [`table`]. The real functions come from [`real`], typed by [`slots`] (each driver
//! function's exported name and signature, listed once). It also carries the whole cupool
//! C API (the `cupool` crate is linked in), so one pool serves both faces.
//!
//! Lifecycle ([`lifecycle`]): nothing but two atomics-and-libc steps at load; the pool
//! starts at the first allocation; exit and fork handlers keep the pool away from a dying
//! driver and from fork children. Every hook body runs inside [`guard`]: no panic crosses.

// The hooks are named after the CUDA functions they replace.
#![allow(non_snake_case)]
// Every exported hook's safety contract is the CUDA driver's (or glibc's, for `dlsym`)
// for the function of the same name; the hooks accept whatever that function accepts.
#![allow(clippy::missing_safety_doc)]
// Its Rust documentation is for developers: notes link to the private items they explain.
#![allow(rustdoc::private_intra_doc_links)]

pub mod capture;
pub mod cuda;
pub mod dlsym_hook;
pub mod guard;
pub mod ipc;
pub mod lifecycle;
pub mod memory;
pub mod peer;
pub mod pinned;
pub mod proc_address;
pub mod real;
pub mod slots;
pub mod streams;
pub mod table;

// Keep the cupool C API in this library's exports.
pub use cupool::ffi;

/// Load-time step: resolve glibc's `dlsym` and raise the interposition flag. Only libc
/// calls and atomics: this runs in every process that inherits `LD_PRELOAD`.
#[ctor::ctor(unsafe)]
fn on_load() {
    lifecycle::on_load();
}
