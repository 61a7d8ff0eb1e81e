//! Note [exported segments]: a segment one of whose blocks was exported through CUDA IPC
//! stays with the pool (another process may have it mapped), while the pool's other idle
//! segments still go back to the driver; the exported segment's blocks are reused.

mod host_pool;

use host_pool::setup_on;

const KIB: usize = 1 << 10;
const MIB: u64 = 1 << 20;

#[test]
fn empty_cache_keeps_exported_segments_and_releases_the_rest() {
    let (rt, _host, ctx) = setup_on(0);
    let reserved = || rt.context_stats(ctx).unwrap().reserved_bytes.current;
    let shared = rt.alloc(4 * KIB).unwrap(); // in a 2 MiB segment
    let own = rt.alloc(64 * MIB as usize).unwrap(); // a segment of its own
    assert!(
        rt.keep_exported(shared + 1).is_none(),
        "not a block's start"
    );
    assert!(rt.keep_exported(0xdead_0000).is_none(), "not a pool block");
    let exported = rt.keep_exported(shared).expect("a live block");
    assert_eq!(exported.ptr, shared);
    rt.free(shared).unwrap();
    rt.free(own).unwrap();
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(
        reserved(),
        exported.segment_size,
        "only the exported segment is left"
    );
    // Its memory is reused as usual.
    let again = rt.alloc(4 * KIB).unwrap();
    let b = rt.lookup(again).unwrap();
    assert_eq!(b.segment_base, exported.segment_base);
    rt.free(again).unwrap();
    rt.empty_context_cache(ctx).unwrap();
    assert_eq!(reserved(), exported.segment_size, "still kept");
}
