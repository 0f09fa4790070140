//! What the CUDA backend, its streams and their watchers share: the
//! context, its broken state, recycled events and the frees parked off the
//! watchers.

use super::driver::{code_name, is_sticky};
use super::options::WaitMode;
use super::ordered::OrderedMem;
use crate::backend::{Draining, Generation, ReleaseFailures};
use crate::base::completion::lock;
use crate::base::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// State shared by the backend, its streams and their watchers.
pub(crate) struct Shared {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) broken: OnceLock<Error>,

    pub(super) wait_mode: WaitMode,
    /// Recycled events, `[non-timing, timing]`: creating and destroying an
    /// event per recorded point cost a driver call each way on every awaited
    /// operation; a recycled one costs a lock.
    pub(super) free_events: [Mutex<Vec<RawCuEvent>>; 2],
    /// Frees and unregistrations asked for on a watcher thread, done later on
    /// another thread (see the module docs).
    pub(super) parked: Mutex<Vec<ParkedFree>>,
    /// `parked` is non-empty (lets every allocation skip the lock).
    pub(super) has_parked: AtomicBool,
    /// Stream-ordered device memory, where the driver has memory pools.
    pub(super) ordered: Option<OrderedMem>,
    /// The driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later).
    pub(super) batch_copies: bool,
    /// Watchers of dropped streams still delivering their completions.
    pub(super) draining: Draining,
    /// Failed frees and unregistrations, the parked ones included.
    pub(super) release_failures: ReleaseFailures,
    /// The process the context was opened in: the driver does not survive
    /// `fork()`, so in a child every operation is refused.
    pub(super) generation: Generation,
}

/// Memory the GPU is done with, to be freed or unregistered off the watchers.
pub(super) enum ParkedFree {
    Device(u64),
    Host(*mut u8),
    /// A registered range, and what frees it once unregistered.
    Unregister(*mut u8, Box<dyn FnOnce() + Send>),
}
// SAFETY: a device address, a pinned host allocation or a registered range
// owned by nobody else (its owner was dropped; `release` is Send); freeing or
// unregistering it from another thread is allowed.
unsafe impl Send for ParkedFree {}

/// Whether the calling thread is a watcher (see `Shared::parked`).
pub(super) fn on_watcher() -> bool {
    crate::base::completion::on_completion_thread()
}

/// Events kept for reuse per kind; more are destroyed.
pub(super) const EVENT_POOL_CAP: usize = 4096;

/// A raw event handle in the free list.
pub(super) struct RawCuEvent(pub(super) sys::CUevent);
// SAFETY: CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for RawCuEvent {}

impl Drop for Shared {
    fn drop(&mut self) {
        // Every EventHandle holds an Arc<Shared>, so no pooled event is in use.
        let _ = self.bind();
        // Every stream holds an Arc<Shared> too: no work is left to wait for,
        // so even a watcher thread may free here.
        self.free_parked_now();
        // The memory pool and its stream go while the context is still
        // retained (`ctx`, a field, is released after this body).
        drop(self.ordered.take());
        for list in &self.free_events {
            for e in lock(list).drain(..) {
                // SAFETY: the event is ours and unused (see above).
                unsafe {
                    sys::cuEventDestroy_v2(e.0);
                }
            }
        }
    }
}

impl Shared {
    /// Checks a driver result; a sticky error marks the context broken.
    pub(super) fn check(&self, call: &'static str, r: CUresult) -> Result<()> {
        if r == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let err = Error::Driver {
            call,
            code: code_name(r),
        };
        if is_sticky(r) {
            let _ = self.broken.set(Error::ContextBroken(err.to_string()));
            return Err(self.broken.get().cloned().unwrap_or(err));
        }
        Err(err)
    }

    /// Fails at once when the context is broken.
    pub(super) fn usable(&self) -> Result<()> {
        self.generation.check("a CUDA device")?;
        match self.broken.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Parks a free when called on a watcher thread; returns whether it did.
    pub(super) fn park_on_watcher(&self, free: ParkedFree) -> bool {
        if !on_watcher() {
            return false;
        }
        self.park(free);
        true
    }

    pub(super) fn park(&self, free: ParkedFree) {
        lock(&self.parked).push(free);
        self.has_parked.store(true, Ordering::Release);
    }

    /// Frees what watchers parked (called off the watchers: allocations,
    /// frees, new streams, synchronize, and at the end).
    pub(super) fn free_parked(&self) {
        if self.has_parked.load(Ordering::Acquire) && !on_watcher() {
            self.free_parked_now();
        }
    }

    pub(super) fn free_parked_now(&self) {
        let parked = {
            let mut p = lock(&self.parked);
            self.has_parked.store(false, Ordering::Release);
            std::mem::take(&mut *p)
        };
        if self.bind().is_err() {
            return; // nothing can be freed without the context; the driver reclaims it
        }
        for free in parked {
            // SAFETY: parked by free_device / free_host / unregister_host_then,
            // whose callers guaranteed the memory is ours and unused; nothing
            // else holds it.
            let (call, r) = unsafe {
                match free {
                    ParkedFree::Device(d) => ("cuMemFree", sys::cuMemFree_v2(d)),
                    ParkedFree::Host(h) => ("cuMemFreeHost", sys::cuMemFreeHost(h.cast())),
                    ParkedFree::Unregister(h, release) => {
                        let r = sys::cuMemHostUnregister(h.cast());
                        release();
                        ("cuMemHostUnregister", r)
                    }
                }
            };
            if let Err(e) = self.check(call, r) {
                self.release_failures
                    .note("a deferred free or unregistration", &e);
            }
        }
    }

    pub(super) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| Error::Driver {
            call: "cuCtxSetCurrent",
            code: code_name(e.0),
        })
    }
}
