//! What `host small-transfers` measures: the sizes, how many rounds of
//! about how long ([`Config`]), the two directions and the modes.

use gpufeed::Device;
use serde::Serialize;
use std::time::Duration;

/// Copy sizes in bytes: 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB.
pub const SIZES: [usize; 5] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];

/// Buffers (and copies outstanding) of the "64 in flight" modes.
pub const IN_FLIGHT: usize = 64;

/// How much to measure.
#[derive(Clone, Debug)]
pub struct Config {
    pub sizes: Vec<usize>,
    /// Timed rounds per mode, size and direction.
    pub rounds: usize,
    /// Wall time a timed round aims at.
    pub target: Duration,
    /// Most copies in a round.
    pub max_copies: usize,
}

impl Config {
    /// A GPU: every size, rounds of about 25 ms, 11 of them. The CPU
    /// emulation (and `demo --small`): 4 KiB to 1 MiB (64 buffers of 4 MiB
    /// are a memory-bound half second a round of memcpy there), rounds of
    /// about 2 ms, 3 of them, so CI stays fast.
    pub fn for_device(device: &Device, small: bool) -> Config {
        if small || device.kind() == gpufeed::BackendKind::Cpu {
            Config {
                sizes: SIZES.iter().copied().filter(|&b| b <= 1 << 20).collect(),
                rounds: 3,
                target: Duration::from_millis(2),
                max_copies: 1024,
            }
        } else {
            Config {
                sizes: SIZES.to_vec(),
                rounds: 11,
                target: Duration::from_millis(25),
                max_copies: 16384,
            }
        }
    }

    /// The same with `rounds` timed rounds and these sizes (bytes), if given.
    pub fn with(mut self, rounds: Option<usize>, sizes: Option<Vec<usize>>) -> Config {
        if let Some(r) = rounds {
            self.rounds = r;
        }
        if let Some(s) = sizes {
            self.sizes = s;
        }
        self
    }
}

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    H2d,
    D2h,
}

impl Direction {
    pub(super) fn name(self) -> &'static str {
        match self {
            Direction::H2d => "H2D",
            Direction::D2h => "D2H",
        }
    }
}

pub(super) const DIRECTIONS: [Direction; 2] = [Direction::H2d, Direction::D2h];

/// How the copies are issued and waited for (see the module's docs).
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    #[serde(rename = "run_sync_1")]
    RunSync1,
    #[serde(rename = "awaited_1")]
    Awaited1,
    #[serde(rename = "awaited_1_tokio")]
    Awaited1Tokio,
    #[serde(rename = "raw_1")]
    Raw1,
    #[serde(rename = "awaited_64")]
    Awaited64,
    #[serde(rename = "awaited_64_batch")]
    Awaited64Batch,
    #[serde(rename = "awaited_64_one_job")]
    Awaited64OneJob,
    #[serde(rename = "awaited_64_4_streams")]
    Awaited64Streams4,
    #[serde(rename = "awaited_64_copy_batch")]
    Awaited64CopyBatch,
    #[serde(rename = "raw_64")]
    Raw64,
}

pub(super) const MODES: [Mode; 10] = [
    Mode::RunSync1,
    Mode::Awaited1,
    Mode::Awaited1Tokio,
    Mode::Raw1,
    Mode::Awaited64,
    Mode::Awaited64Batch,
    Mode::Awaited64OneJob,
    Mode::Awaited64Streams4,
    Mode::Awaited64CopyBatch,
    Mode::Raw64,
];

/// Streams of the `awaited_64_4_streams` variant.
pub(super) const STREAMS: usize = 4;

impl Mode {
    pub(super) fn in_flight(self) -> usize {
        match self {
            Mode::RunSync1 | Mode::Awaited1 | Mode::Awaited1Tokio | Mode::Raw1 => 1,
            _ => IN_FLIGHT,
        }
    }

    pub(super) fn is_raw(self) -> bool {
        matches!(self, Mode::Raw1 | Mode::Raw64)
    }

    /// Streams the mode's copies go over.
    pub(super) fn streams(self) -> usize {
        match self {
            Mode::Awaited64Streams4 => STREAMS,
            _ => 1,
        }
    }

    /// Column header.
    pub(super) fn short(self) -> &'static str {
        match self {
            Mode::RunSync1 => "run_sync 1",
            Mode::Awaited1 => "awaited 1",
            Mode::Awaited1Tokio => "tokio 1",
            Mode::Raw1 => "raw 1",
            Mode::Awaited64 => "awaited 64",
            Mode::Awaited64Batch => "64 batch",
            Mode::Awaited64OneJob => "64 one job",
            Mode::Awaited64Streams4 => "64 4 strms",
            Mode::Awaited64CopyBatch => "64 copy_batch",
            Mode::Raw64 => "raw 64",
        }
    }

    /// Legend of the plot.
    pub(super) fn long(self) -> &'static str {
        match self {
            Mode::RunSync1 => "run_sync, 1 in flight",
            Mode::Awaited1 => "awaited (gpufeed::block_on), 1 in flight",
            Mode::Awaited1Tokio => "awaited (tokio), 1 in flight",
            Mode::Raw1 => "raw driver copy + stream sync, 1 in flight",
            Mode::Awaited64 => "awaited, 64 jobs in flight (window)",
            Mode::Awaited64Batch => "awaited, 64 jobs then join all",
            Mode::Awaited64OneJob => "awaited, one job of 64 copies",
            Mode::Awaited64Streams4 => "awaited, 64 jobs in flight over 4 streams",
            Mode::Awaited64CopyBatch => "awaited, one job of one copy_batch of 64",
            Mode::Raw64 => "raw driver, 64 copies then one sync",
        }
    }
}
