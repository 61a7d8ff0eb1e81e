//! Pinned host memory under `libcupool_preload.so`, on the CPU: a C program
//! (tests/c/pinned_program.c) reaches the fake libcuda (a TEST DOUBLE of the driver,
//! tests/fake_cuda/) the three ways real programs reach the real one, run with and without
//! the preload library. `cuMemHostAlloc`/`cuMemAllocHost_v2`/`cuMemFreeHost` (what
//! `cudaHostAlloc`, `cudaMallocHost` and `cudaFreeHost` become) reach the pinned pool;
//! write-combined and registered memory, and frees the pool does not own, stay the
//! driver's.

mod support;

use support::{run_ok, Reach};

const ALL_REACHES: [Reach; 3] = [Reach::GetProcAddress, Reach::Dlsym, Reach::Linked];

#[test]
fn host_allocations_reach_the_pinned_pool_and_the_rest_stays_the_drivers() {
    for reach in ALL_REACHES {
        let exe = support::pinned_program(reach);
        let plain = run_ok(&exe, &[], false, &[]);
        let pre = run_ok(&exe, &[], true, &[]);

        // Every answer the program sees is the same, and its memory holds what it wrote.
        let differ = ["driver_allocs", "NODIFF", "pool.", "query.cuMem"];
        assert_eq!(pre.without(&differ), plain.without(&differ), "{reach:?}");
        assert_eq!(pre.get("bad_bytes"), "0", "{reach:?}");

        // Without the preload every allocation is a driver call; with it, few are.
        let program = pre.num("program_allocs");
        assert_eq!(plain.num("driver_allocs"), program, "{reach:?}");
        assert_eq!(plain.get("pool.available"), "0");
        assert!(
            pre.num("driver_allocs") * 10 < program,
            "{reach:?}: {} driver allocations for {program} program allocations",
            pre.num("driver_allocs")
        );
        assert_eq!(pre.get("pool.available"), "1", "{reach:?}");
        assert_eq!(pre.num("NODIFF pooled_flags"), program, "{reach:?}");
        // The pool counted the pairs, the two blocks of the range queries and the bad
        // frees' one real block.
        assert_eq!(pre.num("pool.num_allocs"), program + 3, "{reach:?}");
        assert_eq!(pre.num("pool.num_frees"), program + 3, "{reach:?}");
        assert!(pre.num("pool.cache_hits") * 2 > program, "{reach:?}");
        assert_eq!(
            pre.num("pool.driver_allocs"),
            pre.num("driver_allocs"),
            "{reach:?}: the pool's chunks are the driver calls seen"
        );
        assert_eq!(pre.get("pool.allocated"), "0", "{reach:?}");

        // Write-combined memory is the driver's, with its flags; registered memory too.
        for r in [&plain, &pre] {
            assert_eq!(r.get("wc.alloc"), "0", "{reach:?}");
            assert_eq!(r.get("wc.flags"), "4", "{reach:?}");
            assert_eq!(r.get("wc.free"), "0", "{reach:?}");
            assert_eq!(r.get("reg.register"), "0", "{reach:?}");
            assert_eq!(r.get("reg.free_host"), "1", "{reach:?}: INVALID_VALUE");
            assert_eq!(r.get("reg.intact"), "1", "{reach:?}");
            assert_eq!(r.get("reg.unregister"), "0", "{reach:?}");
            assert_eq!(r.get("reg.driver_registers"), "1", "{reach:?}");
            assert_eq!(r.get("attr.start_is_block"), "1", "{reach:?}");
            assert_eq!(r.get("attr.size_value"), "10000", "{reach:?}");
            assert_eq!(r.get("bad.interior"), "1", "{reach:?}");
            assert_eq!(r.get("bad.stack"), "1", "{reach:?}");
            assert_eq!(r.get("bad.free"), "0", "{reach:?}");
            assert_eq!(r.get("bad.twice"), "1", "{reach:?}");
            assert_eq!(r.get("bad.size0_out_untouched"), "1", "{reach:?}");
            assert_eq!(r.get("bad.unknown_flag"), "1", "{reach:?}");
            // Nothing leaks: the pool gave every chunk back on cupool_host_empty_cache.
            assert_eq!(r.get("driver_host_live_bytes"), "0", "{reach:?}");
        }

        if reach == Reach::GetProcAddress {
            let ours = "libcupool_preload.so:";
            let fake = "libcuda.so.1:";
            for (query, variant) in [
                ("query.cuMemHostAlloc@2020", "cuMemHostAlloc"),
                ("query.cuMemAllocHost@3020", "cuMemAllocHost_v2"),
                ("query.cuMemFreeHost@2000", "cuMemFreeHost"),
            ] {
                assert_eq!(pre.get(query), format!("{ours}{variant}"), "{query}");
                assert!(plain.get(query).starts_with(fake), "{query}");
            }
            // The 32-bit v1 and cuMemHostRegister are never hooked.
            for query in ["query.cuMemAllocHost@2000", "query.cuMemHostRegister@6050"] {
                assert_eq!(pre.get(query), plain.get(query), "{query}");
                assert!(pre.get(query).starts_with(fake), "{query}");
            }
        }
    }
}

/// No driver call from cupool once exit has started: pinned blocks freed by an exit
/// handler that runs after the preload's only update the pool's records.
#[test]
fn pinned_frees_during_exit_make_no_driver_call() {
    for reach in ALL_REACHES {
        let exe = support::pinned_program(reach);
        let (out, logged) = support::run_ok_logging_calls(
            &exe,
            &["exit-free-late"],
            true,
            &format!("pinned-exit-{reach:?}.log"),
            &[],
        );
        let frees: Vec<_> = out.0.iter().filter(|(k, _)| k == "atexit_free").collect();
        assert_eq!(frees.len(), 2, "{reach:?}: {frees:?}");
        assert!(frees.iter().all(|(_, v)| v == "0"), "{reach:?}: {frees:?}");
        let after = support::calls_after_last(&logged, "cuDeviceGet");
        assert!(
            after.is_empty(),
            "{reach:?}: driver calls during exit: {after:?}"
        );
    }
}

/// A fork child of a process whose pinned pool is live passes its pinned calls through to
/// the driver, and the parent's pool keeps working.
#[test]
fn a_fork_child_gets_pinned_memory_from_the_driver() {
    for reach in [Reach::GetProcAddress, Reach::Linked] {
        let exe = support::pinned_program(reach);
        let pre = run_ok(&exe, &["fork"], true, &[]);
        assert_eq!(pre.get("child.exit"), "0", "{reach:?}");
        assert_eq!(pre.get("child.alloc"), "0", "{reach:?}");
        assert_eq!(pre.get("child.free"), "0", "{reach:?}");
        assert_eq!(
            pre.get("child.driver_allocs"),
            "1",
            "{reach:?}: the driver's"
        );
        assert_eq!(pre.get("child.pool_stats_ok"), "0", "{reach:?}");
        for key in ["parent.free", "parent.alloc_after", "parent.free_after"] {
            assert_eq!(pre.get(key), "0", "{reach:?}: {key}");
        }
    }
}
