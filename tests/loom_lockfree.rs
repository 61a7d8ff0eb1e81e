//! Model checks (loom) of the pool's lock-free parts. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_lockfree`; without that flag
//! this file is empty (CI runs both).
#![cfg(loom)]

use cupool::pool::address_map::AddressMap;
use cupool::pool::block::{BlockTable, TakeBack};
use cupool::pool::capture::CaptureExclusion;
use cupool::pool::counters::{Level, ThreadCounters};
use loom::sync::Arc;
use loom::thread;

/// Two threads enter blocks in the same (not yet created) radix nodes at once: node
/// creation races through CAS, and both entries must be visible afterwards.
#[test]
fn address_map_concurrent_inserts_both_land() {
    loom::model(|| {
        let map = Arc::new(AddressMap::new());
        let m2 = map.clone();
        let t = thread::spawn(move || {
            assert!(m2.set(0x200, 7));
        });
        assert!(map.set(0x400, 9));
        t.join().unwrap();
        assert_eq!(map.get(0x200), Some(7));
        assert_eq!(map.get(0x400), Some(9));
    });
}

/// A block handed out by one thread and freed by another: the freeing thread sees the
/// fields the allocating thread wrote (Release store / AcqRel CAS), and a concurrent
/// double free is reported, never taken twice.
#[test]
fn tag_hand_over_and_double_free() {
    loom::model(|| {
        let table = Arc::new(BlockTable::new());
        let map = Arc::new(AddressMap::new());
        let idx = table.allocate().unwrap();
        let ptr = 0x1000;
        map.set(ptr, idx);
        let (t1, m1) = (table.clone(), map.clone());
        let allocator = thread::spawn(move || {
            let b = t1.get(idx);
            // SAFETY: this thread owns the block until it publishes it.
            unsafe { b.data().requested = 4242 };
            b.publish_allocated(ptr);
            let _ = m1;
        });
        let freer = |t: Arc<BlockTable>, m: Arc<AddressMap>| {
            move || -> Option<u64> {
                let i = m.get(ptr)?;
                let b = t.get(i);
                match b.try_take_back(ptr) {
                    // SAFETY: the CAS made this thread the owner.
                    TakeBack::Taken => Some(unsafe { b.data().requested }),
                    _ => None,
                }
            }
        };
        let f1 = thread::spawn(freer(table.clone(), map.clone()));
        let f2 = thread::spawn(freer(table.clone(), map.clone()));
        allocator.join().unwrap();
        let r1 = f1.join().unwrap();
        let r2 = f2.join().unwrap();
        assert!(r1.is_none() || r2.is_none(), "a block was taken back twice");
        for r in [r1, r2].into_iter().flatten() {
            assert_eq!(r, 4242, "the freeing thread saw the allocator's writes");
        }
    });
}

/// Single-writer counters: a reader summing while the owner updates never sees a value the
/// owner did not write, and after the owner finishes the sum is exact.
#[test]
fn single_writer_counters_sum_exactly() {
    loom::model(|| {
        let a = Arc::new(ThreadCounters::new(false));
        let shared = Arc::new(ThreadCounters::new(true));
        let (a2, s2) = (a.clone(), shared.clone());
        let owner = thread::spawn(move || {
            let _ = a2.raise(Level::Allocated, 512, 0);
            a2.lower(Level::Allocated, 512);
            let _ = a2.raise(Level::Allocated, 1024, 0);
            let _ = s2.raise(Level::Cached, 1, 0);
        });
        let _ = shared.raise(Level::Cached, 1, 0);
        let seen = a.level(Level::Allocated);
        assert!(
            [0, 512, 1024].contains(&seen),
            "torn or invented value {seen}"
        );
        owner.join().unwrap();
        assert_eq!(a.level(Level::Allocated), 1024);
        assert_eq!(
            shared.level(Level::Cached),
            2,
            "the shared record's RMWs do not lose updates"
        );
    });
}

/// Note [capture exclusion]: a guarded driver call and a capture never overlap. The caller
/// marks its calls in flight in `calls`; the capturing thread checks, once `begin`
/// returned, that none is; every interleaving either makes the caller back off or makes
/// the capture wait.
#[test]
fn a_capture_never_overlaps_guarded_calls() {
    loom::model(|| {
        use loom::sync::atomic::{AtomicU32, Ordering::SeqCst};
        let ex = Arc::new(CaptureExclusion::new());
        let calls = Arc::new(AtomicU32::new(0));
        let (ex2, calls2) = (ex.clone(), calls.clone());
        let caller = thread::spawn(move || {
            if let Some(_guard) = ex2.enter() {
                calls2.fetch_add(1, SeqCst);
                assert!(!ex2.capturing() || calls2.load(SeqCst) > 0);
                calls2.fetch_sub(1, SeqCst);
                true
            } else {
                false
            }
        });
        ex.begin();
        assert_eq!(
            calls.load(SeqCst),
            0,
            "a guarded call runs during the capture"
        );
        ex.end();
        let _ = caller.join().unwrap();
        assert!(!ex.capturing());
        // With no capture open, a guard is granted.
        assert!(ex.enter().is_some());
    });
}
