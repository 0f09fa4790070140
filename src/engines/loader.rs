//! A loader for training loops: batches of rows, gathered by index from
//! host memory straight into pinned blocks and sent to the device ahead of
//! their use, as a [`futures::Stream`] of device buffers.
//!
//! - The rows of a batch are gathered by the staging workers' threads
//!   (each thread a slice of the batch's bytes) into a pinned block, and
//!   the block is sent with one DMA per field on the loader's own stream.
//! - Where every field is pinned in place ([`RowSource::registered`]) a
//!   kernel gathers the rows on the device instead, reading them where they
//!   are; batches alternate between two streams of the loader's, so one
//!   batch's indices go up and its kernel starts while the one before it is
//!   still finishing ([`Gather::Device`]).
//! - [`LoaderConfig::prefetch`] batches are in flight at once, also while
//!   the batch just handed out is used (taking a batch issues the next):
//!   the gather of batch *k + 1* runs while the DMA of batch *k* does.
//! - Every batch gets fresh device buffers, so a batch is never overwritten
//!   while its owner holds it.
//!
//! # Order
//! An epoch's order is [`epoch_indices`]: `0..n` in order, or, with
//! [`LoaderConfig::shuffle`], the permutation [`permutation`]`(n, seed,
//! epoch)`, a deterministic function of the three (the same in every
//! process, on every machine, across restarts). With several ranks
//! (`world_size > 1`) each rank takes its shard with
//! `torch.utils.data.DistributedSampler`'s semantics.

use crate::base::completion::{lock, Completion};
use crate::base::error::{Error, Result};
use crate::interop::RegisteredRaw;
use crate::runtime::device::Device;
use crate::runtime::memory::{DeviceBuffer, Registered};
use crate::runtime::pool::{PinnedPool, PooledBuffer};
use crate::runtime::stream::Stream;
use bytemuck::Pod;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

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

/// The rows of one field of a loader's source: memory in one or several
/// segments (concatenated), each a whole number of rows of `row_bytes`.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Error, RowSource};
/// let features = vec![0.5f32; 10 * 3];
/// let rows = RowSource::new(&features, 3)?; // 10 rows of 3 values
/// assert_eq!((rows.rows(), rows.row_bytes()), (10, 12));
/// let halves = RowSource::concat(&[&features[..15], &features[15..]], 3)?; // two segments
/// assert_eq!(halves.rows(), 10);
/// let err = RowSource::new(&features, 4).unwrap_err(); // 30 values aren't rows of 4
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RowSource<'a> {
    /// (address, rows) of each segment.
    segments: Vec<(usize, usize)>,
    /// The row index each segment ends at (cumulative).
    ends: Vec<usize>,
    row_bytes: usize,
    /// The registration keeping the rows pinned in place, for a source the
    /// device can read where it is.
    pinned: Option<PinnedRows>,
    _borrow: PhantomData<&'a [u8]>,
}

/// A registration guard ([`Registered`] or [`RegisteredRaw`]) shared by the
/// row sources over its memory and the loaders reading it.
#[derive(Clone)]
struct PinnedRows {
    _keep: Arc<dyn std::any::Any + Send + Sync>,
    /// The host-memory domain it is registered in.
    domain: usize,
}

impl std::fmt::Debug for PinnedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRows").finish_non_exhaustive()
    }
}

impl<'a> RowSource<'a> {
    /// The rows of `data`, `row_len` values each.
    ///
    /// # Errors
    /// `InvalidArgument` for `row_len` 0 or a length not a multiple of it.
    pub fn new<T: Pod>(data: &'a [T], row_len: usize) -> Result<Self> {
        Self::concat(&[data], row_len)
    }

    /// The rows of `parts` one after another (`row_len` values each).
    ///
    /// # Errors
    /// As [`RowSource::new`], for any part.
    pub fn concat<T: Pod>(parts: &[&'a [T]], row_len: usize) -> Result<Self> {
        let raw: Vec<(*const u8, usize)> = parts
            .iter()
            .map(|p| (p.as_ptr().cast::<u8>(), p.len()))
            .collect();
        RowSource::from_segments(&raw, row_len, std::mem::size_of::<T>())
    }

    /// Rows from raw segments: `(address, rows)` pairs of `row_bytes`-byte
    /// rows, concatenated (what a binding holding the memory alive uses).
    ///
    /// # Safety
    /// Each segment's `rows × row_bytes` bytes stay readable, and are
    /// written by no one, for `'a`.
    ///
    /// # Errors
    /// `InvalidArgument` for `row_bytes` 0, `SizeOverflow` for a segment
    /// beyond the address space.
    pub unsafe fn from_raw_parts(
        segments: &[(*const u8, usize)],
        row_bytes: usize,
    ) -> Result<Self> {
        if row_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row size must be at least 1 byte".into(),
            ));
        }
        let mut out = Vec::with_capacity(segments.len());
        for &(p, rows) in segments {
            crate::base::error::byte_size::<u8>(rows.checked_mul(row_bytes).ok_or(
                Error::SizeOverflow {
                    count: rows,
                    elem_size: row_bytes,
                },
            )?)?;
            out.push((p as usize, rows));
        }
        Ok(Self::build(out, row_bytes))
    }

    /// The rows of a vector pinned in place, `row_len` values each: a
    /// loader on a device of the backend that registered it gathers its
    /// batches on the device, reading the rows where they are
    /// ([`Gather::Device`]). The source holds the guard, and a loader keeps
    /// it until its last gather is done.
    ///
    /// # Errors
    /// As [`RowSource::new`].
    pub fn registered<T: Pod + Send + Sync>(
        data: Arc<Registered<T>>,
        row_len: usize,
    ) -> Result<RowSource<'static>> {
        let slice = data.as_slice();
        let mut source = RowSource::<'static>::from_segments(
            &[(slice.as_ptr().cast::<u8>(), slice.len())],
            row_len,
            std::mem::size_of::<T>(),
        )?;
        source.pinned = Some(PinnedRows {
            domain: data.device().host_domain(),
            _keep: data,
        });
        Ok(source)
    }

    /// The rows of a range pinned in place by a [`RegisteredRaw`] guard
    /// (from its first byte, `row_bytes` bytes each, as many whole rows as
    /// it holds): as [`RowSource::registered`].
    ///
    /// # Safety
    /// The range is written by no one while a loader reads it (the guard's
    /// contract covers the rest: valid, unmoved while registered).
    ///
    /// # Errors
    /// `InvalidArgument` for `row_bytes` 0.
    pub unsafe fn from_registered_raw(
        guard: Arc<RegisteredRaw>,
        row_bytes: usize,
    ) -> Result<RowSource<'static>> {
        if row_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row size must be at least 1 byte".into(),
            ));
        }
        let rows = guard.byte_len() / row_bytes;
        let mut source = Self::build(vec![(guard.as_ptr() as usize, rows)], row_bytes);
        source.pinned = Some(PinnedRows {
            domain: guard.device().host_domain(),
            _keep: guard,
        });
        Ok(source)
    }

    fn from_segments(
        parts: &[(*const u8, usize)],
        row_len: usize,
        elem: usize,
    ) -> Result<RowSource<'static>> {
        if row_len == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row length must be at least 1".into(),
            ));
        }
        let mut segments = Vec::with_capacity(parts.len());
        for &(p, len) in parts {
            if !len.is_multiple_of(row_len) {
                return Err(Error::InvalidArgument(format!(
                    "a row source of {len} values is not a whole number of rows of {row_len}"
                )));
            }
            segments.push((p as usize, len / row_len));
        }
        Ok(RowSource::build(segments, row_len * elem))
    }

    /// Whether the device can read the rows where they are: the first
    /// segment's address and its byte length, when the source is pinned in
    /// place in `domain`, in one segment.
    fn device_readable(&self, domain: usize) -> Option<(usize, usize)> {
        let p = self.pinned.as_ref()?;
        (p.domain == domain && self.segments.len() == 1)
            .then(|| (self.segments[0].0, self.segments[0].1 * self.row_bytes))
    }

    fn build<'b>(segments: Vec<(usize, usize)>, row_bytes: usize) -> RowSource<'b> {
        let mut total = 0usize;
        let ends = segments
            .iter()
            .map(|&(_, r)| {
                total += r;
                total
            })
            .collect();
        RowSource {
            segments,
            ends,
            row_bytes,
            pinned: None,
            _borrow: PhantomData,
        }
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The address of row `i` (`i < rows()`).
    fn row_addr(&self, i: usize) -> usize {
        let s = self.ends.partition_point(|&e| e <= i);
        let start = if s == 0 { 0 } else { self.ends[s - 1] };
        self.segments[s].0 + (i - start) * self.row_bytes
    }
}

/// One batch: a device buffer per field (in the order the fields were
/// given), `rows` rows each, the data on the device.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use futures::StreamExt;
/// use gpufeed::{block_on, Batch, Device, Loader, LoaderConfig, RowSource};
/// let device = Device::cpu();
/// let features: Vec<u16> = (0..40).collect(); // 20 rows of 2
/// let labels: Vec<u16> = (100..120).collect(); // one per row
/// let fields = vec![RowSource::new(&features, 2)?, RowSource::new(&labels, 1)?];
/// let mut loader = Loader::<u16>::new(&device, fields, LoaderConfig::new(8))?;
/// let mut batch: Batch<u16> = block_on(loader.next()).expect("an epoch of 3 batches")?;
/// assert_eq!((batch.index, batch.rows, batch.fields.len()), (0, 8, 2));
/// let mut first_labels = [0u16; 8];
/// batch.fields[1].copy_to_host_sync(&mut first_labels)?;
/// assert_eq!(first_labels, [100, 101, 102, 103, 104, 105, 106, 107]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Batch<T: Pod> {
    /// The fields' device buffers, `rows × row_len` values each.
    pub fields: Vec<DeviceBuffer<T>>,
    /// Rows in this batch (the batch size, or fewer in a last batch).
    pub rows: usize,
    /// The batch's position in its epoch (0 for the first).
    pub index: usize,
}

/// Where a loader's time went since it was made, on the thread polling it:
/// tells a loader bound by its gathers (host memory) from one bound by the
/// link. The time spent waiting for DMAs is the rest of the wall time.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use futures::StreamExt;
/// use gpufeed::{block_on, Device, Loader, LoaderConfig, LoaderStats, RowSource};
/// let device = Device::cpu();
/// let data = vec![1u32; 64 * 4]; // 64 rows of 4
/// let rows = RowSource::new(&data, 4)?;
/// let mut loader = Loader::<u32>::new(&device, vec![rows], LoaderConfig::new(16))?;
/// while let Some(batch) = block_on(loader.next()) {
///     batch?;
/// }
/// let stats: LoaderStats = loader.stats();
/// assert_eq!((stats.batches, stats.bytes), (4, 64 * 4 * 4));
/// println!("gathers {:?}, allocations {:?}, issues {:?}", stats.gather, stats.alloc, stats.issue);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoaderStats {
    /// Batches gathered and sent.
    pub batches: u64,
    /// Their bytes (all fields).
    pub bytes: u64,
    /// Gathering rows into pinned blocks (this thread and the workers).
    pub gather: std::time::Duration,
    /// Allocating the batches' device buffers (and pinned blocks, the
    /// first times).
    pub alloc: std::time::Duration,
    /// Issuing the DMAs and recording their event.
    pub issue: std::time::Duration,
}

/// A batch in flight: its buffers, its pinned block, its DMAs' completion.
struct InFlightBatch<T: Pod> {
    batch: Batch<T>,
    block: PooledBuffer<u8>,
    done: Completion,
}

/// A loader: batches of rows of one or more fields (features, labels) from
/// host memory to device buffers, `prefetch` batches ahead, as a
/// [`futures::Stream`] over one epoch at a time. Rows are gathered on the
/// device from a source pinned in place ([`RowSource::registered`]: only
/// the indices cross the link), else by the staging workers into pinned
/// blocks sent on the loader's own stream ([`Loader::gather`] says which).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use futures::StreamExt; // a `Loader` is a `futures::Stream` of batches
/// use gpufeed::{block_on, Device, Loader, LoaderConfig, RowSource};
/// let device = Device::cpu();
/// let data: Vec<f32> = (0..100 * 8).map(|i| i as f32).collect();
/// let rows = RowSource::new(&data, 8)?; // 100 rows of 8 values
/// let config = LoaderConfig { shuffle: true, ..LoaderConfig::new(32) };
/// let mut loader = Loader::<f32>::new(&device, vec![rows], config)?;
/// assert_eq!(loader.len(), 4); // batches of 32, 32, 32 and 4 rows
/// for epoch in 0..2 {
///     loader.start_epoch(epoch, 0); // each epoch its own order
///     let mut rows_seen = 0;
///     while let Some(batch) = block_on(loader.next()) { // `loader.next().await` in async code
///         rows_seen += batch?.rows; // `fields[0]`: `rows` × 8 `f32` on the device
///     }
///     assert_eq!(rows_seen, 100);
/// }
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// Gathered on the host ([`Gather::Host`]), rows are read only inside a
/// call (`poll_next`, [`Loader::fill_ahead`]), which returns once they are
/// in the loader's pinned blocks: dropping a `next()` future, the loader,
/// or starting another epoch leaves no thread reading the source, and never
/// blocks. DMAs still running read only the loader's blocks (reused or
/// released once they are done) and write only the fresh device buffers of
/// batches not yet handed out (freed once they are done). Gathered on the
/// device ([`Gather::Device`]), kernels read the source where it is after
/// the call returns: the loader holds the source (its registration guard)
/// and dropping it waits for its last gather (at most `prefetch` batches')
/// before letting go; a leaked loader leaks the guard. A batch handed out
/// is the caller's, untouched by the loader.
pub struct Loader<'a, T: Pod> {
    device: Device,
    /// Batch `k` runs on `streams[k % streams.len()]`: one stream for
    /// gathers on the host, two for gathers on the device.
    streams: Vec<Stream>,
    workers: crate::base::workers::CopyWorkers,
    pool: PinnedPool,
    fields: Vec<RowSource<'a>>,
    rows: usize,
    config: LoaderConfig,
    /// Pinned blocks free for a gather (shared with the deferred returns
    /// of blocks whose DMA was still running when their epoch ended).
    free: Arc<Mutex<Vec<PooledBuffer<u8>>>>,
    epoch: u64,
    /// This epoch's rows (this rank's).
    indices: Vec<usize>,
    /// The next batch to gather, and the number of batches this epoch.
    next_issue: usize,
    batches: usize,
    queue: VecDeque<InFlightBatch<T>>,
    /// A failure ends the epoch: nothing more is yielded until the next.
    failed: bool,
    /// A failure met refilling the queue after a batch was taken, yielded
    /// by the next poll (the epoch's).
    deferred: Option<Error>,
    /// The row addresses of a gather (kept to reuse the allocation).
    addrs: Vec<usize>,
    stats: LoaderStats,
    /// Where batches are gathered; for [`Gather::Device`], each field's
    /// mapped (device) address and byte length, and the kernel.
    gather: Gather,
    mapped: Vec<(u64, usize)>,
    gather_fn: Option<crate::runtime::kernel::Function<gpu_kernels::gather_rows>>,
    /// The completion of the last batch issued on each stream (a
    /// device-gathering loader waits for them before letting go of its
    /// sources).
    last: Vec<Option<Completion>>,
}

/// Where a [`Loader`] gathers a batch's rows.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use futures::StreamExt;
/// use gpufeed::{block_on, Device, Gather, Loader, LoaderConfig, Registered, RowSource};
/// use std::sync::Arc;
/// let device = Device::cpu();
/// let data: Vec<u32> = (0..64).collect(); // 16 rows of 4
/// // Ordinary memory: threads gather the rows into pinned blocks.
/// let rows = RowSource::new(&data, 4)?;
/// let loader = Loader::<u32>::new(&device, vec![rows], LoaderConfig::new(8))?;
/// assert_eq!(loader.gather(), Gather::Host);
/// // Pinned in place: a kernel gathers them where they are.
/// let pinned = RowSource::registered(Arc::new(Registered::new(&device, data.clone())?), 4)?;
/// let mut loader = Loader::<u32>::new(&device, vec![pinned], LoaderConfig::new(8))?;
/// assert_eq!(loader.gather(), Gather::Device);
/// let mut batch = block_on(loader.next()).expect("a batch")?; // rows 0..8
/// let mut out = vec![0u32; 8 * 4];
/// batch.fields[0].copy_to_host_sync(&mut out)?;
/// assert_eq!(out, data[..32]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum Gather {
    /// On the host: worker threads copy the rows into a pinned block, and
    /// one DMA per field sends it.
    Host,
    /// On the device: a kernel reads the rows where they are (every field
    /// pinned in place: [`RowSource::registered`]) into the batch; the
    /// host only sends the batch's indices. Batches alternate between two
    /// streams, so the next batch's indices and kernel start while a
    /// kernel's last reads finish.
    Device,
}

impl<T: Pod> std::fmt::Debug for Loader<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("config", &self.config)
            .field("rows", &self.rows)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl<'a, T: Pod> Loader<'a, T> {
    /// A loader over `fields` (at least one, all of the same row count,
    /// each row a whole number of `T`), on `device`, with the staging
    /// engine's default number of worker threads
    /// ([`crate::StagingConfig::for_device`]). It starts at epoch 0,
    /// batch 0.
    ///
    /// # Errors
    /// `InvalidArgument` for no field, fields of different row counts, a
    /// row size not a multiple of `T`'s, a configuration out of range;
    /// the backend's stream creation error; `Internal` when the threads
    /// can't be started.
    pub fn new(device: &Device, fields: Vec<RowSource<'a>>, config: LoaderConfig) -> Result<Self> {
        let threads = crate::engines::staging::StagingConfig::for_device(device).threads;
        Self::with_threads(device, fields, config, threads)
    }

    /// As [`Loader::new`], with `threads` worker threads besides the one
    /// polling (0 to [`crate::MAX_STAGING_THREADS`]).
    ///
    /// # Errors
    /// As [`Loader::new`].
    pub fn with_threads(
        device: &Device,
        fields: Vec<RowSource<'a>>,
        config: LoaderConfig,
        threads: usize,
    ) -> Result<Self> {
        config.check()?;
        let bad = |s: String| Err(Error::InvalidArgument(s));
        let Some(first) = fields.first() else {
            return bad("a loader needs at least one field".into());
        };
        let rows = first.rows();
        let elem = std::mem::size_of::<T>();
        for (i, f) in fields.iter().enumerate() {
            if f.rows() != rows {
                return bad(format!(
                    "a loader's fields must have equal row counts: field 0 has {rows}, field {i} has {}",
                    f.rows()
                ));
            }
            if elem == 0 || !f.row_bytes().is_multiple_of(elem) {
                return bad(format!(
                    "field {i}'s rows of {} bytes are not a whole number of {elem}-byte values",
                    f.row_bytes()
                ));
            }
        }
        if threads > crate::engines::staging::MAX_STAGING_THREADS {
            return bad(format!(
                "loader threads {threads} above {}",
                crate::engines::staging::MAX_STAGING_THREADS
            ));
        }
        // On the device when every field is pinned in place, in one
        // segment, with this device's backend, and mapped.
        let mapped: Option<Vec<(u64, usize)>> = fields
            .iter()
            .map(|f| {
                let (addr, bytes) = f.device_readable(device.host_domain())?;
                if bytes == 0 {
                    return Some((0, 0));
                }
                // SAFETY: `addr` is the start of a registered range (the
                // source holds its guard).
                unsafe { device.backend.mapped_device_ptr(addr as *mut u8) }
                    .ok()
                    .map(|d| (d, bytes))
            })
            .collect();
        let gather_fn = match &mapped {
            Some(_) => crate::runtime::kernel::Builtins::of(device)
                .ok()
                .map(|b| b.gather_rows.clone()),
            None => None,
        };
        let (gather, mapped) = match (mapped, &gather_fn) {
            (Some(m), Some(_)) => (Gather::Device, m),
            _ => (Gather::Host, Vec::new()),
        };
        let cpus = device
            .numa_node()
            .map(crate::base::numa::cpus_of_node)
            .unwrap_or_default();
        // Gathers on the device need no copying thread.
        let threads = if gather == Gather::Device { 0 } else { threads };
        let workers = crate::base::workers::CopyWorkers::start(threads, move || {
            crate::base::numa::run_on_cpus(&cpus)
        })?;
        let streams = match gather {
            Gather::Host => vec![Stream::new(device)?],
            Gather::Device => vec![Stream::new(device)?, Stream::new(device)?],
        };
        let mut loader = Loader {
            device: device.clone(),
            last: vec![None; streams.len()],
            streams,
            workers,
            pool: PinnedPool::near(device),
            fields,
            rows,
            config,
            free: Arc::default(),
            epoch: 0,
            indices: Vec::new(),
            next_issue: 0,
            batches: 0,
            queue: VecDeque::new(),
            failed: false,
            deferred: None,
            addrs: Vec::new(),
            stats: LoaderStats::default(),
            gather,
            mapped,
            gather_fn,
        };
        loader.start_epoch(0, 0);
        Ok(loader)
    }

    /// The configuration.
    pub fn config(&self) -> LoaderConfig {
        self.config
    }

    /// Rows in the source (all ranks').
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Batches in one epoch (this rank's).
    pub fn len(&self) -> usize {
        batches_per_epoch(self.rows, &self.config)
    }

    /// Whether an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where batches are gathered: on the device when every field is
    /// pinned in place ([`RowSource::registered`]), else on the host.
    pub fn gather(&self) -> Gather {
        self.gather
    }

    /// Where the time went since the loader was made.
    pub fn stats(&self) -> LoaderStats {
        self.stats
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the current epoch handed out or skipped so far.
    pub fn position(&self) -> usize {
        self.next_issue - self.queue.len()
    }

    /// The rows of batch `index` of `epoch` (this rank's), the order this
    /// loader gathers them in.
    pub fn batch_indices(&self, epoch: u64, index: usize) -> Vec<usize> {
        let all = epoch_indices(self.rows, &self.config, epoch);
        let b = self.config.batch_size;
        all.chunks(b)
            .nth(index)
            .filter(|c| !self.config.drop_last || c.len() == b)
            .map(<[usize]>::to_vec)
            .unwrap_or_default()
    }

    /// Starts `epoch` at batch `skip` (0: from the start; a resumed run
    /// passes the batches it had consumed). Batches still in flight from
    /// before are dropped (their device memory and pinned blocks freed once
    /// their DMAs are done).
    pub fn start_epoch(&mut self, epoch: u64, skip: usize) {
        self.drop_queue();
        self.epoch = epoch;
        self.indices = epoch_indices(self.rows, &self.config, epoch);
        self.batches = batches_per_epoch(self.rows, &self.config);
        self.next_issue = skip.min(self.batches);
        self.failed = false;
        self.deferred = None;
    }

    fn drop_queue(&mut self) {
        while let Some(b) = self.queue.pop_front() {
            self.give_back_when_done(b.block, &b.done);
            // The buffers' frees wait for the DMAs noted on them.
            drop(b.batch);
        }
    }

    fn give_back_when_done(&self, block: PooledBuffer<u8>, done: &Completion) {
        if done.is_done() {
            lock(&self.free).push(block);
        } else {
            let free = self.free.clone();
            done.defer(move || lock(&free).push(block));
        }
    }

    /// Gathers and sends batches until `prefetch` are in flight or the
    /// epoch's are all sent. The gathers run on the calling thread and the
    /// workers, and return when the rows are in pinned memory; the DMAs
    /// run on.
    ///
    /// # Errors
    /// The pinned or device allocation's error, the driver's,
    /// [`Error::WorkerPanicked`]. The epoch then ends (its stream yields
    /// the error once, then nothing).
    pub fn fill_ahead(&mut self) -> Result<()> {
        while !self.failed
            && self.queue.len() < self.config.prefetch
            && self.next_issue < self.batches
        {
            if let Err(e) = self.issue_next() {
                self.failed = true;
                self.drop_queue();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gathers batch `next_issue` and sends it: on the host into a pinned
    /// block then one DMA per field, or on the device (its indices sent,
    /// then one gather kernel per field).
    fn issue_next(&mut self) -> Result<()> {
        let b = self.config.batch_size;
        let start = self.next_issue * b;
        let end = (start + b).min(self.indices.len());
        let n = end - start;
        // A block holds the largest batch: never more rows than the epoch
        // has (a batch_size far above them, even near usize::MAX, is one
        // batch of every row).
        let cap = b.min(self.indices.len());
        let block_bytes = match self.gather {
            Gather::Host => self.fields.iter().map(|f| f.row_bytes() * cap).sum(),
            Gather::Device => 8 * cap,
        };
        let t = std::time::Instant::now();
        let mut block = match lock(&self.free).pop() {
            Some(block) => block,
            None => self.pool.alloc::<u8>(block_bytes.max(1))?,
        };
        let mut fields = Vec::with_capacity(self.fields.len());
        let elem = std::mem::size_of::<T>();
        for f in &self.fields {
            fields.push(DeviceBuffer::<T>::new(
                &self.device,
                n * f.row_bytes() / elem,
            )?);
        }
        let indices = match self.gather {
            Gather::Host => None,
            Gather::Device => Some(DeviceBuffer::<u64>::new(&self.device, n)?),
        };
        let alloced = std::time::Instant::now();
        // The host's part first, all of it: a failure there leaves no
        // command behind (the block and the buffers go back at once).
        let mut bytes_sent = 0;
        match self.gather {
            Gather::Host => {
                let mut off = 0;
                for f in &self.fields {
                    let bytes = n * f.row_bytes();
                    self.addrs.clear();
                    self.addrs
                        .extend(self.indices[start..end].iter().map(|&i| f.row_addr(i)));
                    let dst = &mut block.as_mut_slice()[off..off + bytes];
                    // SAFETY: every address is a row of the source, readable
                    // and unwritten for 'a (RowSource's contract: a shared
                    // borrow, or the raw constructor's promise); `dst` is
                    // our block.
                    unsafe { self.workers.gather(&self.addrs, f.row_bytes(), dst)? };
                    off += bytes;
                }
                bytes_sent = off;
            }
            Gather::Device => {
                let dst = &mut block.as_mut_slice()[..8 * n];
                for (d, &i) in dst.chunks_exact_mut(8).zip(&self.indices[start..end]) {
                    d.copy_from_slice(&(i as u64).to_ne_bytes());
                }
            }
        }
        let gathered = std::time::Instant::now();
        // Then the commands, and one event after them, on this batch's stream.
        let on = self.next_issue % self.streams.len();
        let stream = &self.streams[on];
        let issued = match &indices {
            None => self.send_gathered(stream, &block, &fields, n),
            Some(idx) => {
                bytes_sent = self.fields.iter().map(|f| n * f.row_bytes()).sum();
                self.gather_on_device(stream, &block, idx, &fields, n)
            }
        };
        // Recorded even after a failed command: the ones issued before it
        // read the block and write the buffers until it fires.
        let done = match stream.raw().record(false) {
            Ok(ev) => ev.completion,
            Err(e) => {
                // The commands' end can't be observed: never reuse the
                // block nor free the buffers (nor let go of the sources).
                std::mem::forget(block);
                std::mem::forget(fields);
                std::mem::forget(indices);
                std::mem::forget(self.fields.clone());
                return Err(e);
            }
        };
        for buf in &fields {
            buf.staging_parts().2.push(done.clone());
        }
        if let Some(idx) = &indices {
            idx.staging_parts().2.push(done.clone());
        }
        self.last[on] = Some(done.clone());
        if let Err(e) = issued {
            // The buffers' frees and the block's reuse wait for the event.
            self.give_back_when_done(block, &done);
            return Err(e);
        }
        let issued_at = std::time::Instant::now();
        self.stats.batches += 1;
        self.stats.bytes += bytes_sent as u64;
        self.stats.alloc += alloced - t;
        self.stats.gather += gathered - alloced;
        self.stats.issue += issued_at - gathered;
        self.queue.push_back(InFlightBatch {
            batch: Batch {
                fields,
                rows: n,
                index: self.next_issue,
            },
            block,
            done,
        });
        self.next_issue += 1;
        Ok(())
    }

    /// The DMAs of a batch gathered on the host: one per field, from its
    /// part of `block` into its buffer, on `stream`.
    fn send_gathered(
        &self,
        stream: &Stream,
        block: &PooledBuffer<u8>,
        fields: &[DeviceBuffer<T>],
        n: usize,
    ) -> Result<()> {
        let mut off = 0;
        for (f, buf) in self.fields.iter().zip(fields) {
            let bytes = n * f.row_bytes();
            let (_, addr, _) = buf.staging_parts();
            if bytes > 0 {
                // SAFETY: the block is pinned memory of ours, held until
                // the completion recorded after this fires; the device range
                // is the fresh buffer, whose in-flight record keeps its
                // uses and its free behind the DMA.
                unsafe { stream.raw().copy_h2d(addr, block.ptr().add(off), bytes)? };
            }
            off += bytes;
        }
        Ok(())
    }

    /// A batch gathered on the device: its indices (in `block`) sent to
    /// `idx`, then one gather kernel per field reading the source where it
    /// is (pinned in place and mapped) into the field's buffer, on `stream`.
    fn gather_on_device(
        &self,
        stream: &Stream,
        block: &PooledBuffer<u8>,
        idx: &DeviceBuffer<u64>,
        fields: &[DeviceBuffer<T>],
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (_, idx_addr, _) = idx.staging_parts();
        // SAFETY: the block is pinned memory of ours holding the n indices,
        // held until the completion recorded after this fires; `idx` is a
        // fresh buffer of n values, its free behind that completion.
        unsafe { stream.raw().copy_h2d(idx_addr, block.ptr(), 8 * n)? };
        let Some(function) = &self.gather_fn else {
            return Err(Error::Internal(
                "a device-gathering loader without its kernel".into(),
            ));
        };
        for ((f, buf), &(src, src_bytes)) in self.fields.iter().zip(fields).zip(&self.mapped) {
            let bytes = n * f.row_bytes();
            let (_, dst, _) = buf.staging_parts();
            let config =
                crate::runtime::kernel::LaunchConfig::grid_stride(&self.device, bytes.div_ceil(16));
            // SAFETY: `src` is the source's mapped address, readable by the
            // device for `src_bytes` while the loader holds the source's
            // registration (it waits for its last command before letting go
            // of it); `idx` holds n indices, each below the source's row
            // count; `dst` is the fresh buffer of n rows, disjoint from
            // both, its free behind the completion recorded after this.
            let params = unsafe {
                (
                    kernel_abi::Slice::from_raw_parts(src as *const u8, src_bytes),
                    kernel_abi::Slice::from_raw_parts(idx_addr as *const u64, n),
                    f.row_bytes() as u64,
                    kernel_abi::SliceMut::from_raw_parts(dst as *mut u8, bytes),
                )
            };
            let launch = crate::backend::RawLaunch {
                name: "gather_rows",
                function: &function.raw,
                config: kernel_abi::thread::Launch {
                    grid: config.grid,
                    block: config.block,
                    dynamic_shared_bytes: config.shared_bytes,
                },
                params: Box::new(crate::runtime::kernel::TypedParams::<
                    gpu_kernels::gather_rows,
                >(params)),
            };
            // SAFETY: as for the parameters above.
            unsafe { stream.raw().launch(launch)? };
        }
        Ok(())
    }

    /// The next batch of the epoch, once its data is on the device: what
    /// the [`futures::Stream`] implementation yields, for callers holding
    /// a `&mut Loader`.
    ///
    /// # Cancel safety
    /// As the stream's: dropping a pending poll loses nothing (the batch
    /// stays at the front of the queue for the next poll).
    pub fn poll_batch(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Batch<T>>>> {
        if let Some(e) = self.deferred.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if let Err(e) = self.fill_ahead() {
            return Poll::Ready(Some(Err(e)));
        }
        let Some(front) = self.queue.front() else {
            return Poll::Ready(None);
        };
        match front.done.poll_done(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                let Some(b) = self.queue.pop_front() else {
                    return Poll::Ready(None);
                };
                lock(&self.free).push(b.block);
                match r {
                    Ok(()) => {
                        // `prefetch` batches in flight again while this one
                        // is used; a failure is the next poll's.
                        if let Err(e) = self.fill_ahead() {
                            self.deferred = Some(e);
                        }
                        Poll::Ready(Some(Ok(b.batch)))
                    }
                    Err(e) => {
                        self.failed = true;
                        self.drop_queue();
                        Poll::Ready(Some(Err(e)))
                    }
                }
            }
        }
    }

    /// The loader's own streams: batch `k` of an epoch's issue order runs
    /// on `streams()[k % streams().len()]` (one stream when gathering on the
    /// host, two on the device). A batch is yielded only once its commands
    /// are done, so nothing needs ordering after them; a consumer may still
    /// order work on another stream after them, e.g. with
    /// [`crate::interop::foreign_stream_wait`].
    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }
}

/// The current epoch's batches, from the position [`Loader::start_epoch`]
/// set, each yielded once its data is on the device; `None` at the epoch's
/// end (until the next `start_epoch`).
///
/// # Cancel safety
/// As the loader's (see [`Loader`]): gathered on the host, polling gathers
/// rows on the polling thread and the workers and returns when they are in
/// pinned memory, so no thread reads the source between polls, and
/// dropping never blocks; gathered on the device, the loader's own drop
/// waits for its last gather. Dropping a `next()` future loses nothing.
impl<T: Pod> futures::Stream for Loader<'_, T> {
    type Item = Result<Batch<T>>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_batch(cx)
    }
}

// No field is ever pinned (the stream only takes `&mut self`).
impl<T: Pod> Unpin for Loader<'_, T> {}

impl<T: Pod> Drop for Loader<'_, T> {
    fn drop(&mut self) {
        self.drop_queue();
        // Kernels still reading a source where it is: its registration
        // (held by the fields, dropped next) must outlive them. At most
        // `prefetch` batches' gathers; a failure there is the context's,
        // which ends every command of it.
        if self.gather == Gather::Device {
            for last in self.last.iter_mut().filter_map(Option::take) {
                let _ = last.block();
            }
        }
    }
}
