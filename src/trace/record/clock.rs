//! The recorder's clock: raw ticks per event, nanoseconds and time of day when written.
//!
//! Ticks are `rdtsc` on x86-64 (constant rate on every x86-64 of the last 15 years, about
//! 7 ns to read, no syscall) and `CLOCK_MONOTONIC` elsewhere (the vDSO: no syscall either).
//! They become nanoseconds only when a buffer is written, at the tick rate measured from
//! the start of the recording to that write against `CLOCK_MONOTONIC`: the rate is
//! re-measured at every write, and the longer the recording, the finer the measure. (A
//! rate measured against `CLOCK_REALTIME` would follow clock steps.) The time of day is
//! `CLOCK_REALTIME` at the start plus the elapsed nanoseconds, in local time, as RMM
//! writes it.

/// Turns ticks into nanoseconds since the start and time of day.
pub(super) struct Clock {
    ticks0: u64,
    mono0_ns: u64,
    /// Local time at the start, in microseconds since the epoch shifted by the UTC offset.
    pub(super) local0_us: u64,
    ns_per_tick: f64,
}

impl Clock {
    pub(super) fn start() -> Clock {
        let ticks0 = ticks();
        let mono0_ns = clock_ns(libc::CLOCK_MONOTONIC);
        let real_ns = clock_ns(libc::CLOCK_REALTIME);
        let local0_us = (real_ns / 1000).saturating_add_signed(utc_offset_s() * 1_000_000);
        Clock {
            ticks0,
            mono0_ns,
            local0_us,
            ns_per_tick: DEFAULT_NS_PER_TICK,
        }
    }

    /// Measures the tick rate over the time since the start.
    pub(super) fn calibrate(&mut self) {
        let (t, m) = (ticks(), clock_ns(libc::CLOCK_MONOTONIC));
        if t > self.ticks0 && m > self.mono0_ns {
            self.ns_per_tick = (m - self.mono0_ns) as f64 / (t - self.ticks0) as f64;
        }
    }

    pub(super) fn nanos(&self, ticks: u64) -> u64 {
        (ticks.saturating_sub(self.ticks0) as f64 * self.ns_per_tick) as u64
    }
}

#[cfg(target_arch = "x86_64")]
const DEFAULT_NS_PER_TICK: f64 = 1.0 / 3.0;
#[cfg(not(target_arch = "x86_64"))]
const DEFAULT_NS_PER_TICK: f64 = 1.0;

/// Raw time: the time-stamp counter (constant rate on every x86-64 of the last 15 years).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn ticks() -> u64 {
    // SAFETY: `rdtsc` has no preconditions on x86-64.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub(super) fn ticks() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

pub(super) use crate::os_time::clock_ns;

/// Seconds east of UTC now (RMM writes local time of day).
fn utc_offset_s() -> i64 {
    // SAFETY: `time` and `localtime_r` with valid pointers; `tm` is plain data.
    unsafe {
        let now = libc::time(core::ptr::null_mut());
        let mut tm: libc::tm = core::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return 0;
        }
        tm.tm_gmtoff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)] // times rdtsc against a 20 ms sleep: Miri has neither rdtsc nor real time
    fn ticks_become_nanoseconds_at_the_measured_rate() {
        let mut clock = Clock::start();
        let t0 = ticks();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let t1 = ticks();
        clock.calibrate();
        let elapsed = clock.nanos(t1) - clock.nanos(t0);
        assert!(
            (19_000_000..60_000_000).contains(&elapsed),
            "{elapsed} ns for 20 ms"
        );
    }
}
