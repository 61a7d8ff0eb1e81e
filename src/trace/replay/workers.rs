//! The per-thread replay's workers (Note [per-thread replay]) and the pool call each
//! replayed event makes, timed.

use super::{elapsed_ns, Replayer};
use crate::backend::{ContextInfo, StreamHandle};
use crate::runtime::Runtime;
use crate::status::CupoolStatus;
use crate::trace::Trace;
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Instant;

/// One pool call of a replayed event.
#[derive(Copy, Clone)]
pub(super) enum Op {
    Alloc {
        size: usize,
        stream: Option<StreamHandle>,
    },
    Free {
        ptr: u64,
        stream: Option<StreamHandle>,
    },
}

/// An operation's outcome (the block's address for an allocation) and its time in ns.
pub(super) type Done = (Result<u64, CupoolStatus>, u32);

impl Op {
    fn run(self, rt: &Runtime) -> Done {
        let start = Instant::now();
        let result = match self {
            Op::Alloc { size, stream: None } => rt.alloc(size),
            Op::Alloc {
                size,
                stream: Some(s),
            } => rt.alloc_async(size, s),
            Op::Free { ptr, stream: None } => rt.free(ptr).map(|()| 0),
            Op::Free {
                ptr,
                stream: Some(s),
            } => rt.free_async(ptr, s).map(|()| 0),
        };
        (result, elapsed_ns(start))
    }
}

/// Note [per-thread replay]: a program's threads each have a thread cache (blocks they
/// freed, reused by them without a lock), and a block in one thread's cache is out of
/// another's reach until it goes back to the pool. A replay on one thread merges them into
/// one cache and so understates what the pool holds for a program whose threads allocate
/// and free (PyTorch's autograd runs the backward pass on a thread of its own). With
/// `per_thread`, every thread of the trace gets a worker thread in the replay's context,
/// and each event runs on its thread's worker while the replay waits for it: one event at
/// a time, in trace order, so the replay stays deterministic.
pub(super) struct Workers {
    to: HashMap<u64, mpsc::Sender<Op>>,
    back: mpsc::Receiver<Done>,
}

impl Workers {
    pub(super) fn start<'scope, 'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        rt: &'env Runtime,
        host: &'env crate::backend::host::HostBackend,
        ctx: ContextInfo,
        trace: &Trace,
    ) -> Workers {
        let (done, back) = mpsc::channel();
        let mut to = HashMap::new();
        for ev in &trace.events {
            if to.contains_key(&ev.thread) {
                continue;
            }
            let (send, ops) = mpsc::channel::<Op>();
            let done = done.clone();
            scope.spawn(move || {
                host.make_current(ctx);
                for op in ops {
                    if done.send(op.run(rt)).is_err() {
                        break;
                    }
                }
                // Now, not in the thread's exit: the scope may return before thread-local
                // destructors have run, and the clean-up must find every block in the pool.
                rt.flush_thread_cache();
            });
            to.insert(ev.thread, send);
        }
        Workers { to, back }
    }
}

impl Replayer<'_> {
    /// Runs `op` on the worker of trace thread `thread` (a per-thread replay), else here.
    pub(super) fn call(&self, thread: u64, op: Op) -> Done {
        let Some(w) = &self.workers else {
            return op.run(self.rt);
        };
        // Every thread of the trace has a worker, and a worker only ends when its sender
        // is dropped: a lost worker can only be one that panicked.
        let sent = w.to.get(&thread).is_some_and(|s| s.send(op).is_ok());
        match sent.then(|| w.back.recv().ok()).flatten() {
            Some(done) => done,
            None => (Err(CupoolStatus::CupoolErrorInternal), 0),
        }
    }
}
