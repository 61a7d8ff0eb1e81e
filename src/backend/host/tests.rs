//! Unit tests of the host backend's lock-free done fences (Note [host fences]).

use super::*;

#[test]
fn done_fences_of_many_threads_are_distinct_complete_and_all_counted() {
    let host = &HostBackend::new();
    let ctx = host.device_context(0).unwrap().id;
    const THREADS: usize = 4;
    const EACH: usize = if cfg!(miri) { 50 } else { 1000 };
    let mut handles: Vec<u64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(move || {
                    (0..EACH)
                        .map(|_| host.record_context_fence(ctx).unwrap().0)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert!(handles.iter().all(|&h| h & DONE_EVENT != 0));
    assert!(handles
        .iter()
        .all(|&h| host.event_completed(ctx, EventHandle(h)) == Ok(true)));
    handles.sort_unstable();
    handles.dedup();
    assert_eq!(handles.len(), THREADS * EACH, "two fences got one handle");
    assert_eq!(host.counters().fences_recorded, (THREADS * EACH) as u64);
}
