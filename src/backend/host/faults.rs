//! Fault injection of the host backend (issue 14): the next call of a kind fails with the
//! error a test chooses, once. A pending fence or query fault turns the lock-free fast
//! paths off until it fires (`count_special`).

use super::HostBackend;
use crate::backend::BackendError;

impl HostBackend {
    /// The next creation of physical memory fails with `e` (fault injection).
    pub fn fail_next_create(&self, e: BackendError) {
        self.state.lock().vmm.fail_next_create = Some(e);
    }

    /// The next allocation fails with `e` (fault injection).
    pub fn fail_next_alloc(&self, e: BackendError) {
        self.state.lock().fail_next_alloc = Some(e);
    }

    /// The next context fence fails with `e` (fault injection: `cuEventRecord`).
    pub fn fail_next_fence(&self, e: BackendError) {
        let mut s = self.state.lock();
        s.fail_next_fence = Some(e);
        self.count_special(&s);
    }

    /// The next release of a segment fails with `e`, its memory staying allocated (fault
    /// injection: `cuMemFree`).
    pub fn fail_next_release(&self, e: BackendError) {
        self.state.lock().fail_next_release = Some(e);
    }

    /// Disarms every injected fault not yet fired.
    pub fn clear_faults(&self) {
        let mut s = self.state.lock();
        s.fail_next_alloc = None;
        s.fail_next_fence = None;
        s.fail_next_query = None;
        s.fail_next_release = None;
        s.vmm.fail_next_create = None;
        self.count_special(&s);
    }

    /// The next completion query fails with `e` (fault injection: `cuEventQuery`).
    pub fn fail_next_query(&self, e: BackendError) {
        let mut s = self.state.lock();
        s.fail_next_query = Some(e);
        self.count_special(&s);
    }
}
