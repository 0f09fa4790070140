//! Several devices at once: one host array spread over them, each device's
//! part through its own [`Pipeline`] (its own streams, copy engines and
//! link), all parts in flight together.
//!
//! Ownership is the single-device rule: the whole input and output belong to
//! the returned [`MultiJob`] until every device is done with its part, then
//! come back together; on an error they come back with it once nothing is
//! in flight; dropping the job drops them when the last part completes.

use crate::base::error::{Error, JobError, Result};
use crate::engines::pipeline::{Pipeline, Plan, RunInfo};
use crate::runtime::device::Device;
use crate::runtime::kernel::Kernel;
use crate::runtime::memory::PinnedHost;
use crate::runtime::stream::Job;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Elements of each part but the last are a multiple of this (256 bytes of
/// f32, like a pipeline's chunks).
const PART_ALIGN: usize = 64;

/// One pipeline per device, for runs that spread one array over all of
/// them ([`MultiPipeline::run`]).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, BackendChoice, Device, DeviceOptions, Kernel, MultiPipeline};
/// use gpufeed::{PinnedPool, Plan};
/// // Two emulated devices (on GPUs: `Device::all(DeviceOptions::from_env()?)?`).
/// let opts = DeviceOptions {
///     backend: BackendChoice::Cpu,
///     emulated_devices: 2,
///     ..Default::default()
/// };
/// let devices = Device::all(opts)?;
/// let multi = MultiPipeline::new(&devices, 2)?;
/// let n = 10_000;
/// assert_eq!(multi.parts(n), [0..5056, 5056..10_000]); // device 0, device 1
/// let pool = PinnedPool::new(&devices[0]); // pinned for every device of the backend
/// let mut input = pool.alloc::<f32>(n)?;
/// input.as_mut_slice().fill(1.0);
/// let output = pool.alloc::<f32>(n)?;
/// let job = multi.run(input, output, Kernel::Scale { s: 4.0 }, Plan::uniform(2, 2));
/// let ((_, output), infos) = block_on(job)?;
/// assert_eq!(infos.len(), 2); // one `RunInfo` per device
/// assert!(output.as_slice().iter().all(|&v| v == 4.0));
/// # Ok(()) }
/// ```
pub struct MultiPipeline {
    pipes: Vec<Pipeline>,
}

impl std::fmt::Debug for MultiPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiPipeline")
            .field("devices", &self.pipes.len())
            .finish()
    }
}

impl MultiPipeline {
    /// A pipeline of `streams` streams on each of `devices` (all of one
    /// backend; typically [`Device::all`]).
    ///
    /// # Errors
    /// `InvalidArgument` for no devices, or devices of different backends;
    /// as [`Pipeline::new`].
    pub fn new(devices: &[Device], streams: usize) -> Result<MultiPipeline> {
        let Some(first) = devices.first() else {
            return Err(Error::InvalidArgument(
                "a multi-device pipeline needs at least one device".into(),
            ));
        };
        if devices.iter().any(|d| d.kind() != first.kind()) {
            return Err(Error::InvalidArgument(
                "a multi-device pipeline's devices must share one backend".into(),
            ));
        }
        let pipes = devices
            .iter()
            .map(|d| Pipeline::new(d, streams))
            .collect::<Result<_>>()?;
        Ok(MultiPipeline { pipes })
    }

    /// The per-device pipelines, in the order of the devices given.
    pub fn pipelines(&self) -> &[Pipeline] {
        &self.pipes
    }

    /// The element range each device takes of `n`: contiguous parts in
    /// device order, as equal as 64-element steps allow (the
    /// last takes the remainder; a part may be empty when `n` is small).
    pub fn parts(&self, n: usize) -> Vec<Range<usize>> {
        split(n, self.pipes.len())
    }

    /// Pushes `input` through H2D → `kernel` → D2H into `output`: device
    /// `k` takes [`MultiPipeline::parts`]`[k]`, cut by `plan` on its own
    /// pipeline, all devices at once. The job hands both buffers back when
    /// every part is out, with the [`RunInfo`] of each device whose part is
    /// not empty, in device order (a small `n` leaves later parts empty and
    /// their devices idle).
    ///
    /// The buffers are pinned memory of any device of the backend (portable
    /// pinned memory, as a [`PinnedPool`](crate::PinnedPool) allocates, is
    /// pinned for every device's copies). Results are exactly those of one
    /// device: the kernel is elementwise.
    ///
    /// # Errors
    /// The job resolves to a [`JobError`] handing `(input, output)` back:
    /// at once for unequal lengths or a plan that fits no part, else once
    /// every part has ended, with the first part's error. Only when the end
    /// of a part's queued work can't be observed are the buffers leaked
    /// instead (`bundle: None`).
    ///
    /// # Cancel safety
    /// As [`Pipeline::run`]: dropping the job cancels nothing and frees
    /// nothing early; the buffers go when the last part is done.
    pub fn run<I, O>(&self, input: I, mut output: O, kernel: Kernel, plan: Plan) -> MultiJob<(I, O)>
    where
        I: PinnedHost<f32> + Send + 'static,
        O: PinnedHost<f32> + Send + 'static,
    {
        let src = input.host();
        let src = (src.ptr, src.len, src.device_id);
        let dst = output.host_mut();
        let dst = (dst.ptr, dst.len, dst.device_id);
        if src.1 != dst.1 {
            return MultiJob::failed(
                Error::LengthMismatch {
                    what: "multi-device run (output vs input)",
                    expected: src.1,
                    got: dst.1,
                },
                (input, output),
            );
        }
        // The plan is checked against the whole array (as one device's run
        // checks it), then each part gets a plan that fits it (fewer chunks
        // for a short one).
        if let Err(e) = plan.validate(src.1) {
            return MultiJob::failed(e, (input, output));
        }
        let parts = self.parts(src.1);
        let held = Arc::new(Held((input, output)));
        let jobs = self
            .pipes
            .iter()
            .zip(parts)
            .filter(|(_, r)| !r.is_empty())
            .map(|(pipe, range)| {
                let plan = Plan {
                    chunks: plan.chunks.min(range.len()).max(1),
                    ..plan
                };
                // SAFETY: `held` owns both buffers, whose memory stays in
                // place while they live (pinned allocations do not move
                // with their handles); every part's job holds a clone until
                // its work is done, and the parts are disjoint, so nothing
                // else touches a part's range meanwhile (the caller gave the
                // buffers away).
                unsafe { pipe.run_range(held.clone(), src, dst, range, kernel, plan) }
            })
            .map(Some)
            .collect::<Vec<_>>();
        let results = (0..jobs.len()).map(|_| None).collect();
        MultiJob {
            state: State::Running {
                jobs,
                results,
                held,
            },
        }
    }
}

/// `n` elements in `k` contiguous parts (see [`MultiPipeline::parts`]).
fn split(n: usize, k: usize) -> Vec<Range<usize>> {
    let k = k.max(1);
    // Saturating: `n` near `usize::MAX` (zero-sized elements) must not overflow.
    let step = n
        .div_ceil(k)
        .div_ceil(PART_ALIGN)
        .saturating_mul(PART_ALIGN);
    (0..k)
        .map(|i| i.saturating_mul(step).min(n)..(i + 1).saturating_mul(step).min(n))
        .collect()
}

/// The bundle every part holds a share of. Never read through a shared
/// reference: it is moved out once, when the last share comes back.
struct Held<B>(B);
// SAFETY: nothing accesses the bundle through `&Held`; shares only keep it
// alive, and it is moved out by the one owner left (`Arc::try_unwrap`), so
// sharing a `Held` across threads shares no access to `B`.
unsafe impl<B: Send> Sync for Held<B> {}

type Part<B> = Job<Arc<Held<B>>, RunInfo>;
type PartResult<B> = std::result::Result<(Arc<Held<B>>, RunInfo), JobError<Arc<Held<B>>>>;

enum State<B: Send + 'static> {
    Running {
        jobs: Vec<Option<Part<B>>>,
        results: Vec<Option<PartResult<B>>>,
        held: Arc<Held<B>>,
    },
    Failed(Option<JobError<B>>),
    Done,
}

/// A run over several devices in flight; resolves to `(bundle, each
/// device's RunInfo)` when every part is done, or to a [`JobError`] that
/// hands the bundle back.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, Error, Kernel, MultiJob, MultiPipeline, PinnedBuffer, Plan};
/// let device = Device::cpu();
/// let multi = MultiPipeline::new(&[device.clone()], 2)?;
/// let input = PinnedBuffer::<f32>::new(&device, 100)?;
/// let output = PinnedBuffer::<f32>::new(&device, 50)?; // too short
/// let job: MultiJob<_> = multi.run(input, output, Kernel::Scale { s: 2.0 }, Plan::auto(100));
/// assert!(job.is_done()); // refused before anything was enqueued
/// let err = block_on(job).unwrap_err();
/// assert!(matches!(err.error, Error::LengthMismatch { expected: 100, got: 50, .. }));
/// let (input, output) = err.bundle.expect("the buffers come back");
/// assert_eq!((input.len(), output.len()), (100, 50));
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// As [`Job`]: dropping it cancels nothing; the bundle is dropped when the
/// last part's work is done, never earlier, and `drop` never blocks.
#[must_use = "dropping a job does not cancel the GPU work; await it to get the buffers back"]
pub struct MultiJob<B: Send + 'static> {
    state: State<B>,
}

impl<B: Send + 'static> std::fmt::Debug for MultiJob<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiJob")
            .field("done", &self.is_done())
            .finish()
    }
}

impl<B: Send + 'static> MultiJob<B> {
    fn failed(error: Error, bundle: B) -> Self {
        MultiJob {
            state: State::Failed(Some(JobError {
                error,
                bundle: Some(bundle),
            })),
        }
    }

    /// Whether every part's work has finished (it then resolves at once).
    pub fn is_done(&self) -> bool {
        match &self.state {
            State::Running { jobs, .. } => jobs.iter().flatten().all(Job::is_done),
            _ => true,
        }
    }
}

impl<B: Send + 'static> Unpin for MultiJob<B> {}

impl<B: Send + 'static> Future for MultiJob<B> {
    type Output = std::result::Result<(B, Vec<RunInfo>), JobError<B>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let state = std::mem::replace(&mut self.state, State::Done);
        let (mut jobs, mut results, held) = match state {
            State::Running {
                jobs,
                results,
                held,
            } => (jobs, results, held),
            State::Failed(e) => {
                let e = e.unwrap_or(JobError {
                    error: Error::InvalidArgument(
                        "a multi-device job polled after it resolved".into(),
                    ),
                    bundle: None,
                });
                return Poll::Ready(Err(e));
            }
            State::Done => {
                return Poll::Ready(Err(JobError {
                    error: Error::InvalidArgument(
                        "a multi-device job polled after it resolved".into(),
                    ),
                    bundle: None,
                }))
            }
        };
        // Every part is polled each time, so each registers its waker.
        for (job, result) in jobs.iter_mut().zip(results.iter_mut()) {
            if let Some(j) = job {
                if let Poll::Ready(r) = Pin::new(j).poll(cx) {
                    *result = Some(r);
                    *job = None;
                }
            }
        }
        if jobs.iter().any(Option::is_some) {
            self.state = State::Running {
                jobs,
                results,
                held,
            };
            return Poll::Pending;
        }
        // Every part has ended: its share of the bundle is back, unless a
        // part's end could not be observed (then it stays leaked).
        let mut infos = Vec::new();
        let mut first_err = None;
        for r in results.into_iter().flatten() {
            match r {
                Ok((share, info)) => {
                    drop(share);
                    infos.push(info);
                }
                Err(JobError { error, bundle }) => {
                    drop(bundle);
                    first_err.get_or_insert(error);
                }
            }
        }
        let bundle = Arc::try_unwrap(held).ok().map(|h| h.0);
        Poll::Ready(match (first_err, bundle) {
            (None, Some(b)) => Ok((b, infos)),
            (Some(error), bundle) => Err(JobError { error, bundle }),
            (None, None) => Err(JobError {
                error: Error::Internal("a part kept its share of the buffers".into()),
                bundle: None,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn parts_cover_the_array_in_order_without_overlap() {
        for n in [0usize, 1, 63, 64, 65, 1000, 1_000_003] {
            for k in 1..5 {
                let parts = split(n, k);
                assert_eq!(parts.len(), k);
                let mut next = 0;
                for p in &parts {
                    assert_eq!(p.start, next.min(n), "n={n} k={k} {parts:?}");
                    next = p.end;
                }
                assert_eq!(next, n, "n={n} k={k} {parts:?}");
                // Every part that ends before the array does is whole steps.
                for p in parts.iter().filter(|p| p.end < n) {
                    assert!(p.len() % 64 == 0, "{parts:?}");
                }
            }
        }
    }
}
