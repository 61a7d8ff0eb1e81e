//! The CUDA backend's two lock-light tables: which device each context is on, and the idle
//! events kept per context for reuse.

use super::{CONTEXT_SLOTS, MAX_IDLE_EVENTS};
use crate::backend::ContextId;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use cudarc::driver::sys::CUcontext;

/// Context → device, filled once per context and read without locks.
///
/// Slots are claimed in order and never freed. A context destroyed and another created at
/// the same address on another device would read stale; cupool works in primary contexts,
/// which live until exit.
pub(super) struct ContextTable {
    keys: [AtomicPtr<cudarc::driver::sys::CUctx_st>; CONTEXT_SLOTS],
    devices: [AtomicU32; CONTEXT_SLOTS],
    /// Slots claimed so far (may pass CONTEXT_SLOTS when the table is full).
    claimed: AtomicUsize,
}

impl ContextTable {
    pub(super) fn new() -> ContextTable {
        ContextTable {
            keys: core::array::from_fn(|_| AtomicPtr::new(null_mut())),
            devices: core::array::from_fn(|_| AtomicU32::new(0)),
            claimed: AtomicUsize::new(0),
        }
    }

    pub(super) fn device_of(&self, ctx: CUcontext) -> Option<i32> {
        let n = self.claimed.load(Ordering::Acquire).min(CONTEXT_SLOTS);
        // A slot whose key is still null is being written: skipped (the caller then asks
        // the driver, which is only slower).
        (0..n)
            .find(|&i| self.keys[i].load(Ordering::Acquire) == ctx)
            .map(|i| self.devices[i].load(Ordering::Relaxed) as i32)
    }

    pub(super) fn insert(&self, ctx: CUcontext, device: i32) {
        if self.device_of(ctx).is_some() {
            return;
        }
        let i = self.claimed.fetch_add(1, Ordering::AcqRel);
        if i < CONTEXT_SLOTS {
            self.devices[i].store(device as u32, Ordering::Relaxed);
            // Release: a reader that sees the key sees the device.
            self.keys[i].store(ctx, Ordering::Release);
        }
    }
}

/// Idle events per context, so recording does not create one each time. Vectors keep their
/// capacity, so taking and giving back allocate nothing once warm.
#[derive(Default)]
pub(super) struct IdleEvents {
    per_context: Vec<(ContextId, Vec<u64>)>,
}

impl IdleEvents {
    pub(super) fn take(&mut self, ctx: ContextId) -> Option<u64> {
        self.per_context
            .iter_mut()
            .find(|(c, _)| *c == ctx)
            .and_then(|(_, events)| events.pop())
    }

    /// Keeps `ev` for reuse; false when the context already has enough idle events.
    pub(super) fn put(&mut self, ctx: ContextId, ev: u64) -> bool {
        let index = match self.per_context.iter().position(|(c, _)| *c == ctx) {
            Some(i) => i,
            None => {
                self.per_context.push((ctx, Vec::new()));
                self.per_context.len() - 1
            }
        };
        match self.per_context.get_mut(index) {
            Some((_, events)) if events.len() < MAX_IDLE_EVENTS => {
                events.push(ev);
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_events_are_kept_per_context() {
        let mut idle = IdleEvents::default();
        let (a, b) = (ContextId(0x1000), ContextId(0x2000));
        assert_eq!(idle.take(a), None);
        assert!(idle.put(a, 11));
        assert!(idle.put(b, 22));
        assert!(idle.put(a, 12));
        assert_eq!(idle.take(b), Some(22));
        assert_eq!(idle.take(b), None);
        assert_eq!(idle.take(a), Some(12));
        assert_eq!(idle.take(a), Some(11));
        assert_eq!(idle.take(a), None);
    }

    #[test]
    fn idle_events_are_bounded() {
        let mut idle = IdleEvents::default();
        let ctx = ContextId(0x1000);
        for ev in 0..MAX_IDLE_EVENTS as u64 {
            assert!(idle.put(ctx, ev + 1));
        }
        assert!(!idle.put(ctx, 0xdead), "one past the bound is refused");
    }

    #[test]
    fn context_table_maps_contexts_to_devices() {
        let table = ContextTable::new();
        let ctx = |n: usize| {
            core::ptr::without_provenance_mut::<core::ffi::c_void>(n * 0x100) as CUcontext
        };
        assert_eq!(table.device_of(ctx(1)), None);
        table.insert(ctx(1), 0);
        table.insert(ctx(2), 3);
        table.insert(ctx(1), 0);
        assert_eq!(table.device_of(ctx(1)), Some(0));
        assert_eq!(table.device_of(ctx(2)), Some(3));
        assert_eq!(
            table.claimed.load(Ordering::Relaxed),
            2,
            "no duplicate slot"
        );
        for n in 3..CONTEXT_SLOTS + 10 {
            table.insert(ctx(n), n as i32);
        }
        assert_eq!(
            table.device_of(ctx(CONTEXT_SLOTS)),
            Some(CONTEXT_SLOTS as i32)
        );
        assert_eq!(
            table.device_of(ctx(CONTEXT_SLOTS + 5)),
            None,
            "past the table"
        );
    }
}
