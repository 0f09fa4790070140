//! What a run reports: [`RunInfo`], and when asked ([`Timeline::Record`]),
//! the four timed points of each chunk ([`ChunkEvents`]).

use crate::engines::pipeline::plan::Plan;
use crate::runtime::stream::Mark;

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
    pub(super) fn records(self) -> bool {
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
