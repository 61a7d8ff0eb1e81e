//! Unit tests of the arena's bookkeeping: pins, placement and chunks.

use super::*;

const G: u64 = 2 << 20;

fn arena() -> Arena {
    Arena::new(G * 10, 64 * G, G)
}

/// Backs `len` granules from `at` with one new chunk, as a map call would.
fn map_new(a: &mut Arena, at: usize, len: u32, handle: u64) -> u32 {
    let id = a.new_chunk(handle, len);
    a.record_mapped(id, at);
    id
}

#[test]
fn a_chunk_is_stealable_only_when_no_granule_is_pinned() {
    let mut a = arena();
    // A 5 MiB block over granules 0..=2, backed by one chunk.
    a.pin(a.base, 5 << 20);
    map_new(&mut a, 0, 3, 1);
    assert_eq!((a.mapped, a.held()), (3, 3));
    // Its neighbour shares granule 2, then the first block goes back.
    a.pin(a.base + (5 << 20), 1 << 20);
    a.unpin(a.base, 5 << 20);
    let mut create = 0;
    assert_eq!(
        a.plan_run(10, 3, &mut create, 4, false),
        None,
        "granule 2 is still pinned"
    );
    a.unpin(a.base + (5 << 20), 1 << 20);
    let steps = a
        .plan_run(10, 3, &mut create, 4, false)
        .expect("the chunk is free now");
    assert_eq!(steps.len(), 1);
    let Step::Map { chunk, at: 10 } = steps[0] else {
        panic!("{steps:?}");
    };
    assert_eq!((chunk.len, chunk.was_at), (3, Some(0)));
    assert_eq!(
        a.mapped, 0,
        "taken out of the books until the calls are made"
    );
    a.record_mapped(chunk.id, 10);
    a.check(&[0; 64]).unwrap();
}

#[test]
fn runs_take_idle_then_stolen_then_recut_then_new_memory() {
    let mut a = arena();
    let idle = a.new_chunk(7, 2);
    a.record_idle(idle);
    map_new(&mut a, 0, 4, 8); // stealable: nothing pinned
                              // 3 granules: the idle pair, then the 4-granule chunk is too big: re-cut to 1.
    let mut create = 0;
    let steps = a.plan_run(20, 3, &mut create, 4, false).unwrap();
    assert!(matches!(steps[0], Step::Map { chunk, at: 20 } if chunk.id == idle));
    assert!(
        matches!(steps[1], Step::Recut { chunk, len: 1, at: 22 } if chunk.was_at == Some(0)),
        "{steps:?}"
    );
    assert_eq!(a.held(), 0);
    // Nothing left to move: new memory, in chunks of at most `max_chunk`, within
    // `create`.
    let mut create = 5;
    assert_eq!(
        a.plan_run(30, 6, &mut create, 4, false),
        None,
        "over what may be created"
    );
    assert_eq!(create, 5, "nothing planned on failure");
    let mut create = 6;
    let steps = a.plan_run(30, 6, &mut create, 4, false).unwrap();
    assert_eq!(
        steps,
        vec![
            Step::Create { len: 4, at: 30 },
            Step::Create { len: 2, at: 34 }
        ]
    );
    assert_eq!(create, 0);
}

#[test]
fn small_chunks_mapped_side_by_side_are_merged_up_to_the_chunk_size() {
    let plan = |merge: bool| {
        let mut a = arena();
        let idle = a.new_chunk(1, 1);
        a.record_idle(idle);
        for g in 0..4 {
            map_new(&mut a, g, 1, 2 + g as u64); // stealable one-granule chunks
        }
        map_new(&mut a, 8, 4, 9); // a full-size chunk: never merged
        let mut create = 0;
        let steps = a.plan_run(20, 9, &mut create, 4, merge).unwrap();
        assert_eq!(create, 0, "merging creates no memory the pool did not hold");
        steps
    };
    let plain = plan(false);
    assert_eq!(plain.len(), 6, "one map per chunk: {plain:?}");
    let merged = plan(true);
    let kinds: Vec<&str> = merged
        .iter()
        .map(|s| match s {
            Step::Map { .. } => "map",
            Step::Drop { .. } => "drop",
            Step::Create { .. } => "create",
            Step::Recut { .. } => "recut",
        })
        .collect();
    // The idle granule first (its neighbour in the run is the full-size chunk, so it has
    // no partner), then the full-size chunk as it is, then the four stolen one-granule
    // chunks made again as one chunk of four granules at 25.
    assert_eq!(
        kinds,
        ["map", "map", "drop", "drop", "drop", "drop", "create"],
        "{merged:?}"
    );
    assert!(matches!(merged[1], Step::Map { chunk, at: 21 } if chunk.len == 4));
    assert_eq!(merged[6], Step::Create { len: 4, at: 25 });
}

#[test]
fn take_unused_stays_within_its_bound() {
    let mut a = arena();
    map_new(&mut a, 0, 4, 1); // stealable, 4 granules
    let idle = a.new_chunk(2, 3);
    a.record_idle(idle);
    let small = a.new_chunk(3, 1);
    a.record_idle(small);
    let taken = a.take_unused(4);
    let lens: Vec<u32> = taken.iter().map(|t| t.len).collect();
    assert_eq!(
        lens,
        vec![4],
        "the stealable chunk fills the bound; the idle ones stay"
    );
    assert_eq!(a.idle_granules(), 4);
    assert_eq!(
        a.take_unused(u64::MAX).len(),
        2,
        "no bound: everything unused"
    );
}

#[test]
fn placement_prefers_mapped_windows_start_then_end() {
    let mut a = arena();
    // A free block over granules 0..8 whose granules 5..=7 are mapped.
    map_new(&mut a, 5, 3, 1);
    let block = 8 * G;
    assert_eq!(
        a.placement(a.base, block, 2 * G),
        (0, 6 * G),
        "the end before inside"
    );
    assert_eq!(
        a.placement(a.base, block, 3 * G),
        (0, 5 * G),
        "the block's end"
    );
    assert_eq!(
        a.placement(a.base, 10 * G, 2 * G),
        (0, 5 * G),
        "a window inside"
    );
    // Nothing mapped fits 4 granules: the window with the most mapped ones.
    assert_eq!(a.placement(a.base, block, 4 * G), (1, 4 * G));
    map_new(&mut a, 0, 2, 2);
    assert_eq!(
        a.placement(a.base, block, 2 * G),
        (0, 0),
        "the start wins ties"
    );
    // Unaligned: a block starting half way into granule 0.
    let p = a.base + G / 2;
    assert_eq!(a.placement(p, block - G, G), (0, 0));
    assert_eq!(a.unmapped(p, 3 * G), vec![2, 3]);
}

#[test]
fn take_all_unused_leaves_only_pinned_memory() {
    let mut a = arena();
    a.pin(a.base, G);
    map_new(&mut a, 0, 2, 1); // pinned by the block on granule 0
    map_new(&mut a, 4, 2, 2); // free
    let idle = a.new_chunk(3, 1);
    a.record_idle(idle);
    let taken = a.take_all_unused();
    assert_eq!(taken.len(), 2);
    assert_eq!((a.mapped, a.held()), (2, 2));
    for t in taken {
        a.drop_chunk(t.id);
    }
    let mut expected = vec![0; 64];
    expected[0] = 1;
    a.check(&expected).unwrap();
    assert_eq!(a.chunk_counts(), (1, 1));
    assert_eq!(a.mapped_runs(), vec![(a.base, 2 * G)]);
}

#[test]
fn pinned_bytes_of_a_free_block_reaching_past_the_mapped_part() {
    const MIB: u64 = 1 << 20;
    let mut a = arena();
    let end = a.base + a.size;
    // Granules 0..=3 mapped; a live block over [1 MiB, 7 MiB) pins all four.
    map_new(&mut a, 0, 4, 1);
    assert_eq!(a.top, 4);
    a.pin(a.base + MIB, 6 * MIB);
    // The free block after it, to the end of the range, shares granule 3: 1 MiB of it.
    assert_eq!(
        a.pinned_bytes(a.base + 7 * MIB, end - a.base - 7 * MIB),
        MIB
    );
    // Past the top nothing is pinned.
    assert_eq!(a.pinned_bytes(a.address(4), end - a.address(4)), 0);
    // The top moves with a mapping: a live block of half of granule 6, mapped, leaves the
    // free block after it the other half pinned.
    map_new(&mut a, 6, 1, 2);
    a.pin(a.address(6), G / 2);
    let after = a.address(6) + G / 2;
    assert_eq!(a.pinned_bytes(after, end - after), G / 2);
    assert_eq!(
        a.pinned_bytes(a.address(4), 2 * G),
        0,
        "granules 4 and 5: not pinned"
    );
}
