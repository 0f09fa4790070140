//! The [`Loader`]: its fields, its making (the fields checked, the gather
//! chosen, workers and streams started), its epochs, and the batches it
//! yields (polled, as a [`futures::Stream`], and waited for on drop).

use crate::base::completion::{lock, Completion};
use crate::base::error::{Error, Result};
use crate::engines::loader::batch::{Batch, Gather, InFlightBatch, LoaderStats};
use crate::engines::loader::order::{batches_per_epoch, epoch_indices, LoaderConfig};
use crate::engines::loader::source::RowSource;
use crate::runtime::device::Device;
use crate::runtime::pool::{PinnedPool, PooledBuffer};
use crate::runtime::stream::Stream;
use bytemuck::Pod;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

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
    pub(super) device: Device,
    /// Batch `k` runs on `streams[k % streams.len()]`: one stream for
    /// gathers on the host, two for gathers on the device.
    pub(super) streams: Vec<Stream>,
    pub(super) workers: crate::base::workers::CopyWorkers,
    pub(super) pool: PinnedPool,
    pub(super) fields: Vec<RowSource<'a>>,
    pub(super) rows: usize,
    pub(super) config: LoaderConfig,
    /// Pinned blocks free for a gather (shared with the deferred returns
    /// of blocks whose DMA was still running when their epoch ended).
    pub(super) free: Arc<Mutex<Vec<PooledBuffer<u8>>>>,
    pub(super) epoch: u64,
    /// This epoch's rows (this rank's).
    pub(super) indices: Vec<usize>,
    /// The next batch to gather, and the number of batches this epoch.
    pub(super) next_issue: usize,
    pub(super) batches: usize,
    pub(super) queue: VecDeque<InFlightBatch<T>>,
    /// A failure ends the epoch: nothing more is yielded until the next.
    pub(super) failed: bool,
    /// A failure met refilling the queue after a batch was taken, yielded
    /// by the next poll (the epoch's).
    pub(super) deferred: Option<Error>,
    /// The row addresses of a gather (kept to reuse the allocation).
    pub(super) addrs: Vec<usize>,
    pub(super) stats: LoaderStats,
    /// Where batches are gathered; for [`Gather::Device`], each field's
    /// mapped (device) address and byte length, and the kernel.
    pub(super) gather: Gather,
    pub(super) mapped: Vec<(u64, usize)>,
    pub(super) gather_fn: GatherFn,
    /// The completion of the last batch issued on each stream (a
    /// device-gathering loader waits for them before letting go of its
    /// sources).
    pub(super) last: Vec<Option<Completion>>,
}

/// The gather kernel of a loader gathering on the device.
type GatherFn = Option<crate::runtime::kernel::Function<gpu_kernels::gather_rows>>;

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
        let rows = Self::check_fields(&fields, threads)?;
        let (gather, mapped, gather_fn) = Self::choose_gather(device, &fields);
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

    /// The row count of `fields`, checked: at least one field, all of equal
    /// row counts, each row a whole number of `T`; and `threads` in range.
    fn check_fields(fields: &[RowSource<'a>], threads: usize) -> Result<usize> {
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
        Ok(rows)
    }

    /// Where a loader over `fields` gathers: on the device when every field
    /// is pinned in place, in one segment, with this device's backend, and
    /// mapped (then with each field's mapped address and byte length, and
    /// the kernel), else on the host.
    fn choose_gather(
        device: &Device,
        fields: &[RowSource<'a>],
    ) -> (Gather, Vec<(u64, usize)>, GatherFn) {
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
        match (mapped, gather_fn) {
            (Some(m), Some(function)) => (Gather::Device, m, Some(function)),
            _ => (Gather::Host, Vec::new(), None),
        }
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

    pub(super) fn drop_queue(&mut self) {
        while let Some(b) = self.queue.pop_front() {
            self.give_back_when_done(b.block, &b.done);
            // The buffers' frees wait for the DMAs noted on them.
            drop(b.batch);
        }
    }

    pub(super) fn give_back_when_done(&self, block: PooledBuffer<u8>, done: &Completion) {
        if done.is_done() {
            lock(&self.free).push(block);
        } else {
            let free = self.free.clone();
            done.defer(move || lock(&free).push(block));
        }
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
