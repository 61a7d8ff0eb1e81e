//! Giving blocks back: streamless, stream-ordered and in allocation order, and the
//! thread cache's flush.

use super::tracing::{trace_free, Freed};
use super::{legacy_order, Runtime};
use crate::backend::{DevicePtr, StreamHandle};
use crate::pool::handover::{self, Taken};
use crate::pool::thread_cache::with_thread;
use crate::pool::{StreamRef, ADDRESSES, BLOCKS, STREAMLESS};
use crate::status::Result;
use crate::trace::record;

impl Runtime {
    /// Gives the calling thread's cached blocks back to the shared pool (where other
    /// streams can get them once their events complete).
    pub fn flush_thread_cache(&self) {
        with_thread(|_, cache| {
            if let Some(cache) = cache {
                cache.flush_all();
            }
        });
    }

    /// Whether `ptr` is a block the program holds (without taking it).
    pub fn owns(&self, ptr: DevicePtr) -> bool {
        ADDRESSES
            .get(ptr)
            .and_then(|i| BLOCKS.try_get(i))
            .is_some_and(|b| b.is_allocated_at(ptr))
    }

    /// Streamless free: reused only after a context fence recorded after this call completes.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        let result = handover::take_back(ptr).map(Self::free_taken_streamless);
        if record::active() {
            trace_free(result, ptr, None);
        }
        result.map(|_| ())
    }

    /// The rest of [`Runtime::free`], the block taken back.
    fn free_taken_streamless(taken: Taken) -> Freed {
        let pool = taken.pool();
        // Note [legacy order]: a block allocated in the mode (on the legacy stream, in its
        // own pool's context) is freed on that stream; any other block as usual.
        let (alloc_stream, alloc_handle) = taken.stream();
        let on_legacy = legacy_order::active()
            && alloc_stream != STREAMLESS
            && alloc_handle == legacy_order::LEGACY_STREAM as u64;
        with_thread(|ts, cache| {
            let c = ts.counters(pool.index);
            let freed = Freed {
                requested: taken.requested(),
                size: taken.size(),
                device: pool.ctx.device,
                stream_id: record::NO_STREAM_ID,
            };
            pool.note_freed(c, taken.size(), taken.requested());
            if on_legacy {
                let s = StreamRef {
                    id: alloc_stream,
                    handle: legacy_order::LEGACY_STREAM,
                };
                taken.to_stream(cache, s);
            } else {
                taken.to_fence_or_keep(cache, c);
            }
            freed
        })
    }

    /// Frees a block in the order it was allocated in: on its allocation stream (with the
    /// handle and stream id recorded then, so no driver call, and a handle reused by a
    /// newer stream does not mislead it: Note in [`Runtime::free_on_stream`]), or without
    /// a stream when it was allocated without one. The block is looked up once.
    pub fn free_in_allocation_order(&self, ptr: DevicePtr) -> Result<()> {
        let result = handover::take_back(ptr).map(|taken| {
            let (alloc_stream, alloc_handle) = taken.stream();
            if alloc_stream == STREAMLESS {
                (Self::free_taken_streamless(taken), None)
            } else {
                let s = StreamRef {
                    id: alloc_stream,
                    handle: alloc_handle as StreamHandle,
                };
                (Self::free_taken_on_stream(taken, s), Some(alloc_handle))
            }
        });
        if record::active() {
            let stream = result.as_ref().ok().and_then(|&(_, s)| s);
            trace_free(result.map(|(f, _)| f), ptr, stream);
        }
        result.map(|_| ())
    }

    /// Stream-ordered free on `stream`. A block allocated on another stream is made safe
    /// with a context fence instead (the pool cannot know the two streams are ordered).
    #[inline]
    pub fn free_async(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<()> {
        let result = self.free_on_stream(ptr, stream);
        if record::active() {
            trace_free(result, ptr, Some(stream as u64));
        }
        result.map(|_| ())
    }

    #[inline(always)]
    fn free_on_stream(&self, ptr: DevicePtr, stream: StreamHandle) -> Result<Freed> {
        legacy_order::note_stream(stream);
        let taken = handover::take_back(ptr)?;
        let (alloc_stream, alloc_handle) = taken.stream();
        // Freed with the handle it was allocated with: no need to ask the driver. Should
        // that handle now name another stream (the first one destroyed, a new one created
        // at the same address), the block is filed under the first stream's id, which no
        // stream will ever use again, so it is reused only after a context fence: safe.
        let sid = if alloc_stream != STREAMLESS && alloc_handle == stream as u64 {
            crate::backend::StreamId(alloc_stream)
        } else {
            // Asked of the driver, not of the stream id cache (Note [stream id cache]): a
            // default handle names the stream of the current context, which need not be
            // the block's.
            match self.backend.stream_id(stream) {
                Ok(sid) => sid,
                Err(e) => {
                    // The stream cannot be identified: the program keeps the block.
                    taken.keep();
                    return Err(e.into());
                }
            }
        };
        let s = StreamRef {
            id: sid.0,
            handle: stream,
        };
        Ok(Self::free_taken_on_stream(taken, s))
    }

    /// The rest of [`Runtime::free_on_stream`], the block taken back and the stream
    /// identified: a block allocated on another stream waits for a context fence.
    fn free_taken_on_stream(taken: Taken, s: StreamRef) -> Freed {
        let pool = taken.pool();
        let (alloc_stream, _) = taken.stream();
        with_thread(|ts, cache| {
            let c = ts.counters(pool.index);
            let (size, requested) = (taken.size(), taken.requested());
            let freed = Freed {
                requested,
                size,
                device: pool.ctx.device,
                stream_id: s.id,
            };
            pool.note_freed(c, size, requested);
            if alloc_stream != STREAMLESS && alloc_stream != s.id {
                taken.to_fence(true);
            } else {
                taken.to_stream(cache, s);
            }
            freed
        })
    }
}
