//! Pipeline runs over ordinary slices: [`Pipeline::run_slices`].
//!
//! The input is cut into windows of the staging engine's block size
//! (8 MiB by default). Each window is copied into a pinned
//! buffer by the staging engine's workers, pushed through
//! [`Pipeline::run_stage`] (chunked H2D → stage → D2H on the pipeline's
//! streams), and its result copied out of pinned memory into the output by
//! the same workers. [`DEPTH`] windows are in flight: while the GPU runs
//! window *k* (both DMA directions and the kernels overlapping, as in any
//! pipeline run), the workers drain window *k − 1* and fill window *k + 1*.

use crate::base::error::{Error, Result};
use crate::engines::pipeline::{Chunk, Pipeline, Plan, RunInfo, Timeline};
use crate::engines::staging::Staging;
use crate::runtime::pool::PooledBuffer;
use crate::runtime::stream::{Commands, Job};
use bytemuck::Pod;
use std::collections::VecDeque;
use std::ops::Range;

/// Windows in flight: at most `DEPTH` windows of the engine's block size
/// of pinned memory each way (64 MiB in all by default).
pub(crate) const DEPTH: usize = 4;

type WindowJob<A, B> = Job<((PooledBuffer<A>,), (PooledBuffer<B>,)), RunInfo>;

impl Pipeline {
    /// [`Pipeline::run_stage`] over ordinary (pageable) slices: `input` is
    /// staged into pinned windows by `staging`'s workers, each window runs
    /// through the pipeline with `stage`, and its result lands in
    /// `output`, the host copies of neighbouring windows overlapping the
    /// device's work. Resolves when all of `output` is written.
    ///
    /// A window is as many elements of the wider type as fill one of the
    /// engine's blocks ([`crate::StagingConfig::block_bytes`]); each is one
    /// run of [`Pipeline::run_stage`] with one input and
    /// one output array ([`Chunk::input`] `0`, [`Chunk::output`] `0`), cut
    /// by [`Plan::auto_for`]; `stage` runs once per chunk of every window.
    ///
    /// ```rust
    /// # fn main() -> gpufeed::Result<()> { gpufeed::block_on(async {
    /// # let device = gpufeed::Device::cpu();
    /// # let pipe = gpufeed::Pipeline::new(&device, 4)?;
    /// # let staging = &gpufeed::Staging::new(&device)?;
    /// // y = 3 x from a Vec into a Vec: no pinned memory of the caller's.
    /// let x: Vec<f32> = (0..1_000_000).map(|i| i as f32).collect();
    /// let mut y = vec![0f32; x.len()];
    /// pipe.run_slices(staging, &x, &mut y, |c, chunk| {
    ///     let out = chunk.output::<f32>(0)?;
    ///     c.copy_d2d(chunk.input::<f32>(0)?, out)?;
    ///     c.kernel(gpufeed::Kernel::Scale { s: 3.0 }, chunk.output::<f32>(0)?)
    /// })
    /// .await?;
    /// assert_eq!(y[7], 21.0);
    /// # Ok(()) }) }
    /// ```
    ///
    /// # Errors
    /// `LengthMismatch` for slices of unequal lengths and
    /// `InvalidArgument` for an engine of another device, before anything
    /// is touched; the first error of a window's run (`stage`'s own, the
    /// driver's) or of the workers ([`Error::WorkerPanicked`]). After an
    /// error the output holds the windows finished before it, and
    /// unspecified values (never memory unsafety) past them.
    ///
    /// # Cancel safety
    /// The slices are read and written only inside `poll`, by the workers
    /// and the polling thread, which return before `poll` does: dropping
    /// the future at any point leaves nothing touching them. The windows'
    /// runs already enqueued own their pinned buffers and finish on the
    /// GPU; their memory goes back to the pool when each is done. The
    /// output's contents are then unspecified.
    pub async fn run_slices<A, B, F>(
        &self,
        staging: &Staging,
        input: &[A],
        output: &mut [B],
        stage: F,
    ) -> Result<()>
    where
        A: Pod + Send,
        B: Pod + Send,
        F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>,
    {
        if input.len() != output.len() {
            return Err(Error::LengthMismatch {
                what: "run_slices input and output",
                expected: input.len(),
                got: output.len(),
            });
        }
        staging.same_device(self.device())?;
        let n = input.len();
        let widest = size_of::<A>().max(size_of::<B>()).max(1);
        let window = (staging.config().block_bytes / widest).max(1);
        let mut in_flight: VecDeque<(Range<usize>, WindowJob<A, B>)> = VecDeque::new();
        let mut next = 0;
        loop {
            while in_flight.len() < DEPTH && next < n {
                let range = next..(next + window).min(n);
                let job = self.start_window(staging, &input[range.clone()], &stage)?;
                next = range.end;
                in_flight.push_back((range, job));
            }
            let Some((range, job)) = in_flight.pop_front() else {
                return Ok(());
            };
            let ((_, (out,)), _) = job.await.map_err(Error::from)?;
            staging.host_copy(
                bytemuck::cast_slice(out.as_slice()),
                bytemuck::cast_slice_mut(&mut output[range]),
            )?;
        }
    }

    /// Stages `input` into a pinned window and enqueues its run.
    fn start_window<A, B, F>(
        &self,
        staging: &Staging,
        input: &[A],
        stage: &F,
    ) -> Result<WindowJob<A, B>>
    where
        A: Pod + Send,
        B: Pod + Send,
        F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>,
    {
        let mut pinned_in = self.windows().alloc::<A>(input.len())?;
        let pinned_out = self.windows().alloc::<B>(input.len())?;
        staging.host_copy(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(pinned_in.as_mut_slice()),
        )?;
        let plan = Plan::auto_for(input.len(), self.streams().len());
        Ok(self.run_stage((pinned_in,), (pinned_out,), plan, Timeline::Off, stage))
    }
}
