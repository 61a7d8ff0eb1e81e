//! A hasher for the pool's map from stream ids to their free lists.
//!
//! Stream ids come from the driver (`cuStreamGetId`: small, mostly sequential integers),
//! never from input an attacker chooses, so the standard library's SipHash (keyed against
//! flooding) buys nothing here and cost a fifth of a cached stream-ordered pair of a VMM
//! arena block on the host backend (perf: `hash_one` and `DefaultHasher::write`, 24% of
//! the samples; each pair looks its stream up twice). One multiplication by an odd
//! constant spreads sequential ids over the table's buckets (the high bits feed them).
//!
//! Not [`crate::ptr_map::PtrHasher`]: that one finishes with splitmix64 (three
//! multiplications) because pointers are aligned, and a product's low bits depend only
//! on the key's low bits, which for pointers are all zero. Stream ids are not aligned, so
//! one multiplication is enough, and this lookup is on the hit path.

use core::hash::{BuildHasherDefault, Hasher};
use std::collections::HashMap;

/// Stream id → position in the pool's stream list.
pub type StreamPositions = HashMap<u64, usize, BuildHasherDefault<StreamIdHasher>>;

/// Multiplicative hashing of one `u64` (Knuth; the constant is 2^64 / φ, odd).
#[derive(Default)]
pub struct StreamIdHasher(u64);

impl Hasher for StreamIdHasher {
    #[inline]
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed here; any other input still hashes consistently.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_land_in_distinct_buckets() {
        let mut m = StreamPositions::default();
        for id in 0..1000u64 {
            m.insert(id, id as usize);
        }
        assert!((0..1000u64).all(|id| m[&id] == id as usize));
        // The high bits (what hashbrown uses for its control bytes and buckets) differ.
        let top = |id: u64| {
            let mut h = StreamIdHasher::default();
            h.write_u64(id);
            h.finish() >> 57
        };
        let distinct: std::collections::HashSet<u64> = (0..128).map(top).collect();
        assert!(distinct.len() > 64, "{} distinct top bits", distinct.len());
    }
}
