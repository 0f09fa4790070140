//! The [`Pipeline`]: its streams, the state its runs share, and the public
//! runs ([`Pipeline::run`], [`Pipeline::run_stage`], and the multi-device
//! part `run_range`), which erase their arrays' types and hand over to the
//! run proper (`run.rs`).

use crate::base::error::{Error, Result};
use crate::engines::pipeline::arrays::{Arrays, Erased};
use crate::engines::pipeline::chunk::{stage_fn, Chunk};
use crate::engines::pipeline::plan::Plan;
use crate::engines::pipeline::timeline::{RunInfo, Timeline};
use crate::runtime::device::Device;
use crate::runtime::kernel::Kernel;
use crate::runtime::memory::{DeviceBuffer, PinnedHost};
use crate::runtime::pool::PinnedPool;
use crate::runtime::stream::{Commands, Job, Mark, Stream};
use std::any::TypeId;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Streams and per-stream device scratch for pipelined runs; reusable.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, Kernel, PinnedPool, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let pool = PinnedPool::new(&device);
/// let n = 1 << 20;
/// let mut input = pool.alloc::<f32>(n)?;
/// input.as_mut_slice().fill(1.5);
/// let output = pool.alloc::<f32>(n)?;
/// let pipeline = Pipeline::new(&device, 4)?;
/// let plan = Plan::auto(n); // 4 chunks on the copy-in, compute and copy-out streams
/// let job = pipeline.run(input, output, Kernel::Scale { s: 2.0 }, plan, Timeline::Off);
/// let ((_input, output), info) = block_on(job)?; // `job.await?` in async code
/// assert!(output.as_slice().iter().all(|&y| y == 3.0));
/// assert_eq!(info.chunks, 4);
/// # Ok(()) }
/// ```
pub struct Pipeline {
    pub(super) device: Device,
    pub(super) streams: Vec<Stream>,
    pub(super) state: Mutex<RunState>,
    /// Pinned windows of runs over ordinary slices (`run_slices`).
    pub(super) windows: PinnedPool,
}

/// What consecutive runs share, under the pipeline's lock.
#[derive(Default)]
pub(super) struct RunState {
    /// Device chunk buffers: per slot, one per scratch array.
    pub(super) scratch: Vec<Vec<Arc<DeviceBuffer<u8>>>>,
    /// Bytes per element of each scratch array, and elements per array.
    pub(super) shape: (Vec<usize>, usize),
    /// Per slot: a point after the last command of an earlier run that
    /// touched it. A run's first command on a slot waits for it, so a run
    /// may start while the previous one drains, yet never overwrites a buffer
    /// still being read, whatever the two runs' layouts.
    pub(super) free: Vec<Option<Mark>>,
}

impl RunState {
    /// Lets go of the scratch, so the next run gets fresh buffers (the old
    /// ones stay alive with the jobs that use them, or are kept for ever).
    pub(super) fn discard(&mut self) {
        self.scratch.clear();
        self.free.clear();
        self.shape = (Vec::new(), 0);
    }
}

/// The most streams one pipeline may have. Each stream has threads of its
/// own on the CPU emulation and a driver stream on CUDA, and a few streams
/// already keep the copy engines and the SMs busy: far more only costs
/// threads and memory.
pub const MAX_STREAMS: usize = 64;

impl Pipeline {
    /// A pipeline over `streams` new streams.
    ///
    /// # Errors
    /// `InvalidArgument` for 0 streams or more than [`MAX_STREAMS`]; the
    /// backend's error when a stream can't be made.
    pub fn new(device: &Device, streams: usize) -> Result<Pipeline> {
        if streams == 0 {
            return Err(Error::InvalidArgument(
                "a pipeline needs at least one stream".into(),
            ));
        }
        if streams > MAX_STREAMS {
            return Err(Error::InvalidArgument(format!(
                "{streams} streams: a pipeline has at most {MAX_STREAMS} streams"
            )));
        }
        Ok(Pipeline {
            device: device.clone(),
            streams: (0..streams)
                .map(|_| Stream::new(device))
                .collect::<Result<_>>()?,
            state: Mutex::new(RunState::default()),
            windows: PinnedPool::near(device),
        })
    }

    /// The pipeline's streams.
    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }

    /// The device the pipeline runs on.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The pool the pinned windows of `run_slices` come from.
    pub(crate) fn windows(&self) -> &PinnedPool {
        &self.windows
    }

    /// Pushes `input` through H2D → `kernel` → D2H into `output`, cut by
    /// `plan`, in place on the device (one scratch buffer per slot). The job
    /// hands both buffers back when the last chunk is out.
    ///
    /// # Errors
    /// The job resolves to a [`crate::JobError`] that hands `(input,
    /// output)` back: at once for a bad plan (`InvalidArgument`) or unequal
    /// lengths (`LengthMismatch`), before anything is enqueued; after the
    /// work already enqueued has finished when enqueueing fails part-way or
    /// the GPU faults. Only when the end of enqueued work can't be observed
    /// on a live context are the buffers leaked instead (`bundle: None`).
    ///
    /// # Cancel safety
    /// Everything is enqueued by this call. Dropping the job never cancels
    /// the work and never frees early: the buffers (and the device scratch
    /// the run uses) are released by the completion source when the last
    /// stream is done. The next run on this pipeline is ordered after this
    /// one on the GPU either way.
    pub fn run<I, O>(
        &self,
        input: I,
        mut output: O,
        kernel: Kernel,
        plan: Plan,
        timeline: Timeline,
    ) -> Job<(I, O), RunInfo>
    where
        I: PinnedHost<f32> + Send + 'static,
        O: PinnedHost<f32> + Send + 'static,
    {
        let (src, dst) = (input.host(), output.host_mut());
        let erase = |ptr: *mut u8, len, device_id| Erased {
            ptr,
            len,
            size: 4,
            type_id: TypeId::of::<f32>(),
            type_name: "f32",
            device_id,
        };
        let ins = vec![erase(src.ptr as *mut u8, src.len, src.device_id)];
        let outs = vec![erase(dst.ptr.cast(), dst.len, dst.device_id)];
        // In place: the input's scratch array is the output's.
        let stage = stage_fn(move |c, chunk| c.kernel(kernel, chunk.output::<f32>(0)?));
        self.run_erased(
            (input, output),
            (ins, vec![0]),
            (outs, vec![0]),
            &[4],
            plan,
            timeline,
            &stage,
        )
    }

    /// [`Pipeline::run`] over the elements `range` of two host arrays
    /// given by address: the multi-device pipeline's part for this device.
    /// The job owns `bundle` until the work is done.
    ///
    /// # Safety
    /// `src.0` and `dst.0` point to `src.1` / `dst.1` floats of pinned host
    /// memory (host domain `src.2` / `dst.2`) that `bundle` keeps alive and
    /// in place for as long as it lives, and nothing reads or writes
    /// `dst.0[range]`, or writes `src.0[range]`, until the job is done.
    pub(crate) unsafe fn run_range<B: Send + 'static>(
        &self,
        bundle: B,
        src: (*const f32, usize, usize),
        dst: (*mut f32, usize, usize),
        range: Range<usize>,
        kernel: Kernel,
        plan: Plan,
    ) -> Job<B, RunInfo> {
        if range.end > src.1 || range.end > dst.1 || range.start > range.end {
            return Job::failed(
                Error::InvalidArgument(format!(
                    "part {range:?} of arrays of {} and {} elements",
                    src.1, dst.1
                )),
                Some(bundle),
            );
        }
        let part = |ptr: *mut u8, domain| Erased {
            // SAFETY: range.start <= len (checked above): inside or one past
            // the end of the array.
            ptr: unsafe { ptr.add(range.start * 4) },
            len: range.len(),
            size: 4,
            type_id: TypeId::of::<f32>(),
            type_name: "f32",
            device_id: domain,
        };
        let ins = vec![part(src.0 as *mut u8, src.2)];
        let outs = vec![part(dst.0.cast(), dst.2)];
        let stage = stage_fn(move |c, chunk| c.kernel(kernel, chunk.output::<f32>(0)?));
        self.run_erased(
            bundle,
            (ins, vec![0]),
            (outs, vec![0]),
            &[4],
            plan,
            Timeline::Off,
            &stage,
        )
    }

    /// Pushes the `inputs` through H2D → `stage` → D2H into the `outputs`,
    /// cut by `plan`: the general form of [`Pipeline::run`]. Inputs and
    /// outputs are tuples of one to four pinned arrays of equal length,
    /// whose element types may differ (bf16 in, f32 out, say). Each chunk of
    /// every input is copied into a device buffer of its own, `stage`
    /// enqueues the chunk's work (usually one [`Commands::launch`] of a
    /// kernel, over [`Chunk::input`] / [`Chunk::output`] views), then each
    /// output's chunk is copied out. `stage` runs while the run is enqueued,
    /// once per chunk, on the calling thread.
    ///
    /// ```rust
    /// # fn main() -> gpufeed::Result<()> { gpufeed::block_on(async {
    /// # let device = gpufeed::Device::cpu();
    /// # let pipe = gpufeed::Pipeline::new(&device, 4)?;
    /// # let pool = gpufeed::PinnedPool::new(&device);
    /// // SAXPY through the pipeline: two inputs, one output.
    /// let n = 1_000_000;
    /// let alloc = || pool.alloc::<f32>(n);
    /// let (mut x, mut y, out) = (alloc()?, alloc()?, alloc()?);
    /// x.as_mut_slice().fill(1.0);
    /// y.as_mut_slice().fill(0.5);
    /// let (((x, y), (out,)), _) = pipe
    ///     .run_stage((x, y), (out,), gpufeed::Plan::auto(n), gpufeed::Timeline::Off, |c, chunk| {
    ///         let y_out = chunk.output::<f32>(0)?;
    ///         c.copy_d2d(chunk.input::<f32>(1)?, y_out)?;
    ///         c.saxpy(2.0, chunk.input::<f32>(0)?, y_out)
    ///     })
    ///     .await?;
    /// assert!(out.as_slice().iter().all(|&v| v == 2.5));
    /// # drop((x, y)); Ok(()) }) }
    /// ```
    ///
    /// # Errors
    /// As [`Pipeline::run`]; also `LengthMismatch` for arrays of unequal
    /// lengths, and the first error `stage` returns (a wrong element type
    /// asked of a chunk, say), with everything handed back.
    ///
    /// # Cancel safety
    /// As [`Pipeline::run`].
    pub fn run_stage<I, O, F>(
        &self,
        inputs: I,
        mut outputs: O,
        plan: Plan,
        timeline: Timeline,
        stage: F,
    ) -> Job<(I, O), RunInfo>
    where
        I: Arrays,
        O: Arrays,
        F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>,
    {
        let ins: Vec<Erased> = inputs.sources().into_iter().map(|a| a.0).collect();
        let outs: Vec<Erased> = outputs.destinations().into_iter().map(|a| a.0).collect();
        let sizes: Vec<usize> = ins.iter().chain(&outs).map(|a| a.size).collect();
        let (ni, no) = (ins.len(), outs.len());
        self.run_erased(
            (inputs, outputs),
            (ins, (0..ni).collect()),
            (outs, (ni..ni + no).collect()),
            &sizes,
            plan,
            timeline,
            &stage,
        )
    }
}
