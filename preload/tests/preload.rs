//! End-to-end tests of `libcupool_preload.so` on the CPU: C programs that reach the fake
//! libcuda (a TEST DOUBLE of the driver, tests/fake_cuda/) the three ways real programs
//! reach the real one, run with and without the preload library.

mod support;

use std::process::Command;
use support::{run, run_ok, Reach};

const ALL_REACHES: [Reach; 3] = [Reach::GetProcAddress, Reach::Dlsym, Reach::Linked];

/// The driver entry points the library replaces (docs/preload.md lists them).
const HOOKED: &[&str] = &[
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemAllocHost_v2",
    "cuMemFreeHost",
    "cuMemGetInfo_v2",
    "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz",
    "cuStreamBeginCapture",
    "cuStreamBeginCapture_ptsz",
    "cuStreamBeginCapture_v2",
    "cuStreamBeginCapture_v2_ptsz",
    "cuStreamBeginCaptureToGraph",
    "cuStreamBeginCaptureToGraph_ptsz",
    "cuStreamEndCapture",
    "cuStreamEndCapture_ptsz",
    "cuCtxEnablePeerAccess",
    "cuCtxDisablePeerAccess",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuGreenCtxStreamCreate",
    "cuStreamDestroy",
    "cuStreamDestroy_v2",
    "cuCtxDestroy_v2",
    "cuDevicePrimaryCtxReset",
    "cuDevicePrimaryCtxReset_v2",
];

fn tool_output(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool)
        .args(args)
        .arg(support::preload_library())
        .output()
        .unwrap_or_else(|e| panic!("run {tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn exports_are_the_hooks_the_cupool_api_and_dlsym_only() {
    let text = tool_output("nm", &["-D", "--defined-only"]);
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    for name in &exported {
        let base = name.split('@').next().unwrap_or(name);
        assert!(
            HOOKED.contains(&base) || base.starts_with("cupool_") || base == "dlsym",
            "unexpected export {name}"
        );
    }
    for name in HOOKED
        .iter()
        .chain(&["dlsym", "cupool_process_api_v1", "cupool_get_stats"])
    {
        assert!(exported.contains(name), "{name} is not exported");
    }
}

#[test]
fn no_load_time_dependency_on_any_cuda_library() {
    let text = tool_output("readelf", &["-d"]);
    let needed: Vec<&str> = text.lines().filter(|l| l.contains("(NEEDED)")).collect();
    assert!(
        !needed.is_empty(),
        "readelf printed no NEEDED entries:\n{text}"
    );
    for line in needed {
        let lower = line.to_ascii_lowercase();
        assert!(
            !["libcuda", "libcudart", "libnv", "libcublas", "libcudnn"]
                .iter()
                .any(|n| lower.contains(n)),
            "CUDA library among DT_NEEDED: {line}"
        );
    }
}

#[test]
fn processes_that_never_touch_cuda_run_untouched() {
    let log = support::fresh_log("inert.log");
    let log_env = [("FAKE_CUDA_LOG", log.to_str().unwrap())];
    for (program, args) in [("/bin/true", vec![]), ("sh", vec!["-c", "echo hi; exit 0"])] {
        let plain = run(program.as_ref(), &args, false, &log_env);
        let preloaded = run(program.as_ref(), &args, true, &log_env);
        assert!(
            preloaded.status.success(),
            "{program} failed under the preload"
        );
        assert_eq!(plain.stdout, preloaded.stdout, "{program}: stdout differs");
        assert_eq!(plain.stderr, preloaded.stderr, "{program}: stderr differs");
    }
    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        logged.is_empty(),
        "a non-CUDA process reached the driver:\n{logged}"
    );
}

#[test]
fn get_proc_address_is_answered_per_name_version_and_flags() {
    let exe = support::driver_program(Reach::GetProcAddress);
    let plain = run_ok(&exe, &["queries"], false, &[]);
    let pre = run_ok(&exe, &["queries"], true, &[]);
    let ours = "libcupool_preload.so:";
    let fake = "libcuda.so.1:";
    // Hooked variants: our function of exactly that variant.
    for (query, variant) in [
        ("query.cuMemAlloc@3020/0", "cuMemAlloc_v2"),
        ("query.cuMemAlloc@13000/0", "cuMemAlloc_v2"),
        ("query.cuMemFree@3020/0", "cuMemFree_v2"),
        ("query.cuMemGetInfo@3020/0", "cuMemGetInfo_v2"),
        (
            "query.cuMemGetAddressRange@3020/0",
            "cuMemGetAddressRange_v2",
        ),
        ("query.cuIpcGetMemHandle@4010/0", "cuIpcGetMemHandle"),
        (
            "query.cuPointerGetAttribute@4000/0",
            "cuPointerGetAttribute",
        ),
        ("query.cuMemFreeAsync@11020/0", "cuMemFreeAsync"),
        ("query.cuMemFreeAsync@11020/2", "cuMemFreeAsync_ptsz"),
        ("query.cuStreamBeginCapture@10000/0", "cuStreamBeginCapture"),
        (
            "query.cuStreamBeginCapture@10010/0",
            "cuStreamBeginCapture_v2",
        ),
        ("query.cuStreamEndCapture@10000/0", "cuStreamEndCapture"),
        ("query.cuGetProcAddress@11030/0", "cuGetProcAddress"),
        ("query.cuGetProcAddress@12000/0", "cuGetProcAddress_v2"),
        ("query4.cuMemAlloc@3020", "cuMemAlloc_v2"),
        ("query5.cuMemAlloc@3020", "cuMemAlloc_v2"),
        ("dlsym.libcuda.cuMemAlloc_v2", "cuMemAlloc_v2"),
        ("dlsym.libcuda.cuGetProcAddress_v2", "cuGetProcAddress_v2"),
    ] {
        assert_eq!(
            pre.get(query),
            format!("{ours}{variant}"),
            "{query} under the preload"
        );
        assert!(
            plain.get(query).starts_with(fake),
            "{query} without the preload: {}",
            plain.get(query)
        );
    }
    // Everything else: the driver's own answer, identical with and without the preload.
    // v1 cuMemAlloc/cuMemFree (32-bit ABI), the stream-ordered allocators in both flavours,
    // a per-thread query whose _ptsz variant the fake driver does not have, cuInit,
    // unknown names, versions below the first one, versions above the driver's.
    for query in [
        "query.cuMemAlloc@2000/0",
        "query.cuMemFree@2000/0",
        "query.cuMemAllocAsync@11020/0",
        "query.cuMemAllocAsync@11020/2",
        "query.cuStreamBeginCapture@10010/2",
        "query.cuInit@2000/0",
        "query.cuNoSuchFunction@12000/0",
        "query.cuMemAlloc@1000/0",
        "dlsym.libcuda.cuMemAlloc",
        "dlsym.libcuda.cuInit",
        "dlsym.libcuda.cuMemAlloc_v2x",
    ] {
        assert_eq!(pre.get(query), plain.get(query), "{query}");
    }
    assert_eq!(
        pre.get("query.cuMemAllocAsync@11020/2"),
        format!("{fake}cuMemAllocAsync_ptsz")
    );
    assert_eq!(pre.get("query.cuNoSuchFunction@12000/0"), "NULL");
    assert_eq!(pre.get("dlsym.libcuda.cuMemAlloc_v2x"), "NULL");
    // Return codes and symbolStatus are the driver's, for every query.
    let codes = |r: &support::Results| {
        r.0.iter()
            .filter(|(k, _)| k.ends_with(".rc") || k.ends_with(".status"))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(codes(&pre), codes(&plain));
    assert_eq!(pre.get("query.cuNoSuchFunction@12000/0.status"), "1");
    assert_eq!(pre.get("query.cuMemAlloc@1000/0.status"), "2");
    assert_ne!(pre.get("query.too_new.rc"), "0");
}

/// Allocations a program makes many times reach the driver far fewer times under the
/// preload, whichever way the program reaches the driver; without it, every one does.
#[test]
fn allocations_go_through_the_pool_for_every_way_of_reaching_the_driver() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let plain = run_ok(&exe, &["loop"], false, &[]);
        assert_eq!(
            plain.num("driver_allocs"),
            plain.num("program_allocs"),
            "{reach:?} without preload"
        );
        assert_eq!(plain.get("pool.available"), "0");

        // Segments (`vmm:off`), so the pool's device allocations are the driver's
        // `cuMemAlloc` calls; the VMM arena is `vmm_blocks_*` below.
        let pre = run_ok(&exe, &["loop"], true, &[("CUPOOL_CONF", "vmm:off")]);
        let program = pre.num("program_allocs");
        assert!(
            pre.num("driver_allocs") * 10 < program,
            "{reach:?}: {} driver allocations for {program} program allocations",
            pre.num("driver_allocs")
        );
        assert_eq!(pre.get("pool.available"), "1", "{reach:?}");
        assert!(pre.num("pool.num_allocs") >= program, "{reach:?}");
        assert!(
            pre.num("pool.cache_hits") * 2 > program,
            "{reach:?}: too few hits"
        );
        assert_eq!(
            pre.num("pool.device_allocs"),
            pre.num("driver_allocs"),
            "{reach:?}"
        );
    }
}

/// Note [legacy order]: with `legacy_order:on`, a program without streams gets its freed
/// block back at once and no context fence is recorded; creating a stream ends that with
/// one wait, and frees are fenced from then on. Off (the default), every phase fences.
#[test]
fn legacy_order_reuses_at_once_until_a_stream_is_created() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let on = run_ok(
            &exe,
            &["legacy-order"],
            true,
            &[("CUPOOL_CONF", "legacy_order:on")],
        );
        assert_eq!(on.num("before.same_block"), 200, "{reach:?}");
        assert_eq!(on.num("before.fences"), 0, "{reach:?}");
        assert_eq!(
            on.num("at_stream.fences"),
            1,
            "{reach:?}: the wait at the end"
        );
        assert_eq!(on.num("at_stream.waits"), 1, "{reach:?}");
        assert!(on.num("after.fences") > 0, "{reach:?}: frees fenced again");

        let off = run_ok(&exe, &["legacy-order"], true, &[]);
        assert!(off.num("before.fences") > 0, "{reach:?}");
        assert_eq!(off.num("at_stream.fences"), 0, "{reach:?}");
        assert!(off.num("after.fences") > 0, "{reach:?}");
    }
}

/// Note [device waits]: under the preload (`fence_waits:auto`), with every fence held in
/// flight, a block freed without a stream comes back at once behind a legacy-stream wait,
/// also once a blocking stream exists; a live non-blocking stream waits at its creation
/// and at every device wait, a destroyed one no more; the 65th live one ends device waits
/// after one wait for queued work. With `fence_waits:host` no stream wait is ever made.
#[test]
fn device_waits_make_non_blocking_streams_wait_too_and_end_past_their_bound() {
    let held = ("FAKE_CUDA_EVENT_LATENCY", "1000000");
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let on = run_ok(&exe, &["device-waits"], true, &[held]);
        assert_eq!(on.num("before.same_block"), 50, "{reach:?}");
        assert!(on.num("before.legacy_waits") >= 49, "{reach:?}");
        assert_eq!(on.num("before.other_waits"), 0, "{reach:?}");
        assert_eq!(on.num("blocking.same_block"), 50, "{reach:?}");
        assert!(on.num("blocking.legacy_waits") >= 50, "{reach:?}");
        assert_eq!(
            on.num("blocking.other_waits"),
            0,
            "{reach:?}: a blocking stream"
        );
        // Created while drained blocks may be in use: it waits for them, the program not.
        assert_eq!(on.num("at_non_blocking.other_waits"), 1, "{reach:?}");
        assert_eq!(on.num("at_non_blocking.host_waits"), 0, "{reach:?}");
        // Listed: every device wait makes it wait too, and reuse stays at once.
        assert_eq!(on.num("listed.same_block"), 20, "{reach:?}");
        let legacy = on.num("listed.legacy_waits");
        assert!(legacy >= 20, "{reach:?}: {legacy}");
        assert_eq!(on.num("listed.other_waits"), legacy, "{reach:?}");
        // Destroyed: no longer named.
        assert_eq!(on.num("destroyed.same_block"), 20, "{reach:?}");
        assert!(on.num("destroyed.legacy_waits") >= 20, "{reach:?}");
        assert_eq!(on.num("destroyed.other_waits"), 0, "{reach:?}");
        // 65 non-blocking streams: 64 listed (each waits once), the 65th ends the mode with
        // a wait of the program for queued work; no device wait follows.
        assert_eq!(on.num("many.other_waits"), 64, "{reach:?}");
        assert!(
            on.num("many.host_waits") >= 1,
            "{reach:?}: the wait at the end"
        );
        assert_eq!(on.num("after.legacy_waits"), 0, "{reach:?}");
        assert_eq!(on.num("after.other_waits"), 0, "{reach:?}");
        assert!(
            on.num("after.fences") > 0,
            "{reach:?}: frees fenced on the host again"
        );

        let host = run_ok(
            &exe,
            &["device-waits"],
            true,
            &[held, ("CUPOOL_CONF", "fence_waits:host")],
        );
        assert_eq!(host.num("before.legacy_waits"), 0, "{reach:?}");
        assert_eq!(host.num("blocking.legacy_waits"), 0, "{reach:?}");
        assert_eq!(host.num("at_non_blocking.other_waits"), 0, "{reach:?}");
        assert_eq!(host.num("listed.other_waits"), 0, "{reach:?}");
        assert!(
            host.num("before.same_block") < 50,
            "{reach:?}: fenced on the host"
        );
    }
}

/// Note [stream id cache]: under the preload a stream-ordered pair (through the C API) does
/// not ask the driver for its stream's id, and a stream created since makes the pool ask
/// again (the creation hook at work).
#[test]
fn stream_ids_are_asked_for_again_only_after_a_stream_creation() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let log = format!("stream-ids-{reach:?}.log");
        let (out, calls) = support::run_ok_counting_calls(&exe, &["stream-ids"], true, &log);
        assert_eq!(out.num("api"), 1, "{reach:?}: the preload's C API is there");
        assert_eq!(out.num("failures"), 0, "{reach:?}");
        assert_eq!(
            out.num("same_block"),
            300,
            "{reach:?}: reused in stream order"
        );
        let asked = calls("cuStreamGetId");
        // Stream A, stream B, then A again after B's creation: 3 for 300 pairs.
        assert_eq!(asked, 3, "{reach:?}: cuStreamGetId calls for 300 pairs");
    }
}

/// NULL, interior, unknown, double and managed frees, NULL out-pointers and size 0 get
/// exactly the driver's answers.
#[test]
fn frees_the_pool_does_not_own_get_the_drivers_own_answers() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let plain = run_ok(&exe, &["errors"], false, &[]);
        let pre = run_ok(&exe, &["errors"], true, &[]);
        assert_eq!(pre, plain, "{reach:?}");
        assert_eq!(pre.get("free_interior"), "1");
        assert_eq!(pre.get("free_block"), "0");
        assert_eq!(pre.get("free_block_twice"), "1");
        assert_eq!(pre.get("free_managed"), "0");
    }
}

#[test]
fn out_of_memory_returns_the_driver_code_and_recovers() {
    for reach in [Reach::GetProcAddress, Reach::Linked] {
        let exe = support::driver_program(reach);
        let plain = run_ok(&exe, &["oom"], false, &[]);
        let pre = run_ok(&exe, &["oom"], true, &[]);
        for r in [&plain, &pre] {
            assert_eq!(r.get("oom"), "2", "{reach:?}");
            assert_eq!(r.get("oom_out_untouched"), "1", "{reach:?}");
            assert_eq!(r.get("after_oom"), "0", "{reach:?}");
        }
        assert!(
            pre.num("pool.num_ooms") >= 1,
            "{reach:?}: the pool did not count the OOM"
        );
    }
}

/// The fake driver, like the real one, invalidates a capture when a context fence is
/// recorded during it: the pool must not fence while the capture is open.
#[test]
fn allocations_inside_a_capture_do_not_invalidate_it() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        for scenario in ["capture", "capture-nonblocking"] {
            let plain = run_ok(&exe, &[scenario], false, &[]);
            let pre = run_ok(&exe, &[scenario], true, &[]);
            assert_eq!(pre, plain, "{reach:?} {scenario}");
            assert_eq!(pre.get("end_capture"), "0", "{reach:?} {scenario}");
            assert_eq!(pre.get("fence_refusals"), "0", "{reach:?} {scenario}");
            assert_eq!(pre.get("capture_failures"), "0", "{reach:?} {scenario}");
        }
    }
}

/// Address ranges and pointer attributes of pool blocks are the blocks' own; a block that
/// shares its driver allocation exports through the registry and opens at the block (as a
/// whole allocation does natively); everything else is the driver's.
#[test]
fn queries_on_pool_blocks_answer_for_the_block() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let plain = run_ok(&exe, &["block-queries"], false, &[]);
        // Segments (`vmm:off`): a whole-segment block opens through legacy IPC at its own
        // address, as without cupool. VMM-backed blocks open through their chunks'
        // descriptors instead (`vmm_blocks_open_in_another_process`).
        let pid_file = std::env::temp_dir().join(format!(
            "cupool-block-queries-{}-{reach:?}.pid",
            std::process::id()
        ));
        let pre = run_ok(
            &exe,
            &["block-queries"],
            true,
            &[
                ("CUPOOL_CONF", "vmm:off"),
                ("PID_FILE", pid_file.to_str().expect("UTF-8 path")),
            ],
        );
        // The registry its exports made is gone with the process (removed at exit).
        let pid = std::fs::read_to_string(&pid_file).expect("the program's pid");
        let _ = std::fs::remove_file(&pid_file);
        // SAFETY: a plain libc call.
        let uid = unsafe { libc::getuid() };
        let registry = format!("/dev/shm/cupool-ipc-{uid}-{}", pid.trim());
        assert!(
            !std::path::Path::new(&registry).exists(),
            "{reach:?}: {registry} left behind"
        );
        assert_eq!(pre, plain, "{reach:?}");
        assert_eq!(pre.get("range_a.base_is_a"), "1");
        assert_eq!(pre.get("range_a.size"), "1000");
        assert_eq!(pre.get("attr_b.start_is_b"), "1");
        assert_eq!(pre.get("attr_b.size"), "1000");
        // Note [ipc registry]: a sub-allocated block travels as a tagged handle and opens
        // at the block, twice over one mapping of its segment; closes are counted.
        for key in [
            "ipc_small",
            "ipc_small_open",
            "ipc_small_open_again",
            "ipc_small_close",
            "ipc_small_close_again",
            "ipc_whole",
            "ipc_whole_open",
            "ipc_whole_close",
        ] {
            assert_eq!(pre.get(key), "0", "{reach:?}: {key}");
        }
        assert_eq!(pre.get("ipc_small_open_is_a"), "1", "{reach:?}");
        assert_eq!(pre.get("ipc_whole_open_is_whole"), "1", "{reach:?}");
        assert_eq!(pre.get("info_free_recovered"), "1", "{reach:?}");
    }
}

/// With `vmm:on`, blocks above 1 MiB come from the VMM arena: address range and pointer
/// attributes are the block's (not the arena's), IPC exports it, memory freed counts
/// as free, and a program's `cuCtxEnablePeerAccess` reaches blocks mapped before and after.
#[test]
fn vmm_blocks_answer_queries_and_follow_peer_access() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let env = [("CUPOOL_CONF", "vmm:on"), ("FAKE_CUDA_DEVICES", "2")];
        let pre = run_ok(&exe, &["vmm"], true, &env);
        assert_eq!(pre.get("a.mapped"), "1", "{reach:?}: an arena block");
        assert_eq!(pre.get("range_a.base_is_a"), "1", "{reach:?}");
        assert_eq!(pre.get("range_a.size"), (5 * 1024 * 1024 + 3).to_string());
        assert_eq!(pre.get("attr_a.start_is_a"), "1", "{reach:?}");
        assert_eq!(pre.get("attr_a.size"), (5 * 1024 * 1024 + 3).to_string());
        assert_eq!(pre.get("ipc_a"), "0", "{reach:?}: exported as descriptors");
        assert_eq!(pre.get("a.peer_before"), "0", "{reach:?}");
        assert_eq!(pre.get("enable_peer"), "0", "{reach:?}");
        assert_eq!(pre.get("a.peer_after"), "1", "{reach:?}: mapped before");
        assert_eq!(pre.get("b.peer"), "1", "{reach:?}: mapped after");
        assert_eq!(pre.get("info_free_recovered"), "1", "{reach:?}");
    }
}

/// Note [ipc of arena blocks]: with `vmm:on`, a block of the arena exported by one process
/// opens in another one under cupool (through `pidfd_getfd` and the chunks' descriptors):
/// it sees the exporter's bytes and its writes reach the exporter; opening twice gives the
/// same pointer, and the last close unmaps it. A process without cupool gets the driver's
/// error for the tagged handle.
#[test]
fn vmm_blocks_open_in_another_process() {
    for reach in ALL_REACHES {
        let exe = support::driver_program(reach);
        let env = [("CUPOOL_CONF", "vmm:on")];
        let pre = run_ok(&exe, &["vmm-ipc"], true, &env);
        assert_eq!(pre.get("ipc_a"), "0", "{reach:?}");
        assert_eq!(pre.get("child.exit"), "0", "{reach:?}");
        assert_eq!(pre.get("child.open"), "0", "{reach:?}");
        assert_eq!(pre.get("child.sees_pattern"), "1", "{reach:?}");
        assert_eq!(pre.get("child.open_again"), "0", "{reach:?}");
        assert_eq!(pre.get("child.same_pointer"), "1", "{reach:?}");
        assert_eq!(pre.get("child.close"), "0", "{reach:?}");
        assert_eq!(pre.get("child.close_again"), "0", "{reach:?}");
        assert_ne!(pre.get("child.imports"), "0", "{reach:?}");
        assert_eq!(pre.get("child.mappings_left"), "0", "{reach:?}");
        assert_eq!(pre.get("a.sees_child_write"), "1", "{reach:?}");
        assert_eq!(pre.get("a.rest_unchanged"), "1", "{reach:?}");
        assert_eq!(pre.get("plain.exit"), "0", "{reach:?}");
        assert_eq!(
            pre.get("plain.open"),
            "1",
            "{reach:?}: CUDA_ERROR_INVALID_VALUE"
        );
    }
}

#[test]
fn interposition_is_reported_only_under_the_preload() {
    let exe = support::api_program();
    assert_eq!(
        run_ok(&exe, &[], false, &[]).get("interposition_active"),
        "0"
    );
    assert_eq!(
        run_ok(&exe, &[], true, &[]).get("interposition_active"),
        "1"
    );
}

/// Note [captures seen by hooks]: under the preload the pool skips the driver's capture
/// probe before its fences even when the program reaches it only through the C API (no
/// hook ever ran); without the preload (the API library alone) it still asks.
#[test]
fn api_only_programs_under_the_preload_make_no_capture_probe() {
    let exe = support::api_program();
    for preload in [true, false] {
        let log = format!("api-probe-{preload}.log");
        let (out, count) = support::run_ok_counting_calls(&exe, &["200"], preload, &log);
        assert_eq!(out.get("pair_failures"), "0");
        assert!(count("cuCtxRecordEvent") > 0, "the frees were fenced");
        let probes = count("cuStreamIsCapturing");
        if preload {
            assert_eq!(probes, 0, "no probe under the preload");
        } else {
            assert!(probes > 0, "the API library alone asks the driver");
        }
    }
}

/// RTLD_NEXT stays relative to the caller (glibc finds it from the return address), and a
/// handle's own definition of a hooked name is returned unchanged.
#[test]
fn dlsym_keeps_the_callers_lookup_semantics() {
    let exe = support::rtld_next_program();
    let plain = run_ok(&exe, &[], false, &[]);
    let pre = run_ok(&exe, &[], true, &[]);
    assert_eq!(pre, plain);
    assert_eq!(pre.get("rtld_next_from_library_is_libc"), "1");
    assert_eq!(pre.get("wrapped_getpid_works"), "1");
    assert_eq!(pre.get("handle_own_definition"), "77");
    assert_eq!(pre.get("unknown_name_is_null"), "1");
    assert_eq!(pre.get("prefix_name_is_null"), "1");
}
