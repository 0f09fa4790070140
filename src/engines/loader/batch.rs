//! What a loader yields and reports: a [`Batch`], its [`LoaderStats`], where
//! it gathers ([`Gather`]), and a batch still in flight.

use crate::base::completion::Completion;
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::pool::PooledBuffer;
use bytemuck::Pod;

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
pub(super) struct InFlightBatch<T: Pod> {
    pub(super) batch: Batch<T>,
    pub(super) block: PooledBuffer<u8>,
    pub(super) done: Completion,
}

/// Where a [`Loader`](super::Loader) gathers a batch's rows.
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
    /// pinned in place: [`RowSource::registered`](super::RowSource::registered)) into the batch; the
    /// host only sends the batch's indices. Batches alternate between two
    /// streams, so the next batch's indices and kernel start while a
    /// kernel's last reads finish.
    Device,
}
