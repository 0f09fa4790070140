//! A CUDA stream and the commands enqueued on it.

use super::driver::StreamHandle;
use super::event::EventHandle;
use super::module::FunctionHandle;
use super::options::WaitMode;
use super::shared::{RawCuEvent, Shared};
use super::watch::WatchTx;
use crate::backend::{Backend, RawCopy, RawEvent, RawLaunch, RawStream, Timer};
use crate::base::completion::{lock, Completion};
use crate::base::error::{Error, Result};
use cudarc::driver::sys::{self};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub(super) struct CudaStream {
    pub(super) stream: StreamHandle,
    pub(super) shared: Arc<Shared>,
    pub(super) watcher: Mutex<Option<WatchTx>>,
    /// Points sent to the watcher so far: what a spinning watcher watches
    /// (one word) instead of the channel, whose lines the sender then
    /// writes without a reader pulling them away at every look.
    pub(super) sent: Arc<AtomicUsize>,
    pub(super) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.shared.generation.is_current() {
            // A fork() child: the watcher and the driver's stream are the
            // parent's; nothing to destroy or join here.
            if let Some(t) = lock(&self.thread).take() {
                std::mem::forget(t);
            }
            return;
        }
        // Pending work still runs to completion; the driver releases the stream
        // afterwards. The watcher drains its queue (delivering the completions
        // and deferred releases still due) and exits when the sender goes.
        // SAFETY: we own the stream handle.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream.0);
        }
        self.shared.draining.begin();
        drop(lock(&self.watcher).take());
        // Wait for it: a watcher left running could be the last owner of the
        // context and tear it down while the process exits, racing the
        // driver's own teardown (seen as heap corruption at exit under
        // compute-sanitizer). Not on a completion thread (a deferred release,
        // on this watcher or on one whose stream this stream's work may wait
        // for: joining there could wait forever): the watcher then drains on
        // its own, counted in `draining`, which `synchronize` waits for.
        if let Some(t) = lock(&self.thread).take() {
            if !crate::base::completion::on_completion_thread() {
                let _ = t.join();
            }
        }
    }
}

impl CudaStream {
    pub(super) fn new_event(&self, timing: bool) -> Result<EventHandle> {
        let recycled = lock(&self.shared.free_events[timing as usize]).pop();
        if let Some(RawCuEvent(ev)) = recycled {
            return Ok(EventHandle {
                ev,
                timing,
                shared: self.shared.clone(),
            });
        }
        let mut flags = 0;
        if !timing {
            flags |= sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        }
        if self.shared.wait_mode == WaitMode::Blocking {
            flags |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuEventCreate(&mut e, flags) };
        self.shared.check("cuEventCreate", r)?;
        Ok(EventHandle {
            ev: e,
            timing,
            shared: self.shared.clone(),
        })
    }

    /// An event (recycled or new) recorded at this point of the stream.
    pub(super) fn record_event(&self, timing: bool) -> Result<Arc<EventHandle>> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        let event = Arc::new(self.new_event(timing)?);
        // SAFETY: event and stream are alive.
        let r = unsafe { sys::cuEventRecord(event.ev, self.stream.0) };
        self.shared.check("cuEventRecord", r)?;
        Ok(event)
    }
}

impl RawStream for CudaStream {
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, self.stream.0) };
        self.shared.check("cuMemcpyHtoDAsync", r)
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, self.stream.0) };
        self.shared.check("cuMemcpyDtoHAsync", r)
    }

    unsafe fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.0) };
        self.shared.check("cuMemcpyDtoDAsync", r)
    }

    unsafe fn copy_peer(
        &self,
        dst: u64,
        dst_dev: &dyn Backend,
        src: u64,
        src_dev: &dyn Backend,
        bytes: usize,
    ) -> Result<()> {
        let ctx = |b: &dyn Backend| {
            b.as_any()
                .downcast_ref::<Shared>()
                .map(|s| s.ctx.cu_ctx())
                .ok_or_else(|| {
                    Error::InvalidArgument("a peer copy to or from another backend".into())
                })
        };
        let (dst_ctx, src_ctx) = (ctx(dst_dev)?, ctx(src_dev)?);
        self.shared.usable()?;
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion, each in its context's
        // memory (caller); both contexts alive (the caller holds their
        // backends); the stream is ours.
        let r = unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, self.stream.0) };
        self.shared.check("cuMemcpyPeerAsync", r)
    }

    unsafe fn copy_batch(&self, copies: &[RawCopy]) -> Result<()> {
        self.shared.usable()?;
        self.shared.bind()?;
        let copies: Vec<_> = copies.iter().filter(|c| c.bytes > 0).collect();
        if copies.len() < 2 || !self.shared.batch_copies {
            for c in copies {
                // SAFETY: ranges valid until completion (caller); unified
                // addressing names host and device memory alike; the
                // stream is ours.
                let r = unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.bytes, self.stream.0) };
                self.shared.check("cuMemcpyAsync", r)?;
            }
            return Ok(());
        }
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.bytes).collect();
        // SAFETY: a C struct of integers and enums whose zero values are
        // valid (location hints of the "invalid" type: no hint; default
        // flags); the access order is set next.
        let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        // The sources are read in stream order: after the work before the
        // batch on this stream, which is what the job's ownership promises.
        attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut first = 0usize;
        // SAFETY: the three arrays have `len` entries and outlive the call;
        // one attribute applies from copy 0; the ranges are valid until
        // completion (caller); the driver has the entry point (checked at
        // creation: `batch_copies`); the stream is ours.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                &mut attrs,
                &mut first,
                1,
                self.stream.0,
            )
        };
        self.shared.check("cuMemcpyBatchAsync", r)
    }

    unsafe fn launch(&self, mut launch: RawLaunch<'_>) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        let Some(f) = launch.function.get::<FunctionHandle>() else {
            return Err(Error::InvalidArgument(
                "a kernel function of another backend".into(),
            ));
        };
        let cfg = launch.config;
        f.fit_shared(launch.name, cfg.dynamic_shared_bytes, &self.shared)?;
        let mut params = launch.params.pointers();
        // SAFETY: the function comes from a loaded module of this context;
        // `params` points at one live value of each declared parameter type
        // (the declaration's tuple); ranges valid until completion (caller);
        // the grid, block and shared bytes were checked against the
        // device's limits (the safe layer, and `fit_shared` above).
        let r = unsafe {
            sys::cuLaunchKernel(
                f.func,
                cfg.grid.x,
                cfg.grid.y,
                cfg.grid.z,
                cfg.block.x,
                cfg.block.y,
                cfg.block.z,
                cfg.dynamic_shared_bytes,
                self.stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.shared.check("cuLaunchKernel", r)
    }

    fn record(&self, timing: bool) -> Result<RawEvent> {
        let event = self.record_event(timing)?;
        let completion = Completion::new();
        lock(&self.watcher)
            .as_ref()
            .ok_or_else(|| Error::Internal("the stream's watcher has stopped".into()))?
            .send((event.clone(), completion.clone()))
            .map_err(|_| Error::Internal("the stream's watcher has stopped".into()))?;
        self.sent.fetch_add(1, Ordering::Release);
        Ok(RawEvent {
            completion,
            // The handle is kept for cross-stream waits; only timed events can be
            // measured (cuEventElapsedTime reports an error otherwise).
            timer: Timer::shared(event),
            timing,
        })
    }

    fn marker(&self, timing: bool) -> Result<RawEvent> {
        Ok(RawEvent {
            completion: Completion::new(),
            timer: Timer::shared(self.record_event(timing)?),
            timing,
        })
    }

    fn synchronize_in_driver(&self) -> Result<()> {
        self.shared.usable()?;
        self.shared.bind()?;
        // SAFETY: our stream, alive while self is.
        let r = unsafe { sys::cuStreamSynchronize(self.stream.0) };
        self.shared.check("cuStreamSynchronize", r)
    }

    fn wait(&self, event: &RawEvent) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        match event.timer.get::<EventHandle>() {
            Some(e) => {
                // SAFETY: both handles alive.
                let r = unsafe { sys::cuStreamWaitEvent(self.stream.0, e.ev, 0) };
                self.shared.check("cuStreamWaitEvent", r)
            }
            None => Err(Error::InvalidArgument(
                "cannot wait for an event of another backend".into(),
            )),
        }
    }
}
