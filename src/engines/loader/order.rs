//! The order of a loader's rows: its configuration ([`LoaderConfig`]), the
//! deterministic permutation of an epoch, and each rank's shard of it.

use crate::base::error::{Error, Result};

/// SplitMix64's step: adds the golden-ratio increment to `state` and
/// returns the mixed output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform integer in `0..bound` (`bound > 0`) by Lemire's
/// multiply-and-reject method over [`splitmix64`] outputs.
fn below(state: &mut u64, bound: u64) -> u64 {
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let m = u128::from(splitmix64(state)) * u128::from(bound);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}

/// The shuffled order of `0..n` for `(seed, epoch)`, reproducible in any
/// process on any machine.
///
/// The algorithm, fixed (changing it changes every user's order):
/// 1. the generator is SplitMix64 (Steele, Lea and Flood), its state
///    starting at `seed ^ splitmix64_output(epoch)`, where the second term
///    is SplitMix64's first output from state `epoch`;
/// 2. a Fisher–Yates shuffle of `[0, 1, …, n-1]`: for `i` from `n-1` down
///    to 1, swap element `i` with element `j`, `j` uniform in `0..=i`
///    (Lemire's multiply-and-reject over the generator's 64-bit outputs).
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut e = epoch;
    let mut state = seed ^ splitmix64(&mut e);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = below(&mut state, i as u64 + 1) as usize;
        v.swap(i, j);
    }
    v
}

/// The most ranks a loader's shard may be one of (an epoch's order is padded
/// to a multiple of the world size: this bounds that padding).
pub const MAX_WORLD_SIZE: usize = 1 << 20;

/// The shape of a loader: batch size, order, prefetch depth and shard.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{batches_per_epoch, epoch_indices, Error, LoaderConfig};
/// let config = LoaderConfig { shuffle: true, seed: 42, drop_last: true, ..LoaderConfig::new(64) };
/// config.check()?;
/// assert_eq!(batches_per_epoch(1000, &config), 15); // 15 × 64 rows, 40 dropped
/// // Rank 1 of 4 processes: a quarter of each epoch's rows, disjoint from the others'.
/// let shard = LoaderConfig { rank: 1, world_size: 4, ..config };
/// assert_eq!(epoch_indices(1000, &shard, 0).len(), 250);
/// let err = LoaderConfig { rank: 4, ..shard }.check().unwrap_err();
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Rows per batch (at least 1).
    pub batch_size: usize,
    /// Each epoch in the order [`permutation`]`(n, seed, epoch)` instead of
    /// `0..n`.
    pub shuffle: bool,
    /// The seed of the shuffled order.
    pub seed: u64,
    /// Drops the rows that do not fill a last batch, and (with several
    /// ranks) the rows that do not divide evenly among the ranks instead of
    /// padding the shards by wrapping around.
    pub drop_last: bool,
    /// Batches in flight ahead of the one handed out (at least 1): each
    /// holds a pinned block of one batch's bytes.
    pub prefetch: usize,
    /// This process's rank among `world_size` (0 for one process).
    pub rank: usize,
    /// Processes sharing the data, each taking a disjoint shard (1: all of
    /// it).
    pub world_size: usize,
}

impl LoaderConfig {
    /// `batch_size` rows per batch, in order, last batch kept, 2 batches
    /// ahead, one process.
    pub fn new(batch_size: usize) -> LoaderConfig {
        LoaderConfig {
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            prefetch: 2,
            rank: 0,
            world_size: 1,
        }
    }

    /// `InvalidArgument` for a configuration out of range.
    pub fn check(&self) -> Result<()> {
        let bad = |s: String| Err(Error::InvalidArgument(s));
        if self.batch_size == 0 {
            return bad("a loader's batch_size must be at least 1".into());
        }
        if self.prefetch == 0 {
            return bad("a loader's prefetch must be at least 1".into());
        }
        if self.world_size > MAX_WORLD_SIZE {
            return bad(format!(
                "a loader's world_size {} is above {MAX_WORLD_SIZE}",
                self.world_size
            ));
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            return bad(format!(
                "a loader's rank {} must be below its world_size {} (at least 1)",
                self.rank, self.world_size
            ));
        }
        Ok(())
    }
}

/// The rows one rank's sampler gives in `epoch`, in order, from a source of
/// `n` rows: `torch.utils.data.DistributedSampler`'s semantics exactly, the
/// permutation aside (ours is [`permutation`]). The loader cuts them into
/// batches of `batch_size`; with `drop_last` it also leaves out a last
/// partial batch, as `DataLoader(drop_last=True)` does.
///
/// The order of the epoch (`0..n`, or the permutation when shuffling) is
/// made a multiple of `world_size` long: without `drop_last` by repeating
/// its beginning (wrapping around as often as needed), with `drop_last`
/// by cutting its end; rank `r` takes every `world_size`-th element from
/// `r`. With one rank that is the epoch's order itself.
pub fn epoch_indices(n: usize, config: &LoaderConfig, epoch: u64) -> Vec<usize> {
    let order: Vec<usize> = if config.shuffle {
        permutation(n, config.seed, epoch)
    } else {
        (0..n).collect()
    };
    let world = config.world_size.max(1);
    if world == 1 {
        return order;
    }
    let per_rank = if config.drop_last && !n.is_multiple_of(world) {
        n.saturating_sub(world).div_ceil(world)
    } else {
        n.div_ceil(world)
    };
    let total = per_rank * world;
    let padded: Vec<usize> = if total <= n {
        order[..total].to_vec()
    } else if n == 0 {
        Vec::new()
    } else {
        order.iter().copied().cycle().take(total).collect()
    };
    padded
        .into_iter()
        .skip(config.rank)
        .step_by(world)
        .collect()
}

/// Batches per epoch for a source of `n` rows (one rank's).
pub fn batches_per_epoch(n: usize, config: &LoaderConfig) -> usize {
    let rows = epoch_indices_len(n, config);
    let b = config.batch_size.max(1);
    if config.drop_last {
        rows / b
    } else {
        rows.div_ceil(b)
    }
}

/// The length of [`epoch_indices`] without making it.
fn epoch_indices_len(n: usize, config: &LoaderConfig) -> usize {
    let world = config.world_size.max(1);
    if world == 1 {
        n
    } else if config.drop_last && !n.is_multiple_of(world) {
        n.saturating_sub(world).div_ceil(world)
    } else {
        n.div_ceil(world)
    }
}
