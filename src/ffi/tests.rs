//! Tests of the C boundary's own functions (`src/ffi.rs`).

use super::*;

#[test]
fn status_table_is_indexed_by_value() {
    for (i, s) in ALL_STATUSES.iter().enumerate() {
        assert_eq!(*s as usize, i);
        let text = unsafe { CStr::from_ptr(cupool_status_string(i as c_int)) };
        assert_eq!(text.to_str().unwrap(), s.as_str());
    }
}

#[test]
fn unknown_status_values_get_text() {
    for v in [-1, 15, 1000, c_int::MIN, c_int::MAX] {
        let text = unsafe { CStr::from_ptr(cupool_status_string(v)) };
        assert_eq!(text, UNKNOWN_STATUS_TEXT);
    }
}

#[test]
fn version_is_the_package_version() {
    let text = unsafe { CStr::from_ptr(cupool_version()) };
    assert_eq!(text.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn guard_turns_panic_into_internal() {
    assert_eq!(guard(|| panic!("boom")), CupoolErrorInternal);
    assert_eq!(guard(|| Err(CupoolErrorDoubleFree)), CupoolErrorDoubleFree);
    assert_eq!(guard(|| Ok(())), CupoolOk);
}

#[test]
fn device_selection_maps_minus_one_to_all() {
    assert_eq!(device_selection(-1), Ok(None));
    assert_eq!(device_selection(3), Ok(Some(3)));
    assert_eq!(device_selection(-2), Err(CupoolErrorInvalidDevice));
    assert_eq!(device_ordinal(-1), Err(CupoolErrorInvalidDevice));
}

#[test]
fn text_out_reports_needed_size_and_writes_only_when_it_fits() {
    let mut needed = 0usize;
    let mut buf = [b'x' as c_char; 8];
    unsafe {
        assert_eq!(
            copy_text_out("hello", core::ptr::null_mut(), 0, &mut needed),
            Err(CupoolErrorBufferTooSmall)
        );
        assert_eq!(needed, 6);
        needed = 0;
        assert_eq!(
            copy_text_out("hello", buf.as_mut_ptr(), 5, &mut needed),
            Err(CupoolErrorBufferTooSmall)
        );
        assert_eq!(needed, 6);
        assert!(
            buf.iter().all(|&c| c == b'x' as c_char),
            "buffer touched on failure"
        );
        assert_eq!(
            copy_text_out("hello", buf.as_mut_ptr(), 6, core::ptr::null_mut()),
            Ok(())
        );
        assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap(), "hello");
        assert_eq!(
            copy_text_out("hello", core::ptr::null_mut(), 3, &mut needed),
            Err(CupoolErrorInvalidValue)
        );
    }
}

#[test]
fn null_out_pointers_are_refused_before_any_work() {
    unsafe {
        assert_eq!(
            cupool_alloc(core::ptr::null_mut(), 16),
            CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_alloc_async(core::ptr::null_mut(), 16, core::ptr::null_mut()),
            CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_get_stats(-1, core::ptr::null_mut()),
            CupoolErrorInvalidValue
        );
        assert_eq!(
            cupool_get_memory_limit(0, core::ptr::null_mut()),
            CupoolErrorInvalidValue
        );
        assert_eq!(cupool_free(core::ptr::null_mut()), CupoolOk);
        assert_eq!(
            cupool_free_async(core::ptr::null_mut(), core::ptr::null_mut()),
            CupoolOk
        );
    }
}

#[test]
fn stats_header_is_checked_before_any_work() {
    let mut stats = CupoolStats::new();
    stats.version = 0;
    assert_eq!(
        unsafe { cupool_get_stats(-1, &mut stats) },
        CupoolErrorVersionMismatch
    );
    stats.version = CUPOOL_STATS_VERSION + 1;
    assert_eq!(
        unsafe { cupool_get_stats(-1, &mut stats) },
        CupoolErrorVersionMismatch
    );
    stats.version = CUPOOL_STATS_VERSION;
    stats.size = 4;
    assert_eq!(
        unsafe { cupool_get_stats(-1, &mut stats) },
        CupoolErrorVersionMismatch
    );
}
