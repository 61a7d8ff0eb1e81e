//! Atomics and cells used by the lock-free parts of the pool, through one facade so the
//! model checker (`loom`, built with `RUSTFLAGS="--cfg loom"`) can replace them.
//!
//! [`RecordCell`] holds a block record's fields. Its accessor returns the record's `&mut`
//! in normal builds (no cost) and, under loom, a guard that keeps loom's write access open
//! while it lives, so the model checker sees every access to the data and reports two
//! threads touching one record without an order between them (as sharded-slab's facade
//! does with closures; a guard keeps the pool's many `data()` call sites unchanged).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicU8};

/// Keeps a value on cache lines of its own (two, for the adjacent-line prefetcher): for a
/// value written often by several threads next to values others read on every call.
#[repr(align(128))]
pub(crate) struct LineApart<T>(pub(crate) T);

impl<T> core::ops::Deref for LineApart<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// A record's fields, written by one owner at a time (the pool's hand-over rules).
pub struct RecordCell<T> {
    #[cfg(not(loom))]
    value: core::cell::UnsafeCell<T>,
    #[cfg(loom)]
    value: loom::cell::UnsafeCell<T>,
}

/// Exclusive access to a [`RecordCell`]'s value: `&mut T`, or under loom a guard.
#[cfg(not(loom))]
pub type RecordMut<'a, T> = &'a mut T;

/// Exclusive access to a [`RecordCell`]'s value, tracked by loom while it lives.
#[cfg(loom)]
pub struct RecordMut<'a, T> {
    access: loom::cell::MutPtr<T>,
    _cell: core::marker::PhantomData<&'a mut T>,
}

#[cfg(loom)]
impl<T> core::ops::Deref for RecordMut<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard's access is exclusive (loom checks it) and lives as long as it.
        unsafe { self.access.deref() }
    }
}

#[cfg(loom)]
impl<T> core::ops::DerefMut for RecordMut<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`.
        unsafe { self.access.deref() }
    }
}

impl<T> RecordCell<T> {
    pub fn new(value: T) -> Self {
        RecordCell {
            #[cfg(not(loom))]
            value: core::cell::UnsafeCell::new(value),
            #[cfg(loom)]
            value: loom::cell::UnsafeCell::new(value),
        }
    }

    /// The value, for its one owner.
    ///
    /// # Safety
    /// No other access to the value exists while the result lives.
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    pub unsafe fn get_mut(&self) -> RecordMut<'_, T> {
        #[cfg(not(loom))]
        {
            // SAFETY: the caller's contract.
            unsafe { &mut *self.value.get() }
        }
        #[cfg(loom)]
        {
            RecordMut {
                access: self.value.get_mut(),
                _cell: core::marker::PhantomData,
            }
        }
    }
}

/// A lock for short critical sections that may hold a backend call: a spin lock in normal
/// builds, loom's mutex under the model checker (which cannot see a spin lock's atomics).
pub struct Lock<T> {
    #[cfg(not(loom))]
    inner: spin::Mutex<T>,
    #[cfg(loom)]
    inner: loom::sync::Mutex<T>,
}

/// The guard of a [`Lock`].
#[cfg(not(loom))]
pub type LockGuard<'a, T> = spin::MutexGuard<'a, T>;
/// The guard of a [`Lock`].
#[cfg(loom)]
pub type LockGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

impl<T> Lock<T> {
    /// A lock for a static (loom's mutex has no `const` constructor: under loom, statics
    /// are built in each model).
    #[cfg(not(loom))]
    pub const fn new_const(value: T) -> Self {
        Lock {
            inner: spin::Mutex::new(value),
        }
    }

    pub fn new(value: T) -> Self {
        Lock {
            #[cfg(not(loom))]
            inner: spin::Mutex::new(value),
            #[cfg(loom)]
            inner: loom::sync::Mutex::new(value),
        }
    }

    /// The guard, waiting for it.
    pub fn lock(&self) -> LockGuard<'_, T> {
        #[cfg(not(loom))]
        {
            self.inner.lock()
        }
        #[cfg(loom)]
        {
            self.inner.lock().unwrap()
        }
    }

    /// The guard if nobody holds it now.
    pub fn try_lock(&self) -> Option<LockGuard<'_, T>> {
        #[cfg(not(loom))]
        {
            // Note [try a lock by reading first]: a failed `try_lock` is a compare-and-swap
            // all the same, which takes the lock's line from the holder's cache while 16
            // threads try the fence clock's lock on their misses. A load leaves it shared.
            // One of three changes that together gave 16 threads 4-9% more streamless pairs
            // on the host backend (docs/BENCHMARKS.md, nineteenth session).
            if self.inner.is_locked() {
                return None;
            }
            self.inner.try_lock()
        }
        #[cfg(loom)]
        {
            self.inner.try_lock().ok()
        }
    }
}
