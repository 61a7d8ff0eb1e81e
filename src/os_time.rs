//! Clocks read through the vDSO (no system call): the trace recorder's time base and the
//! shared thread fences' recorder role (Note [fence recorder role]) read them.

/// Nanoseconds of `clock` (`CLOCK_MONOTONIC`, `CLOCK_REALTIME`, `CLOCK_THREAD_CPUTIME_ID`).
#[inline]
pub(crate) fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; the vDSO answers without a syscall.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000) + ts.tv_nsec as u64
}
