//! The overlap pipeline: a host array pushed through host-to-device copy,
//! kernel and device-to-host copy in chunks over several streams, so the two
//! copy engines and the SMs work at the same time.
//!
//! ```text
//! stream 0: [H2D c0][K c0][D2H c0]            [H2D c4][K c4][D2H c4] ...
//! stream 1:         [H2D c1][K c1][D2H c1]            [H2D c5] ...
//! stream 2:                 [H2D c2][K c2][D2H c2]
//! ```
//!
//! Each stream reuses one chunk-sized device buffer; its stream order makes
//! that safe (chunk `i + S` is copied in only after chunk `i` was copied out).
//!
//! The *engines* layout ([`Plan::engines`]) instead gives each engine its own
//! stream: every host-to-device copy goes on a copy-in stream, every kernel on
//! a compute stream, every device-to-host copy on a copy-out stream, linked by
//! events, with a ring of device buffers:
//!
//! ```text
//! copy-in:  [H2D c0][H2D c1][H2D c2][H2D c3]...   (waits: c_i+R for D2H c_i)
//! compute:          [K c0]  [K c1]  [K c2]  ...   (waits: H2D c_i)
//! copy-out:              [D2H c0][D2H c1][D2H c2] (waits: K c_i)
//! ```
//!
//! Copies of one direction then never share the link with each other, so the
//! first chunk arrives at full speed and the pipeline fills sooner.
//!
//! Consecutive runs on one pipeline are ordered on the GPU: every stream of a
//! run first waits for the end of the previous run, so device scratch is never
//! written by one run while another still reads it, whatever their layouts.
//! A run is one [`Job`] owning the input, the output and the device buffers
//! until the last stream is done, so dropping it early frees nothing in use.

use crate::base::completion::Completion;
use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::kernel::Kernel;
use crate::runtime::memory::{
    device_slice_mut, host_slice, host_slice_mut, DeviceBuffer, DeviceSlice, DeviceSliceMut,
    HostSlice, HostSliceMut, PinnedBuffer, PinnedHost, Registered,
};
use crate::runtime::pool::{PinnedPool, PooledBuffer};
use crate::runtime::stream::{Commands, Event, Job, Mark, Stream};
use bytemuck::Pod;
use std::any::TypeId;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// How a run is cut: how many chunks, how they are laid over streams, and
/// whether their sizes ramp.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Layout, Plan};
/// let plan = Plan::auto(10_000_000); // sqrt(40 MB / 320 KiB) chunks, engine streams
/// assert_eq!((plan.chunks, plan.layout), (11, Layout::Engines { slots: 4 }));
/// assert_eq!(Plan::auto_for(10_000_000, 2), Plan::uniform(11, 2)); // for 2 streams
/// let plan = Plan::uniform(4, 2).chained();
/// assert_eq!(plan.to_string(), "4 chunks x 2 streams, chained");
/// assert_eq!(plan.ranges(1000)[3], 768..1000); // multiples of 64 elements but the last
/// let err = Plan::uniform(0, 2).validate(1000).unwrap_err();
/// assert!(matches!(err, gpufeed::Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Chunks the arrays are cut into, at most. A plan is reduced, never
    /// refused, for the data it meets: `n` elements are cut into chunks of
    /// `ceil(n / chunks)` elements rounded up to a multiple of 64 (the
    /// granularity: 256 bytes of `f32`), the last one shorter, so
    /// `ceil(n / that)` chunks run, each holding at least one element (an
    /// empty run none). 100 chunks over 10 elements run as 1;
    /// `Plan::uniform(7, 4)` over 1,000 elements runs 6 chunks of 192 (the
    /// last of 40). [`RunInfo::chunks`] says how many ran, and
    /// [`Plan::ranges`] gives them beforehand. A plan is refused
    /// ([`Error::InvalidArgument`], [`Plan::validate`]) only for 0 chunks
    /// or 0 streams (slots).
    ///
    /// ```
    /// use gpufeed::Plan;
    /// let plan = Plan::uniform(7, 4);
    /// let lens: Vec<usize> = plan.ranges(1000).iter().map(|r| r.len()).collect();
    /// assert_eq!(lens, [192, 192, 192, 192, 192, 40]);
    /// assert_eq!(Plan::uniform(100, 4).ranges(10), [0..10]);
    /// assert!(Plan::uniform(7, 4).ranges(0).is_empty());
    /// assert!(Plan::uniform(0, 4).validate(1000).is_err());
    /// ```
    pub chunks: usize,
    /// How the chunks go over the pipeline's streams.
    pub layout: Layout,
    /// Ramp the chunk sizes: the first three chunks are 1/8, 1/4 and 1/2 of
    /// the others, and the last three mirror them. The pipeline's fill (the
    /// first H2D, which nothing overlaps) and drain (the last D2H) shrink
    /// eightfold, while the middle chunks stay large enough for full-speed
    /// copies. The chunk count then counts the full-size chunks. An array
    /// shorter than the six ramp pieces and one full chunk runs unramped.
    pub ramp: bool,
}

/// How a run's chunks go over the pipeline's streams.
///
/// ```rust
/// use gpufeed::{Layout, Plan};
/// let plan = Plan::uniform(8, 4);
/// assert_eq!(plan.layout, Layout::RoundRobin { streams: 4, chain: false });
/// assert_eq!(plan.layout.name(), "round-robin");
/// let engines = Plan::engines(8, 3); // 3 sets of device buffers in flight
/// assert_eq!(engines.layout.name(), "engines");
/// assert_eq!(engines.streams_used(), 3); // copy-in, compute, copy-out
/// let layout = Layout::RoundRobin { streams: 2, chain: true };
/// let own = Plan { chunks: 16, layout, ramp: false };
/// assert_eq!(own, Plan::uniform(16, 2).chained());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Chunk `i` goes to stream `i % streams`, which copies it in, runs the
    /// stage and copies it out; each stream has one set of device buffers.
    RoundRobin {
        /// Streams the chunks are dealt to (at most the pipeline's).
        streams: usize,
        /// Chain the host-to-device copies across streams: each waits for
        /// the previous chunk's copy, so the first chunk arrives at full link
        /// speed instead of sharing it with the next ones, and its stage and
        /// D2H start sooner (a shorter fill), at the price of an event per
        /// chunk.
        chain: bool,
    },
    /// One stream per engine (module docs): copy-in, compute and copy-out
    /// streams linked by events (the pipeline needs three streams), over a
    /// ring of `slots` sets of device buffers, i.e. chunks in flight.
    Engines {
        /// Sets of device buffers in the ring.
        slots: usize,
    },
}

#[cfg(feature = "serde")]
impl serde::Serialize for Plan {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Plan", 6)?;
        st.serialize_field("chunks", &self.chunks)?;
        st.serialize_field("layout", self.layout.name())?;
        st.serialize_field("streams", &self.streams_used())?;
        st.serialize_field("buffers", &self.slots())?;
        st.serialize_field("ramp", &self.ramp)?;
        st.serialize_field(
            "chain",
            &matches!(self.layout, Layout::RoundRobin { chain: true, .. }),
        )?;
        st.end()
    }
}

impl Layout {
    /// `round-robin` or `engines`.
    pub fn name(&self) -> &'static str {
        match self {
            Layout::RoundRobin { .. } => "round-robin",
            Layout::Engines { .. } => "engines",
        }
    }
}

/// What one more chunk costs, in bytes of copy time: each copy has a fixed
/// cost of about 7 us per direction (on the H200, 40 MB both ways took
/// 0.822 ms as whole copies, 0.892 ms in 8 pieces and 0.934 ms in 16), which
/// the link would have spent moving about 320 KiB.
pub const AUTO_CHUNK_COST_BYTES: usize = 320 << 10;

impl Plan {
    /// A near-optimal plan for `n` floats: the engines layout (it needs a
    /// pipeline of at least three streams) with `k = sqrt(bytes /
    /// AUTO_CHUNK_COST_BYTES)` chunks. More chunks add a fixed cost each
    /// ([`AUTO_CHUNK_COST_BYTES`]); fewer make the one chunk nothing overlaps
    /// (the fill, about `bytes / k`) longer; `k c + bytes / k` is least at
    /// that `k`. About 11 chunks for 10^7 floats, 35 for 10^8, 110 for 10^9;
    /// one chunk on one stream under about 1.5 MB.
    pub fn auto(n: usize) -> Plan {
        let bytes = n.saturating_mul(4) as f64;
        let k = (bytes / AUTO_CHUNK_COST_BYTES as f64).sqrt().round() as usize;
        let k = k.clamp(1, 256).min(n.max(1));
        if k < 2 {
            return Plan::uniform(1, 1);
        }
        Plan::engines(k, 4)
    }

    /// [`Plan::auto`] fitted to a pipeline of `streams` streams: the engines
    /// layout needs three; with fewer, the same chunks go round robin over
    /// the streams there are.
    pub fn auto_for(n: usize, streams: usize) -> Plan {
        let plan = Plan::auto(n);
        match plan.layout {
            Layout::Engines { .. } if streams < 3 => Plan::uniform(plan.chunks, streams.max(1)),
            _ => plan,
        }
    }

    /// `chunks` equal chunks dealt round robin over `streams` streams.
    pub fn uniform(chunks: usize, streams: usize) -> Plan {
        Plan {
            chunks,
            layout: Layout::RoundRobin {
                streams,
                chain: false,
            },
            ramp: false,
        }
    }

    /// The engines layout: `chunks` chunks, `slots` sets of device buffers.
    pub fn engines(chunks: usize, slots: usize) -> Plan {
        Plan {
            chunks,
            layout: Layout::Engines { slots },
            ramp: false,
        }
    }

    /// The same plan with ramped chunk sizes (see [`Plan::ramp`]).
    pub fn ramped(self) -> Plan {
        Plan { ramp: true, ..self }
    }

    /// The same plan with chained host-to-device copies (round robin only;
    /// an engines plan already copies in on one stream, so it is unchanged).
    pub fn chained(self) -> Plan {
        match self.layout {
            Layout::RoundRobin { streams, .. } => Plan {
                layout: Layout::RoundRobin {
                    streams,
                    chain: true,
                },
                ..self
            },
            Layout::Engines { .. } => self,
        }
    }

    /// Streams a run of this plan uses.
    pub fn streams_used(&self) -> usize {
        match self.layout {
            Layout::RoundRobin { streams, .. } => streams,
            Layout::Engines { .. } => 3,
        }
    }

    /// Sets of device chunk buffers a run uses: chunks in flight.
    pub fn slots(&self) -> usize {
        match self.layout {
            Layout::RoundRobin { streams, .. } => streams,
            Layout::Engines { slots } => slots,
        }
    }

    /// The element ranges of the chunks of `n` elements, in issue order.
    /// Chunks are multiples of 64 elements (256 bytes), except the last.
    pub fn ranges(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let m = self.chunk_len(n);
        let ramp: Vec<usize> = [m / 8, m / 4, m / 2]
            .iter()
            .map(|l| (l / 64 * 64).max(64))
            .collect();
        let ramp_total = ramp
            .iter()
            .fold(0usize, |a, &b| a.saturating_add(b))
            .saturating_mul(2);
        let sizes: Vec<usize> = if !self.ramp || n < ramp_total.saturating_add(m) {
            // Only the chunks that hold an element (none is empty): a count
            // far above `n` (any usize is a valid plan) costs nothing.
            (0..self.chunks.min(n.div_ceil(m.max(1))))
                .map(|i| self.chunk(i, n).len())
                .collect()
        } else {
            let middle = n - ramp_total;
            let mut v = ramp.clone();
            v.extend(std::iter::repeat_n(m, middle / m));
            if !middle.is_multiple_of(m) {
                v.push(middle % m);
            }
            v.extend(ramp.iter().rev());
            v
        };
        let mut start = 0;
        sizes
            .into_iter()
            .map(|l| {
                let r = start..start + l;
                start += l;
                r
            })
            .collect()
    }

    /// Checks the plan for `n` elements: at least one chunk and one stream
    /// or buffer slot. Any `n` is fine, even below the chunk count: short
    /// arrays run in fewer chunks ([`RunInfo::chunks`]).
    pub fn validate(&self, _n: usize) -> Result<()> {
        if self.chunks == 0 || self.slots() == 0 {
            return Err(Error::InvalidArgument(format!(
                "a plan needs at least one chunk and one {} (got {} chunks, {})",
                match self.layout {
                    Layout::RoundRobin { .. } => "stream",
                    Layout::Engines { .. } => "buffer slot",
                },
                self.chunks,
                self.slots()
            )));
        }
        Ok(())
    }

    /// The element range of chunk `i` of `n`: chunks are multiples of 64
    /// elements (256 bytes) except the last.
    pub fn chunk(&self, i: usize, n: usize) -> std::ops::Range<usize> {
        // Saturating: `n` near `usize::MAX` (zero-sized elements) must not
        // overflow.
        let len = self.chunk_len(n);
        let start = i.saturating_mul(len).min(n);
        start..start.saturating_add(len).min(n)
    }

    /// Elements per chunk (the last may be shorter).
    pub fn chunk_len(&self, n: usize) -> usize {
        n.div_ceil(self.chunks.max(1))
            .div_ceil(64)
            .saturating_mul(64)
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chunks = if self.chunks == 1 { "chunk" } else { "chunks" };
        match self.layout {
            Layout::Engines { slots } => write!(
                f,
                "{} {chunks}, engine streams, {slots} buffers",
                self.chunks
            )?,
            Layout::RoundRobin { streams, chain } => {
                let s = if streams == 1 { "stream" } else { "streams" };
                write!(f, "{} {chunks} x {streams} {s}", self.chunks)?;
                if chain {
                    write!(f, ", chained")?;
                }
            }
        }
        if self.ramp {
            write!(f, ", ramped")?;
        }
        Ok(())
    }
}

/// GPU timestamps of one chunk: before H2D, after H2D, after the kernel,
/// after D2H (for the timeline plot). Measure with [`Mark::elapsed_ms`].
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, ChunkEvents, Device, Kernel, PinnedPool, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let pool = PinnedPool::new(&device);
/// let (input, output) = (pool.alloc::<f32>(4096)?, pool.alloc::<f32>(4096)?);
/// let (k, plan) = (Kernel::Scale { s: 2.0 }, Plan::uniform(4, 2));
/// let pipeline = Pipeline::new(&device, 2)?;
/// let (_, info) = block_on(pipeline.run(input, output, k, plan, Timeline::Record))?;
/// let timeline: Vec<ChunkEvents> = info.timeline.expect("recorded");
/// for c in &timeline {
///     let [start, copied_in, computed, copied_out] = &c.events;
///     let (h2d, d2h) = (start.elapsed_ms(copied_in)?, computed.elapsed_ms(copied_out)?);
///     println!("chunk {} on stream {}: H2D {h2d:.3} ms, D2H {d2h:.3} ms", c.chunk, c.stream);
/// }
/// assert_eq!(timeline.iter().map(|c| c.stream).collect::<Vec<_>>(), [0, 1, 0, 1]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ChunkEvents {
    /// Chunk index.
    pub chunk: usize,
    /// Stream index.
    pub stream: usize,
    /// The four timed points.
    pub events: [Mark; 4],
}

/// Whether a run records its timeline: four timed points of each chunk
/// ([`RunInfo::timeline`]), for a timeline plot.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, Kernel, PinnedPool, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let (pool, pipeline) = (PinnedPool::new(&device), Pipeline::new(&device, 2)?);
/// let (k, plan) = (Kernel::Scale { s: 2.0 }, Plan::uniform(4, 2));
/// let (x, y) = (pool.alloc::<f32>(4096)?, pool.alloc::<f32>(4096)?);
/// let ((x, y), info) = block_on(pipeline.run(x, y, k, plan, Timeline::Off))?;
/// assert!(info.timeline.is_none());
/// let (_, info) = block_on(pipeline.run(x, y, k, plan, Timeline::Record))?;
/// assert_eq!(info.timeline.map(|t| t.len()), Some(4)); // one entry per chunk
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Timeline {
    /// No timed points.
    #[default]
    Off,
    /// Each chunk's points before H2D, after H2D, after the stage and after
    /// D2H ([`ChunkEvents`]).
    Record,
}

impl Timeline {
    fn records(self) -> bool {
        self == Timeline::Record
    }
}

/// What a run hands back besides the buffers.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, Kernel, PinnedPool, Pipeline, Plan, RunInfo, Timeline};
/// let device = Device::cpu();
/// let pool = PinnedPool::new(&device);
/// let (x, y) = (pool.alloc::<f32>(200)?, pool.alloc::<f32>(200)?);
/// let plan = Plan::uniform(8, 2);
/// let job = Pipeline::new(&device, 2)?.run(x, y, Kernel::Scale { s: 2.0 }, plan, Timeline::Off);
/// let (_, info): (_, RunInfo) = block_on(job)?;
/// assert_eq!(info.plan, plan);
/// assert_eq!(info.chunks, 4); // 200 elements: 4 chunks of at least 64, not 8
/// assert!(info.timeline.is_none()); // not asked for
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct RunInfo {
    /// The plan used, as asked.
    pub plan: Plan,
    /// The chunks that ran: at most `plan.chunks` (more with a ramped plan),
    /// fewer when the arrays are short (chunks are whole multiples of 64
    /// elements), 0 for empty arrays.
    pub chunks: usize,
    /// Per-chunk events, when the run was asked to record them.
    pub timeline: Option<Vec<ChunkEvents>>,
}

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
    device: Device,
    streams: Vec<Stream>,
    state: Mutex<RunState>,
    /// Pinned windows of runs over ordinary slices (`run_slices`).
    windows: PinnedPool,
}

/// What consecutive runs share, under the pipeline's lock.
#[derive(Default)]
struct RunState {
    /// Device chunk buffers: per slot, one per scratch array.
    scratch: Vec<Vec<Arc<DeviceBuffer<u8>>>>,
    /// Bytes per element of each scratch array, and elements per array.
    shape: (Vec<usize>, usize),
    /// Per slot: a point after the last command of an earlier run that
    /// touched it. A run's first command on a slot waits for it, so a run
    /// may start while the previous one drains, yet never overwrites a buffer
    /// still being read, whatever the two runs' layouts.
    free: Vec<Option<Mark>>,
}

impl RunState {
    /// Lets go of the scratch, so the next run gets fresh buffers (the old
    /// ones stay alive with the jobs that use them, or are kept for ever).
    fn discard(&mut self) {
        self.scratch.clear();
        self.free.clear();
        self.shape = (Vec::new(), 0);
    }
}

/// One host array of a pipeline run: pinned memory of one element type
/// ([`PinnedBuffer`], [`PooledBuffer`], [`Registered`]).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedPool, Pipeline, Plan, Registered, Timeline};
/// let device = Device::cpu();
/// // A registered `Vec` in, a pool's buffer out: both `PinnedArray`s of `u32`.
/// let input = Registered::new(&device, (0..1000u32).collect())?;
/// let output = PinnedPool::new(&device).alloc::<u32>(1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// let plan = Plan::uniform(4, 2);
/// let job = pipeline.run_stage((input,), (output,), plan, Timeline::Off, |c, chunk| {
///     c.copy_d2d(chunk.input::<u32>(0)?, chunk.output::<u32>(0)?)
/// });
/// let (((input,), (output,)), _) = block_on(job)?;
/// assert_eq!(output.as_slice(), input.as_slice());
/// # Ok(()) }
/// ```
pub trait PinnedArray: Send + 'static {
    /// The element type.
    type Elem: Pod;
    /// A source view of the whole array.
    fn source(&self) -> HostSlice<'_, Self::Elem>;
    /// A destination view of the whole array.
    fn destination(&mut self) -> HostSliceMut<'_, Self::Elem>;
}

macro_rules! pinned_array {
    ($($t:ident),*) => { $(
        impl<T: Pod + Send> PinnedArray for $t<T> {
            type Elem = T;
            fn source(&self) -> HostSlice<'_, T> {
                self.host()
            }
            fn destination(&mut self) -> HostSliceMut<'_, T> {
                self.host_mut()
            }
        }
    )* };
}
pinned_array!(PinnedBuffer, PooledBuffer, Registered);

/// A host array with its type erased (the pipeline copies bytes).
#[derive(Clone, Copy)]
struct Erased {
    ptr: *mut u8,
    len: usize,
    size: usize,
    type_id: TypeId,
    type_name: &'static str,
    device_id: usize,
}

fn erase_source<A: PinnedArray>(a: &A) -> Erased {
    let v = a.source();
    Erased {
        ptr: v.ptr as *mut u8,
        len: v.len,
        size: std::mem::size_of::<A::Elem>(),
        type_id: TypeId::of::<A::Elem>(),
        type_name: std::any::type_name::<A::Elem>(),
        device_id: v.device_id,
    }
}

fn erase_destination<A: PinnedArray>(a: &mut A) -> Erased {
    let v = a.destination();
    Erased {
        ptr: v.ptr.cast(),
        len: v.len,
        size: std::mem::size_of::<A::Elem>(),
        type_id: TypeId::of::<A::Elem>(),
        type_name: std::any::type_name::<A::Elem>(),
        device_id: v.device_id,
    }
}

/// The host arrays of a run: a tuple of one to four [`PinnedArray`]s,
/// whose element types may differ.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedBuffer, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[1.0f32; 1000])?;
/// let y = PinnedBuffer::from_slice(&device, &[2.0f32; 1000])?;
/// let out = PinnedBuffer::<f32>::new(&device, 1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// // Inputs `(x, y)` and outputs `(out,)`: SAXPY, out = 3 x + y, chunk by chunk.
/// let job = pipeline.run_stage((x, y), (out,), Plan::uniform(4, 2), Timeline::Off, |c, chunk| {
///     let out = chunk.output::<f32>(0)?;
///     c.copy_d2d(chunk.input::<f32>(1)?, out)?;
///     c.saxpy(3.0, chunk.input::<f32>(0)?, out)
/// });
/// let (((_x, _y), (out,)), _) = block_on(job)?;
/// assert!(out.as_slice().iter().all(|&v| v == 5.0));
/// # Ok(()) }
/// ```
///
/// Sealed: implemented by this crate only (for tuples of [`PinnedArray`]s and
/// [`KeepAlive`]), since the pipeline copies to and from the addresses these
/// report.
pub trait Arrays: Send + 'static + sealed::Sealed {
    #[doc(hidden)]
    fn sources(&self) -> Vec<ErasedArray>;
    #[doc(hidden)]
    fn destinations(&mut self) -> Vec<ErasedArray>;
}

/// A type-erased host array (opaque).
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct ErasedArray(Erased);

mod sealed {
    /// Only this crate's [`super::Arrays`] implementations.
    pub trait Sealed {}
}

/// No host arrays, only something a run must keep alive until its work is
/// done: the outputs of a run whose stage writes device memory of its own
/// (given to the stage as views) instead of host arrays. Nothing is copied
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::interop::{device_ptr, device_slice_mut};
/// use gpufeed::{block_on, Device, DeviceBuffer, KeepAlive, Kernel, PinnedBuffer};
/// use gpufeed::{Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[2.0f32; 1000])?;
/// let out = DeviceBuffer::<f32>::new(&device, 1000)?; // the result stays on the device
/// let addr = device_ptr(&out);
/// let pipeline = Pipeline::new(&device, 2)?;
/// let plan = Plan::uniform(4, 2);
/// let job = pipeline.run_stage((x,), KeepAlive(out), plan, Timeline::Off, |c, chunk| {
///     let r = chunk.range();
///     // SAFETY: `out`, owned by the job, holds 1000 floats at `addr`; the
///     // chunks are disjoint, and nothing else uses `out` during the run.
///     let dst = unsafe { device_slice_mut::<f32>(&device, addr + 4 * r.start as u64, r.len()) };
///     c.copy_d2d(chunk.input::<f32>(0)?, dst)?;
///     c.kernel(Kernel::Scale { s: 3.0 }, dst)
/// });
/// let ((_x, KeepAlive(mut out)), _) = block_on(job)?;
/// let mut back = vec![0f32; 1000];
/// out.copy_to_host_sync(&mut back)?;
/// assert!(back.iter().all(|&v| v == 6.0));
/// # Ok(()) }
/// ```
///
/// out; the job hands `T` back with the inputs.
#[derive(Debug)]
pub struct KeepAlive<T>(pub T);

impl<T: Send + 'static> sealed::Sealed for KeepAlive<T> {}

impl<T: Send + 'static> Arrays for KeepAlive<T> {
    fn sources(&self) -> Vec<ErasedArray> {
        Vec::new()
    }
    fn destinations(&mut self) -> Vec<ErasedArray> {
        Vec::new()
    }
}

macro_rules! arrays {
    ($($t:ident $i:tt),*) => {
        impl<$($t: PinnedArray),*> sealed::Sealed for ($($t,)*) {}
        impl<$($t: PinnedArray),*> Arrays for ($($t,)*) {
            fn sources(&self) -> Vec<ErasedArray> {
                vec![$(ErasedArray(erase_source(&self.$i))),*]
            }
            fn destinations(&mut self) -> Vec<ErasedArray> {
                vec![$(ErasedArray(erase_destination(&mut self.$i))),*]
            }
        }
    };
}
arrays!(A 0);
arrays!(A 0, B 1);
arrays!(A 0, B 1, C 2);
arrays!(A 0, B 1, C 2, D 3);

/// One chunk on the device, as a stage sees it: the chunk's part of every
/// input (copied in) and every output (copied out after the stage), typed.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedBuffer, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[1.0f32; 1000])?;
/// let y = PinnedBuffer::<f32>::new(&device, 1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// let seen = std::cell::RefCell::new(Vec::new());
/// let job = pipeline.run_stage((x,), (y,), Plan::uniform(4, 2), Timeline::Off, |c, chunk| {
///     seen.borrow_mut().push((chunk.index(), chunk.range()));
///     assert!(chunk.input::<u32>(0).is_err()); // input 0 holds `f32`
///     c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
/// });
/// block_on(job)?;
/// let seen = seen.into_inner();
/// assert_eq!(seen[1], (1, 256..512)); // chunks of 256, the last of 232
/// assert_eq!(seen.last(), Some(&(3, 768..1000)));
/// # Ok(()) }
/// ```
pub struct Chunk<'a> {
    index: usize,
    range: Range<usize>,
    inputs: Vec<(Erased, u64)>,
    outputs: Vec<(Erased, u64)>,
    device_id: usize,
    _p: std::marker::PhantomData<&'a mut ()>,
}

impl<'a> Chunk<'a> {
    /// The chunk's index in the run, in issue order.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The chunk's element range in the host arrays.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Elements in the chunk.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the chunk is empty (never, in a run).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    fn typed<T: Pod>(
        &self,
        what: &str,
        arrays: &[(Erased, u64)],
        i: usize,
    ) -> Result<(u64, usize)> {
        let (a, addr) = arrays.get(i).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the stage asked for {what} {i}; the run has {}",
                arrays.len()
            ))
        })?;
        if a.type_id != TypeId::of::<T>() {
            return Err(Error::InvalidArgument(format!(
                "{what} {i} holds {}, the stage asked for {}",
                a.type_name,
                std::any::type_name::<T>()
            )));
        }
        crate::runtime::memory::check_device_align::<T>()?;
        Ok((*addr, self.range.len()))
    }

    /// The chunk of input `i` on the device, as `T` (the input's element type).
    ///
    /// # Errors
    /// `InvalidArgument` for an input that does not exist or holds another type.
    pub fn input<T: Pod>(&self, i: usize) -> Result<DeviceSlice<'a, T>> {
        let (addr, len) = self.typed::<T>("input", &self.inputs, i)?;
        // SAFETY: the slot's scratch array for input i holds at least the
        // chunk's elements of T; the run's job keeps it alive until its
        // streams are done, and only this run's commands use it meanwhile.
        Ok(unsafe { device_slice_mut::<T>(addr, len, self.device_id) }.into())
    }

    /// The chunk of output `j` on the device, as `T`: what the stage writes
    /// there is copied out to the output's chunk.
    ///
    /// # Errors
    /// `InvalidArgument` for an output that does not exist or holds another type.
    pub fn output<T: Pod>(&self, j: usize) -> Result<DeviceSliceMut<'a, T>> {
        let (addr, len) = self.typed::<T>("output", &self.outputs, j)?;
        // SAFETY: as for `input`; outputs have scratch arrays of their own
        // (or, in an in-place run, the one array, written by that run alone).
        Ok(unsafe { device_slice_mut::<T>(addr, len, self.device_id) })
    }
}

/// The arrays a run copies in and out, and where each lives in the slots.
struct Placement<'s> {
    ins: Vec<Erased>,
    outs: Vec<Erased>,
    /// Scratch array index of each input and each output.
    in_at: Vec<usize>,
    out_at: Vec<usize>,
    scratch: &'s [Vec<Arc<DeviceBuffer<u8>>>],
    device_id: usize,
}

impl Placement<'_> {
    fn addr(&self, slot: usize, array: usize) -> u64 {
        self.scratch[slot][array].raw_parts().0
    }

    fn chunk<'a>(&self, index: usize, r: Range<usize>, slot: usize) -> Chunk<'a> {
        Chunk {
            index,
            range: r,
            inputs: self
                .ins
                .iter()
                .zip(&self.in_at)
                .map(|(a, &k)| (*a, self.addr(slot, k)))
                .collect(),
            outputs: self
                .outs
                .iter()
                .zip(&self.out_at)
                .map(|(a, &k)| (*a, self.addr(slot, k)))
                .collect(),
            device_id: self.device_id,
            _p: std::marker::PhantomData,
        }
    }

    /// Copies chunk `r` of every input into `slot`: one copy for one input,
    /// one batch ([`Commands::copy_batch`]) for several, so a chunk pays
    /// the copy engine's fixed per-operation cost once per direction.
    fn copy_in(&self, c: &mut Commands<'_>, r: &Range<usize>, slot: usize) -> Result<()> {
        let mut copies = self.ins.iter().zip(&self.in_at).map(|(a, &k)| {
            let bytes = r.len() * a.size;
            // SAFETY: the chunk lies inside the input (every array is n long,
            // checked), which the run's job owns; the slot's array k holds at
            // least a chunk of this element size (the scratch shape).
            let (h, d) = unsafe {
                (
                    host_slice::<u8>(a.ptr.add(r.start * a.size), bytes, a.device_id),
                    device_slice_mut::<u8>(self.addr(slot, k), bytes, self.device_id),
                )
            };
            crate::runtime::transfer::Transfer::h2d(h, d)
        });
        if self.ins.len() == 1 {
            if let Some(crate::runtime::transfer::Transfer::H2d { src, dst }) = copies.next() {
                return c.copy_h2d(src, dst);
            }
        }
        c.copy_batch(copies)
    }

    /// Copies chunk `r` of every output out of `slot`, as [`Self::copy_in`].
    fn copy_out(&self, c: &mut Commands<'_>, r: &Range<usize>, slot: usize) -> Result<()> {
        let mut copies = self.outs.iter().zip(&self.out_at).map(|(a, &k)| {
            let bytes = r.len() * a.size;
            // SAFETY: as for copy_in; outputs are borrowed exclusively (the
            // job owns them and no other view of them exists).
            let (d, h) = unsafe {
                (
                    device_slice_mut::<u8>(self.addr(slot, k), bytes, self.device_id),
                    host_slice_mut::<u8>(a.ptr.add(r.start * a.size), bytes, a.device_id),
                )
            };
            crate::runtime::transfer::Transfer::d2h(d, h)
        });
        if self.outs.len() == 1 {
            if let Some(crate::runtime::transfer::Transfer::D2h { src, dst }) = copies.next() {
                return c.copy_d2h(src, dst);
            }
        }
        c.copy_batch(copies)
    }
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

/// What a run does on the device to each chunk.
type StageFn<'f> = &'f dyn for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>;

/// Gives a closure the stage signature (ties its lifetimes together).
fn stage_fn<F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>>(f: F) -> F {
    f
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

    #[allow(clippy::too_many_arguments)]
    fn run_erased<B: Send + 'static>(
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
            let (ranges, events) = (&chunks.ranges, events.as_mut());
            match plan.layout {
                Layout::Engines { .. } => {
                    enqueue_engines(&mut cmds, ranges, &layout, free, stage, events)
                }
                Layout::RoundRobin { chain, .. } => {
                    enqueue_round_robin(&mut cmds, ranges, &layout, chain, free, stage, events)
                }
            }
        });
        let enqueued: usize = cmds.iter().map(|c| c.enqueued()).sum();
        drop(cmds);
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

/// Enqueues a run in the round-robin layout: chunk `i` on stream
/// `i % streams` (`cmds`), in that stream's slot, after that slot's last use
/// by an earlier run and, when `chain`, after the previous chunk's copy-in.
fn enqueue_round_robin<'a>(
    cmds: &mut [Commands<'a>],
    ranges: &[Range<usize>],
    layout: &Placement<'_>,
    chain: bool,
    free: &mut [Option<Mark>],
    stage: StageFn<'_>,
    mut events: Option<&mut Vec<ChunkEvents>>,
) -> Result<()> {
    let streams = cmds.len();
    let mut chained: Option<Mark> = None;
    for (i, r) in ranges.iter().cloned().enumerate() {
        let s = i % streams;
        let c = &mut cmds[s];
        if let Some(prev) = free[s].take() {
            c.wait_mark(&prev)?;
        }
        if let Some(prev) = chained.take() {
            c.wait_mark(&prev)?;
        }
        chained = enqueue_chunk(c, (i, r), s, layout, chain, stage, events.as_deref_mut())?;
    }
    // Each stream's slot is free once the stream has passed this point.
    for (s, c) in cmds.iter_mut().enumerate().take(ranges.len()) {
        free[s] = Some(c.marker(false)?);
    }
    Ok(())
}

/// Enqueues chunk `i` (elements `r`) on `c`, in `slot`: copy in, the stage,
/// copy out, with the chunk's four timed points when `events` records them.
/// Returns, when `chain`, the point after its copy-in.
fn enqueue_chunk(
    c: &mut Commands<'_>,
    (i, r): (usize, Range<usize>),
    slot: usize,
    layout: &Placement<'_>,
    chain: bool,
    stage: StageFn<'_>,
    events: Option<&mut Vec<ChunkEvents>>,
) -> Result<Option<Mark>> {
    let timeline = events.is_some();
    let t0 = timeline.then(|| c.marker(true)).transpose()?;
    layout.copy_in(c, &r, slot)?;
    let chained = if chain { Some(c.marker(false)?) } else { None };
    let t1 = timeline.then(|| c.marker(true)).transpose()?;
    stage(c, &layout.chunk(i, r.clone(), slot))?;
    let t2 = timeline.then(|| c.marker(true)).transpose()?;
    layout.copy_out(c, &r, slot)?;
    if let (Some(ev), Some(t0), Some(t1), Some(t2)) = (events, t0, t1, t2) {
        let t3 = c.marker(true)?;
        ev.push(ChunkEvents {
            chunk: i,
            stream: slot,
            events: [t0, t1, t2, t3],
        });
    }
    Ok(chained)
}

/// Enqueues a run in the engines layout: copy-in, compute and copy-out
/// streams (`cmds[0..3]`), linked by events, over a ring of slots.
fn enqueue_engines<'a>(
    cmds: &mut [Commands<'a>],
    ranges: &[Range<usize>],
    layout: &Placement<'_>,
    free: &mut [Option<Mark>],
    stage: StageFn<'_>,
    mut events: Option<&mut Vec<ChunkEvents>>,
) -> Result<()> {
    let [cin, ck, cout] = cmds else {
        return Err(Error::InvalidArgument(
            "the engines layout needs exactly three streams".into(),
        ));
    };
    let slots = layout.scratch.len().max(1);
    let timeline = events.is_some();
    // D2H-done points of the chunks whose slot is still to be reused.
    let mut out_done = std::collections::VecDeque::new();
    for (i, r) in ranges.iter().cloned().enumerate() {
        let slot = i % slots;
        // The slot's previous chunk (of this run, or else of an earlier
        // run) must be out before this one comes in.
        let prev = if i >= slots {
            out_done.pop_front()
        } else {
            free.get_mut(i).and_then(Option::take)
        };
        if let Some(prev) = prev {
            cin.wait_mark(&prev)?;
        }
        let t0 = timeline.then(|| cin.marker(true)).transpose()?;
        layout.copy_in(cin, &r, slot)?;
        // Timed when drawing a timeline, so they serve as its points too.
        let copied = cin.marker(timeline)?;
        ck.wait_mark(&copied)?;
        stage(ck, &layout.chunk(i, r.clone(), slot))?;
        let computed = ck.marker(timeline)?;
        cout.wait_mark(&computed)?;
        layout.copy_out(cout, &r, slot)?;
        out_done.push_back(cout.marker(false)?);
        if let (Some(ev), Some(t0)) = (events.as_mut(), t0) {
            let t3 = cout.marker(true)?;
            ev.push(ChunkEvents {
                chunk: i,
                stream: 0,
                events: [t0, copied, computed, t3],
            });
        }
    }
    // The last chunks' slots are free once their D2H is done.
    let first_left = ranges.len() - out_done.len();
    for (k, done) in out_done.into_iter().enumerate() {
        if let Some(slot) = free.get_mut((first_left + k) % slots) {
            *slot = Some(done);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_element_once_in_order() {
        for n in [1usize, 5, 63, 64, 1000, 65_537, 10_000_000] {
            for chunks in [1usize, 3, 8, 32] {
                for ramp in [false, true] {
                    let plan = Plan {
                        ramp,
                        ..Plan::uniform(chunks.min(n), 2)
                    };
                    let r = plan.ranges(n);
                    assert_eq!(r.first().map(|r| r.start), Some(0));
                    assert_eq!(r.last().map(|r| r.end), Some(n));
                    assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                    assert!(r.iter().all(|r| !r.is_empty()), "{plan:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn a_chunk_count_far_above_the_elements_costs_nothing() {
        // 2^62 chunks of 10 elements: one chunk, at once (the loop over
        // every chunk count took ~29 ns a chunk: forever).
        let t = std::time::Instant::now();
        for plan in [Plan::uniform(1 << 62, 4), Plan::engines(1 << 62, 4)] {
            assert_eq!(plan.ranges(10), vec![0..10]);
            assert!(plan.ranges(0).is_empty());
            assert_eq!(plan.ranges(200), vec![0..64, 64..128, 128..192, 192..200]);
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn ramped_plans_start_and_end_small() {
        let n = 10_000_000;
        let r = Plan::uniform(16, 4).ramped().ranges(n);
        let m = Plan::uniform(16, 4).chunk_len(n);
        assert!(r[0].len() <= m / 8 && r[r.len() - 1].len() <= m / 8);
        assert!(r.iter().all(|c| c.len() <= m));
    }

    #[test]
    fn auto_plans_balance_chunk_cost_against_fill() {
        assert_eq!(Plan::auto(1), Plan::uniform(1, 1));
        assert_eq!(Plan::auto(100_000), Plan::uniform(1, 1));
        assert_eq!(Plan::auto(10_000_000), Plan::engines(11, 4));
        assert_eq!(Plan::auto(100_000_000), Plan::engines(35, 4));
        assert_eq!(Plan::auto(1_000_000_000), Plan::engines(110, 4));
        for n in [2usize, 3, 1000, 1 << 20, 12_345_678] {
            assert!(Plan::auto(n).validate(n).is_ok(), "{n}");
        }
    }

    #[test]
    fn plans_say_what_they_are() {
        assert_eq!(Plan::uniform(1, 1).to_string(), "1 chunk x 1 stream");
        assert_eq!(
            Plan::uniform(8, 4).chained().ramped().to_string(),
            "8 chunks x 4 streams, chained, ramped"
        );
        assert_eq!(Plan::engines(5, 2).chained(), Plan::engines(5, 2));
        assert_eq!(Plan::engines(5, 2).streams_used(), 3);
        assert_eq!(Plan::engines(5, 2).slots(), 2);
    }

    #[test]
    fn bad_plans_are_rejected() {
        assert!(Plan::uniform(0, 1).validate(10).is_err());
        assert!(Plan::uniform(1, 0).validate(10).is_err());
        // More chunks than elements: fewer run (`RunInfo::chunks`), as for n = 0.
        assert!(Plan::uniform(11, 1).validate(10).is_ok());
        assert!(Plan::uniform(3, 1).validate(0).is_ok());
        assert!(Plan::uniform(10, 1).validate(10).is_ok());
    }
}
