//! What `host staging` measures: the sizes, the runs of each route
//! ([`Config`]), the routes ([`Path4`]), and the staging engines they use.

use gpufeed::{Device, Route, Staging, StagingConfig};
use serde::Serialize;

/// Sizes below this many bytes get [`Config::small_reps`] runs.
pub const SMALL_BELOW: usize = 16 << 20;

/// The sizes and repetitions of one run.
pub struct Config {
    pub sizes: Vec<usize>,
    /// Timed runs per route, size and direction (medians are quoted).
    pub reps: usize,
    /// Timed runs of the two slow routes (the driver's pageable copy, pin
    /// in place + copy) from 256 MiB up, where each run takes seconds.
    pub slow_reps: usize,
    /// Timed runs per route below [`SMALL_BELOW`] bytes (at least `reps`):
    /// a run there takes well under a millisecond, so more of them settle
    /// the median.
    pub small_reps: usize,
    /// Size at which the engine's shape is swept (0: no sweep).
    pub sweep_bytes: usize,
    pub sweep_reps: usize,
    /// Milliseconds of idle before each timed run (10: the workers parked).
    pub settle_ms: u64,
    /// The routes measured (all five by default).
    pub routes: Vec<Path4>,
    /// Workers of the engines of the routes' table (`None`: the default,
    /// [`StagingConfig::for_device`]); the sweep sets its own.
    pub workers: Option<usize>,
}

impl Config {
    pub fn for_device(device: &Device, small: bool) -> Config {
        if small || device.kind() == gpufeed::BackendKind::Cpu {
            Config {
                sizes: vec![64 << 10, 1 << 20, 16 << 20, 64 << 20],
                reps: 3,
                slow_reps: 3,
                small_reps: 3,
                sweep_bytes: 16 << 20,
                sweep_reps: 2,
                settle_ms: 10,
                routes: PATHS.to_vec(),
                workers: None,
            }
        } else {
            Config {
                sizes: [16, 18, 20, 22, 24, 26, 28, 30, 32]
                    .iter()
                    .map(|s| 1usize << s)
                    .collect(),
                reps: 11,
                slow_reps: 3,
                small_reps: 51,
                sweep_bytes: 1 << 30,
                sweep_reps: 7,
                settle_ms: 10,
                routes: PATHS.to_vec(),
                workers: None,
            }
        }
    }

    /// Timed runs below [`SMALL_BELOW`] bytes: `small_reps`, never fewer
    /// than `reps`.
    pub(super) fn small_runs(&self) -> usize {
        self.small_reps.max(self.reps)
    }

    /// Timed runs of `path` at `bytes`.
    pub(super) fn runs(&self, path: Path4, bytes: usize) -> usize {
        match path {
            Path4::Pageable | Path4::RegisterCopy if bytes >= 256 << 20 => self.slow_reps,
            _ if bytes < SMALL_BELOW => self.small_runs(),
            _ => self.reps,
        }
    }
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Path4 {
    /// The driver's synchronous copy of pageable memory.
    Pageable,
    /// `Registered::new` (pin in place), the copy, `into_inner` (unpin).
    RegisterCopy,
    /// The staging engine, forced through its ring.
    Staged,
    /// The staging engine's automatic choice (`Route::Auto`).
    Auto,
    /// From (into) memory already pinned: the link's own speed.
    Pinned,
}

pub(super) const PATHS: [Path4; 5] = [
    Path4::Pageable,
    Path4::RegisterCopy,
    Path4::Staged,
    Path4::Auto,
    Path4::Pinned,
];

/// An engine of the default shape (or `shape`: threads, block bytes,
/// blocks) taking `route`.
pub(super) fn engine(
    device: &Device,
    route: Route,
    shape: Option<(usize, usize, usize)>,
) -> gpufeed::Result<Staging> {
    let mut c = StagingConfig::for_device(device);
    c.route = route;
    if let Some((threads, block_bytes, blocks)) = shape {
        c.threads = threads;
        c.block_bytes = block_bytes;
        c.blocks = blocks;
    }
    Staging::with_config(device, c)
}
