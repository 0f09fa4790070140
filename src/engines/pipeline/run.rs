//! A run proper, over type-erased arrays: its chunks planned and checked,
//! the pipeline's lock and device scratch, the stage guarded against
//! re-entry and panics, the chunks enqueued in the plan's layout, and the
//! job that owns everything until the streams are done.

use crate::base::completion::Completion;
use crate::base::error::{Error, Result};
use crate::engines::pipeline::arrays::Erased;
use crate::engines::pipeline::chunk::{Placement, StageFn};
use crate::engines::pipeline::enqueue::{enqueue_engines, enqueue_round_robin};
use crate::engines::pipeline::pipe::{Pipeline, RunState};
use crate::engines::pipeline::plan::{Layout, Plan};
use crate::engines::pipeline::timeline::{ChunkEvents, RunInfo, Timeline};
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::stream::{Commands, Event, Job, Mark};
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex};

impl Pipeline {
    /// At least `slots` slots of scratch arrays of `sizes` bytes per element
    /// and at least `len` elements each.
    fn scratch(
        &self,
        st: &mut RunState,
        slots: usize,
        sizes: &[usize],
        len: usize,
    ) -> Result<Vec<Vec<Arc<DeviceBuffer<u8>>>>> {
        if st.scratch.len() < slots || st.shape.0 != sizes || st.shape.1 < len {
            // Old buffers may still be in use by runs in flight: those runs hold
            // their own Arc clones, so replacing them here frees nothing early.
            let n = slots.max(if st.shape.0 == sizes {
                st.scratch.len()
            } else {
                0
            });
            st.scratch = (0..n)
                .map(|_| {
                    sizes
                        .iter()
                        .map(|&size| {
                            let bytes = len.checked_mul(size).ok_or(Error::SizeOverflow {
                                count: len,
                                elem_size: size,
                            })?;
                            DeviceBuffer::new(&self.device, bytes).map(Arc::new)
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<_>>()?;
            st.shape = (sizes.to_vec(), len);
            st.free = (0..st.scratch.len()).map(|_| None).collect();
        }
        Ok(st.scratch[..slots].to_vec())
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_erased<B: Send + 'static>(
        &self,
        bundle: B,
        (ins, in_at): (Vec<Erased>, Vec<usize>),
        (outs, out_at): (Vec<Erased>, Vec<usize>),
        sizes: &[usize],
        plan: Plan,
        timeline: Timeline,
        stage: StageFn<'_>,
    ) -> Job<B, RunInfo> {
        let chunks = match self.plan_chunks(&ins, &outs, &plan) {
            Ok(chunks) => chunks,
            Err(e) => return Job::failed(e, Some(bundle)),
        };
        let mut guard = match self.lock_for_run() {
            Ok(guard) => guard,
            Err(e) => return Job::failed(e, Some(bundle)),
        };
        let st = &mut *guard;
        let scratch = match self.scratch(st, chunks.slots, sizes, chunks.longest) {
            Ok(s) => s,
            Err(e) => {
                drop(guard);
                return Job::failed(e, Some(bundle));
            }
        };
        let free = &mut st.free;
        let layout = Placement {
            ins,
            outs,
            in_at,
            out_at,
            scratch: &scratch,
            device_id: self.device.id(),
        };
        let mut events = timeline.records().then(Vec::new);
        let (outcome, panicked, enqueued) =
            self.enqueue(&chunks, plan.layout, &layout, free, stage, events.as_mut());
        drop(layout);
        let engines_done = matches!(plan.layout, Layout::Engines { .. }) && outcome.is_ok();
        let joined = self
            .join(chunks.streams, engines_done)
            .map(Event::into_completion);
        if outcome.is_err() || joined.is_err() {
            // This run stopped part-way (or its end can't be observed), so the
            // next run can't be ordered after its use of the buffers.
            guard.discard();
        }
        drop(guard);
        let info = RunInfo {
            plan,
            chunks: chunks.ranges.len(),
            timeline: events,
        };
        self.finish(
            (bundle, scratch),
            (outcome, panicked),
            joined,
            enqueued,
            info,
        )
    }

    /// Enqueues a run's `chunks` on its streams in `layout` (the stage run
    /// by [`Self::in_stage`]): the outcome, a caught panic, and how many
    /// commands were enqueued. The streams' commands are dropped on return.
    fn enqueue(
        &self,
        chunks: &Chunks,
        layout: Layout,
        placement: &Placement<'_>,
        free: &mut [Option<Mark>],
        stage: StageFn<'_>,
        events: Option<&mut Vec<ChunkEvents>>,
    ) -> (Result<()>, Option<Panic>, usize) {
        let mut cmds: Vec<Commands<'_>> = self.streams[..chunks.streams]
            .iter()
            // SAFETY: every address given to these commands belongs to the
            // bundle's arrays or to `scratch`, which the returned job owns
            // until a point recorded after them on every stream has
            // completed; the CPU cannot touch the arrays meanwhile (the job
            // owns them).
            .map(|s| unsafe { Commands::unbound(s) })
            .collect();
        let (outcome, panicked) = self.in_stage(|| {
            let ranges = &chunks.ranges;
            match layout {
                Layout::Engines { .. } => {
                    enqueue_engines(&mut cmds, ranges, placement, free, stage, events)
                }
                Layout::RoundRobin { chain, .. } => {
                    enqueue_round_robin(&mut cmds, ranges, placement, chain, free, stage, events)
                }
            }
        });
        let enqueued: usize = cmds.iter().map(|c| c.enqueued()).sum();
        (outcome, panicked, enqueued)
    }

    /// Plans a run's chunks: every array as long as the first input and of
    /// this pipeline's host memory, the plan valid for that length and no
    /// wider than the pipeline.
    fn plan_chunks(&self, ins: &[Erased], outs: &[Erased], plan: &Plan) -> Result<Chunks> {
        let n = ins.first().map_or(0, |a| a.len);
        let streams = plan.streams_used();
        ins.iter().chain(outs).try_for_each(|a| {
            crate::runtime::memory::check_len(
                "pipeline (every array vs the first input)",
                n,
                a.len,
            )?;
            if a.device_id != self.device.host_domain() {
                return Err(Error::InvalidArgument(
                    "host memory of another backend was given to this pipeline".into(),
                ));
            }
            Ok(())
        })?;
        plan.validate(n)?;
        if streams > self.streams.len() {
            let hint = match plan.layout {
                Layout::Engines { .. } => format!(
                    " (the engines layout, Plan::auto's, needs 3; Plan::auto_for(n, {}) fits \
                     the automatic plan to this pipeline)",
                    self.streams.len()
                ),
                Layout::RoundRobin { .. } => String::new(),
            };
            return Err(Error::InvalidArgument(format!(
                "plan wants {} streams, the pipeline has {}{hint}",
                streams,
                self.streams.len(),
            )));
        }
        let ranges = plan.ranges(n);
        // An engines ring needs no more buffers than there are chunks: a
        // larger slot count would only allocate device scratch never used.
        let slots = match plan.layout {
            Layout::Engines { slots } => slots.min(ranges.len()).max(1),
            Layout::RoundRobin { .. } => plan.slots(),
        };
        let longest = ranges.iter().map(|r| r.len()).max().unwrap_or(1).max(1);
        Ok(Chunks {
            ranges,
            streams,
            slots,
            longest,
        })
    }

    /// This pipeline, as `IN_STAGE` lists it.
    fn key(&self) -> usize {
        std::ptr::from_ref(&self.state) as usize
    }

    /// The lock a run is enqueued under. One run's commands reach each
    /// stream as one unbroken sequence, and each slot's first use waits for
    /// its last use by earlier runs (`RunState::free`), so runs may start
    /// from many tasks at once. The lock covers enqueueing only,
    /// microseconds; never a wait. A stage runs under it, so a stage
    /// starting a run of this same pipeline would wait for itself: refused
    /// instead.
    fn lock_for_run(&self) -> Result<std::sync::MutexGuard<'_, RunState>> {
        let me = self.key();
        if IN_STAGE.with(|s| s.borrow().contains(&me)) {
            return Err(Error::InvalidArgument(
                "a pipeline stage started a run of its own pipeline (it would wait \
                 for itself): use another Pipeline, or the stage's Commands"
                    .into(),
            ));
        }
        if IN_STAGE.with(|s| s.borrow().is_empty()) {
            return Ok(crate::base::completion::lock(&self.state));
        }
        // From another pipeline's stage, which holds that pipeline's lock:
        // two pipelines whose stages start runs of each other would each
        // wait for the other's lock for ever. Waited for a while (another
        // run's enqueueing takes microseconds), then refused, never waited
        // for without end.
        try_lock_for(&self.state, std::time::Duration::from_millis(20)).ok_or_else(|| {
            Error::InvalidArgument(
                "a pipeline stage started a run of another pipeline whose lock stayed \
                 taken (its own stage may be starting a run of this one: the two \
                 would wait for each other); start the run outside the stage"
                    .into(),
            )
        })
    }

    /// Runs `enqueue` with this pipeline listed in `IN_STAGE`. A panic in
    /// the stage must not free the bundle under the commands already queued:
    /// caught here, it ends the run like an error (the bundle is dropped
    /// once that work is done), and is handed back to resume.
    fn in_stage(&self, enqueue: impl FnOnce() -> Result<()>) -> (Result<()>, Option<Panic>) {
        let me = self.key();
        IN_STAGE.with(|s| s.borrow_mut().push(me));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(enqueue));
        IN_STAGE.with(|s| s.borrow_mut().retain(|&p| p != me));
        match caught {
            Ok(outcome) => (outcome, None),
            Err(panic) => (
                Err(Error::Internal("a pipeline stage panicked".into())),
                Some(panic),
            ),
        }
    }

    /// Joins a run's `streams` on the GPU: stream 0 waits for a marker of
    /// every other stream, and one point recorded after that ends the run.
    /// One watcher wakes the caller, instead of one per stream. A complete
    /// engines run (`engines_done`) ends with its last D2H, on stream 2.
    fn join(&self, streams: usize, engines_done: bool) -> Result<Event> {
        if engines_done {
            // The last D2H comes after every other command of the run.
            return self.streams[2].record();
        }
        let first = &self.streams[0];
        for s in &self.streams[1..streams] {
            first.wait_mark(&s.marker()?)?;
        }
        first.record()
    }

    /// The job of a run whose enqueueing ended with `outcome` (and a caught
    /// panic, resumed here) and whose end on the GPU is `joined`: it owns
    /// `bundle` and `scratch` until then. When that end can't be observed
    /// after work was queued on a live context, they are never freed.
    fn finish<B: Send + 'static>(
        &self,
        (bundle, scratch): (B, Scratch),
        (outcome, panicked): (Result<()>, Option<Panic>),
        joined: Result<Completion>,
        enqueued: usize,
        info: RunInfo,
    ) -> Job<B, RunInfo> {
        if let Some(panic) = panicked {
            let held = (bundle, scratch);
            match joined {
                Ok(all) => all.defer(move || drop(held)),
                Err(_) if enqueued > 0 && self.device.broken().is_none() => std::mem::forget(held),
                Err(_) => drop(held),
            }
            std::panic::resume_unwind(panic);
        }
        match joined {
            Ok(all) => {
                let value = outcome.map(|()| info);
                Job::from_parts(all, bundle, value, Some(Box::new(scratch)))
            }
            Err(e) => {
                let error = outcome.err().unwrap_or(e);
                if enqueued > 0 && self.device.broken().is_none() {
                    // The end of queued work can't be observed: never free it.
                    std::mem::forget((bundle, scratch));
                    return Job::failed(error, None);
                }
                // Otherwise (nothing queued, or a context broken for good, which
                // runs nothing more) the buffers are handed back.
                Job::failed(error, Some(bundle))
            }
        }
    }
}

/// A run's device scratch: per slot, one buffer per scratch array.
type Scratch = Vec<Vec<Arc<DeviceBuffer<u8>>>>;

/// A caught panic's payload.
type Panic = Box<dyn std::any::Any + Send + 'static>;

/// A run's chunks and the streams and slots they need.
struct Chunks {
    /// Each chunk's elements, in order.
    ranges: Vec<Range<usize>>,
    /// Streams the plan uses.
    streams: usize,
    /// Sets of device buffers.
    slots: usize,
    /// Elements of the longest chunk (at least 1): each buffer's length.
    longest: usize,
}

/// The lock of `m` if it can be had within `patience`, trying without
/// blocking (yielding between tries).
fn try_lock_for<T>(
    m: &Mutex<T>,
    patience: std::time::Duration,
) -> Option<std::sync::MutexGuard<'_, T>> {
    let start = std::time::Instant::now();
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < patience => {
                std::thread::yield_now()
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

thread_local! {
    /// The pipelines (their state's address) whose stage runs on this thread.
    static IN_STAGE: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}
