//! Size rounding and size classes.
//!
//! Every block is a multiple of [`ALIGNMENT`] (512 B, what `cudaMalloc` guarantees, so a
//! pool block never gives a program weaker alignment than the driver would). Classes are
//! TLSF-style: each power of two is split into [`SUBCLASSES`] equal steps, so a class spans
//! at most 12.5% of its lower bound and the class of a size is a few bit operations.

/// Alignment and granularity of every block.
pub const ALIGNMENT: u64 = 512;
const ALIGN_SHIFT: u32 = 9;
/// Steps per power of two (2^3).
const SUB_SHIFT: u32 = 3;
pub const SUBCLASSES: usize = 1 << SUB_SHIFT;
/// Largest address/size the pool handles (2^48: every device and host address fits).
pub const MAX_SIZE: u64 = 1 << 47;
/// Number of classes for sizes up to [`MAX_SIZE`].
pub const NUM_CLASSES: usize = ((47 - ALIGN_SHIFT + 1) as usize) * SUBCLASSES;

/// Rounds a request to the block size the pool hands out; `None` when the request is 0 or
/// too large to ever be satisfied.
#[inline]
pub fn round_size(requested: u64) -> Option<u64> {
    if requested == 0 || requested > MAX_SIZE {
        return None;
    }
    Some((requested + ALIGNMENT - 1) & !(ALIGNMENT - 1))
}

/// The class holding blocks of `size` (a rounded size): blocks of one class differ by less
/// than one step.
#[inline]
pub const fn class_of(size: u64) -> usize {
    debug_assert!(size >= ALIGNMENT && size <= MAX_SIZE);
    let size = if size < ALIGNMENT { ALIGNMENT } else { size };
    let fl = 63 - size.leading_zeros();
    let sl = (size >> (fl - SUB_SHIFT)) as usize & (SUBCLASSES - 1);
    (fl - ALIGN_SHIFT) as usize * SUBCLASSES + sl
}

/// Smallest size that belongs to `class`.
#[inline]
pub fn class_min_size(class: usize) -> u64 {
    let fl = (class / SUBCLASSES) as u32 + ALIGN_SHIFT;
    let sl = (class % SUBCLASSES) as u64;
    (1u64 << fl) + (sl << (fl - SUB_SHIFT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_aligned_and_minimal() {
        assert_eq!(round_size(0), None);
        assert_eq!(round_size(1), Some(512));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(MAX_SIZE), Some(MAX_SIZE));
        assert_eq!(round_size(MAX_SIZE + 1), None);
        assert_eq!(round_size(u64::MAX), None);
    }

    #[test]
    fn classes_are_monotonic_and_bounded() {
        let mut last = 0;
        let mut size = ALIGNMENT;
        while size <= MAX_SIZE {
            let c = class_of(size);
            assert!(c >= last, "class must not decrease at {size}");
            assert!(c < NUM_CLASSES);
            assert!(class_min_size(c) <= size, "{size} below its class minimum");
            if c + 1 < NUM_CLASSES {
                assert!(
                    class_min_size(c + 1) > size,
                    "{size} belongs to a higher class"
                );
            }
            last = c;
            size = if size < 1 << 20 {
                size + ALIGNMENT
            } else {
                size + size / 7 + ALIGNMENT
            };
            size = round_size(size.min(MAX_SIZE)).unwrap();
            if size == MAX_SIZE {
                assert_eq!(class_of(size), class_of(MAX_SIZE));
                break;
            }
        }
    }

    #[test]
    fn a_class_spans_at_most_an_eighth() {
        for c in SUBCLASSES..NUM_CLASSES - 1 {
            let lo = class_min_size(c);
            let hi = class_min_size(c + 1);
            assert!((hi - lo) * 8 <= lo, "class {c} spans {lo}..{hi}");
        }
    }
}
