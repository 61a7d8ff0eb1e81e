//! Maps keyed by pointers and handles (device addresses, stream handles, event ids) with
//! a fast hash: these keys never come from input an attacker chooses, so the standard
//! library's SipHash (keyed against flooding) buys nothing, and it cost a few percent of a
//! host-backend pair (perf of `examples/live_cost.rs`: `hash_one` and
//! `DefaultHasher::write` under the host backend's stream lookup).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes a pointer with splitmix64's finalizer: pointers are aligned and clustered, so
/// their low bits alone make poor buckets, and SipHash is needlessly slow for millions of
/// them. (The pool's stream ids, small sequential integers looked up on the hit path, use
/// the cheaper `StreamIdHasher` instead: one multiplication spreads those.)
#[derive(Default, Clone, Copy)]
pub struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }

    fn write_usize(&mut self, n: usize) {
        self.0 ^= n as u64;
    }
}

/// A map keyed by integers (pointers, handles, ids), hashed with [`PtrHasher`].
pub type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<PtrHasher>>;

/// A map keyed by pointer, hashed with [`PtrHasher`].
pub type PtrMap<V> = IntMap<u64, V>;
