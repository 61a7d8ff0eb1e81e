//! `legacy_order:on` (Note [legacy order]) on the host backend: streamless frees are reused
//! at once, without a context fence, until a pool call names another stream; from then on
//! they are fenced again. One process, one test: the mode ends for the whole process.

mod host_pool;

use cupool::runtime::legacy_order;

#[test]
fn streamless_frees_are_reused_at_once_until_another_stream_is_used() {
    cupool::config::set("legacy_order", "on").unwrap();
    let (rt, host, ctx) = host_pool::setup();
    // The device runs nothing on its own: a fenced block comes back only once the test
    // completes the fence, so a reuse without a fence shows.
    host.set_manual_completion(ctx.id, true);
    assert!(legacy_order::active());

    let fences = || rt.context_stats(ctx).unwrap().fences_recorded;
    // A miss may fence once (the pool moves what other lists hold before it grows); the
    // reuses after it fence never.
    for size in [3 << 20, 4096, 200 << 20] {
        let first = host_pool::alloc_free_pairs(rt, 1, size)[0];
        let before = fences();
        let addrs = host_pool::alloc_free_pairs(rt, 100, size);
        assert!(
            addrs.iter().all(|&a| a == first),
            "{size}: one block, reused at once"
        );
        assert_eq!(fences(), before, "{size}: no fence per reuse");
    }
    // A block freed while another device's context is current goes back to its own pool,
    // on its own context's legacy stream.
    let other = host.create_context(1);
    let before = fences();
    let a = rt.alloc(3 << 20).unwrap();
    host.make_current(other);
    rt.free(a).unwrap();
    host.make_current(ctx);
    assert_eq!(
        rt.alloc(3 << 20).unwrap(),
        a,
        "back in its own pool at once"
    );
    rt.free(a).unwrap();
    assert_eq!(fences(), before);
    assert_eq!(rt.context_stats(other).unwrap().num_frees, 0);
    let kept = rt.alloc(1000).unwrap();
    // A stream-ordered call on another stream ends it, with one wait for queued work.
    let s = host_pool::S1;
    let p = rt.alloc_async(1 << 20, s).unwrap();
    assert!(!legacy_order::active() && legacy_order::ended());
    rt.free_async(p, s).unwrap();

    // A block allocated under legacy order and freed now is fenced like any other.
    rt.free(kept).unwrap();
    let a = rt.alloc(3 << 20).unwrap();
    rt.free(a).unwrap();
    let pending = rt.context_stats(ctx).unwrap().pending_fence_bytes;
    assert!(
        pending >= (3 << 20) + 1000,
        "frees wait for a fence again: {pending}"
    );
    let b = rt.alloc(3 << 20).unwrap();
    assert_ne!(a, b, "a streamless free is not reused before its fence");
    rt.free(b).unwrap();
    host.complete_all(ctx.id);
    host.set_manual_completion(ctx.id, false);
}
