//! CUDA events, recycled through the backend's free list.

use super::driver::code_name;
use super::shared::{RawCuEvent, Shared, EVENT_POOL_CAP};
use crate::base::completion::lock;
use crate::base::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use std::sync::Arc;

/// An owned CUDA event, recycled (or destroyed) on drop.
pub(crate) struct EventHandle {
    pub(super) ev: sys::CUevent,
    pub(super) timing: bool,
    pub(super) shared: Arc<Shared>,
}
// SAFETY: CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for EventHandle {}
// SAFETY: as above; record/query/synchronize are thread-safe driver calls.
unsafe impl Sync for EventHandle {}

impl EventHandle {
    /// `cuEventSynchronize` on the calling thread: the baseline the watcher's
    /// wake-up is measured against (a benchmark hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    pub(crate) fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is alive while &self is.
        let r = unsafe { sys::cuEventSynchronize(self.ev) };
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Error::Driver {
                call: "cuEventSynchronize",
                code: code_name(r),
            })
        }
    }
}

impl Drop for EventHandle {
    fn drop(&mut self) {
        // Reuse is safe: nobody holds this handle any more, and a stream wait
        // already enqueued on it refers to the record made before it (a later
        // cuEventRecord does not change what an enqueued wait waits for).
        if self.shared.broken.get().is_none() {
            let mut free = lock(&self.shared.free_events[self.timing as usize]);
            if free.len() < EVENT_POOL_CAP {
                free.push(RawCuEvent(self.ev));
                return;
            }
        }
        // SAFETY: we own the event; the driver defers destruction of a pending event.
        unsafe {
            sys::cuEventDestroy_v2(self.ev);
        }
    }
}

impl EventHandle {
    /// The driver's handle, for [`crate::interop::raw_event`]: valid while
    /// `self` is alive.
    pub(crate) fn raw_handle(&self) -> sys::CUevent {
        self.ev
    }
}
