//! Model checks (loom) of the pool's lock-free parts. Run with
//! `RUSTFLAGS="--cfg loom" cargo test --release --test loom_lockfree`; without that flag
//! this file is empty (CI runs both).
//!
//! Block records' fields live in a `RecordCell` (`src/sync.rs`): under loom every `data()`
//! is an access loom tracks, so a model fails when two threads touch one record's fields
//! without an order between them, not only when a value read back is wrong. Where a model
//! needs the device pool's lock (a spin lock the model checker cannot see), a loom `Mutex`
//! stands for it, taken exactly where the pool takes its lock.
#![cfg(loom)]

use cupool::pool::address_map::AddressMap;
use cupool::pool::block::{BlockTable, Place, TakeBack};
use cupool::pool::capture::CaptureExclusion;
use cupool::pool::counters::{Level, ThreadCounters};
use cupool::pool::fence_clock::{FenceClock, FenceRecorder, Urge};
use loom::sync::Arc;
use loom::thread;

/// Two threads enter blocks at once (the first of them makes the table): both entries are
/// visible afterwards.
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

/// Two starts with one home slot, the second one step along the first's probe run.
/// Removing the first moves the second back into its place: a reader looking for the
/// second while that happens must still find it (Note [address map as a hash]: without
/// the `moves` sequence lock it reads the old place after the move, the new one before).
#[test]
fn address_map_finds_an_entry_a_removal_moves() {
    let first = 0x200;
    loom::model(move || {
        let map = Arc::new(AddressMap::new());
        assert!(map.set(first, 7));
        let home = map.home_slot(first);
        let second = (2..)
            .map(|g: u64| g * 0x200)
            .find(|&a| map.home_slot(a) == home)
            .expect("a start with the same home");
        assert!(map.set(second, 9));
        let m2 = map.clone();
        let t = thread::spawn(move || m2.clear(first));
        assert_eq!(map.get(second), Some(9));
        t.join().unwrap();
        assert_eq!(map.get(first), None);
        assert_eq!(map.get(second), Some(9));
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
        // Within the model's small address map (0x1000 is past it: this model checked
        // nothing until the map's answer was asserted).
        let ptr = 0x200;
        assert!(map.set(ptr, idx));
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
        // Once the allocator has published, exactly one freer can have taken the block.
        if table.get(idx).try_take_back(ptr) == TakeBack::Taken {
            assert!(r1.is_none() && r2.is_none());
        }
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

/// Note [place is atomic]: the pool, holding its lock, reads a neighbour's place to decide a
/// merge and reads the neighbour's fields only when the place says the pool holds it
/// (`FreeShared`); the neighbour's owner writes the fields while it holds the block (a
/// thread-cache put) and hands the block to the pool under the lock. Every interleaving:
/// the pool either sees the block as not its own and leaves its fields alone, or sees the
/// owner's writes.
#[test]
fn a_neighbours_fields_are_read_only_once_the_pool_holds_it() {
    loom::model(|| {
        let table = Arc::new(BlockTable::new());
        let pool_lock = Arc::new(loom::sync::Mutex::new(()));
        let idx = table.allocate().unwrap();
        table.get(idx).set_place(Place::Allocated);
        let (t1, l1) = (table.clone(), pool_lock.clone());
        let owner = thread::spawn(move || {
            let b = t1.get(idx);
            // A thread-cache put: the owner rewrites the record without the lock.
            b.set_place(Place::ThreadCache);
            // SAFETY: the owner holds the block.
            unsafe { b.data().requested = 7 };
            // The cache flushes it to the pool: under the lock.
            let _g = l1.lock().unwrap();
            // SAFETY: still the owner until the place says otherwise.
            unsafe { b.data().requested = 8 };
            b.set_place(Place::FreeShared);
        });
        let merged = {
            let _g = pool_lock.lock().unwrap();
            let b = table.get(idx);
            match b.place() {
                // SAFETY: the pool holds the block (its lock is held).
                Place::FreeShared => Some(unsafe { b.data().requested }),
                _ => None,
            }
        };
        owner.join().unwrap();
        assert!(matches!(merged, None | Some(8)), "{merged:?}");
    });
}

/// A streamless free of a block against its allocating thread exiting: the exiting thread
/// flushes the blocks of its cache to the pool (under the lock) while another thread takes
/// the block it had handed out back through its tag and gives it to the pool too. A pass
/// over the pool's blocks (a fence being sealed, under the lock) reads the fields of
/// whatever the pool holds. Each record has one owner at a time in every interleaving.
#[test]
fn a_streamless_free_against_the_allocating_thread_exiting() {
    loom::model(|| {
        let table = Arc::new(BlockTable::new());
        let pool_lock = Arc::new(loom::sync::Mutex::new(Vec::new()));
        let handed_out = table.allocate().unwrap();
        let cached = table.allocate().unwrap();
        let ptr = 0x2000;
        // The allocating thread hands one block to the program; the other sits in its cache.
        {
            let b = table.get(handed_out);
            // SAFETY: set-up, before any other thread exists.
            unsafe { b.data().requested = 100 };
            b.set_place(Place::Allocated);
            b.publish_allocated(ptr);
            let c = table.get(cached);
            // SAFETY: as above.
            unsafe { c.data().requested = 200 };
            c.set_place(Place::ThreadCache);
        }
        let (t1, l1) = (table.clone(), pool_lock.clone());
        let exiting = thread::spawn(move || {
            let c = t1.get(cached);
            let mut pool = l1.lock().unwrap();
            // SAFETY: the exiting thread owns its cache's blocks.
            unsafe { c.data().requested = 201 };
            c.set_place(Place::FreeShared);
            pool.push(cached);
        });
        let (t2, l2) = (table.clone(), pool_lock.clone());
        let freer = thread::spawn(move || {
            let b = t2.get(handed_out);
            assert_eq!(b.try_take_back(ptr), TakeBack::Taken);
            // SAFETY: the CAS made this thread the owner.
            let requested = unsafe { b.data().requested };
            let mut pool = l2.lock().unwrap();
            b.set_place(Place::FreeShared);
            pool.push(handed_out);
            requested
        });
        // A fence pass: reads every record the pool holds, under the lock.
        let seen: Vec<u64> = {
            let pool = pool_lock.lock().unwrap();
            pool.iter()
                // SAFETY: the pool holds these records (its lock is held).
                .map(|&i| unsafe { table.get(i).data().requested })
                .collect()
        };
        exiting.join().unwrap();
        assert_eq!(freer.join().unwrap(), 100);
        assert!(seen.iter().all(|r| [100, 201].contains(r)), "{seen:?}");
    });
}

/// A device for the shared thread fences' model: a fence's handle holds its number and
/// whether the device work the closing thread queued (`launched`) was in it; retired
/// fences are listed.
struct ModelDevice {
    clock: Arc<FenceClock>,
    launched: Arc<loom::sync::atomic::AtomicU64>,
    retired: Arc<loom::sync::Mutex<Vec<u64>>>,
}

impl FenceRecorder for ModelDevice {
    fn record(&self) -> Option<u64> {
        use loom::sync::atomic::Ordering::Relaxed;
        // The clock numbered this fence just before calling: `started` is its number.
        let seq = self.clock.started();
        let saw = self.launched.load(Relaxed);
        Some(seq << 1 | saw)
    }
    fn completed(&self, _fence: u64) -> bool {
        true
    }
    fn recycle(&self, fence: u64) {
        self.retired.lock().unwrap().push(fence);
    }
}

/// Note [shared thread fences]: every fence numbered at or above a batch's ticket saw the
/// work its thread queued before taking the ticket, whichever thread records it and
/// however the ticket and the record interleave; and a batch reported covered was covered
/// by such a fence.
#[test]
fn a_shared_fence_covers_what_came_before_its_ticket() {
    loom::model(|| {
        use loom::sync::atomic::{AtomicU64, Ordering::Relaxed};
        let clock = Arc::new(FenceClock::new());
        let launched = Arc::new(AtomicU64::new(0));
        let retired = Arc::new(loom::sync::Mutex::new(Vec::new()));
        let device = || ModelDevice {
            clock: clock.clone(),
            launched: launched.clone(),
            retired: retired.clone(),
        };
        let (a, b) = (device(), device());
        let (clock_a, clock_b) = (clock.clone(), clock.clone());
        let closer = thread::spawn(move || {
            // The program's work on the batch's blocks, then the batch closes.
            a.launched.store(1, Relaxed);
            let need = clock_a.ticket();
            (need, clock_a.advance(need, Urge::Ask, &a))
        });
        // Another thread's batch, closing at the same time.
        let other = thread::spawn(move || {
            let need = clock_b.ticket();
            clock_b.advance(need, Urge::Wait, &b);
        });
        other.join().unwrap();
        let (need, covered) = closer.join().unwrap();
        let retired = retired.lock().unwrap().clone();
        for fence in &retired {
            if fence >> 1 >= need {
                assert_eq!(
                    fence & 1,
                    1,
                    "fence {} missed the batch of ticket {need}",
                    fence >> 1
                );
            }
        }
        if covered {
            assert!(retired.iter().any(|f| f >> 1 >= need));
        }
        // Nobody is left waiting: a fence recorded now covers the batch.
        assert!(clock.advance(need, Urge::Wait, &device()));
    });
}

/// Note [parked arena blocks]: a parking slot hands a record from the thread that parked
/// it to whichever thread swaps the slot empty: the stream's next request, another free
/// that displaces it, or a pass filing every parked block. Each parked block has exactly
/// one owner at the end, and that owner reads what the parking thread wrote.
#[test]
fn a_parked_block_has_one_owner_and_its_owner_sees_its_record() {
    use cupool::pool::parked::ParkSlots;
    const STREAM: u64 = 7;
    loom::model(|| {
        let table = Arc::new(BlockTable::new());
        let slots = Arc::new(ParkSlots::new());
        let first = table.allocate().unwrap();
        let second = table.allocate().unwrap();
        let park = |t: Arc<BlockTable>, s: Arc<ParkSlots>, idx, stamp| {
            move || {
                let b = t.get(idx);
                // SAFETY: this thread holds the block until the slot publishes it.
                unsafe { t.links(idx).free_epoch = stamp };
                b.set_place(Place::Parked);
                // What the slot held before is this thread's now.
                s.park(STREAM, idx).map(|earlier| {
                    // SAFETY: swapped out of the slot: owned.
                    (earlier, unsafe { t.links(earlier).free_epoch })
                })
            }
        };
        // Parked before the race: the other threads displace, take and file it.
        assert_eq!(park(table.clone(), slots.clone(), first, 11)(), None);
        let p2 = thread::spawn(park(table.clone(), slots.clone(), second, 22));
        let (t3, s3) = (table.clone(), slots.clone());
        let request = thread::spawn(move || {
            s3.take(STREAM).map(|idx| {
                // SAFETY: swapped out of the slot: owned.
                (idx, unsafe { t3.links(idx).free_epoch })
            })
        });
        let mut filed = Vec::new();
        slots.take_all(|idx| {
            // SAFETY: swapped out of the slot: owned.
            filed.push((idx, unsafe { table.links(idx).free_epoch }));
        });
        let mut owners: Vec<(u32, u64)> = filed;
        owners.extend(p2.join().unwrap());
        owners.extend(request.join().unwrap());
        slots.take_all(|idx| {
            // SAFETY: every other thread has ended.
            owners.push((idx, unsafe { table.links(idx).free_epoch }));
        });
        owners.sort();
        assert_eq!(owners, vec![(first, 11), (second, 22)], "one owner each");
    });
}
