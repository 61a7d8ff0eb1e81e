//! Atomics and cells used by the lock-free parts of the pool, through one facade so the
//! model checker (`loom`, built with `RUSTFLAGS="--cfg loom"`) can replace them.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8};
