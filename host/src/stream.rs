//! Streams, events, and jobs: GPU work as Rust futures.
//!
//! A [`Stream`] is an in-order queue of device work. [`Stream::run`] enqueues
//! a batch of commands against a *bundle* of buffers it takes by value, and
//! returns a [`Job`]: a future that resolves to the bundle once the GPU has
//! finished with it. While the job is pending nothing else can reach the
//! buffers, so memory in flight can't be read, written or freed by the CPU.
//!
//! Cancellation: dropping an unfinished `Job` never frees memory the GPU
//! still uses and never blocks: the bundle moves into the completion's
//! deferred actions and is dropped by the completion source when the GPU is
//! done (pool buffers then return to their pool).
//!
//! The futures are runtime-agnostic (tokio, `futures::executor::block_on`,
//! anything): the backend's completion source wakes them; nothing polls.

use crate::backend::{RawEvent, RawStream};
use crate::completion::{Completion, Wait};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, KernelCall};
use crate::memory::{check_len, DeviceSlice, HostSlice, HostSliceMut, MappedFlag};
use bytemuck::Pod;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// An in-order queue of device work (a CUDA stream, or a CPU worker).
///
/// Clones share the stream. Dropping the last clone lets the work already
/// queued run to completion; on CUDA it also waits until the stream's
/// completion thread has delivered the completions still due (so no thread
/// of ours outlives the stream), which takes as long as that work does.
#[derive(Clone)]
pub struct Stream {
    raw: Arc<dyn RawStream>,
    device: Device,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").finish_non_exhaustive()
    }
}

/// A recorded point in a stream. Awaiting it waits for all work queued
/// before it; a timed event can measure elapsed GPU time to a later one.
pub struct Event {
    raw: RawEvent,
    device: Device,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("done", &self.raw.completion.is_done())
            .finish()
    }
}

impl Event {
    /// A future that resolves when the work before the event has finished
    /// (with the fault, if the work failed).
    pub fn wait(&self) -> Wait {
        self.raw.completion.wait()
    }

    /// Whether the work before the event has finished.
    pub fn is_done(&self) -> bool {
        self.raw.completion.is_done()
    }

    /// Blocks the calling thread until done (synchronous code only).
    pub fn synchronize(&self) -> Result<()> {
        self.raw.completion.block()
    }

    /// Blocks in the driver's own event wait on the calling thread
    /// (`cuEventSynchronize`), bypassing the completion source: the baseline
    /// of the wake-latency benchmark. On the CPU backend, same as `synchronize`.
    pub fn synchronize_direct(&self) -> Result<()> {
        match &self.raw.timer {
            crate::backend::Timer::Cuda(h) => h.synchronize(),
            crate::backend::Timer::Cpu(_) => self.synchronize(),
        }
    }

    /// GPU milliseconds from this event to `later` (both timed and done).
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32> {
        self.device
            .backend
            .elapsed_ms(&self.raw.timer, &later.raw.timer)
    }

    /// The completion signal behind the event.
    pub fn completion(&self) -> &Completion {
        &self.raw.completion
    }
}

impl Stream {
    /// A new stream on `device`. Created non-blocking: it never synchronizes
    /// implicitly with the legacy default stream, so streams overlap.
    pub fn new(device: &Device) -> Result<Stream> {
        Ok(Stream {
            raw: Arc::from(device.backend.new_stream()?),
            device: device.clone(),
        })
    }

    /// The device of the stream.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Records a point (no timing: cheaper).
    pub fn record(&self) -> Result<Event> {
        Ok(Event {
            raw: self.raw.record(false)?,
            device: self.device.clone(),
        })
    }

    /// Records a point that can measure elapsed time.
    pub fn record_timed(&self) -> Result<Event> {
        Ok(Event {
            raw: self.raw.record(true)?,
            device: self.device.clone(),
        })
    }

    /// A point for other streams to wait on ([`Stream::wait_event`]); it
    /// cannot be awaited (on CUDA nothing watches it, which keeps it cheap).
    pub(crate) fn marker(&self) -> Result<Event> {
        Ok(Event {
            raw: self.raw.marker(false)?,
            device: self.device.clone(),
        })
    }

    /// Makes work queued later on this stream wait for `event` (which may
    /// belong to another stream): cross-stream ordering without the host.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        if event.device.id() != self.device.id() {
            return Err(Error::InvalidArgument("event of another device".into()));
        }
        self.raw.wait(&event.raw)
    }

    /// Blocks until all queued work has finished (synchronous code only).
    pub fn synchronize(&self) -> Result<()> {
        self.record()?.synchronize()
    }

    /// An empty batch of commands on this stream.
    fn commands(&self) -> Commands<'_> {
        Commands {
            raw: &*self.raw,
            device_id: self.device.id(),
            enqueued: 0,
            _p: PhantomData,
        }
    }

    /// Enqueues the commands `f` issues against `bundle` and returns a job that
    /// hands the bundle (and `f`'s value) back once the GPU is done with it.
    ///
    /// `f` borrows host memory out of the bundle for the whole enqueue, so it
    /// cannot touch a host buffer after handing it to a copy. If `f` fails
    /// after enqueuing some commands, the job still holds the bundle until
    /// those have finished, then resolves to the error.
    pub fn run<B, R, F>(&self, mut bundle: B, f: F) -> Job<B, R>
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> Result<R>,
    {
        let mut cmds = self.commands();
        let outcome = f(&mut cmds, &mut bundle);
        let enqueued = cmds.enqueued;
        let state = match (outcome, self.raw.record(false)) {
            (outcome, Ok(ev)) => JobState::Pending {
                completion: ev.completion,
                bundle,
                value: Some(outcome),
                keep: None,
            },
            (outcome, Err(record_err)) => {
                self.abandon(bundle, enqueued);
                JobState::Failed(Some(outcome.err().unwrap_or(record_err)))
            }
        };
        Job { state }
    }

    /// The synchronous twin of [`Stream::run`]: enqueues the commands `f`
    /// issues against `bundle`, then blocks the calling thread in the
    /// driver's own wait (`cuEventSynchronize` on CUDA; no completion thread
    /// involved) until the GPU is done, and hands the bundle back. For
    /// synchronous code only: never call it on an executor thread.
    ///
    /// If `f` fails, the error is returned once what it did enqueue has
    /// finished. If the wait itself fails, the bundle is released only when
    /// that is safe (nothing enqueued, or the context broken for good), and
    /// leaked otherwise, as for [`Stream::run`].
    pub fn run_sync<B, R, F>(&self, mut bundle: B, f: F) -> Result<(B, R)>
    where
        F: for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> Result<R>,
    {
        let mut cmds = self.commands();
        let outcome = f(&mut cmds, &mut bundle);
        let enqueued = cmds.enqueued;
        if enqueued == 0 {
            return outcome.map(|v| (bundle, v));
        }
        let waited = self.raw.marker(false).and_then(|raw| {
            Event {
                raw,
                device: self.device.clone(),
            }
            .synchronize_direct()
        });
        match waited {
            Ok(()) => outcome.map(|v| (bundle, v)),
            Err(e) => {
                self.abandon(bundle, enqueued);
                Err(e)
            }
        }
    }

    /// Lets go of a bundle whose `enqueued` commands can't be seen to finish.
    /// Work was queued but its end can't be observed: never free what the GPU
    /// might still touch, so it is leaked. Nothing queued, or the context
    /// broken for good (a broken CUDA context runs nothing more, and its
    /// driver refuses to free): releasing the buffers is safe.
    fn abandon<B>(&self, bundle: B, enqueued: usize) {
        if enqueued > 0 && self.device.broken().is_none() {
            std::mem::forget(bundle);
        } else {
            drop(bundle);
        }
    }

    /// Copies pinned host memory to the device; hands both back when done.
    pub fn copy_h2d<H, T>(
        &self,
        src: H,
        dst: crate::DeviceBuffer<T>,
    ) -> Job<(H, crate::DeviceBuffer<T>), ()>
    where
        H: crate::PinnedHost<T> + Send + 'static,
        T: Pod,
    {
        self.run((src, dst), |c, (h, d)| c.copy_h2d(h.host(), d.view()))
    }

    /// Copies device memory to pinned host memory; hands both back when done.
    pub fn copy_d2h<H, T>(
        &self,
        src: crate::DeviceBuffer<T>,
        dst: H,
    ) -> Job<(crate::DeviceBuffer<T>, H), ()>
    where
        H: crate::PinnedHost<T> + Send + 'static,
        T: Pod,
    {
        self.run((src, dst), |c, (d, h)| c.copy_d2h(d.view(), h.host_mut()))
    }

    /// Applies `kernel` to a device buffer; hands it back when done.
    pub fn launch(
        &self,
        kernel: Kernel,
        x: crate::DeviceBuffer<f32>,
    ) -> Job<crate::DeviceBuffer<f32>, ()> {
        self.run(x, |c, x| c.kernel(kernel, x.view()))
    }
}

/// The commands of one [`Stream::run`] batch. `'a` is the borrow of the
/// job's bundle: host memory handed to a command stays borrowed until the
/// batch ends, and then the job owns it until completion.
pub struct Commands<'a> {
    raw: &'a dyn RawStream,
    device_id: usize,
    enqueued: usize,
    _p: PhantomData<&'a mut ()>,
}

impl<'a> Commands<'a> {
    /// Commands on `stream` with no bundle borrow: for crate code that keeps
    /// the memory alive by other means (the pipeline owns its buffers in a
    /// job joined over all its streams).
    ///
    /// # Safety
    /// Every host slice and device address given to these commands must stay
    /// valid, and host memory untouched by the CPU, until a point recorded on
    /// `stream` after them has completed.
    pub(crate) unsafe fn unbound(stream: &'a Stream) -> Commands<'a> {
        Commands {
            raw: &*stream.raw,
            device_id: stream.device.id(),
            enqueued: 0,
            _p: PhantomData,
        }
    }

    /// How many commands were enqueued so far.
    pub(crate) fn enqueued(&self) -> usize {
        self.enqueued
    }

    fn same_device(&self, id: usize) -> Result<()> {
        if id != self.device_id {
            return Err(Error::InvalidArgument(
                "a buffer of another device (or backend) was given to this stream".into(),
            ));
        }
        Ok(())
    }

    /// Async host-to-device copy (`cuMemcpyHtoDAsync`); lengths must match.
    pub fn copy_h2d<T: Pod>(
        &mut self,
        src: HostSlice<'a, T>,
        dst: DeviceSlice<'_, T>,
    ) -> Result<()> {
        self.same_device(src.device_id)?;
        self.same_device(dst.device_id)?;
        check_len(
            "copy_h2d (device destination vs host source)",
            src.len,
            dst.len,
        )?;
        let bytes = std::mem::size_of::<T>() * src.len;
        // SAFETY: src is pinned memory borrowed for 'a and then owned by the
        // job until completion; dst is device memory of the same owner.
        unsafe { self.raw.copy_h2d(dst.addr, src.ptr.cast(), bytes)? };
        self.enqueued += 1;
        Ok(())
    }

    /// Async device-to-host copy (`cuMemcpyDtoHAsync`); lengths must match.
    pub fn copy_d2h<T: Pod>(
        &mut self,
        src: DeviceSlice<'_, T>,
        dst: HostSliceMut<'a, T>,
    ) -> Result<()> {
        self.same_device(src.device_id)?;
        self.same_device(dst.device_id)?;
        check_len(
            "copy_d2h (host destination vs device source)",
            src.len,
            dst.len,
        )?;
        let bytes = std::mem::size_of::<T>() * src.len;
        // SAFETY: as for copy_h2d, with dst exclusively borrowed.
        unsafe { self.raw.copy_d2h(dst.ptr.cast(), src.addr, bytes)? };
        self.enqueued += 1;
        Ok(())
    }

    /// Async device-to-device copy; lengths must match.
    pub fn copy_d2d<T: Pod>(
        &mut self,
        src: DeviceSlice<'_, T>,
        dst: DeviceSlice<'_, T>,
    ) -> Result<()> {
        self.same_device(src.device_id)?;
        self.same_device(dst.device_id)?;
        check_len("copy_d2d (destination vs source)", src.len, dst.len)?;
        // SAFETY: device memory owned by the job; stream order serialises access.
        unsafe {
            self.raw
                .copy_d2d(dst.addr, src.addr, std::mem::size_of::<T>() * src.len)?
        };
        self.enqueued += 1;
        Ok(())
    }

    /// Applies an elementwise kernel to `x` in place.
    pub fn kernel(&mut self, kernel: Kernel, x: DeviceSlice<'_, f32>) -> Result<()> {
        self.same_device(x.device_id)?;
        // SAFETY: x is device memory owned by the job for the kernel's length.
        unsafe { self.launch_raw(&kernel.call(x.addr, x.len)) }
    }

    /// `y = a * x + y` (fused multiply-add); lengths must match.
    pub fn saxpy(
        &mut self,
        a: f32,
        x: DeviceSlice<'_, f32>,
        y: DeviceSlice<'_, f32>,
    ) -> Result<()> {
        self.same_device(x.device_id)?;
        self.same_device(y.device_id)?;
        check_len("saxpy (y vs x)", x.len, y.len)?;
        // SAFETY: device memory owned by the job; stream order serialises access.
        unsafe {
            self.launch_raw(&KernelCall::Saxpy {
                a,
                x: x.addr,
                y: y.addr,
                n: x.len,
            })
        }
    }

    /// Holds the stream until `flag` is set by the host (a GPU-side gate).
    pub fn gate(&mut self, flag: &'a MappedFlag) -> Result<()> {
        self.same_device(flag.device_id())?;
        // SAFETY: the flag outlives 'a, and the job holds the bundle that owns it.
        unsafe {
            self.launch_raw(&KernelCall::GateWait {
                flag: flag.device_addr(),
            })
        }
    }

    /// Launches the `trap` kernel: breaks the context (fault tests only).
    pub fn trap(&mut self) -> Result<()> {
        // SAFETY: the kernel touches no memory.
        unsafe { self.launch_raw(&KernelCall::Trap) }
    }

    /// Orders the rest of this batch after `event`.
    pub fn wait_event(&mut self, event: &Event) -> Result<()> {
        self.same_device(event.device.id())?;
        self.raw.wait(&event.raw)
    }

    /// Records a point that other streams' commands can wait for; with
    /// `timing`, it can also be measured (`elapsed_ms`). Never awaited, so no
    /// completion source watches it and it disturbs nothing it measures.
    pub(crate) fn marker(&mut self, device: &Device, timing: bool) -> Result<Event> {
        Ok(Event {
            raw: self.raw.marker(timing)?,
            device: device.clone(),
        })
    }

    /// Records a timed event at this point of the batch.
    pub fn record_timed(&mut self, device: &Device) -> Result<Event> {
        Ok(Event {
            raw: self.raw.record(true)?,
            device: device.clone(),
        })
    }

    /// # Safety
    /// The call's addresses are valid for its lengths until the job completes.
    unsafe fn launch_raw(&mut self, call: &KernelCall) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.raw.launch(call)? };
        self.enqueued += 1;
        Ok(())
    }
}

enum JobState<B, R> {
    Pending {
        completion: Completion,
        bundle: B,
        value: Option<Result<R>>,
        /// Owned by the job until completion, never handed back.
        keep: Option<Box<dyn Send>>,
    },
    Failed(Option<Error>),
    Done,
}

/// A batch of GPU work in flight; resolves to `(bundle, value)` when done.
/// See the module docs for the cancellation rule.
#[must_use = "dropping a job does not cancel the GPU work; await it to get the buffers back"]
pub struct Job<B: Send + 'static, R> {
    state: JobState<B, R>,
}

impl<B: Send + 'static, R> Job<B, R> {
    /// A job that owns `bundle` until `completion`, then yields `value`.
    /// `keep` is dropped at completion too, but not handed back.
    pub(crate) fn from_parts(
        completion: Completion,
        bundle: B,
        value: Result<R>,
        keep: Option<Box<dyn Send>>,
    ) -> Self {
        Job {
            state: JobState::Pending {
                completion,
                bundle,
                value: Some(value),
                keep,
            },
        }
    }

    /// A job that failed before any work was queued for it.
    pub(crate) fn failed(e: Error) -> Self {
        Job {
            state: JobState::Failed(Some(e)),
        }
    }

    /// Whether the GPU has finished the job's work.
    pub fn is_done(&self) -> bool {
        match &self.state {
            JobState::Pending { completion, .. } => completion.is_done(),
            _ => true,
        }
    }

    /// The completion signal of the job (e.g. to join several jobs).
    pub fn completion(&self) -> Option<&Completion> {
        match &self.state {
            JobState::Pending { completion, .. } => Some(completion),
            _ => None,
        }
    }
}

impl<B: Send + 'static, R> Unpin for Job<B, R> {}

impl<B: Send + 'static, R> Future for Job<B, R> {
    type Output = Result<(B, R)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let done = match &mut self.state {
            JobState::Pending { completion, .. } => match completion.poll_done(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            JobState::Failed(e) => {
                let e = e
                    .take()
                    .unwrap_or(Error::InvalidArgument("job polled after completion".into()));
                self.state = JobState::Done;
                return Poll::Ready(Err(e));
            }
            JobState::Done => {
                return Poll::Ready(Err(Error::InvalidArgument(
                    "job polled after completion".into(),
                )))
            }
        };
        match std::mem::replace(&mut self.state, JobState::Done) {
            JobState::Pending {
                bundle,
                value,
                keep,
                ..
            } => {
                drop(keep);
                let value = value.unwrap_or(Err(Error::InvalidArgument("job value taken".into())));
                Poll::Ready(done.and(value).map(|v| (bundle, v)))
            }
            _ => Poll::Ready(Err(Error::InvalidArgument(
                "job polled after completion".into(),
            ))),
        }
    }
}

impl<B: Send + 'static, R> Drop for Job<B, R> {
    fn drop(&mut self) {
        if let JobState::Pending { completion, .. } = &self.state {
            if !completion.is_done() {
                let completion = completion.clone();
                if let JobState::Pending { bundle, keep, .. } =
                    std::mem::replace(&mut self.state, JobState::Done)
                {
                    // Released when the GPU is done, by the completion source; never
                    // here. `keep` (e.g. a pipeline's device scratch) goes with it.
                    completion.defer(move || drop((bundle, keep)));
                }
            }
        }
    }
}
