//! Context fences: sealing frees under a fence, polling or waiting for fences, draining
//! what they cover into the shared index, waiting for a fence before growing, and the
//! second copy of a lone fenced block.

use super::block::SegmentKind;
use super::counters::ThreadCounters;
use super::fence_times::FenceCall;
use super::fifo::Fifo;
use super::{DevicePool, Request, Shared, BLOCKS};
use crate::backend::EventHandle;
use crate::config::{self, Key};
use core::sync::atomic::Ordering;

/// Context fences outstanding at most before a poll stops recording new ones (each costs
/// an event and ~0.2-0.7 µs to record; while the device is this far behind, a new one
/// would not complete before the outstanding ones).
const MAX_OUTSTANDING_FENCES: usize = 64;
/// Fenced reuses of a lone block in a row after which the pool grows a second copy of it
/// (Note [lone fences]). A ski-rental bound: 256 fences (a record and a query, ~0.37 µs
/// on an H100) cost about what allocating a 64 MiB segment costs (~85 µs), so a loop never
/// pays much more than twice what the better of "fence every reuse" and "hold a second
/// copy" would have cost it.
const SPARE_AFTER_LONE_FENCES: u32 = 256;

/// An event or fence and the clock value it covers.
type Recorded = (EventHandle, u64);

/// The context fences outstanding after a seal.
pub(super) struct Outstanding {
    count: usize,
    newest: Option<Recorded>,
}

impl Outstanding {
    fn of(sh: &Shared) -> Self {
        Outstanding {
            count: sh.fences.len(),
            newest: sh.fences.back().copied(),
        }
    }
}

/// Which work a fence-advance pass may do. Each first seals: records one fence for the
/// frees no fence covers yet (not past [`MAX_OUTSTANDING_FENCES`] unless it waits for all).
#[derive(Copy, Clone, PartialEq, Eq)]
pub(super) enum Advance {
    /// Record events/fences for unsealed frees and poll the outstanding ones.
    Poll,
    /// Record, then wait for every outstanding event and fence (OOM path, empty_cache).
    Wait,
    /// Record, then wait at most this long for the newest fence (before growing: Note
    /// [wait before growing]); what completed meanwhile drains either way.
    WaitUpTo(core::time::Duration),
}

impl DevicePool {
    /// Records one context fence covering every block freed so far that no fence covers
    /// yet (in the fence queue and in every stream's age list).
    ///
    /// Note [no stored stream handles]: a stream's frees are made shareable by a context
    /// fence, never by an event recorded on the stream's handle: the pool only remembers
    /// handles from earlier calls, and the program may have destroyed that stream since
    /// (the driver does not validate handles: recording on a dead one is a use after
    /// free). A context fence needs no handle and covers all streams at once. Caller holds
    /// `self.events`.
    pub(super) fn seal(&self, mode: Advance) -> Outstanding {
        // Note [parked arena blocks]: a fence covers what was freed before it; parked
        // blocks first go where their free would have put them.
        self.file_all_parked();
        let (epoch, dropped) = {
            let mut sh = self.shared.lock();
            let outstanding = Outstanding::of(&sh);
            // Note [device waits]: there a new fence is of use at once (the legacy stream
            // waits for it), so the oldest outstanding one makes room: blocks it covered
            // are seen idle when a later one completes.
            let drop_oldest = mode == Advance::Poll && super::device_waits::active();
            if mode != Advance::Wait && sh.fences.len() >= MAX_OUTSTANDING_FENCES && !drop_oldest {
                // The device is far behind: one more fence would not complete sooner than
                // the outstanding ones, and the blocks simply wait for a later one.
                return outstanding;
            }
            let covered = sh.fence_sealed;
            // SAFETY (closure): pool lock held; stamps grow along each FIFO, so its newest
            // block tells whether anything in it is unsealed.
            let newest = |f: &Fifo| {
                f.back()
                    .map_or(0, |t| unsafe { BLOCKS.links(t).free_epoch })
            };
            let unsealed = newest(&sh.fence_queue) > covered
                || sh.streams.iter().any(|st| newest(&st.age) > covered);
            if !unsealed {
                return outstanding;
            }
            let dropped = if sh.fences.len() >= MAX_OUTSTANDING_FENCES && drop_oldest {
                sh.fences.pop_front()
            } else {
                None
            };
            let epoch = sh.clock;
            sh.clock += 1;
            // Before the record (Note [parked arena blocks]).
            self.fence_side.clock.store(sh.clock, Ordering::Release);
            (epoch, dropped)
        };
        if let Some((ev, _)) = dropped {
            self.backend.recycle_event(self.ctx.id, ev);
        }
        // Note [capture exclusion]: no capture may begin between the check and the fence.
        let recorded = match self.enter_ordering_calls() {
            Some(_calls) => self.fence_call(FenceCall::Record, || {
                self.backend.record_context_fence(self.ctx.id)
            }),
            None => Err(crate::backend::BackendError::Capturing),
        };
        let mut sh = self.shared.lock();
        match recorded {
            Ok(ev) => {
                sh.fences.push_back((ev, epoch));
                sh.fence_sealed = epoch;
                sh.unsealed_fence_blocks = 0;
                sh.slow.fences += 1;
            }
            Err(e) => crate::log::debug(&format!("cupool: context fence failed: {e:?}")),
        }
        Outstanding::of(&sh)
    }

    /// Seals unsealed frees, polls (or waits for) outstanding context fences, and moves
    /// the blocks they cover to the shared index. Returns how many blocks moved.
    ///
    /// This is the streamless path's cost whenever a freed block must be fenced before its
    /// reuse, so it takes the pool lock as few times as it can: once before and once after
    /// recording, once to retire fences and drain; more only in a binary search.
    pub(super) fn advance(&self, mode: Advance) -> usize {
        self.reporting_stalls("a fence pass", || self.advance_now(mode))
    }

    /// Runs `fence_work`; with `CUPOOL_LOG=debug`, reports it when it stalled the caller for
    /// over 50 µs (a driver call that blocked, or a wait for another thread's pass).
    pub(super) fn reporting_stalls<T>(&self, what: &str, fence_work: impl FnOnce() -> T) -> T {
        if crate::log::level() < crate::log::Level::Debug {
            return fence_work();
        }
        let started = std::time::Instant::now();
        let result = fence_work();
        let spent = started.elapsed();
        if spent > std::time::Duration::from_micros(50) {
            crate::log::debug(&format!(
                "cupool: device {}: {what} took {} us",
                self.ctx.device,
                spent.as_micros()
            ));
        }
        result
    }

    fn advance_now(&self, mode: Advance) -> usize {
        // A panic elsewhere cannot leave the guarded data (there is none) inconsistent.
        let _ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let Outstanding { count, newest } = self.seal(mode);
        let queries = core::cell::Cell::new(0u64);
        // Note [device waits]: a poll makes the legacy stream wait for what it does not find
        // complete. A bounded wait before growing stays on the host: what it waits for
        // must be seen idle to move.
        let on_device = mode == Advance::Poll && super::device_waits::active();
        let done = match (mode, newest) {
            (_, None) => 0,
            // Waiting on the newest covers every older one; if that fails (driver error),
            // no older one is tried.
            (Advance::Wait, Some((ev, e))) => {
                if self.backend.wait_event(self.ctx.id, ev).is_ok() {
                    e
                } else {
                    0
                }
            }
            (Advance::WaitUpTo(bound), Some(newest)) => {
                match self.backend.wait_event_for(self.ctx.id, newest.0, bound) {
                    Ok(true) => newest.1,
                    _ => self
                        .newest_completed(count, newest, &queries)
                        .map_or(0, |(_, e)| e),
                }
            }
            (_, Some(newest)) => self
                .newest_completed(count, newest, &queries)
                .map_or(0, |(_, e)| e),
        };
        let mut device_done = match newest {
            Some((ev, e)) if on_device && done < e => self.wait_on_device(ev, e),
            _ => 0,
        };
        // Retire the fences that completed and drain what they cover; the events go back
        // to the backend with no pool lock held (Note [pool locks]).
        let mut moved = 0;
        loop {
            let mut retired = [EventHandle(0); 16];
            let mut n = 0;
            {
                let mut sh = self.shared.lock();
                sh.slow.fence_queries += queries.take();
                sh.fence_done = sh.fence_done.max(done);
                // Taken once, as the queries are: later rounds only retire more fences.
                let waited_to = core::mem::take(&mut device_done);
                if waited_to > 0 {
                    sh.slow.device_waits += 1;
                    sh.device_drained = sh.device_drained.max(waited_to);
                }
                Self::release_confirmed(&mut sh);
                while n < retired.len() {
                    match sh.fences.front() {
                        Some(&(ev, e)) if e <= sh.fence_done => {
                            sh.fences.pop_front();
                            retired[n] = ev;
                            n += 1;
                        }
                        _ => break,
                    }
                }
                if n < retired.len() {
                    // SAFETY: pool lock held.
                    moved += unsafe { self.drain(&mut sh) };
                }
            }
            for &ev in &retired[..n] {
                self.backend.recycle_event(self.ctx.id, ev);
            }
            if n < retired.len() {
                return moved;
            }
        }
    }

    /// The newest of the `count` outstanding fences (`newest` is the last) known complete,
    /// if any; `queries` counts the driver queries made. Caller holds `self.events`, so the
    /// list does not change meanwhile.
    ///
    /// Note [galloping fence search]: a fence covers all the work its older ones cover, so
    /// the completed fences are (up to the instant of each query) a prefix of the list.
    /// Every pass records a fence and retires the ones that completed since the last pass,
    /// so while the device is behind, the list holds many fences of which only the oldest
    /// one or two have completed; on an idle device it holds one. So the search starts at
    /// the oldest and gallops (positions 0, 1, 3, 7, ...), then bisects the last gap: k
    /// newly completed fences cost about 2 log2(k + 1) + 1 queries, whatever the list's
    /// length. Asking the newest first and bisecting the whole list, as before, cost
    /// 1 + log2(count) whenever the newest had not completed. On the traces at 1-5 ms of
    /// lag the queries fell by half; on an H200 under the preload, by 19% (GPT loop) and 44%
    /// (conv net) a step, but their time only by 3-7%: the queries left cost more each
    /// (1.40 → 1.60 µs and 1.00 → 1.74 µs on average), for reasons not known
    /// (docs/BENCHMARKS.md, eighteenth session). Whatever a query error or a
    /// race does to the ordering, the answer is a fence that did complete, which is all
    /// correctness needs.
    fn newest_completed(
        &self,
        count: usize,
        newest: Recorded,
        queries: &core::cell::Cell<u64>,
    ) -> Option<Recorded> {
        let fence_at = |i: usize| -> Recorded {
            if i + 1 == count {
                newest
            } else {
                self.shared.lock().fences[i]
            }
        };
        let complete = |i: usize| -> Option<Recorded> {
            let f = fence_at(i);
            queries.set(queries.get() + 1);
            self.fence_call(FenceCall::Query, || {
                self.backend.event_completed(self.ctx.id, f.0)
            })
            .unwrap_or(false)
            .then_some(f)
        };
        galloping_prefix_end(count, complete)
    }

    /// Moves every block whose event or fence has completed to the shared index; returns
    /// how many.
    ///
    /// # Safety
    /// Pool lock held.
    unsafe fn drain(&self, sh: &mut Shared) -> usize {
        let mut moved = 0;
        // Note [device waits]: blocks up to `device_drained` are reusable too; those the
        // host has not seen idle keep their granules pinned.
        let confirmed = sh.fence_done;
        let fence_done = confirmed.max(sh.device_drained);
        while let Some(idx) = sh.fence_queue.front() {
            if BLOCKS.links(idx).free_epoch > fence_done {
                break;
            }
            sh.fence_queue.remove(&BLOCKS, idx);
            if BLOCKS.links(idx).free_epoch > confirmed {
                Self::hold_until_confirmed(sh, idx);
            }
            self.insert_shared(sh, idx);
            moved += 1;
        }
        for pos in 0..sh.streams.len() {
            loop {
                let st = &mut sh.streams[pos];
                let Some(idx) = st.age.front() else { break };
                let free_epoch = BLOCKS.links(idx).free_epoch;
                if free_epoch > fence_done {
                    break;
                }
                let (kind, unconfirmed) = (BLOCKS.get(idx).data().kind, free_epoch > confirmed);
                st.age.remove(&BLOCKS, idx);
                st.index(kind).remove(&BLOCKS, idx);
                if unconfirmed {
                    Self::hold_until_confirmed(sh, idx);
                }
                self.insert_shared(sh, idx);
                moved += 1;
            }
        }
        moved
    }

    /// Note [wait before growing]: blocks freed while the device is behind wait for their
    /// fence, and a miss that cannot use them would take more memory from the driver. When
    /// the bytes waiting would cover the request, the miss waits (at most `grow_wait_us`)
    /// for the newest fence instead, which is what `cudaFree` would have waited for on
    /// every free; then it fits the request from what drained. The stall is bounded and
    /// taken only on a miss, where a driver allocation (tens of µs) was the alternative.
    /// A spare copy (Note [lone fences]) is not subject to this: it exists to save fences.
    ///
    /// In the VMM arena, memory freed without a stream need not cover the whole request:
    /// once drained, its chunks move to the new block (Note [arena chunks]), which then needs new
    /// memory only for the rest. So a large request also waits when such frees cover half
    /// of it. A buffer freed and allocated again a little larger every step while the
    /// device is behind (a KV cache grown by `torch.cat`) otherwise holds two copies: host
    /// replays with `--gpu-lag-us 5000`, `synthetic/growing` 49.97% → 99.37% utilization,
    /// `small_huge_interleaved` 82.94% → 95.03%, `streamless` 83.35% → 89.47%,
    /// `conv_train.cupool` 95.54% → 96.77% (docs/BENCHMARKS.md).
    ///
    /// The requesting stream's own frees count toward that half as well: no block of them
    /// fits (the fit above would have taken it), but once fenced their chunks move just the
    /// same. Without them, PyTorch's frees through `cupool.torch.enable()` (all on one
    /// stream) sat beside the new memory while the device was behind: `--gpu-lag-us 5000`,
    /// `gpt_train.torch` 92.89% → 96.63%, `llm_generate.torch` 96.81% → 97.88%,
    /// `conv_train.torch` 96.84% → 97.17% (at the peak of the first, 347 MiB of them).
    /// Frees made on other streams are left out: counting every stream's made
    /// `multistream` wait and fragment (93.62% → 90.97%).
    ///
    /// And the request waits when those frees cover all the memory the arena would create
    /// for it (the request less the idle and stealable memory it holds, which moves to it
    /// anyway), however small a share of the request that is: waiting then saves the whole
    /// growth. Host replays at `--gpu-lag-us` 5000 / 1000: `conv_train.torch` 97.17% →
    /// 98.06% / unchanged, `many_large_sizes` 94.06% → 95.49% / 95.28%,
    /// `small_huge_interleaved` over 8 seeds +3.3 / +5.1 points on average (one seed −8.2
    /// at 5000: its peak moved to another event), `multistream` −0.4 / −0.3 on average,
    /// `synthetic/streamless` 91.15% → 89.80%; lag 0 unchanged.
    ///
    /// Frees made without a stream count for any share, down to one granule of what the
    /// arena would create: each of them was a `cudaFree`, which would have waited for the
    /// device, so waiting for them once before growing costs the program no more than its
    /// own calls would have, and each granule they free is a granule not created. Frees on
    /// streams still need the shares above (waiting for them is a stall a stream-ordered
    /// allocator would not make). Host replays at `--gpu-lag-us` 1000 / 5000:
    /// `synthetic/streamless` 90.47% → 93.97% / 90.47% → 93.97%,
    /// `small_huge_interleaved` 96.45% → 99.39% / 96.45% → 99.39%,
    /// `gpt_train.cupool` 95.82% → 96.85% / 96.24% → 96.74%, `many_large_sizes` 94.53% →
    /// 95.11% / 95.83% → 95.28%; lag 0 unchanged (docs/BENCHMARKS.md).
    pub(super) fn wait_before_growing(&self, c: &ThreadCounters, req: Request) -> Option<u64> {
        let bound = config::get(Key::GrowWaitUs);
        if bound == 0 || !self.may_order() {
            return None;
        }
        let (waiting, moves_into_it) = {
            let sh = self.shared.lock();
            // Note [device waits]: blocks drained by a device wait are reusable in place,
            // but their memory moves only once their fence is seen complete.
            let held_by_device: u64 = sh.device_pins.iter().map(|p| p.1).sum();
            let streamless = sh.fence_queue.bytes + held_by_device;
            let on_streams: u64 = sh.streams.iter().map(|st| st.age.bytes).sum();
            let own = req
                .stream
                .and_then(|s| sh.stream_pos.get(&s.id).copied())
                .map_or(0, |pos| sh.streams[pos].age.bytes);
            let in_arena = req.kind == SegmentKind::Large && self.arena_active_in(&sh);
            // What the arena would create for the request: at most its granules less
            // the memory the arena holds unused (idle and stealable chunks move to it).
            let to_create = sh.arena.as_ref().map_or(u64::MAX, |a| {
                let held = (a.idle_granules() + a.stealable_granules()) * a.granule;
                req.size.next_multiple_of(a.granule).saturating_sub(held)
            });
            let movable = streamless + own;
            let granule = sh.arena.as_ref().map_or(u64::MAX, |a| a.granule);
            // A granule's worth of streamless frees saves a granule of growth: their
            // `cudaFree` would have waited for the device anyway.
            let saves_a_granule = to_create > 0 && streamless >= granule;
            (
                streamless + on_streams,
                in_arena
                    && (saves_a_granule
                        || 2 * movable >= req.size
                        || (to_create > 0 && movable >= to_create)),
            )
        };
        if waiting < req.size && !moves_into_it {
            return None;
        }
        let bound = core::time::Duration::from_micros(bound);
        let started = std::time::Instant::now();
        let moved = self.advance(Advance::WaitUpTo(bound));
        {
            let mut sh = self.shared.lock();
            sh.slow.grow_waits += 1;
            sh.slow.grow_wait_ns += started.elapsed().as_nanos() as u64;
        }
        // Blocks drained by a device wait that are now seen idle moved nothing, but their
        // memory may move now: the caller's next fit remaps it.
        if moved == 0 {
            return None;
        }
        self.try_fit(c, req, false)
    }

    /// Whether this miss should grow a second copy of a large block instead of fencing the
    /// freed one again; if so, the streak starts again.
    ///
    /// Note [lone fences]: a block with a segment of its own that a loop frees without a
    /// stream and allocates again needs, for every reuse, a context fence recorded after
    /// its free and seen complete (~0.37 µs of driver calls on an H100, most of such a
    /// pair's cost). With two copies, one fence covers both frees: half the fences. When
    /// [`SPARE_AFTER_LONE_FENCES`] misses in a row were each served by a fence pass that
    /// made exactly one block reusable, the next miss of a large block up to
    /// `fence_spare_max` grows instead. With GPU work in flight the pool grows the second
    /// copy anyway (the fence is not complete yet), so this only gives an idle loop a busy
    /// loop's footprint. The copy is ordinary idle cache: released by `empty_cache` and
    /// before an out-of-memory error, reported free by the interposer's `cuMemGetInfo`.
    pub(super) fn spare_due(&self, req: Request) -> bool {
        if req.kind != SegmentKind::Large || req.size > config::get(Key::FenceSpareMax) {
            return false;
        }
        let streak = self.lone_fence_streak.load(Ordering::Relaxed);
        // Of racing misses, the one that resets the streak grows the copy.
        streak >= SPARE_AFTER_LONE_FENCES
            && self
                .lone_fence_streak
                .compare_exchange(streak, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Counts a miss's fence pass for Note [lone fences]: it made `moved` blocks reusable,
    /// and the request was `served` from them.
    pub(super) fn note_fence_pass(&self, req: Request, moved: usize, served: bool) {
        let lone = moved == 1 && served && req.kind == SegmentKind::Large;
        let streak = self.lone_fence_streak.load(Ordering::Relaxed);
        let next = if lone { streak.saturating_add(1) } else { 0 };
        if next != streak {
            self.lone_fence_streak.store(next, Ordering::Relaxed);
        }
    }

    /// Waits until the work queued in this pool's context so far has completed: one
    /// context fence, recorded and waited for (Note [legacy order] in the runtime). A
    /// capture in progress, or a driver error, is reported and nothing is waited for.
    pub fn wait_for_queued_work(&self) -> core::result::Result<(), crate::backend::BackendError> {
        // Note [capture exclusion]: no capture may begin between the record and the wait.
        let Some(_calls) = self.enter_ordering_calls() else {
            return Err(crate::backend::BackendError::Capturing);
        };
        let ev = self.backend.record_context_fence(self.ctx.id)?;
        let waited = self.backend.wait_event(self.ctx.id, ev);
        self.backend.recycle_event(self.ctx.id, ev);
        waited
    }
}

/// The last of `count` positions for which `complete` answers (`Some`), where the
/// positions that answer form a prefix (Note [galloping fence search]): probes 0, 1, 3, 7,
/// ... (the last position when that is beyond it) until one fails, then bisects between
/// the last success and the failure. Returns what `complete` gave for the position found.
fn galloping_prefix_end<T>(
    count: usize,
    mut complete: impl FnMut(usize) -> Option<T>,
) -> Option<T> {
    let mut found = None;
    // Every position below `lo` answered (as last seen); `hi` failed, or is `count`.
    let (mut lo, mut hi) = (0, count);
    let mut galloping = true;
    while lo < hi {
        let probe = if galloping {
            (2 * lo).saturating_sub(1).clamp(lo, hi - 1)
        } else {
            lo + (hi - lo) / 2
        };
        match complete(probe) {
            Some(t) => {
                found = Some(t);
                lo = probe + 1;
            }
            None => {
                hi = probe;
                galloping = false;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::galloping_prefix_end;

    /// Runs the search over `count` positions of which the first `done` answer; returns
    /// what it found and the positions it asked, in order.
    fn search(count: usize, done: usize) -> (Option<usize>, Vec<usize>) {
        let mut asked = Vec::new();
        let found = galloping_prefix_end(count, |i| {
            asked.push(i);
            (i < done).then_some(i)
        });
        (found, asked)
    }

    #[test]
    fn finds_the_end_of_every_prefix() {
        for count in 1..=70 {
            for done in 0..=count {
                let (found, asked) = search(count, done);
                assert_eq!(found, done.checked_sub(1), "count {count}, done {done}");
                assert!(asked.iter().all(|&i| i < count), "{asked:?}");
                let mut unique = asked.clone();
                unique.sort_unstable();
                unique.dedup();
                assert_eq!(unique.len(), asked.len(), "asked twice: {asked:?}");
            }
        }
    }

    #[test]
    fn queries_grow_with_the_completed_fences_not_the_list() {
        // The device behind: one or none of 64 outstanding fences completed since the last
        // pass. Bisecting the list would ask 1 + 6.
        assert_eq!(search(64, 0).1, vec![0]);
        assert_eq!(search(64, 1).1, vec![0, 1]);
        // An idle device: the one fence outstanding.
        assert_eq!(search(1, 1).1, vec![0]);
        for count in [8usize, 64, 1000] {
            for done in 0..=count {
                let bound = 2 * (usize::BITS - done.leading_zeros()) as usize + 1;
                let asked = search(count, done).1.len();
                assert!(
                    asked <= bound,
                    "count {count}, done {done}: {asked} > {bound}"
                );
            }
        }
    }
}
