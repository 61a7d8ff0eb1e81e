//! Random allocation and free sequences shared by the fault tests (`pool_faults.rs` on the
//! host backend, `cuda_faults_fake.rs` on the fake driver): a deterministic generator, and
//! live blocks that carry a byte pattern checked before every free.

use cupool::backend::{ContextInfo, StreamHandle};
use cupool::runtime::Runtime;
use cupool::CupoolStatus;

/// xorshift64*: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    /// A generator for `seed` (any value).
    pub fn for_seed(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Log-uniform between 256 B and 48 MiB.
    pub fn size(&mut self) -> u64 {
        let bits = 8 + self.below(18);
        (1u64 << bits) + self.below(1u64 << bits)
    }
}

fn fill(p: u64, n: u64, v: u8) {
    // SAFETY: the pool handed out at least n bytes at p (host memory on both backends the
    // tests use).
    unsafe { std::ptr::write_bytes(p as *mut u8, v, n.min(4096) as usize) };
}

fn holds(p: u64, n: u64, v: u8) -> bool {
    // SAFETY: as for fill.
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, n.min(4096) as usize) };
    s.iter().all(|&b| b == v)
}

/// Blocks a sequence holds: (pointer, size, stream or 0 for streamless, byte pattern).
#[derive(Default)]
pub struct Live(Vec<(u64, u64, StreamHandle, u8)>);

impl Live {
    /// One step: allocate a block of random size (streamless or on one of `streams`) and
    /// write its pattern, or free a random live block (on its stream, or one time in four
    /// without it) after checking its pattern. A failed allocation returns its status.
    pub fn step(
        &mut self,
        rt: &Runtime,
        rng: &mut Rng,
        streams: [StreamHandle; 2],
        seed: u64,
        step: u32,
    ) -> Result<(), CupoolStatus> {
        if self.0.len() < 24 && (self.0.is_empty() || rng.below(3) != 0) {
            let n = rng.size();
            let stream = [0, streams[0], streams[1]][rng.below(3) as usize];
            let p = if stream == 0 {
                rt.alloc(n as usize)
            } else {
                rt.alloc_async(n as usize, stream)
            }?;
            let v = (step % 251) as u8 + 1;
            fill(p, n, v);
            self.0.push((p, n, stream, v));
        } else {
            let i = rng.below(self.0.len() as u64) as usize;
            let (p, n, stream, v) = self.0.swap_remove(i);
            assert!(
                holds(p, n, v),
                "seed {seed} step {step}: block {p:#x} changed"
            );
            if stream == 0 || rng.below(4) == 0 {
                rt.free(p).unwrap();
            } else {
                rt.free_async(p, stream).unwrap();
            }
        }
        Ok(())
    }

    /// Checks and frees every live block.
    pub fn free_all(&mut self, rt: &Runtime, seed: u64) {
        for (p, n, _, v) in self.0.drain(..) {
            assert!(holds(p, n, v), "seed {seed}: block {p:#x} changed");
            rt.free(p).unwrap();
        }
    }
}

/// The pool's invariant check, every 50 steps.
pub fn check_every_50(rt: &Runtime, ctx: ContextInfo, seed: u64, step: u32) {
    if step % 50 == 0 {
        rt.context_pool(ctx)
            .unwrap()
            .check_invariants()
            .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
    }
}
