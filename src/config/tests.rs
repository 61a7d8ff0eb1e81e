//! Tests of the options (`src/config.rs`).

use super::*;

#[test]
fn bytes_parse_with_suffixes() {
    assert_eq!(parse_bytes("512"), Some(512));
    assert_eq!(parse_bytes("64K"), Some(64 << 10));
    assert_eq!(parse_bytes("2m"), Some(2 << 20));
    assert_eq!(parse_bytes("8GiB"), Some(8 << 30));
    assert_eq!(parse_bytes("1.5G"), Some(3 << 29));
    assert_eq!(parse_bytes("G"), None);
    assert_eq!(parse_bytes("12Q"), None);
    assert_eq!(parse_bytes("-1"), None);
    assert_eq!(parse_bytes("99999999999999999999T"), None);
}

#[test]
fn reserve_values_parse_and_print_back() {
    let p = ReserveSpec::parse;
    assert_eq!(
        p("8G"),
        Some(ReserveSpec {
            device: None,
            amount: ReserveAmount::Bytes(8 << 30)
        })
    );
    assert_eq!(
        p("0.9"),
        Some(ReserveSpec {
            device: None,
            amount: ReserveAmount::Fraction(0.9)
        })
    );
    assert_eq!(
        p(" 1 = 2M "),
        Some(ReserveSpec {
            device: Some(1),
            amount: ReserveAmount::Bytes(2 << 20)
        })
    );
    assert_eq!(
        p("0=0.25"),
        Some(ReserveSpec {
            device: Some(0),
            amount: ReserveAmount::Fraction(0.25)
        })
    );
    assert_eq!(
        p("1.5G"),
        Some(ReserveSpec {
            device: None,
            amount: ReserveAmount::Bytes(3 << 29)
        })
    );
    for bad in [
        "1.5", "0.0", "-1", "x=1G", "1=", "=1G", "8Q", "65535=1G", "200T",
    ] {
        assert_eq!(p(bad), None, "{bad}");
    }
    for v in ["8G", "0.9", "1=2M", "3=0.5", "0"] {
        let spec = p(v).unwrap();
        assert_eq!(ReserveSpec::unpack(spec.pack()), spec, "{v}");
        assert_eq!(p(&spec.to_string()), Some(spec), "{v} prints back");
    }
}

#[test]
fn every_default_parses() {
    for o in OPTIONS.iter() {
        assert!(parse(o.kind, o.default).is_some(), "{}", o.key);
    }
}

#[test]
fn key_enum_matches_table() {
    assert_eq!(OPTIONS[Key::Backend as usize].key, "backend");
    assert_eq!(OPTIONS[Key::Verbose as usize].key, "verbose");
    assert_eq!(OPTIONS.len(), Key::Verbose as usize + 1);
}

#[test]
fn bad_entries_are_rejected_and_defaults_kept() {
    ensure_loaded();
    let before = get(Key::FenceBatch);
    assert_eq!(
        apply_string("nonsense_key:1,fence_batch:abc,novalue", "test"),
        3
    );
    assert_eq!(get(Key::FenceBatch), before);
    assert_eq!(
        set("fence_batch", "x"),
        Err(CupoolStatus::CupoolErrorInvalidConfigValue)
    );
    assert_eq!(
        set("no_such", "1"),
        Err(CupoolStatus::CupoolErrorUnknownConfigKey)
    );
}
