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

use crate::backend::{RawCopy, RawEvent, RawLaunch, RawStream};
use crate::base::completion::{Completion, Wait};
use crate::base::error::{Error, JobError, Result};
use crate::runtime::device::Device;
use crate::runtime::kernel::{
    check_overlaps, Args, Builtins, Function, Kernel, LaunchConfig, TypedParams,
};
use crate::runtime::memory::{
    check_len, overlaps, DeviceSlice, DeviceSliceMut, HostSlice, HostSliceMut,
};
use bytemuck::Pod;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// An in-order queue of device work (a CUDA stream, or a CPU worker).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Kernel, PinnedBuffer, PinnedHost, Stream};
/// let device = Device::cpu();
/// let stream = Stream::new(&device)?;
/// let input = PinnedBuffer::from_slice(&device, &[1.0f32, 2.0, 3.0])?;
/// let output = PinnedBuffer::<f32>::new(&device, 3)?;
/// let dev = DeviceBuffer::<f32>::new(&device, 3)?;
/// // One job: copy in, scale, copy out; it owns the buffers until the work is done.
/// let job = stream.run((input, dev, output), |c, (i, d, o)| {
///     let d = d.view_mut();
///     c.copy_h2d(i.host(), d)?;
///     c.kernel(Kernel::Scale { s: 2.0 }, d)?;
///     c.copy_d2h(d, o.host_mut())
/// });
/// let ((_, _, output), ()) = block_on(job)?; // `job.await?` in async code
/// assert_eq!(output.as_slice(), &[2.0, 4.0, 6.0]);
/// # Ok(()) }
/// ```
///
/// Clones share the stream. Dropping the last clone waits until the work
/// already queued has run and the stream's completion thread has delivered
/// the completions still due (so no thread of ours outlives the stream),
/// which takes as long as that work does; on both backends. Except on a
/// completion thread (the last clone held by a cancelled job's bundle,
/// released there): the drop then returns at once, since that thread may be
/// the one the stream's work waits for, and the stream's completion thread
/// finishes on its own. Either way [`Device::synchronize`] waits for the
/// work of dropped streams too.
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

/// A recorded point in a stream that can be awaited. Awaiting it waits for
/// all work queued before it; a timed event can measure elapsed GPU time to
/// a later one.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Error, Kernel, Stream};
/// let device = Device::cpu();
/// let stream = Stream::new(&device)?;
/// let start = stream.record_timed()?;
/// let job = stream.launch(Kernel::Intensity { k: 16 }, DeviceBuffer::new(&device, 1 << 16)?);
/// let end = stream.record_timed()?;
/// block_on(end.wait())?; // `end.wait().await?` in async code
/// assert!(start.is_done() && job.is_done()); // queued before `end`
/// println!("{:.3} ms on the device", start.elapsed_ms(&end)?);
/// let other = Stream::new(&device)?;
/// other.wait_event(&end)?; // later work on `other` runs after the kernel
/// let untimed = stream.record()?;
/// assert!(matches!(start.elapsed_ms(&untimed), Err(Error::NotTimed)));
/// # drop(job); Ok(()) }
/// ```
pub struct Event {
    raw: RawEvent,
    device: Device,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("done", &self.raw.completion.is_done())
            .field("timed", &self.raw.timing)
            .finish()
    }
}

/// Milliseconds between two recorded points of one device.
fn elapsed(device: &Device, a: &RawEvent, b_device: &Device, b: &RawEvent) -> Result<f32> {
    if device.id() != b_device.id() {
        return Err(Error::InvalidArgument(
            "elapsed time between events of two devices".into(),
        ));
    }
    if !a.timing || !b.timing {
        return Err(Error::NotTimed);
    }
    device.backend.elapsed_ms(&a.timer, &b.timer)
}

impl Event {
    /// A future that resolves when the work before the event has finished
    /// (with the fault, if the work failed).
    ///
    /// # Cancel safety
    /// Dropping the future has no effect on the event or the work.
    pub fn wait(&self) -> Wait {
        self.raw.completion.wait()
    }

    /// Whether the work before the event has finished.
    pub fn is_done(&self) -> bool {
        self.raw.completion.is_done()
    }

    /// Blocks the calling thread until done (synchronous code only).
    ///
    /// # Errors
    /// The fault of the work before it; `Internal` when called on one of the
    /// library's completion threads (from the `Drop` of a cancelled job's
    /// bundle), where it would wait for itself.
    pub fn synchronize(&self) -> Result<()> {
        crate::base::completion::refuse_blocking_on_completion_thread("Event::synchronize")?;
        self.raw.completion.block()
    }

    /// Blocks in the driver's own event wait on the calling thread
    /// (`cuEventSynchronize`), bypassing the completion source: the baseline
    /// of the wake-latency benchmark. On the CPU backend, same as `synchronize`.
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn synchronize_direct(&self) -> Result<()> {
        crate::base::completion::refuse_blocking_on_completion_thread("a blocking wait")?;
        match self.device.backend.synchronize_event(&self.raw.timer) {
            Some(waited) => waited,
            None => self.synchronize(),
        }
    }

    /// GPU milliseconds from this event to `later`.
    ///
    /// # Errors
    /// [`Error::NotTimed`] unless both were recorded with timing
    /// ([`Stream::record_timed`], [`Commands::record_timed`]);
    /// [`Error::NotReady`] unless both have completed; `InvalidArgument` for
    /// events of two devices. The same on every backend.
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32> {
        if self.raw.timing && later.raw.timing && !(self.is_done() && later.is_done()) {
            return Err(Error::NotReady);
        }
        elapsed(&self.device, &self.raw, &later.device, &later.raw)
    }

    pub(crate) fn raw(&self) -> &RawEvent {
        &self.raw
    }

    /// The driver's handle of this event, where the backend has one.
    pub(crate) fn driver_handle(&self) -> Option<u64> {
        self.device.backend.event_handle(&self.raw.timer)
    }

    pub(crate) fn into_completion(self) -> Completion {
        self.raw.completion
    }
}

/// A timed point of a stream that only measures: the timeline of a pipeline
/// run ([`crate::RunInfo::timeline`]) is made of them. It cannot be awaited
/// (no completion source watches it, so recording it disturbs nothing it
/// measures); the run that recorded it has finished by the time you get it.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, Kernel, PinnedPool, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let pool = PinnedPool::new(&device);
/// let (input, output) = (pool.alloc::<f32>(4096)?, pool.alloc::<f32>(4096)?);
/// let pipeline = Pipeline::new(&device, 2)?;
/// let (k, plan) = (Kernel::Scale { s: 2.0 }, Plan::uniform(4, 2));
/// let job = pipeline.run(input, output, k, plan, Timeline::Record);
/// let (_, info) = block_on(job)?;
/// let chunk = &info.timeline.expect("recorded")[0];
/// let [before_h2d, after_h2d, _, after_d2h] = &chunk.events; // `Mark`s
/// let h2d_ms = before_h2d.elapsed_ms(after_h2d)?;
/// assert!(h2d_ms >= 0.0 && before_h2d.elapsed_ms(after_d2h)? >= h2d_ms);
/// # Ok(()) }
/// ```
pub struct Mark {
    raw: RawEvent,
    device: Device,
}

impl std::fmt::Debug for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mark")
            .field("timed", &self.raw.timing)
            .finish()
    }
}

impl Mark {
    /// GPU milliseconds from this mark to `later`.
    ///
    /// # Errors
    /// [`Error::NotTimed`] for an untimed mark, [`Error::NotReady`] when the
    /// stream has not reached one of them, `InvalidArgument` for marks of two
    /// devices. The same on every backend.
    pub fn elapsed_ms(&self, later: &Mark) -> Result<f32> {
        elapsed(&self.device, &self.raw, &later.device, &later.raw)
    }

    pub(crate) fn raw(&self) -> &RawEvent {
        &self.raw
    }
}

impl Stream {
    /// A new stream on `device`. Created non-blocking: it never synchronizes
    /// implicitly with the legacy default stream, so streams overlap.
    pub fn new(device: &Device) -> Result<Stream> {
        let raw: Arc<dyn RawStream> = Arc::from(device.backend.new_stream()?);
        device.register_stream(&raw);
        Ok(Stream {
            raw,
            device: device.clone(),
        })
    }

    /// The device of the stream.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The backend's stream, for the crate's own commands that keep their
    /// memory alive by other means (staged copies).
    pub(crate) fn raw(&self) -> &dyn RawStream {
        &*self.raw
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

    /// A point for other streams to wait on; it cannot be awaited (on CUDA
    /// nothing watches it, which keeps it cheap).
    pub(crate) fn marker(&self) -> Result<Mark> {
        Ok(Mark {
            raw: self.raw.marker(false)?,
            device: self.device.clone(),
        })
    }

    /// Makes work queued later on this stream wait for `event` (which may
    /// belong to another stream): cross-stream ordering without the host.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.wait_raw(&event.device, event.raw())
    }

    pub(crate) fn wait_mark(&self, mark: &Mark) -> Result<()> {
        self.wait_raw(&mark.device, mark.raw())
    }

    fn wait_raw(&self, device: &Device, raw: &RawEvent) -> Result<()> {
        if device.id() != self.device.id() {
            return Err(Error::InvalidArgument("event of another device".into()));
        }
        self.raw.wait(raw)
    }

    /// Blocks until all queued work on this stream has finished (synchronous
    /// code only).
    pub fn synchronize(&self) -> Result<()> {
        self.record()?.synchronize()
    }

    /// An empty batch of commands on this stream.
    fn commands(&self) -> Commands<'_> {
        Commands {
            raw: &*self.raw,
            device: &self.device,
            enqueued: 0,
            watched: 0,
        }
    }

    /// Runs `f` on a fresh batch, and deals with a panic in it: the commands
    /// `f` enqueued before panicking still run, so the bundle is released
    /// only when they are done (deferred to their completion), and then the
    /// panic goes on.
    fn enqueue<B, R, F>(&self, bundle: &mut Option<B>, f: F) -> (Result<R>, usize, usize)
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> Result<R>,
    {
        let mut cmds = self.commands();
        let outcome = match bundle.as_mut() {
            Some(b) => std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut cmds, b))),
            None => Ok(Err(Error::Internal("no bundle".into()))),
        };
        let (enqueued, watched) = (cmds.enqueued, cmds.watched);
        match outcome {
            Ok(outcome) => (outcome, enqueued, watched),
            Err(panic) => {
                if let Some(b) = bundle.take() {
                    self.release_when_done(b, enqueued);
                }
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// Drops `bundle` once the `enqueued` commands queued for it are done,
    /// without blocking; leaks it if their end can't be observed.
    fn release_when_done<B: Send + 'static>(&self, bundle: B, enqueued: usize) {
        if enqueued == 0 {
            drop(bundle);
            return;
        }
        match self.raw.record(false) {
            Ok(ev) => ev.completion.defer(move || drop(bundle)),
            Err(_) => self.abandon(bundle, enqueued).map_or((), drop),
        }
    }

    /// Enqueues the commands `f` issues against `bundle` and returns a job that
    /// hands the bundle (and `f`'s value) back once the GPU is done with it.
    ///
    /// `f` gets the bundle by `&'a mut` and the batch as `Commands<'a>`: every
    /// view a command takes (host or device) must be borrowed from the bundle
    /// for `'a`, so a command can touch no memory the job does not own, and
    /// `f` cannot use a host buffer after handing it to a copy.
    ///
    /// # Errors
    /// The job resolves to a [`JobError`] carrying the bundle back:
    /// - when `f` returns an error (a bad length, a buffer of another device,
    ///   overlapping operands): once the commands it enqueued before the
    ///   error have finished;
    /// - when the GPU work faulted ([`Error::ContextBroken`]).
    ///
    /// Only when the end of enqueued work can't be observed on a live
    /// context (recording the final point failed) is the bundle leaked
    /// instead (`bundle: None`): freeing it could free memory in use.
    ///
    /// # Panics
    /// A panic in `f` is passed on after the batch is closed: the commands it
    /// enqueued still run and the bundle is dropped when they are done, never
    /// earlier.
    ///
    /// # Cancel safety
    /// The work is enqueued by this call, before the job is first polled.
    /// Dropping the job at any point never cancels that work and never frees
    /// or reuses the bundle early: an unfinished job's bundle is dropped by
    /// the completion source when the GPU is done with it (pool buffers go
    /// back to their pool then). Dropping it never blocks.
    pub fn run<B, R, F>(&self, bundle: B, f: F) -> Job<B, R>
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> Result<R>,
    {
        let mut slot = Some(bundle);
        let (outcome, enqueued, _) = self.enqueue(&mut slot, f);
        let Some(bundle) = slot else {
            return Job::failed(Error::Internal("bundle lost".into()), None);
        };
        match self.raw.record(false) {
            Ok(ev) => Job::from_parts(ev.completion, bundle, outcome, None),
            Err(record_err) => {
                let bundle = self.abandon(bundle, enqueued);
                Job::failed(outcome.err().unwrap_or(record_err), bundle)
            }
        }
    }

    /// The synchronous twin of [`Stream::run`]: enqueues the commands `f`
    /// issues against `bundle`, then blocks the calling thread in the
    /// driver's own wait (`cuStreamSynchronize` on CUDA; no completion
    /// thread involved) until the GPU is done, and hands the bundle back. For
    /// synchronous code only: never call it on an executor thread.
    ///
    /// # Errors
    /// As [`Stream::run`]: a [`JobError`] with the bundle once what `f`
    /// enqueued has finished. If the wait itself fails on a live context the
    /// bundle is leaked (`bundle: None`) rather than freed under the GPU.
    ///
    /// # Panics
    /// As [`Stream::run`].
    pub fn run_sync<B, R, F>(&self, bundle: B, f: F) -> Result<(B, R), JobError<B>>
    where
        B: Send + 'static,
        F: for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> Result<R>,
    {
        let mut slot = Some(bundle);
        let (outcome, enqueued, watched) = self.enqueue(&mut slot, f);
        let Some(bundle) = slot else {
            return Err(JobError {
                error: Error::Internal("bundle lost".into()),
                bundle: None,
            });
        };
        // Always waited for, even when `f` queued no copy or kernel: points it
        // recorded (or waits it queued) are done when this returns too. When
        // it recorded awaitable events, the wait goes through the completion
        // source (which completes them in order) so they read as done; else
        // through the driver's own wait on this thread.
        let wait = || {
            if watched > 0 {
                crate::base::completion::refuse_blocking_on_completion_thread("Stream::run_sync")
                    .and_then(|()| self.raw.record(false))
                    .and_then(|raw| raw.completion.block())
            } else {
                // The driver's own stream wait: no event to record, no thread
                // hand-off.
                crate::base::completion::refuse_blocking_on_completion_thread("Stream::run_sync")
                    .and_then(|()| self.raw.synchronize_in_driver())
            }
        };
        // A panic while waiting (none is expected) must not drop the bundle
        // under its queued work: it is released when that work is done, as a
        // panic in `f` is, and the panic goes on.
        let waited = match std::panic::catch_unwind(AssertUnwindSafe(wait)) {
            Ok(waited) => waited,
            Err(panic) => {
                self.release_when_done(bundle, enqueued);
                std::panic::resume_unwind(panic)
            }
        };
        match (waited, outcome) {
            (Ok(()), Ok(v)) => Ok((bundle, v)),
            (Ok(()), Err(error)) => Err(JobError {
                error,
                bundle: Some(bundle),
            }),
            (Err(error), _) => {
                let bundle = self.abandon(bundle, enqueued);
                Err(JobError { error, bundle })
            }
        }
    }

    /// Lets go of a bundle whose `enqueued` commands can't be seen to finish.
    /// Work was queued but its end can't be observed: never free what the GPU
    /// might still touch, so it is leaked (`None`). Nothing queued, or the
    /// context broken for good (a broken context runs nothing more): the
    /// bundle is safe to hand back.
    fn abandon<B>(&self, bundle: B, enqueued: usize) -> Option<B> {
        if enqueued > 0 && self.device.broken().is_none() {
            std::mem::forget(bundle);
            None
        } else {
            Some(bundle)
        }
    }

    /// Copies pinned host memory to the device; hands both back when done.
    pub fn copy_h2d<H, T>(
        &self,
        src: H,
        dst: crate::runtime::memory::DeviceBuffer<T>,
    ) -> Job<(H, crate::runtime::memory::DeviceBuffer<T>), ()>
    where
        H: crate::runtime::memory::PinnedHost<T> + Send + 'static,
        T: Pod,
    {
        self.run((src, dst), |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()))
    }

    /// Copies device memory to pinned host memory; hands both back when done.
    pub fn copy_d2h<H, T>(
        &self,
        src: crate::runtime::memory::DeviceBuffer<T>,
        dst: H,
    ) -> Job<(crate::runtime::memory::DeviceBuffer<T>, H), ()>
    where
        H: crate::runtime::memory::PinnedHost<T> + Send + 'static,
        T: Pod,
    {
        self.run((src, dst), |c, (d, h)| c.copy_d2h(d.view(), h.host_mut()))
    }

    /// Applies `kernel` to a device buffer; hands it back when done.
    pub fn launch(
        &self,
        kernel: Kernel,
        x: crate::runtime::memory::DeviceBuffer<f32>,
    ) -> Job<crate::runtime::memory::DeviceBuffer<f32>, ()> {
        self.run(x, |c, x| c.kernel(kernel, x.view_mut()))
    }
}

/// The commands of one [`Stream::run`] batch. `'a` is the borrow of the
/// job's bundle: every view given to a command (host or device) must live
/// for `'a`, i.e. come out of the bundle, which the job owns until the GPU
/// is done.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, PinnedBuffer, PinnedHost, Stream};
/// let device = Device::cpu();
/// let host = PinnedBuffer::from_slice(&device, &[1u8, 2, 3, 4])?;
/// let (a, b) = (DeviceBuffer::<u8>::new(&device, 4)?, DeviceBuffer::<u8>::new(&device, 4)?);
/// let stream = Stream::new(&device)?;
/// // `c` is the batch's `&mut Commands`; its views come from the bundle.
/// let ((_, _, mut b), half) = block_on(stream.run((host, a, b), |c, (h, a, b)| {
///     let a = a.view_mut();
///     c.copy_h2d(h.host(), a)?;
///     let half = c.record()?; // an awaitable point inside the batch
///     c.copy_d2d(a, b.view_mut())?;
///     Ok(half) // the batch's value, handed back with the bundle
/// }))?;
/// assert!(half.is_done());
/// let mut out = [0u8; 4];
/// b.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [1, 2, 3, 4]);
/// # Ok(()) }
/// ```
pub struct Commands<'a> {
    raw: &'a dyn RawStream,
    device: &'a Device,
    enqueued: usize,
    /// Awaitable events recorded in the batch.
    watched: usize,
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
            device: &stream.device,
            enqueued: 0,
            watched: 0,
        }
    }

    /// How many commands were enqueued so far.
    pub(crate) fn enqueued(&self) -> usize {
        self.enqueued
    }

    fn same_device(&self, id: usize) -> Result<()> {
        if id != self.device.id() {
            return Err(Error::InvalidArgument(
                "a buffer of another device (or backend) was given to this stream".into(),
            ));
        }
        Ok(())
    }

    /// Host memory any device of this backend may copy from or to.
    fn same_host_domain(&self, domain: usize) -> Result<()> {
        if domain != self.device.host_domain() {
            return Err(Error::InvalidArgument(
                "host memory of another backend was given to this stream".into(),
            ));
        }
        Ok(())
    }

    /// Async host-to-device copy (`cuMemcpyHtoDAsync`); lengths must match.
    ///
    /// # Errors
    /// `LengthMismatch`; `InvalidArgument` for memory of another device.
    pub fn copy_h2d<T: Pod>(
        &mut self,
        src: HostSlice<'a, T>,
        dst: DeviceSliceMut<'a, T>,
    ) -> Result<()> {
        self.same_host_domain(src.device_id)?;
        self.same_device(dst.device_id)?;
        check_len(
            "copy_h2d (device destination vs host source)",
            src.len,
            dst.len,
        )?;
        let bytes = std::mem::size_of::<T>() * src.len;
        // SAFETY: src is pinned memory borrowed for 'a and then owned by the
        // job until completion; dst is device memory borrowed exclusively from
        // the same bundle for 'a.
        unsafe { self.raw.copy_h2d(dst.addr, src.ptr.cast(), bytes)? };
        self.enqueued += 1;
        Ok(())
    }

    /// Async device-to-host copy (`cuMemcpyDtoHAsync`); lengths must match.
    ///
    /// # Errors
    /// `LengthMismatch`; `InvalidArgument` for memory of another device.
    pub fn copy_d2h<T: Pod>(
        &mut self,
        src: impl Into<DeviceSlice<'a, T>>,
        dst: HostSliceMut<'a, T>,
    ) -> Result<()> {
        let src = src.into();
        self.same_device(src.device_id)?;
        self.same_host_domain(dst.device_id)?;
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

    /// Async copy between the memory of two devices of one backend
    /// (`cuMemcpyPeerAsync`: direct over NVLink or PCIe where peer access is
    /// enabled, [`Device::enable_peer_access`](crate::Device::enable_peer_access),
    /// else staged by the driver); enqueued on this stream, whose device must
    /// be the source's or the destination's. Both views come from this
    /// batch's bundle, as for every command, so neither buffer can be used
    /// elsewhere meanwhile. Between views of one device, the same as
    /// [`Commands::copy_d2d`].
    ///
    /// # Errors
    /// `LengthMismatch`; `InvalidArgument` when neither view is of this
    /// stream's device or the two are of different backends; as
    /// [`Commands::copy_d2d`] for views of one device.
    pub fn copy_peer<T: Pod>(
        &mut self,
        src: impl Into<DeviceSlice<'a, T>>,
        dst: DeviceSliceMut<'a, T>,
    ) -> Result<()> {
        let src = src.into();
        if src.device_id == dst.device_id {
            return self.copy_d2d(src, dst);
        }
        let mine = self.device.id();
        if src.device_id != mine && dst.device_id != mine {
            return Err(Error::InvalidArgument(
                "a peer copy runs on a stream of its source's or its destination's device".into(),
            ));
        }
        check_len("copy_peer (destination vs source)", src.len, dst.len)?;
        let gone =
            || Error::InvalidArgument("a peer copy's memory belongs to no open device".into());
        let src_dev = crate::runtime::device::backend_by_id(src.device_id).ok_or_else(gone)?;
        let dst_dev = crate::runtime::device::backend_by_id(dst.device_id).ok_or_else(gone)?;
        if src_dev.info().backend != dst_dev.info().backend {
            return Err(Error::InvalidArgument(
                "a peer copy between devices of different backends".into(),
            ));
        }
        let bytes = std::mem::size_of::<T>() * src.len;
        // SAFETY: both ranges are device memory of the devices whose
        // backends were just found (their views carry those ids), borrowed
        // from this batch's bundle for 'a, which the job owns until a point
        // recorded after this copy completes; two devices' memory can't
        // overlap.
        unsafe {
            self.raw
                .copy_peer(dst.addr, &*dst_dev, src.addr, &*src_dev, bytes)?
        };
        self.enqueued += 1;
        Ok(())
    }

    /// Several copies as one command: one driver call
    /// (`cuMemcpyBatchAsync`, CUDA 13.0+ drivers; elsewhere one copy after
    /// another), so the copy engines pay their fixed per-operation cost
    /// once per batch instead of once per copy (on the H200: 64 copies of
    /// 64 KiB at about 600k copies per second instead of 260k;
    /// `host chunk-cost`). The copies of a batch run in no particular order
    /// among themselves; the batch as a whole is in stream order.
    ///
    /// # Errors
    /// Checked before anything is enqueued: `LengthMismatch` for a copy
    /// whose source and destination differ in length; [`Error::Overlap`]
    /// when a copy's destination overlaps another copy's source or
    /// destination, or (device to device) its own source; `InvalidArgument`
    /// for memory of another device. An error from the driver may come
    /// after part of the batch was enqueued: the batch counts as enqueued,
    /// so the job hands the bundle back only after a point recorded after
    /// it (or leaks it where that point can't be recorded), never under the
    /// GPU.
    pub fn copy_batch<T: Pod>(
        &mut self,
        transfers: impl IntoIterator<Item = crate::runtime::transfer::Transfer<'a, T>>,
    ) -> Result<()> {
        use crate::runtime::transfer::Transfer;
        let size = std::mem::size_of::<T>();
        let mut copies = Vec::new();
        for t in transfers {
            let c = match t {
                Transfer::H2d { src, dst } => {
                    self.same_host_domain(src.device_id)?;
                    self.same_device(dst.device_id)?;
                    check_len("copy_batch (h2d destination vs source)", src.len, dst.len)?;
                    RawCopy {
                        dst: dst.addr,
                        src: src.ptr as u64,
                        bytes: size * src.len,
                    }
                }
                Transfer::D2h { src, dst } => {
                    self.same_device(src.device_id)?;
                    self.same_host_domain(dst.device_id)?;
                    check_len("copy_batch (d2h destination vs source)", src.len, dst.len)?;
                    RawCopy {
                        dst: dst.ptr as u64,
                        src: src.addr,
                        bytes: size * src.len,
                    }
                }
                Transfer::D2d { src, dst } => {
                    self.same_device(src.device_id)?;
                    self.same_device(dst.device_id)?;
                    check_len("copy_batch (d2d destination vs source)", src.len, dst.len)?;
                    if overlaps(src, dst.into()) {
                        return Err(Error::Overlap {
                            what: "copy_batch (a d2d copy's source and destination)",
                        });
                    }
                    RawCopy {
                        dst: dst.addr,
                        src: src.addr,
                        bytes: size * src.len,
                    }
                }
            };
            copies.push(c);
        }
        crate::runtime::transfer::check(&copies)?;
        // Counted before the call: a driver error may leave part of the
        // batch enqueued, and the bundle must then not be handed back.
        self.enqueued += 1;
        // SAFETY: every range is pinned host memory of this backend's host
        // domain or device memory of this device, borrowed from the bundle
        // for 'a (the job owns it until a point recorded after this batch
        // completes); lengths match; no destination overlaps another range
        // of the batch or its own source (checked just above).
        unsafe { self.raw.copy_batch(&copies) }
    }

    /// Async device-to-device copy; lengths must match.
    ///
    /// # Errors
    /// `LengthMismatch`; [`Error::Overlap`] when the ranges share memory;
    /// `InvalidArgument` for memory of another device.
    pub fn copy_d2d<T: Pod>(
        &mut self,
        src: impl Into<DeviceSlice<'a, T>>,
        dst: DeviceSliceMut<'a, T>,
    ) -> Result<()> {
        let src = src.into();
        self.same_device(src.device_id)?;
        self.same_device(dst.device_id)?;
        check_len("copy_d2d (destination vs source)", src.len, dst.len)?;
        if overlaps(src, dst.into()) {
            return Err(Error::Overlap {
                what: "copy_d2d (source and destination)",
            });
        }
        // SAFETY: device memory borrowed from the bundle for 'a; stream order
        // serialises access; the ranges are disjoint.
        unsafe {
            self.raw
                .copy_d2d(dst.addr, src.addr, std::mem::size_of::<T>() * src.len)?
        };
        self.enqueued += 1;
        Ok(())
    }

    /// Launches kernel `K` with `args`: a tuple matching the parameter list
    /// its declaration gives (`DeviceSlice` for `Slice<T>`, `DeviceSliceMut`
    /// for `SliceMut<T>`, scalars for scalars, [`crate::ByValue`] for a
    /// `#[repr(C)]` struct), checked at compile time. Device views must come
    /// from the bundle, like every command's. On the CPU emulation the
    /// kernel's host build runs over the same grid.
    ///
    /// ```rust
    /// use gpufeed::kernel_abi::{kernels, thread, Slice, SliceMut};
    /// use gpufeed::{DeviceBuffer, LaunchConfig, Module};
    /// // Normally in the kernel crate (built to PTX by its build script).
    /// kernels! {
    ///     /// `y = a * x + b * y`.
    ///     pub unsafe fn axpby(a: f32, x: Slice<f32>, b: f32, y: SliceMut<f32>) {
    ///         let mut i = thread::global_id();
    ///         while i < x.len() && i < y.len() {
    ///             // SAFETY: i is in bounds; one thread per index (grid stride).
    ///             unsafe { y.write(i, a * x.read(i) + b * y.read(i)) };
    ///             i += thread::grid_stride();
    ///         }
    ///     }
    /// }
    /// # fn main() -> gpufeed::Result<()> { gpufeed::block_on(async {
    /// # let device = &gpufeed::Device::cpu();
    /// # let stream = &gpufeed::Stream::new(device)?;
    /// # let ptx = "";
    /// // SAFETY: `ptx` is the PTX kernel-builder built from the crate that
    /// // declares `axpby` (here the declaration above).
    /// let f = unsafe { Module::from_ptx(device, ptx)? }.function::<axpby>()?;
    /// let n = 1 << 20;
    /// let (mut x, mut y) = (DeviceBuffer::new(device, n)?, DeviceBuffer::new(device, n)?);
    /// x.copy_from_host_sync(&vec![1.0f32; n])?;
    /// y.copy_from_host_sync(&vec![2.0f32; n])?;
    /// let ((_x, mut y), ()) = stream
    ///     .run((x, y), move |c, (x, y)| {
    ///         let cfg = LaunchConfig::grid_stride(c.device(), x.len());
    ///         c.launch(&f, cfg, (2.0f32, x.view(), 0.5f32, y.view_mut()))
    ///     })
    ///     .await?;
    /// let mut out = vec![0f32; n];
    /// y.copy_to_host_sync(&mut out)?;
    /// assert!(out.iter().all(|&v| v == 3.0)); // 2 * 1 + 0.5 * 2
    /// # Ok(()) }) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Overlap`] when a writable range overlaps another range of
    /// the launch; `InvalidArgument` for memory or a function of another
    /// device; a grid or block of zero threads; the driver's launch error.
    pub fn launch<K, A>(&mut self, f: &Function<K>, config: LaunchConfig, args: A) -> Result<()>
    where
        K: kernel_abi::Kernel,
        A: Args<'a, Params = K::Params>,
    {
        self.launch_checked(f, config, args, false)
    }

    fn launch_checked<K, A>(
        &mut self,
        f: &Function<K>,
        config: LaunchConfig,
        args: A,
        same_range_ok: bool,
    ) -> Result<()>
    where
        K: kernel_abi::Kernel,
        A: Args<'a, Params = K::Params>,
    {
        self.same_device(f.device_id)?;
        // The device's limits, on every backend (the CPU emulation has a
        // GPU's): a launch the GPU would refuse is refused on the CPU
        // emulation too, before anything is queued.
        config.check(K::NAME, &self.device.info().limits)?;
        let mut touches = Vec::new();
        let params = args.params(self.device.id(), &mut touches)?;
        check_overlaps(K::NAME, &touches, same_range_ok)?;
        let launch = RawLaunch {
            name: K::NAME,
            function: &f.raw,
            config: kernel_abi::thread::Launch {
                grid: config.grid,
                block: config.block,
                dynamic_shared_bytes: config.shared_bytes,
            },
            params: Box::new(TypedParams::<K>(params)),
        };
        // SAFETY: every device range in the parameters comes from a view
        // borrowed from the bundle for 'a (the `Arg` impls), which the job
        // owns until completion; writable ranges overlap no other range.
        unsafe { self.raw.launch(launch)? };
        self.enqueued += 1;
        Ok(())
    }

    /// The device of this batch's stream.
    pub fn device(&self) -> &Device {
        self.device
    }

    /// Applies an elementwise kernel to `x` in place.
    ///
    /// # Errors
    /// `InvalidArgument` for memory of another device.
    pub fn kernel(&mut self, kernel: Kernel, x: DeviceSliceMut<'a, f32>) -> Result<()> {
        let b = Builtins::of(self.device)?;
        // Grid-stride over 16-byte vectors.
        let config = LaunchConfig::grid_stride(self.device, x.len.div_ceil(4));
        match kernel {
            Kernel::Scale { s } => self.launch(&b.scale, config, (x, s)),
            Kernel::Intensity { k } => self.launch(&b.intensity, config, (x, k)),
        }
    }

    /// `y = a * x + y` as a fused multiply-add: the product and sum are
    /// computed exactly and rounded once (`fma.rn.f32`; `f32::mul_add` on the
    /// CPU emulation, bit-identical), so results can differ in the last bit
    /// from `a * x + y` written out (two roundings), as NumPy computes it.
    /// Kernels of your own get the same operation from `kernel_abi::fma`.
    /// Lengths must match. `x` may be `y` itself (the same range), but not
    /// partly overlap it.
    ///
    /// # Errors
    /// `LengthMismatch`; [`Error::Overlap`]; `InvalidArgument` for memory of
    /// another device.
    pub fn saxpy(
        &mut self,
        a: f32,
        x: impl Into<DeviceSlice<'a, f32>>,
        y: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let x = x.into();
        check_len("saxpy (y vs x)", x.len, y.len)?;
        let b = Builtins::of(self.device)?;
        let config = LaunchConfig::grid_stride(self.device, x.len.div_ceil(4));
        // Elementwise: each thread reads x[i] and y[i] and writes y[i] only,
        // so x may be y itself.
        self.launch_checked(&b.saxpy, config, (a, x, y), true)
    }

    /// Holds the stream until `flag` is set by the host (a GPU-side gate;
    /// a test hook).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn gate(&mut self, flag: &'a crate::runtime::memory::MappedFlag) -> Result<()> {
        let b = Builtins::of(self.device)?;
        self.launch(&b.gate_wait, LaunchConfig::SINGLE, (flag.view(),))
    }

    /// Launches the `trap` kernel: breaks the context (fault tests only).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn trap(&mut self) -> Result<()> {
        let b = Builtins::of(self.device)?;
        self.launch(&b.trap, LaunchConfig::SINGLE, ())
    }

    /// Orders the rest of this batch after `event` (of any stream of the
    /// same device).
    pub fn wait_event(&mut self, event: &Event) -> Result<()> {
        self.wait_raw(&event.device, event.raw())
    }

    pub(crate) fn wait_mark(&mut self, mark: &Mark) -> Result<()> {
        self.wait_raw(&mark.device, mark.raw())
    }

    fn wait_raw(&mut self, device: &Device, raw: &RawEvent) -> Result<()> {
        self.same_device(device.id())?;
        self.raw.wait(raw)
    }

    /// Records a point that other streams' commands can wait for; with
    /// `timing`, it can also be measured. Never awaited, so no completion
    /// source watches it and it disturbs nothing it measures.
    pub(crate) fn marker(&mut self, timing: bool) -> Result<Mark> {
        Ok(Mark {
            raw: self.raw.marker(timing)?,
            device: self.device.clone(),
        })
    }

    /// Records an awaitable point at this place of the batch (for other
    /// streams to wait on, or to await part of a batch).
    pub fn record(&mut self) -> Result<Event> {
        self.watched += 1;
        Ok(Event {
            raw: self.raw.record(false)?,
            device: self.device.clone(),
        })
    }

    /// Records a timed event at this place of the batch.
    pub fn record_timed(&mut self) -> Result<Event> {
        self.watched += 1;
        Ok(Event {
            raw: self.raw.record(true)?,
            device: self.device.clone(),
        })
    }
}

enum JobState<B, R> {
    Pending {
        completion: Completion,
        bundle: B,
        value: Result<R>,
        /// Owned by the job until completion, never handed back.
        keep: Option<Box<dyn Send>>,
    },
    Failed {
        error: Error,
        bundle: Option<B>,
    },
    Done,
}

/// A batch of GPU work in flight; resolves to `(bundle, value)` when done,
/// or to a [`JobError`] that hands the bundle back.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Job, PinnedBuffer, Stream};
/// let device = Device::cpu();
/// let (s1, s2) = (Stream::new(&device)?, Stream::new(&device)?);
/// let a = PinnedBuffer::from_slice(&device, &[1u32; 256])?;
/// let b = PinnedBuffer::from_slice(&device, &[2u32; 256])?;
/// // Two jobs in flight at once, on two streams; the CPU is free meanwhile.
/// let j1: Job<_, ()> = s1.copy_h2d(a, DeviceBuffer::new(&device, 256)?);
/// let j2 = s2.copy_h2d(b, DeviceBuffer::new(&device, 256)?);
/// let (r1, r2) = block_on(futures::future::join(j1, j2));
/// let (((a, _), ()), ((b, _), ())) = (r1?, r2?); // the buffers, back
/// assert_eq!((a.as_slice()[0], b.as_slice()[0]), (1, 2));
/// // Dropping a job cancels nothing: its buffers go when its work is done.
/// drop(s1.copy_h2d(a, DeviceBuffer::new(&device, 256)?));
/// device.synchronize()?; // ... which this waits for
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// The work was enqueued when the job was made; dropping the job never
/// cancels it. An unfinished job's bundle is dropped by the completion source
/// when the GPU is done with it (pool buffers return to their pool then),
/// never earlier; `drop` never blocks. [`crate::Device::synchronize`] waits
/// for those releases too.
#[must_use = "dropping a job does not cancel the GPU work; await it to get the buffers back"]
pub struct Job<B: Send + 'static, R> {
    state: JobState<B, R>,
}

impl<B: Send + 'static, R> std::fmt::Debug for Job<B, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("done", &self.is_done())
            .finish()
    }
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
                value,
                keep,
            },
        }
    }

    /// A job that failed with no work of its own left in flight; `bundle` is
    /// handed back with the error (`None`: leaked, see [`JobError`]).
    pub(crate) fn failed(error: Error, bundle: Option<B>) -> Self {
        Job {
            state: JobState::Failed { error, bundle },
        }
    }

    /// An unfinished job that can't be waited for here: blocked on by
    /// `gpufeed::block_on` on a completion thread (in the `Drop` of a cancelled
    /// job's bundle: that thread may be the one that completes it), or in a
    /// `fork()` child of the process that made it (nothing completes it
    /// there). It resolves to `error` at once instead of waiting for ever;
    /// its bundle is released when its work is done, as a dropped job's is
    /// (`bundle: None`). An ordinary poll on a completion thread (an executor
    /// that polls in `wake`) is not refused.
    fn refuse(&mut self, error: Error) -> JobError<B> {
        if let JobState::Pending {
            completion,
            bundle,
            keep,
            ..
        } = std::mem::replace(&mut self.state, JobState::Done)
        {
            completion.defer(move || drop((bundle, keep)));
        }
        JobError {
            error,
            bundle: None,
        }
    }

    /// Whether the job's work has finished (it then resolves at once).
    pub fn is_done(&self) -> bool {
        match &self.state {
            JobState::Pending { completion, .. } => completion.is_done(),
            _ => true,
        }
    }
}

impl<B: Send + 'static, R> Unpin for Job<B, R> {}

impl<B: Send + 'static, R> Future for Job<B, R> {
    type Output = Result<(B, R), JobError<B>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let JobState::Pending { completion, .. } = &self.state {
            if let Some(e) =
                completion.refuse_wait("a job (its buffers are released when its work is done)")
            {
                return Poll::Ready(Err(self.refuse(e)));
            }
            if completion.poll_done(cx).is_pending() {
                return Poll::Pending;
            }
        }
        Poll::Ready(match std::mem::replace(&mut self.state, JobState::Done) {
            JobState::Pending {
                completion,
                bundle,
                value,
                keep,
            } => {
                drop(keep);
                let done = completion
                    .result()
                    .unwrap_or(Err(Error::Internal("completion without a result".into())));
                match done.and(value) {
                    Ok(v) => Ok((bundle, v)),
                    Err(error) => Err(JobError {
                        error,
                        bundle: Some(bundle),
                    }),
                }
            }
            JobState::Failed { error, bundle } => Err(JobError { error, bundle }),
            JobState::Done => Err(JobError {
                error: Error::InvalidArgument("job polled after it resolved".into()),
                bundle: None,
            }),
        })
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
