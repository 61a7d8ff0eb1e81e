//! Unit tests of the shared thread fences' clock and recorder role.

use super::*;
use std::sync::atomic::AtomicU64 as StdU64;
use std::sync::Arc;

/// A simulated device: its fences complete up to `done_up_to` (all of them for
/// [`Device::instant`], none until the test says so for [`Device::behind`]); counts the
/// records and the queries.
struct Device {
    records: StdU64,
    queries: StdU64,
    done_up_to: StdU64,
}

impl Device {
    fn instant() -> Self {
        Device::with_done(u64::MAX)
    }

    fn behind() -> Self {
        Device::with_done(0)
    }

    fn with_done(done_up_to: u64) -> Self {
        Device {
            records: StdU64::new(0),
            queries: StdU64::new(0),
            done_up_to: StdU64::new(done_up_to),
        }
    }
}

impl FenceRecorder for Device {
    fn record(&self) -> Option<Fence> {
        Some(self.records.fetch_add(1, Relaxed) + 1)
    }
    fn completed(&self, fence: Fence) -> bool {
        self.queries.fetch_add(1, Relaxed);
        fence <= self.done_up_to.load(Relaxed)
    }
    fn recycle(&self, _fence: Fence) {}
}

fn on_other_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(f).join().unwrap()
}

/// Long enough that a thread started meanwhile finds the role held and the closers
/// of earlier threads counted.
const HELD_NS: u64 = 10_000_000_000;

/// A clock whose role lasts `idle_ns` without its holder and `tenure_ns` in all, and
/// whose closers are counted over [`HELD_NS`].
fn clock_with(idle_ns: u64, tenure_ns: u64) -> Arc<FenceClock> {
    let clock = Arc::new(FenceClock::new());
    clock.set_role_times(idle_ns, tenure_ns, HELD_NS);
    clock
}

/// Threads kept alive until dropped, so that each has closed as a thread of its own.
struct Crowd(
    Vec<std::sync::mpsc::Sender<()>>,
    Vec<std::thread::JoinHandle<()>>,
);

impl Drop for Crowd {
    fn drop(&mut self) {
        self.0.clear();
        for t in self.1.drain(..) {
            t.join().unwrap();
        }
    }
}

/// `n` threads, one after the other, each close a batch (and record for it, fewer
/// than [`MANY_CLOSERS`] having closed so far), then wait, alive, until dropped.
fn crowd(clock: &Arc<FenceClock>, device: &Arc<Device>, n: usize) -> Crowd {
    let mut crowd = Crowd(Vec::new(), Vec::new());
    for _ in 0..n {
        let (c, d) = (clock.clone(), device.clone());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let (stay_tx, stay_rx) = std::sync::mpsc::channel::<()>();
        crowd.1.push(std::thread::spawn(move || {
            done_tx.send(c.advance(c.ticket(), Urge::Ask, &*d)).unwrap();
            let _ = stay_rx.recv();
        }));
        crowd.0.push(stay_tx);
        assert!(
            done_rx.recv().unwrap(),
            "a crowd thread's batch not covered"
        );
    }
    crowd
}

/// A clock whose role lasts, with `MANY_CLOSERS - 1` other threads counted as closers
/// (alive until the `Crowd` is dropped): the caller's next close is the first among many.
fn crowded_clock() -> (Arc<FenceClock>, Arc<Device>, Crowd) {
    let clock = clock_with(HELD_NS, HELD_NS);
    let device = Arc::new(Device::instant());
    let crowd = crowd(&clock, &device, MANY_CLOSERS as usize - 1);
    (clock, device, crowd)
}

#[test]
fn one_thread_records_and_is_covered() {
    let (clock, device) = (FenceClock::new(), Device::instant());
    let need = clock.ticket();
    assert!(!clock.covers(need));
    assert!(clock.advance(need, Urge::Ask, &device));
    assert_eq!(device.records.load(Relaxed), 1);
    let next = clock.ticket();
    assert!(clock.advance(next, Urge::Ask, &device));
    assert_eq!(device.records.load(Relaxed), 2);
    assert!(!clock.many_closers());
}

/// Note [fence recorder role]: with fewer than [`MANY_CLOSERS`] threads closing
/// batches, every thread records for itself, as before the role (PyTorch's two
/// threads under the preload).
#[test]
fn a_few_threads_record_for_themselves() {
    let clock = clock_with(HELD_NS, HELD_NS);
    let device = Arc::new(Device::instant());
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    let _crowd = crowd(&clock, &device, MANY_CLOSERS as usize - 2);
    assert_eq!(device.records.load(Relaxed), MANY_CLOSERS as u64 - 1);
    assert!(!clock.many_closers());
}

/// Note [fence recorder role]: among many threads, one that does not hold the role
/// asks and returns without a driver call; the holder's next call records one fence
/// that covers both.
#[test]
fn among_many_threads_the_holder_records_for_the_others() {
    let (clock, device, _crowd) = crowded_clock();
    // The fourth to close: the first among many, it takes the role.
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    assert!(clock.many_closers());
    let before = device.records.load(Relaxed);
    let (theirs, recorded) = ask_on_other_thread(&clock, &device);
    assert!(!recorded, "a thread without the role recorded");
    assert_eq!(device.records.load(Relaxed), before, "no driver call");
    assert!(!clock.covers(theirs));
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    assert_eq!(device.records.load(Relaxed), before + 1);
    assert!(
        clock.covers(theirs),
        "the holder's fence covers the asker's batch"
    );
}

/// A thread's batch closing, on a thread of its own: its ticket and whether it was
/// covered.
fn ask_on_other_thread(clock: &Arc<FenceClock>, device: &Arc<Device>) -> (u64, bool) {
    let (c, d) = (clock.clone(), device.clone());
    on_other_thread(move || {
        let need = c.ticket();
        (need, c.advance(need, Urge::Ask, &*d))
    })
}

/// A clock whose role lasts `idle_ns` without its holder, among many closing threads
/// (alive until the `Crowd` is dropped), and the calling thread holding the role since the
/// time returned.
fn role_taken(idle_ns: u64) -> (Arc<FenceClock>, Arc<Device>, Crowd, u64) {
    let clock = clock_with(idle_ns, HELD_NS);
    let device = Arc::new(Device::instant());
    let crowd = crowd(&clock, &device, MANY_CLOSERS as usize - 1);
    let taken = role::now_ns();
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    (clock, device, crowd, taken)
}

#[test]
fn the_role_passes_on_when_its_holder_stays_away() {
    const IDLE_NS: u64 = 50_000_000;
    let (clock, device, _crowd, taken) = role_taken(IDLE_NS);
    let (_, recorded) = ask_on_other_thread(&clock, &device);
    if role::now_ns() - taken < IDLE_NS {
        assert!(!recorded, "refused while the holder's time runs");
    }
    std::thread::sleep(std::time::Duration::from_nanos(IDLE_NS * 2));
    let (_, recorded) = ask_on_other_thread(&clock, &device);
    assert!(recorded, "the holder stayed away: another thread records");
}

/// Note [role renewed in steps]: the holder's calls renew the role once a quarter of its
/// idle time has passed, so a holder that keeps coming back keeps it past the first
/// deadline.
#[test]
fn a_holder_that_comes_back_keeps_the_role() {
    const IDLE_NS: u64 = 200_000_000;
    let (clock, device, _crowd, taken) = role_taken(IDLE_NS);
    std::thread::sleep(std::time::Duration::from_nanos(IDLE_NS / 2));
    let renewed = role::now_ns();
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    std::thread::sleep(std::time::Duration::from_nanos(IDLE_NS * 3 / 4));
    let (_, recorded) = ask_on_other_thread(&clock, &device);
    let now = role::now_ns();
    if now - taken > IDLE_NS && now - renewed < IDLE_NS {
        assert!(!recorded, "the holder came back: its role was renewed");
    }
}

#[test]
fn the_role_passes_on_after_its_tenure() {
    let clock = clock_with(HELD_NS, 1);
    let device = Arc::new(Device::instant());
    let _crowd = crowd(&clock, &device, MANY_CLOSERS as usize - 1);
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    let (_, recorded) = ask_on_other_thread(&clock, &device);
    assert!(recorded);
    assert_eq!(device.records.load(Relaxed), MANY_CLOSERS as u64 + 1);
}

#[test]
fn callers_that_need_their_blocks_or_an_answer_ignore_the_role() {
    let (clock, device, _crowd) = crowded_clock();
    assert!(clock.advance(clock.ticket(), Urge::Ask, &*device));
    let before = device.records.load(Relaxed);
    for urge in [Urge::Try, Urge::Wait] {
        let (c, d) = (clock.clone(), device.clone());
        assert!(on_other_thread(move || c.advance(c.ticket(), urge, &*d)));
    }
    assert_eq!(device.records.load(Relaxed), before + 2);
}

#[test]
fn a_call_that_records_asks_about_the_oldest_fence_once() {
    // Note [one retire a call].
    let (clock, device) = (FenceClock::new(), Device::behind());
    assert!(!clock.advance(clock.ticket(), Urge::Ask, &device));
    assert_eq!(device.records.load(Relaxed), 1);
    assert_eq!(device.queries.load(Relaxed), 1, "the new fence, asked once");
    // A second batch: one more fence, and one question about the oldest (still behind).
    assert!(!clock.advance(clock.ticket(), Urge::Ask, &device));
    assert_eq!(device.records.load(Relaxed), 2);
    assert_eq!(device.queries.load(Relaxed), 2);
    // The device catches up with the first fence: the next call retires it (and asks
    // about the second), and the first batch is covered.
    device.done_up_to.store(1, Relaxed);
    assert!(clock.advance(1, Urge::Try, &device));
    assert_eq!(device.queries.load(Relaxed), 4);
    assert!(clock.covers(1) && !clock.covers(2));
    // With every slot taken, a call that records makes room first.
    for _ in 0..MAX_IN_FLIGHT - 1 {
        clock.advance(clock.ticket(), Urge::Ask, &device);
    }
    assert_eq!(device.records.load(Relaxed), 1 + MAX_IN_FLIGHT as u64);
    let before = device.queries.load(Relaxed);
    device.done_up_to.store(2, Relaxed);
    assert!(!clock.advance(clock.ticket(), Urge::Ask, &device));
    assert_eq!(device.records.load(Relaxed), 2 + MAX_IN_FLIGHT as u64);
    assert!(clock.covers(2));
    // Before the record: fence 2 retired, fence 3 asked; after it: fence 3 again.
    assert_eq!(device.queries.load(Relaxed) - before, 3);
}
