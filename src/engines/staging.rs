//! Staged copies: ordinary (pageable) host memory to and from the device at
//! the link's speed.
//!
//! The driver copies pageable memory through a small bounce buffer of its
//! own, one piece at a time: 7 GB/s host-to-device and 11.5 GB/s back on the
//! H200 machine, against 55 GB/s from pinned memory. [`Staging`] does what
//! the driver does, in parallel and overlapped:
//!
//! - a bounded ring of pinned blocks ([`StagingConfig::blocks`] ×
//!   [`StagingConfig::block_bytes`], 4 × 8 MiB by default) from a pool of
//!   its own ([`Staging::pool_stats`]);
//! - persistent worker threads ([`StagingConfig::threads`]) that copy each
//!   block's bytes between the user's memory and the block, every thread a
//!   piece of the block as it comes (the thread driving the copy too, from
//!   the start, so it never waits for a parked worker to wake); they spin
//!   between blocks while a copy streams and park 2 ms after the last;
//! - the DMA of block *b* runs while the workers fill block *b + 1*
//!   (host-to-device: the driving thread issues it once they have started
//!   on *b + 1*, so the driver's calls cost the copy nothing), or copy
//!   block *b* out while the DMAs of the next blocks run (device-to-host),
//!   on the engine's own two streams;
//! - where nothing overlaps a piece, it is short: a copy to the device
//!   starts with a 1 MiB piece and doubles to whole blocks (the first DMA
//!   waits only for 1 MiB), a copy from the device halves its last pieces
//!   down to 1 MiB (the last drain after the last DMA is short).
//!
//! # Which route a copy takes
//! [`Route::Auto`] (the default) sends a small copy straight to the driver
//! (one synchronous pageable copy: the staging ring's fixed costs outweigh
//! its bandwidth there) and a larger one through the ring. The thresholds
//! ([`StagingConfig::direct_h2d_below`], [`StagingConfig::direct_d2h_below`])
//! are where the two routes crossed on the H200 machine (`host staging`,
//! 75b4506, every timed run after a 10 ms pause, so with the workers
//! parked): the driver's copy won at 256 KiB (host-to-device 3.40 against
//! 1.87 GB/s staged, device-to-host 4.01 against 2.04) and lost at 1 MiB
//! (5.39 against 5.86, 5.98 against 6.97), so 512 KiB both ways. Memory copied again
//! and again is best pinned once ([`crate::Registered`] or a
//! [`crate::PinnedPool`] buffer) and copied with [`crate::Stream::run`]:
//! pinning in place costs about 65 ms per GiB, a one-shot staged copy none.
//! [`Route::Direct`] and [`Route::Staged`] force a route.
//!
//! # Safety by construction
//! A staged copy is a future that borrows the host slice (shared for
//! host-to-device, exclusively for device-to-host) and the device buffer.
//! Every access to the host slice happens inside a call to `poll`: the
//! workers copy a block while the polling thread waits for them, so
//! between polls nothing touches the slice, and dropping or even
//! forgetting the future leaves no thread reading or writing it. The DMAs
//! in flight read or write only the engine's pinned blocks (released to the
//! ring when their DMA is done, never earlier) and the device buffer, which
//! records them: its next use waits for them and its free is deferred past
//! them.
//!
//! # The ring is shared
//! The copies of one engine (and its clones) share its blocks. A copy holds
//! the blocks it has taken until it is polled to its end or dropped: a copy
//! left pending unpolled (the losing branch of a `select!` kept alive) holds
//! them meanwhile, and one passed to `std::mem::forget` holds them for good,
//! so later copies of that engine wait for blocks that never come back. Drop
//! copies you no longer poll; give independent users engines of their own.

use crate::base::completion::{lock, Completion};
use crate::base::error::{byte_size, Error, Result};
pub use crate::io::direct_io::{cached_share, FileIo, DIRECT_IO_ALIGN, PROBE_SAMPLES};
use crate::runtime::device::Device;
use crate::runtime::memory::{DeviceBuffer, DeviceSliceMut, InFlight};
use crate::runtime::pool::{PinnedPool, PoolStats, PooledBuffer};
use crate::runtime::stream::Stream;
use bytemuck::Pod;
use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// The first piece of a staged host-to-device copy, and the last of a
/// device-to-host one (see [`piece_len`]).
const RAMP_PIECE: usize = 1 << 20;

/// Which way a staged copy of host memory goes (for [`piece_len`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Way {
    ToDevice,
    ToHost,
}

/// Bytes of the piece of a staged copy of `total` bytes that starts at
/// `at`, in blocks of `block` bytes: a whole block or the rest, except
/// where nothing overlaps the piece. To the device, no DMA starts before
/// the first fill: pieces start at [`RAMP_PIECE`] and double (each the
/// size of all before it). To the host, the last drain runs after every
/// DMA: pieces halve toward the end (each about the size of all after it,
/// in 64 KiB steps), down to [`RAMP_PIECE`].
///
/// Measured on the H200 machine (`host staging`, 8 MiB blocks, one run,
/// medians of 15): host-to-device 64 MiB 33.8 GB/s against 28.7 with whole
/// blocks from the start, 1 GiB 52.3 against 47.2; device-to-host 43.9
/// against 39.6 and 50.7 against 47.2.
fn piece_len(way: Way, at: usize, total: usize, block: usize) -> usize {
    let rest = total - at;
    let want = match way {
        Way::ToDevice => at.max(RAMP_PIECE),
        Way::ToHost => (rest / 2).next_multiple_of(64 << 10).max(RAMP_PIECE),
    };
    want.min(block).min(rest)
}

/// One synchronous pageable copy by the driver of `total` bytes between
/// the host memory of `dir` and device address `dev` (the direct route).
///
/// # Safety
/// `dir`'s host pointer is valid for `total` bytes (for writes, and
/// written by no one else, device-to-host), and `dev..dev + total` is
/// device memory of `device` that no one else writes (nor, host-to-device,
/// reads) until this returns.
unsafe fn direct_copy(device: &Device, dir: Dir, dev: u64, total: usize) -> Result<()> {
    if total == 0 {
        return Ok(());
    }
    let backend = &device.backend;
    match dir {
        // SAFETY: the caller's contract; synchronous.
        Dir::H2d(src) => unsafe { backend.copy_h2d_sync(dev, src, total) },
        // SAFETY: as above.
        Dir::D2h(dst) => unsafe { backend.copy_d2h_sync(dst, dev, total) },
        Dir::FileIn | Dir::FileOut { .. } => Err(Error::Internal(
            "a file copy taking the direct route".into(),
        )),
    }
}

/// Default size of one staging block (8 MiB).
pub const DEFAULT_BLOCK_BYTES: usize = 8 << 20;
/// Default number of staging blocks (4: 32 MiB of pinned memory in all).
pub const DEFAULT_BLOCKS: usize = 4;
/// Default size below which [`Route::Auto`] copies host-to-device directly.
pub const DEFAULT_DIRECT_H2D_BELOW: usize = 512 << 10;
/// Default size below which [`Route::Auto`] copies device-to-host directly.
pub const DEFAULT_DIRECT_D2H_BELOW: usize = 512 << 10;
/// Most worker threads an engine starts.
pub const MAX_STAGING_THREADS: usize = 256;
/// The default worker count never exceeds this: past it the host copies
/// outrun the link (16 threads fill pinned memory at over 60 GB/s on the
/// H200 machine).
pub const DEFAULT_MAX_THREADS: usize = 16;

/// How a copy reaches the device.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceBuffer, Route, Staging, StagingConfig};
/// let device = Device::cpu();
/// let data = vec![7u32; 1000]; // 4 KB: `Route::Auto` would copy it directly
/// let mut dev = DeviceBuffer::<u32>::new(&device, data.len())?;
/// // Through the pinned ring, whatever the size.
/// let staged = StagingConfig { route: Route::Staged, ..StagingConfig::for_device(&device) };
/// let staging = Staging::with_config(&device, staged)?;
/// staging.h2d_blocking(&data, &mut dev)?;
/// assert!(staging.pool_stats().peak_in_use_bytes > 0); // a block of the ring was used
/// let direct = Staging::with_config(&device, StagingConfig { route: Route::Direct, ..staged })?;
/// direct.h2d_blocking(&data, &mut dev)?;
/// assert_eq!(direct.pool_stats().peak_in_use_bytes, 0); // one driver copy, no block
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Route {
    /// Direct below [`StagingConfig::direct_h2d_below`] (host-to-device) or
    /// [`StagingConfig::direct_d2h_below`] (device-to-host) bytes, staged
    /// above.
    #[default]
    Auto,
    /// One synchronous pageable copy by the driver.
    Direct,
    /// Through the pinned ring, whatever the size.
    Staged,
}

/// The shape of a staging engine.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, Error, Staging, StagingConfig};
/// let device = Device::cpu();
/// let default = StagingConfig::for_device(&device); // 4 blocks of 8 MiB
/// let small = StagingConfig { block_bytes: 1 << 20, blocks: 2, ..default };
/// assert_eq!(small.total_bytes(), 2 << 20); // the most pinned memory the engine holds
/// let staging = Staging::with_config(&device, small)?;
/// assert_eq!(staging.config(), small);
/// let err = Staging::with_config(&device, StagingConfig { blocks: 0, ..small }).unwrap_err();
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes in one pinned block (at least 4 KiB). Each is a block of the
    /// pinned pool, whose size classes round it up by less than an eighth
    /// (8 MiB and 12 MiB stay as they are, 8 MiB + 1 byte takes 9 MiB).
    pub block_bytes: usize,
    /// Blocks in the ring (at least 1; 2 or more to overlap): the engine
    /// never holds more than [`StagingConfig::total_bytes`] of pinned
    /// memory.
    pub blocks: usize,
    /// Worker threads copying between the user's memory and the blocks,
    /// besides the thread driving the copy, which takes a piece of every
    /// block too (1 to [`MAX_STAGING_THREADS`]).
    pub threads: usize,
    /// Which route copies take.
    pub route: Route,
    /// Under [`Route::Auto`], host-to-device copies of fewer bytes than
    /// this go direct.
    pub direct_h2d_below: usize,
    /// Under [`Route::Auto`], device-to-host copies of fewer bytes than
    /// this go direct.
    pub direct_d2h_below: usize,
}

impl StagingConfig {
    /// The default for `device`: 4 blocks of 8 MiB; workers on three
    /// quarters of the CPUs of the GPU's NUMA node (of all CPUs when it has
    /// none), at least 1 and at most [`DEFAULT_MAX_THREADS`]; direct copies
    /// below 512 KiB both ways. The quarter left keeps the thread driving
    /// the copy, the completion thread, the driver's and the program's own
    /// threads off the workers' cores: a worker descheduled while it holds a
    /// piece holds up the whole block.
    ///
    /// Measured on the H200 machine (16 cores, one NUMA node, 1 GiB; `host
    /// staging`'s sweep, every shape and the pinned copy taking turns run by
    /// run, as a fraction of that pinned copy, two runs): 15 workers with 4
    /// × 8 MiB reached 0.941 / 0.904 host-to-device and 0.970 / 0.977
    /// device-to-host, 12 workers 0.934 / 0.845 and 0.965 / 0.893, 8
    /// workers 0.825 / 0.768. But the one full run with 15 workers as the
    /// default (a6fdecf) collapsed at 16-256 MiB: host-to-device 16 MiB 5.6
    /// GB/s and device-to-host 64 MiB 17.6, where 12 workers gave 20.3-21.9
    /// and 44.2-47.5 earlier the same day; host-to-device 256 MiB 17.2,
    /// where 12 workers gave 45-46 in earlier runs. So 12. Rings of 16, 24
    /// or 64 MiB in all did no better than 4 × 8 MiB.
    pub fn for_device(device: &Device) -> StagingConfig {
        let cpus = device
            .numa_node()
            .map(|n| crate::base::numa::cpus_of_node(n).len())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        StagingConfig {
            block_bytes: DEFAULT_BLOCK_BYTES,
            blocks: DEFAULT_BLOCKS,
            threads: (cpus - cpus / 4).clamp(1, DEFAULT_MAX_THREADS),
            route: Route::Auto,
            direct_h2d_below: DEFAULT_DIRECT_H2D_BELOW,
            direct_d2h_below: DEFAULT_DIRECT_D2H_BELOW,
        }
    }

    /// The route a copy of `bytes` takes, `direct_below` the threshold of
    /// its direction.
    fn route_for(&self, bytes: usize, direct_below: usize) -> Route {
        match self.route {
            Route::Auto if bytes < direct_below => Route::Direct,
            Route::Auto => Route::Staged,
            r => r,
        }
    }

    /// Pinned bytes the engine may hold at most: `blocks` pool blocks of
    /// `block_bytes`, each counted at its size class (what the pool hands
    /// out and its statistics count).
    pub fn total_bytes(&self) -> usize {
        self.blocks
            .saturating_mul(crate::runtime::pool::size_class(self.block_bytes))
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if self.block_bytes < 4096 {
            return bad(format!(
                "staging block_bytes {} is below 4096",
                self.block_bytes
            ));
        }
        if self.blocks == 0 {
            return bad("staging needs at least one block".into());
        }
        if self.threads == 0 || self.threads > MAX_STAGING_THREADS {
            return bad(format!(
                "staging threads {} outside 1..={MAX_STAGING_THREADS}",
                self.threads
            ));
        }
        if self
            .blocks
            .checked_mul(crate::runtime::pool::size_class(self.block_bytes))
            .is_none()
        {
            return bad("staging blocks × block_bytes overflows".into());
        }
        byte_size::<u8>(self.total_bytes())?;
        Ok(())
    }
}

/// A staging engine: a bounded ring of pinned blocks, worker threads, and
/// two streams of its own, for copies between ordinary host memory and
/// device memory. Cheap to clone (clones share the engine); safe to use
/// from many tasks at once (they share the ring: each copy waits for a
/// block when all are in use).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Staging};
/// let device = Device::cpu();
/// let staging = Staging::new(&device)?;
/// let data: Vec<f32> = (0..1 << 20).map(|i| i as f32).collect(); // ordinary memory
/// let mut dev = DeviceBuffer::<f32>::new(&device, data.len())?;
/// block_on(staging.h2d(&data, &mut dev))?; // `staging.h2d(..).await?` in async code
/// let mut back = vec![0f32; data.len()];
/// staging.d2h_blocking(&dev, &mut back)?; // the same, for synchronous code
/// assert_eq!(back, data);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Staging {
    engine: Arc<Engine>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("config", &self.engine.config)
            .finish_non_exhaustive()
    }
}

struct Engine {
    device: Device,
    h2d: Stream,
    d2h: Stream,
    pool: PinnedPool,
    workers: crate::base::workers::CopyWorkers,
    config: StagingConfig,
    ring: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    /// Blocks not lent to any copy.
    free: Vec<PooledBuffer<u8>>,
    /// Blocks allocated so far (at most `config.blocks`).
    made: usize,
    /// Copies waiting for a block.
    waiters: Vec<Waker>,
}

impl Engine {
    /// A block for a copy: a free one, or a new one while fewer than
    /// `blocks` exist. `None` when all are lent; with `cx` the copy is then
    /// woken when one comes back.
    fn take(&self, cx: Option<&mut Context<'_>>) -> Result<Option<PooledBuffer<u8>>> {
        {
            let mut ring = lock(&self.ring);
            if let Some(b) = ring.free.pop() {
                return Ok(Some(b));
            }
            if ring.made >= self.config.blocks {
                if let Some(cx) = cx {
                    if !ring.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                        ring.waiters.push(cx.waker().clone());
                    }
                }
                return Ok(None);
            }
            ring.made += 1;
        }
        // Allocated outside the lock (a pinned allocation takes milliseconds).
        match self.pool.alloc::<u8>(self.config.block_bytes) {
            Ok(b) => Ok(Some(b)),
            Err(e) => {
                lock(&self.ring).made -= 1;
                Err(e)
            }
        }
    }

    /// A block back to the ring; wakes the copies waiting for one.
    fn give_back(&self, block: PooledBuffer<u8>) {
        let waiters = {
            let mut ring = lock(&self.ring);
            ring.free.push(block);
            std::mem::take(&mut ring.waiters)
        };
        waiters.into_iter().for_each(Waker::wake);
    }

    /// A block whose DMA may still run back to the ring when it is done.
    fn give_back_when_done(self: &Arc<Self>, slot: Slot) {
        if slot.done.is_done() {
            self.give_back(slot.block);
        } else {
            let engine = self.clone();
            let block = slot.block;
            slot.done.defer(move || engine.give_back(block));
        }
    }
}

impl Staging {
    /// An engine with the default configuration for `device`
    /// ([`StagingConfig::for_device`]).
    ///
    /// # Errors
    /// The backend's stream creation error; `Internal` when the worker
    /// threads can't be started.
    pub fn new(device: &Device) -> Result<Staging> {
        Staging::with_config(device, StagingConfig::for_device(device))
    }

    /// An engine of the given shape. Its pinned blocks are allocated at
    /// first use and kept until the engine is dropped.
    ///
    /// # Errors
    /// `InvalidArgument` for a configuration out of range (no block, no
    /// thread, blocks under 4 KiB); as [`Staging::new`].
    pub fn with_config(device: &Device, config: StagingConfig) -> Result<Staging> {
        config.check()?;
        let cpus = device
            .numa_node()
            .map(crate::base::numa::cpus_of_node)
            .unwrap_or_default();
        let workers = crate::base::workers::CopyWorkers::start(config.threads, move || {
            crate::base::numa::run_on_cpus(&cpus)
        })?;
        let engine = Engine {
            h2d: Stream::new(device)?,
            d2h: Stream::new(device)?,
            pool: PinnedPool::near(device),
            device: device.clone(),
            workers,
            config,
            ring: Mutex::default(),
        };
        Ok(Staging {
            engine: Arc::new(engine),
        })
    }

    /// A test hook: the next piece a worker of this engine copies panics.
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn plant_worker_panic(&self) {
        self.engine.workers.plant_panic();
    }

    /// The device the engine copies to and from.
    pub fn device(&self) -> &Device {
        &self.engine.device
    }

    /// How this engine's file reads reach the device: what the GPUDirect
    /// Storage probe found for its device. Where it is available, reads
    /// that take `O_DIRECT` ([`FileIo`]) go through cuFile when the file's
    /// system is supported ([`StagedCopy::uses_gds`]); through the ring
    /// otherwise.
    pub fn file_route(&self) -> crate::io::gds::GdsStatus {
        crate::io::gds::gds_status(&self.engine.device)
    }

    /// The engine's configuration.
    pub fn config(&self) -> StagingConfig {
        self.engine.config
    }

    /// The statistics of the engine's own pinned pool: `in_use_bytes` and
    /// `peak_in_use_bytes` never exceed [`StagingConfig::total_bytes`].
    pub fn pool_stats(&self) -> PoolStats {
        self.engine.pool.stats()
    }

    /// Copies `src` into `dst` (the same length) and resolves when the data
    /// is on the device.
    ///
    /// # Errors
    /// `LengthMismatch`; `InvalidArgument` for a buffer of another device;
    /// the driver's error; [`Error::WorkerPanicked`] when a worker panicked
    /// (the copy stops there, the buffers stay usable).
    ///
    /// # Cancel safety
    /// Dropping the future stops the copy: no thread touches `src` once it
    /// is dropped (host copies only run inside `poll`). DMAs already issued
    /// go on, reading the engine's own blocks; `dst` then holds an
    /// unspecified mix of old and new data, and its next use (or its free)
    /// waits for those DMAs. Dropping never blocks.
    pub fn h2d<'a, T: Pod>(&'a self, src: &'a [T], dst: &'a mut DeviceBuffer<T>) -> StagedCopy<'a> {
        let len = dst.len();
        let checked = crate::runtime::memory::check_len(
            "staged h2d (device buffer vs host slice)",
            len,
            src.len(),
        );
        self.h2d_at(src, dst, 0).or_fail(checked)
    }

    /// Copies `src` into `dst[at..at + src.len()]`.
    ///
    /// # Errors
    /// `OutOfBounds` for a range past the buffer's end; otherwise as
    /// [`Staging::h2d`].
    ///
    /// # Cancel safety
    /// As [`Staging::h2d`].
    pub fn h2d_at<'a, T: Pod>(
        &'a self,
        src: &'a [T],
        dst: &'a mut DeviceBuffer<T>,
        at: usize,
    ) -> StagedCopy<'a> {
        self.start(dst, at, src.len(), Dir::H2d(src.as_ptr().cast()))
    }

    /// Copies `src` into `dst` (the same length) and resolves when the data
    /// is in `dst`.
    ///
    /// # Errors
    /// As [`Staging::h2d`].
    ///
    /// # Cancel safety
    /// Dropping the future stops the copy: no thread touches `dst` once it
    /// is dropped (host copies only run inside `poll`), and `dst` holds an
    /// unspecified mix of old and new data. DMAs already issued go on,
    /// writing only the engine's own blocks; `src`'s next use (or its free)
    /// waits for them. Dropping never blocks.
    pub fn d2h<'a, T: Pod>(&'a self, src: &'a DeviceBuffer<T>, dst: &'a mut [T]) -> StagedCopy<'a> {
        let checked = crate::runtime::memory::check_len(
            "staged d2h (host slice vs device buffer)",
            src.len(),
            dst.len(),
        );
        self.d2h_at(src, 0, dst).or_fail(checked)
    }

    /// Copies `src[at..at + dst.len()]` into `dst`.
    ///
    /// # Errors
    /// As [`Staging::h2d_at`].
    ///
    /// # Cancel safety
    /// As [`Staging::d2h`].
    pub fn d2h_at<'a, T: Pod>(
        &'a self,
        src: &'a DeviceBuffer<T>,
        at: usize,
        dst: &'a mut [T],
    ) -> StagedCopy<'a> {
        self.start(src, at, dst.len(), Dir::D2h(dst.as_mut_ptr().cast()))
    }

    /// Reads `dst.len()` values from `file`, starting at byte `at`, into
    /// `dst`: parallel `pread`s by the workers into the pinned ring, each
    /// block's DMA overlapping the reads of the next. Read buffered
    /// ([`FileIo::Auto`]); [`Staging::read_file_with`] takes
    /// [`FileIo::Direct`] for `O_DIRECT` reads that leave the page cache alone.
    ///
    /// # Errors
    /// [`Error::Io`]: the system's error (a directory, a file opened for
    /// writing only), or `UnexpectedEof` when the file ends before `dst`
    /// is full (truncated, or shrinking during the read); `dst` then holds
    /// unspecified data. As [`Staging::h2d`] otherwise.
    ///
    /// # Cancel safety
    /// As [`Staging::h2d`]: no read runs once the future is dropped.
    pub fn read_file<'a, T: Pod>(
        &'a self,
        file: &'a std::fs::File,
        at: u64,
        dst: &'a mut DeviceBuffer<T>,
    ) -> StagedCopy<'a> {
        let len = dst.len();
        self.read_file_with(file, at, dst, 0..len, FileIo::Auto)
    }

    /// Reads `range.len()` values from `file`, starting at byte `at`, into
    /// `dst[range]`, the way `io` says ([`FileIo::Auto`]: buffered; see
    /// [`StagedCopy::file_io`] for the way taken). Reading a large file in
    /// ranges lets the caller report progress between them.
    ///
    /// # Errors
    /// `OutOfBounds` for a range outside `dst`; with [`FileIo::Direct`],
    /// [`Error::Io`] of kind `Unsupported` when the file system refuses
    /// `O_DIRECT`; as [`Staging::read_file`] otherwise.
    ///
    /// # Cancel safety
    /// As [`Staging::read_file`].
    pub fn read_file_with<'a, T: Pod>(
        &'a self,
        file: &'a std::fs::File,
        at: u64,
        dst: &'a mut DeviceBuffer<T>,
        range: std::ops::Range<usize>,
        io: FileIo,
    ) -> StagedCopy<'a> {
        self.read_file_pieces(file, vec![FilePiece { at, dst, range }], io)
    }

    /// Reads several pieces of `file` into ranges of device buffers in one
    /// stream through the ring: the blocks flow from one piece into the
    /// next (a block may carry the end of one piece and the start of the
    /// next where they follow each other in the file), so the ring stays
    /// full across pieces and only the last block's DMA is waited for at
    /// the end. Loading many tensors of one file this way costs one
    /// transfer instead of one per tensor. `io` as for
    /// [`Staging::read_file_with`], decided once for all the pieces.
    ///
    /// # Errors
    /// Every piece is checked before any byte is read: `OutOfBounds` for a
    /// range outside its buffer (or the wrong way round), `InvalidArgument`
    /// for a buffer of another device or a file range past `u64::MAX`. As
    /// [`Staging::read_file_with`] otherwise (a file that ends before the
    /// last piece is full is `UnexpectedEof`; the buffers then hold
    /// unspecified data).
    ///
    /// # Cancel safety
    /// As [`Staging::read_file`].
    pub fn read_file_pieces<'a, T: Pod>(
        &'a self,
        file: &'a std::fs::File,
        pieces: Vec<FilePiece<'a, T>>,
        io: FileIo,
    ) -> StagedCopy<'a> {
        let elem = std::mem::size_of::<T>();
        let mut check = Ok(());
        let mut segs: Vec<Seg<'a>> = Vec::with_capacity(pieces.len());
        for FilePiece { at, dst, range } in pieces {
            let dst: &'a DeviceBuffer<T> = dst;
            let len = range.end.saturating_sub(range.start);
            let (device, addr, in_flight) = dst.staging_parts();
            let ok = ordered(&range, dst.len())
                .and_then(|()| self.check_range(dst, range.start, len))
                .and_then(|()| self.same_device(device));
            match ok {
                Ok(()) => segs.push(Seg {
                    file: 0,
                    file_at: at,
                    dev: addr + (range.start * elem) as u64,
                    len: len * elem,
                    start: 0,
                    run_end: 0,
                    join_end: 0,
                    in_flight: Some(in_flight),
                }),
                Err(e) => {
                    if check.is_ok() {
                        check = Err(e);
                    }
                }
            }
        }
        self.file_read(vec![file], segs, check, io)
    }

    /// The read of `segs` (their `start`, `run_end` and `join_end` filled
    /// in here; each names its file by index in `files`) as one copy:
    /// refused with `check`'s error, or for a piece whose file range ends
    /// past `u64::MAX`; each file's way (`io`) chosen once.
    fn file_read<'a>(
        &'a self,
        files: Vec<&'a std::fs::File>,
        segs: Vec<Seg<'a>>,
        mut check: Result<()>,
        io: FileIo,
    ) -> StagedCopy<'a> {
        let mut kept: Vec<Seg<'a>> = Vec::with_capacity(segs.len());
        let mut total = 0usize;
        for mut g in segs {
            if g.file_at.checked_add(g.len as u64).is_none() {
                if check.is_ok() {
                    check = Err(Error::InvalidArgument(format!(
                        "a file piece of {} bytes at offset {} ends past u64::MAX",
                        g.len, g.file_at
                    )));
                }
                continue;
            }
            if g.len == 0 {
                continue;
            }
            g.start = total;
            total = total.saturating_add(g.len);
            kept.push(g);
        }
        let mut segs = kept;
        // Runs: pieces that follow each other in one file; joins: pieces of
        // one file that follow each other in the file or on the device (a
        // gathered block holds such a chain: one read each, one DMA).
        for i in (0..segs.len()).rev() {
            let (file_next, dev_next) = match segs.get(i + 1) {
                Some(n) if n.file == segs[i].file => (
                    segs[i].file_at + segs[i].len as u64 == n.file_at,
                    segs[i].dev + segs[i].len as u64 == n.dev,
                ),
                _ => (false, false),
            };
            let end = segs[i].start + segs[i].len;
            segs[i].run_end = if file_next { segs[i + 1].run_end } else { end };
            segs[i].join_end = if file_next || dev_next {
                segs[i + 1].join_end
            } else {
                end
            };
        }
        let dev = segs.first().map_or(0, |g| g.dev);
        let mut copy = StagedCopy::new(&self.engine, Dir::FileIn, dev, total, None);
        copy.fail_unless(check);
        copy.waits_on_drop = segs.iter().any(|g| g.in_flight.is_none());
        copy.segs = segs;
        copy.files = files
            .into_iter()
            .map(|f| FileSrc {
                file: f,
                direct: None,
                gds: None,
            })
            .collect();
        if matches!(copy.state, State::Running) && total > 0 {
            let gds_here = io == FileIo::Direct
                && crate::io::gds::gds_status(&self.engine.device).is_available();
            let mut all_gds = gds_here;
            for f in &mut copy.files {
                match crate::io::direct_io::choose(f.file, io, self.engine.config.block_bytes) {
                    Ok(direct) => {
                        // A direct read goes through cuFile where GPUDirect
                        // Storage is available and every file's system is
                        // supported.
                        if let (Some(d), true) = (&direct, gds_here) {
                            f.gds = crate::io::gds::Registered::new(d).ok();
                        }
                        all_gds &= f.gds.is_some();
                        f.direct = direct;
                    }
                    Err(e) => {
                        copy.fail_unless(Err(e));
                        break;
                    }
                }
            }
            if matches!(copy.state, State::Running) {
                copy.file_io = Some(if copy.files.iter().any(|f| f.direct.is_some()) {
                    FileIo::Direct
                } else {
                    FileIo::Buffered
                });
                copy.gds = all_gds;
                if !all_gds {
                    copy.files.iter_mut().for_each(|f| f.gds = None);
                }
            }
        }
        copy
    }

    /// The way a read of `file` would take with `io` ([`FileIo::Direct`]
    /// or [`FileIo::Buffered`]; `Auto` is buffered): it depends on `io` and
    /// the file (its file system's acceptance of `O_DIRECT`), not on the
    /// range. Nothing is read.
    ///
    /// # Errors
    /// As [`Staging::read_file_with`] refuses `io` for the file.
    pub fn file_io_for(&self, file: &std::fs::File, io: FileIo) -> Result<FileIo> {
        let direct = crate::io::direct_io::choose(file, io, self.engine.config.block_bytes)?;
        Ok(if direct.is_some() {
            FileIo::Direct
        } else {
            FileIo::Buffered
        })
    }

    /// [`Staging::read_file_pieces`] for synchronous code.
    ///
    /// # Errors
    /// As [`Staging::read_file_pieces`].
    pub fn read_file_pieces_blocking<T: Pod>(
        &self,
        file: &std::fs::File,
        pieces: Vec<FilePiece<'_, T>>,
        io: FileIo,
    ) -> Result<()> {
        crate::base::block::block_on(self.read_file_pieces(file, pieces, io))
    }

    /// Writes the values of `src` to `file` from byte `at` (parallel
    /// `pwrite`s of each block as it arrives from the device).
    ///
    /// # Errors
    /// [`Error::Io`]: the system's error (`StorageFull` on a full disk, a
    /// file opened read-only); the file then holds part of the data: write
    /// to a temporary name and rename it when this succeeds.
    ///
    /// # Cancel safety
    /// As [`Staging::d2h`]: no write runs once the future is dropped.
    pub fn write_file<'a, T: Pod>(
        &'a self,
        src: &'a DeviceBuffer<T>,
        file: &'a std::fs::File,
        at: u64,
    ) -> StagedCopy<'a> {
        self.write_file_with(src, 0..src.len(), file, at)
    }

    /// Writes the values of `src[range]` to `file` from byte `at` (a large
    /// buffer written in ranges lets the caller report progress).
    ///
    /// # Errors
    /// `OutOfBounds` for a range outside `src`, `InvalidArgument` for a file
    /// range past `u64::MAX` (nothing written); as [`Staging::write_file`].
    ///
    /// # Cancel safety
    /// As [`Staging::write_file`].
    pub fn write_file_with<'a, T: Pod>(
        &'a self,
        src: &'a DeviceBuffer<T>,
        range: std::ops::Range<usize>,
        file: &'a std::fs::File,
        at: u64,
    ) -> StagedCopy<'a> {
        let len = range.end.saturating_sub(range.start);
        let bytes = len.saturating_mul(std::mem::size_of::<T>()) as u64;
        let mut copy = self.start(src, range.start, len, Dir::FileOut { file, at });
        copy.fail_unless(ordered(&range, src.len()));
        // Checked before any byte is written: a sum past u64::MAX would wrap
        // the workers' offsets to the start of the file.
        copy.fail_unless(at.checked_add(bytes).map(|_| ()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a file write of {bytes} bytes at offset {at} ends past u64::MAX"
            ))
        }));
        copy
    }

    /// [`Staging::read_file`] for synchronous code.
    ///
    /// # Errors
    /// As [`Staging::read_file`].
    pub fn read_file_blocking<T: Pod>(
        &self,
        file: &std::fs::File,
        at: u64,
        dst: &mut DeviceBuffer<T>,
    ) -> Result<()> {
        crate::base::block::block_on(self.read_file(file, at, dst))
    }

    /// [`Staging::read_file_with`] for synchronous code.
    ///
    /// # Errors
    /// As [`Staging::read_file_with`].
    pub fn read_file_with_blocking<T: Pod>(
        &self,
        file: &std::fs::File,
        at: u64,
        dst: &mut DeviceBuffer<T>,
        range: std::ops::Range<usize>,
        io: FileIo,
    ) -> Result<()> {
        crate::base::block::block_on(self.read_file_with(file, at, dst, range, io))
    }

    /// [`Staging::write_file_with`] for synchronous code.
    ///
    /// # Errors
    /// As [`Staging::write_file_with`].
    pub fn write_file_with_blocking<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        range: std::ops::Range<usize>,
        file: &std::fs::File,
        at: u64,
    ) -> Result<()> {
        crate::base::block::block_on(self.write_file_with(src, range, file, at))
    }

    /// [`Staging::write_file`] for synchronous code.
    ///
    /// # Errors
    /// As [`Staging::write_file`].
    pub fn write_file_blocking<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        file: &std::fs::File,
        at: u64,
    ) -> Result<()> {
        crate::base::block::block_on(self.write_file(src, file, at))
    }

    /// [`Staging::h2d`] for synchronous code: returns when the data is on
    /// the device. Never call it on an executor thread.
    ///
    /// # Errors
    /// As [`Staging::h2d`].
    pub fn h2d_blocking<T: Pod>(&self, src: &[T], dst: &mut DeviceBuffer<T>) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        let below = self.engine.config.direct_h2d_below;
        if let Some(addr) = self.direct_here(dst, src.len(), bytes, below) {
            // SAFETY: `src` is borrowed for the call, `bytes` long; the
            // device range is the whole buffer (the same byte count),
            // borrowed exclusively, its staged DMAs settled.
            return unsafe {
                direct_copy(
                    &self.engine.device,
                    Dir::H2d(src.as_ptr().cast()),
                    addr,
                    bytes,
                )
            };
        }
        self.h2d(src, dst).wait_here()
    }

    /// The device address of `buf` when a blocking copy between it and
    /// `host_len` elements (`bytes` bytes) takes the direct route (`below`:
    /// its direction's threshold), its staged DMAs settled; `None` when it
    /// doesn't, or when the copy is refused (the future says why). Made
    /// without a future around it, a direct copy skips a few microseconds
    /// of that machinery on a cold cache (a 256 KiB copy takes about 70).
    fn direct_here<T: Pod>(
        &self,
        buf: &DeviceBuffer<T>,
        host_len: usize,
        bytes: usize,
        below: usize,
    ) -> Option<u64> {
        if self.engine.config.route_for(bytes, below) != Route::Direct || host_len != buf.len() {
            return None;
        }
        let (device, addr, _) = buf.staging_parts();
        self.same_device(device).ok().map(|()| addr)
    }

    /// [`Staging::d2h`] for synchronous code: returns when the data is in
    /// `dst`. Never call it on an executor thread.
    ///
    /// # Errors
    /// As [`Staging::d2h`].
    pub fn d2h_blocking<T: Pod>(&self, src: &DeviceBuffer<T>, dst: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        let below = self.engine.config.direct_d2h_below;
        if let Some(addr) = self.direct_here(src, dst.len(), bytes, below) {
            // SAFETY: `dst` is borrowed exclusively for the call, `bytes`
            // long; the device range is the whole buffer (the same byte
            // count), borrowed for the call, its staged DMAs settled.
            return unsafe {
                direct_copy(
                    &self.engine.device,
                    Dir::D2h(dst.as_mut_ptr().cast()),
                    addr,
                    bytes,
                )
            };
        }
        self.d2h(src, dst).wait_here()
    }

    /// A copy of `len` values at element `at` of `buf`, the other side in
    /// `dir`: refused (at its first poll) for a range past the buffer's
    /// end or a buffer of another device.
    fn start<'a, T: Pod>(
        &'a self,
        buf: &'a DeviceBuffer<T>,
        at: usize,
        len: usize,
        dir: Dir,
    ) -> StagedCopy<'a> {
        let elem = std::mem::size_of::<T>();
        let range = self.check_range(buf, at, len);
        let (device, addr, in_flight) = buf.staging_parts();
        // Offset and bytes only when the range is inside the buffer (else
        // they may overflow; the copy is refused anyway).
        let (offset, bytes) = if range.is_ok() {
            ((at * elem) as u64, len * elem)
        } else {
            (0, 0)
        };
        let mut copy = StagedCopy::new(&self.engine, dir, addr + offset, bytes, Some(in_flight));
        copy.fail_unless(range.and_then(|()| self.same_device(device)));
        copy
    }

    /// Copies `src` into `dst` (equal lengths) on the engine's workers and
    /// the calling thread: a parallel memcpy.
    ///
    /// # Errors
    /// [`Error::WorkerPanicked`]; `InvalidArgument` in a `fork()` child.
    pub(crate) fn host_copy(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        self.engine.workers.copy(src, dst)
    }

    pub(crate) fn same_device(&self, device: &Device) -> Result<()> {
        if device.id() != self.engine.device.id() {
            return Err(Error::InvalidArgument(
                "a device buffer of another device (or backend) was given to this staging engine"
                    .into(),
            ));
        }
        Ok(())
    }

    fn check_range<T: Pod>(&self, buf: &DeviceBuffer<T>, at: usize, len: usize) -> Result<()> {
        match at.checked_add(len) {
            Some(end) if end <= buf.len() => Ok(()),
            end => Err(Error::OutOfBounds {
                start: at,
                end: end.unwrap_or(usize::MAX),
                len: buf.len(),
            }),
        }
    }
}

/// `OutOfBounds` for a range whose end is before its start.
fn ordered(range: &std::ops::Range<usize>, len: usize) -> Result<()> {
    if range.end < range.start {
        return Err(Error::OutOfBounds {
            start: range.start,
            end: range.end,
            len,
        });
    }
    Ok(())
}

/// Which way a staged copy goes, with the user's host memory or file.
#[derive(Clone, Copy)]
enum Dir {
    H2d(*const u8),
    D2h(*mut u8),
    /// From files (the copy's `files`); the pieces are its `segs`.
    FileIn,
    /// To a file (borrowed), from offset `at`.
    FileOut {
        file: *const std::fs::File,
        at: u64,
    },
}

impl Dir {
    /// Toward the device.
    fn is_upload(self) -> bool {
        matches!(self, Dir::H2d(_) | Dir::FileIn)
    }
}

/// One piece of a file read ([`Staging::read_file_pieces`]), of at least
/// one byte: `len` bytes of the file from `file_at` to device address
/// `dev`.
struct Seg<'a> {
    /// Its file: an index in the copy's `files`.
    file: usize,
    file_at: u64,
    dev: u64,
    len: usize,
    /// Offset of its first byte in the copy.
    start: usize,
    /// Where the run of pieces holding it (following each other in the
    /// file) ends, as an offset in the copy: a block never crosses it.
    run_end: usize,
    /// Where the chain of pieces holding it ends (pieces of its file that
    /// follow each other in the file or on the device): a gathered block
    /// never crosses it.
    join_end: usize,
    /// Its buffer's record of staged DMAs; `None` for a slice of device
    /// memory (the copy then waits for its DMAs when dropped).
    in_flight: Option<&'a InFlight>,
}

/// A file of a read: borrowed for the copy's life, with the `O_DIRECT`
/// descriptor of a direct read and its cuFile registration.
struct FileSrc<'a> {
    file: &'a std::fs::File,
    direct: Option<std::fs::File>,
    gds: Option<crate::io::gds::Registered>,
}

/// One piece of a file read by [`Staging::read_file_pieces`]: the file's
/// bytes from offset `at` into `dst[range]` (elements).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceBuffer, FileIo, FilePiece, Staging};
/// let path = std::env::temp_dir().join(format!("gpufeed-doc-pieces-{}", std::process::id()));
/// std::fs::write(&path, (0..=255u8).collect::<Vec<u8>>())?; // byte i is i
/// let device = Device::cpu();
/// let staging = Staging::new(&device)?;
/// let (mut a, mut b) = (DeviceBuffer::<u8>::new(&device, 16)?, DeviceBuffer::new(&device, 32)?);
/// let pieces = vec![
///     FilePiece { at: 0, dst: &mut a, range: 0..16 },   // bytes 0..16
///     FilePiece { at: 100, dst: &mut b, range: 0..32 }, // bytes 100..132
/// ];
/// let file = std::fs::File::open(&path)?;
/// staging.read_file_pieces_blocking(&file, pieces, FileIo::Auto)?; // one pass through the ring
/// let mut out = vec![0u8; 32];
/// b.copy_to_host_sync(&mut out)?;
/// assert_eq!((out[0], out[31]), (100, 131));
/// # std::fs::remove_file(&path)?;
/// # Ok(()) }
/// ```
pub struct FilePiece<'a, T: Pod> {
    /// Offset in the file of the piece's first byte.
    pub at: u64,
    /// The buffer the piece lands in (borrowed exclusively for the read).
    pub dst: &'a mut DeviceBuffer<T>,
    /// The elements of `dst` it fills.
    pub range: std::ops::Range<usize>,
}

/// The next block of a file read: `len` bytes of the copy from offset
/// `off` (file offset `file_at`), landing at `skew` in the block.
#[derive(Clone, Copy)]
struct BlockPlan {
    /// The file (an index in the copy's `files`).
    file: usize,
    file_at: u64,
    skew: usize,
    len: usize,
    /// A gathered block: several pieces of the file that follow each other
    /// on the device (one read each, buffered, one DMA).
    gather: bool,
}

/// A block lent to a copy, with the completion of its DMA.
struct Slot {
    block: PooledBuffer<u8>,
    done: Completion,
    /// Offset of its bytes in the copy, and their count.
    off: usize,
    len: usize,
}

/// A staged copy in progress ([`Staging::h2d`], [`Staging::d2h`]): a
/// future resolving to `Ok(())` when the data has arrived.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Error, StagedCopy, Staging};
/// let device = Device::cpu();
/// let staging = Staging::new(&device)?;
/// let data = vec![1u8; 4 << 20];
/// let mut dev = DeviceBuffer::<u8>::new(&device, data.len())?;
/// let copy: StagedCopy<'_> = staging.h2d(&data, &mut dev); // borrows both until done
/// assert_eq!(copy.file_io(), None); // not a file read
/// block_on(copy)?; // `copy.await?` in async code
/// let err = block_on(staging.h2d(&data[..10], &mut dev)).unwrap_err();
/// assert!(matches!(err, Error::LengthMismatch { expected: 4194304, got: 10, .. }));
/// # Ok(()) }
/// ```
///
/// # Cancel safety
/// See [`Staging::h2d`] and [`Staging::d2h`]: dropping it stops the copy
/// at once and never blocks; no thread touches the host slice afterwards.
#[must_use = "a staged copy does nothing unless awaited"]
pub struct StagedCopy<'a> {
    engine: Arc<Engine>,
    dir: Dir,
    /// Device address of the copy's first byte.
    dev: u64,
    total: usize,
    /// Next offset to fill and send (H2D) or to fetch (D2H).
    next: usize,
    ring: VecDeque<Slot>,
    /// The device buffer's record of staged DMAs (file reads: each
    /// piece's, in `segs`).
    in_flight: Option<&'a InFlight>,
    /// A file read's pieces (none empty), in the order they are read.
    segs: Vec<Seg<'a>>,
    /// Blocks taken for the next fill of a file read (no DMA on them).
    filling: Vec<PooledBuffer<u8>>,
    /// A copy to the device: the block filled last and its byte count,
    /// the bytes at `next`, not yet sent (it is sent while the workers
    /// fill the block after it).
    filled: Option<(PooledBuffer<u8>, usize)>,
    state: State,
    /// A file read: the way chosen ([`FileIo::Buffered`] or
    /// [`FileIo::Direct`]).
    file_io: Option<FileIo>,
    /// A file read's files (each reopened with `O_DIRECT` for reads of
    /// [`FileIo::Direct`]).
    files: Vec<FileSrc<'a>>,
    /// Every file registered with cuFile: read by GPUDirect Storage.
    gds: bool,
    /// Some piece lands in a slice of device memory that keeps no record
    /// of staged DMAs: dropping the copy waits for the DMAs it issued.
    waits_on_drop: bool,
    /// Borrows of the host slice and the device buffer (`Dir` holds the
    /// host pointer).
    _borrow: PhantomData<&'a mut [u8]>,
}

enum State {
    /// Refused before starting.
    Refused(Error),
    Running,
    Finished,
}

// SAFETY: the raw pointers are a borrow of the user's slice of `Pod` values
// (`&'a [T]`, which is `Send` for `T: Sync`, or `&'a mut [T]`, `Send` for
// `T: Send`; `Pod` values are both), used only inside `poll`.
unsafe impl Send for StagedCopy<'_> {}

impl<'a> StagedCopy<'a> {
    fn new(
        engine: &Arc<Engine>,
        dir: Dir,
        dev: u64,
        total: usize,
        in_flight: Option<&'a InFlight>,
    ) -> Self {
        StagedCopy {
            engine: engine.clone(),
            dir,
            dev,
            total,
            next: 0,
            ring: VecDeque::new(),
            in_flight,
            segs: Vec::new(),
            filling: Vec::new(),
            filled: None,
            state: State::Running,
            file_io: None,
            files: Vec::new(),
            gds: false,
            waits_on_drop: false,
            _borrow: PhantomData,
        }
    }

    /// For a file read, the way it reads the file: [`FileIo::Direct`] or
    /// [`FileIo::Buffered`] (what [`FileIo::Auto`] chose); `None` for other
    /// copies, and for a read refused or of no bytes.
    pub fn file_io(&self) -> Option<FileIo> {
        self.file_io
    }

    /// Whether this file read goes by GPUDirect Storage (cuFile, straight
    /// into device memory) rather than through the ring.
    pub fn uses_gds(&self) -> bool {
        self.gds
    }

    /// The whole read by cuFile, synchronously.
    fn read_by_gds(&mut self) -> Result<()> {
        crate::backend::cuda::bind(&*self.engine.device.backend)?;
        for seg in &self.segs {
            let Some(gds) = self.files.get(seg.file).and_then(|f| f.gds.as_ref()) else {
                return Err(Error::Internal(
                    "a GPUDirect Storage read without a handle".into(),
                ));
            };
            // SAFETY: each piece's device range was checked against its
            // buffer, borrowed exclusively for the copy (its earlier staged
            // DMAs were settled when the copy started); the engine's context
            // is current.
            unsafe { gds.read(seg.file_at, seg.dev, seg.len)? };
        }
        Ok(())
    }

    /// The index of the file read's piece holding copy offset `off`.
    fn seg_at(&self, off: usize) -> usize {
        self.segs.partition_point(|g| g.start + g.len <= off)
    }

    /// The block of a file read starting at copy offset `off`: up to a
    /// whole block, never past the end of the run of pieces (so its bytes
    /// follow each other in the file); for a direct read, the block holds
    /// the aligned range around them: its bytes start at the skew of their
    /// file offset and end at an aligned offset (or the run's end).
    fn plan_block(&self, off: usize) -> BlockPlan {
        let seg = &self.segs[self.seg_at(off)];
        let file_at = seg.file_at + (off - seg.start) as u64;
        let left = seg.run_end - off;
        let block_bytes = self.engine.config.block_bytes;
        if seg.join_end > seg.run_end && left < block_bytes {
            // The run ends inside the block and the pieces after it land
            // right after it on the device: gathered into this block.
            return BlockPlan {
                file: seg.file,
                file_at,
                skew: 0,
                len: (seg.join_end - off).min(block_bytes),
                gather: true,
            };
        }
        if self.files[seg.file].direct.is_some() {
            let align = DIRECT_IO_ALIGN as usize;
            let skew = (file_at % DIRECT_IO_ALIGN) as usize;
            let cap = block_bytes - block_bytes % align;
            BlockPlan {
                file: seg.file,
                file_at,
                skew,
                len: left.min(cap - skew),
                gather: false,
            }
        } else {
            BlockPlan {
                file: seg.file,
                file_at,
                skew: 0,
                len: left.min(block_bytes),
                gather: false,
            }
        }
    }

    /// The blocks the next fill of a file read covers: one for a buffered
    /// read or a gathered block; for a direct one, up to half the ring (at
    /// least one) of one file, read in one job of large requests while the
    /// DMAs of the other half run.
    fn plan_fill(&self) -> Vec<BlockPlan> {
        let first = self.plan_block(self.next);
        let most = if !first.gather && self.files[first.file].direct.is_some() {
            (self.engine.config.blocks / 2).max(1)
        } else {
            1
        };
        let mut plans = Vec::with_capacity(most);
        let mut off = self.next + first.len;
        plans.push(first);
        while plans.len() < most && off < self.total {
            let p = self.plan_block(off);
            if p.gather || p.file != first.file {
                break;
            }
            off += p.len;
            plans.push(p);
        }
        plans
    }

    /// Bytes of the piece of this copy of host memory that starts at `at`
    /// (see [`piece_len`]).
    fn piece_len(&self, at: usize) -> usize {
        let way = if self.dir.is_upload() {
            Way::ToDevice
        } else {
            Way::ToHost
        };
        piece_len(way, at, self.total, self.engine.config.block_bytes)
    }

    /// Runs the copy on the calling thread: a direct copy (or a refusal)
    /// ends in the first poll, without [`crate::block_on`]'s set-up; a
    /// staged one goes on under it.
    fn wait_here(mut self) -> Result<()> {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut self).poll(&mut cx) {
            Poll::Ready(r) => r,
            Poll::Pending => crate::base::block::block_on(self),
        }
    }

    fn fail_unless(&mut self, check: Result<()>) {
        if let (State::Running, Err(e)) = (&self.state, check) {
            self.state = State::Refused(e);
        }
    }

    fn or_fail(mut self, check: Result<()>) -> Self {
        if let Err(e) = check {
            self.state = State::Refused(e);
        }
        self
    }

    /// The route this copy takes (files: always the ring, whose reads and
    /// writes are the workers' own).
    fn route(&self) -> Route {
        let c = &self.engine.config;
        let below = match self.dir {
            Dir::H2d(_) => c.direct_h2d_below,
            Dir::D2h(_) => c.direct_d2h_below,
            Dir::FileIn | Dir::FileOut { .. } => return Route::Staged,
        };
        c.route_for(self.total, below)
    }

    /// The whole copy as one synchronous pageable copy by the driver.
    fn direct(&mut self) -> Result<()> {
        // SAFETY: the host range is the borrowed slice (exclusively for
        // device-to-host), valid for `total` bytes; the device range was
        // checked against the buffer, borrowed for the copy.
        unsafe { direct_copy(&self.engine.device, self.dir, self.dev, self.total) }
    }

    /// Fills `blocks` from the file as `plans` say (one plan each).
    fn fill_file(&self, blocks: &mut [PooledBuffer<u8>], plans: &[BlockPlan]) -> Result<()> {
        let Some(first) = plans.first() else {
            return Ok(());
        };
        let Some(src) = self.files.get(first.file) else {
            return Err(Error::Internal("fill_file of a copy from memory".into()));
        };
        let file = src.file;
        if first.gather {
            // One gathered block (plans of a fill after a gathered one are
            // never planned): the pieces at `next`, one read each.
            let Some(block) = blocks.first_mut() else {
                return Ok(());
            };
            return self.fill_gathered(file, self.next, &mut block.as_mut_slice()[..first.len]);
        }
        match &src.direct {
            Some(direct) => {
                let mut reads: Vec<crate::io::direct_io::DirectBlock<'_>> = blocks
                    .iter_mut()
                    .zip(plans)
                    .map(|(b, p)| crate::io::direct_io::DirectBlock {
                        at: p.file_at,
                        block: b.as_mut_slice(),
                        len: p.len,
                    })
                    .collect();
                crate::io::direct_io::read_blocks(&self.engine.workers, direct, file, &mut reads)
            }
            None => {
                for (b, p) in blocks.iter_mut().zip(plans) {
                    let dst = &mut b.as_mut_slice()[p.skew..p.skew + p.len];
                    self.engine.workers.read(file, p.file_at, dst)?;
                }
                Ok(())
            }
        }
    }

    /// Hands `block` (arrived from the device) to the destination at
    /// offset `off` (the user's slice, or the file).
    fn drain(&self, off: usize, block: &[u8]) -> Result<()> {
        match self.dir {
            Dir::D2h(dst) => {
                // SAFETY: `dst` is the exclusively borrowed slice of `total`
                // bytes, alive while this future lives; the piece lies in it.
                let piece = unsafe { std::slice::from_raw_parts_mut(dst.add(off), block.len()) };
                self.engine.workers.copy(block, piece)
            }
            Dir::FileOut { file, at } => {
                // SAFETY: the file is borrowed for the future's life.
                let file = unsafe { &*file };
                self.engine.workers.write(file, at + off as u64, block)
            }
            Dir::H2d(_) | Dir::FileIn => {
                Err(Error::Internal("drain of a copy toward the device".into()))
            }
        }
    }

    /// A block for the next piece: our oldest once its DMA is done, else
    /// one from the engine's ring. `None`: wait (the waker is registered
    /// with our oldest DMA or with the engine).
    fn next_block(&mut self, cx: &mut Context<'_>) -> Result<Option<PooledBuffer<u8>>> {
        loop {
            if self.ring.front().is_some_and(|s| s.done.is_done()) {
                if let Some(slot) = self.ring.pop_front() {
                    let result = slot.done.result().unwrap_or(Ok(()));
                    return match result {
                        Ok(()) => Ok(Some(slot.block)),
                        Err(e) => {
                            self.engine.give_back(slot.block);
                            Err(e)
                        }
                    };
                }
            }
            let held = self.ring.len() + self.filling.len() + usize::from(self.filled.is_some());
            if held < self.engine.config.blocks {
                let cx_if_idle = if self.ring.is_empty() {
                    Some(&mut *cx)
                } else {
                    None
                };
                if let Some(b) = self.engine.take(cx_if_idle)? {
                    return Ok(Some(b));
                }
            }
            match self.ring.front() {
                Some(front) => {
                    if front.done.poll_done(cx).is_pending() {
                        return Ok(None);
                    }
                }
                None => return Ok(None),
            }
        }
    }

    /// Sends `block` (filled for H2D) or fetches into it (D2H), for the
    /// piece at `self.next`, and records its completion.
    fn issue(&mut self, block: PooledBuffer<u8>, skew: usize, len: usize) -> Result<()> {
        if let Dir::FileIn = self.dir {
            return self.issue_file(block, skew, len);
        }
        let off = self.next;
        let dev = self.dev + off as u64;
        // Our own handle: the stream stays borrowed while `self` moves on.
        let engine = self.engine.clone();
        let stream = if self.dir.is_upload() {
            &engine.h2d
        } else {
            &engine.d2h
        };
        let raw = stream.raw();
        // SAFETY: the block is pinned memory of the engine, held in `ring`
        // (or deferred to the ring) until the completion recorded after the
        // DMA fires; `skew + len` lies within it (`fill` returned `skew` for
        // `len` bytes inside the block); the device range lies in the
        // borrowed buffer, whose `in_flight` record keeps its next use and
        // its free behind it.
        let issued = unsafe {
            if self.dir.is_upload() {
                raw.copy_h2d(dev, block.ptr().add(skew), len)
            } else {
                raw.copy_d2h(block.ptr(), dev, len)
            }
        };
        if let Err(e) = issued {
            self.engine.give_back(block);
            return Err(e);
        }
        let done = self.ring_block(raw, block, len)?;
        if let Some(f) = self.in_flight {
            f.push(done);
        }
        Ok(())
    }

    /// Records, on `raw`, the completion of the DMAs just issued from
    /// `block` for the `len` bytes at `self.next`, puts the block in the
    /// ring until it fires and moves on past them; returns the completion
    /// for the buffers to note. A failed record leaks the block: the DMAs'
    /// end can't be observed, so it is never reused.
    fn ring_block(
        &mut self,
        raw: &dyn crate::backend::RawStream,
        block: PooledBuffer<u8>,
        len: usize,
    ) -> Result<Completion> {
        let off = self.next;
        match raw.record(false) {
            Ok(ev) => {
                self.ring.push_back(Slot {
                    block,
                    done: ev.completion.clone(),
                    off,
                    len,
                });
                self.next += len;
                Ok(ev.completion)
            }
            Err(e) => {
                std::mem::forget(block);
                Err(e)
            }
        }
    }

    /// Sends `block` (filled from the file) for the bytes at `self.next`:
    /// one DMA per piece they cover, then one completion for all, noted on
    /// each piece's buffer.
    fn issue_file(&mut self, block: PooledBuffer<u8>, skew: usize, len: usize) -> Result<()> {
        let off = self.next;
        let engine = self.engine.clone();
        let raw = engine.h2d.raw();
        // The pieces the block covers touched by an issued DMA: `first..i`.
        let first = self.seg_at(off);
        let mut issued = Ok(());
        let (mut i, mut pos) = (first, off);
        while pos < off + len {
            // One DMA for the pieces that follow each other on the device.
            let dev = self.segs[i].dev + (pos - self.segs[i].start) as u64;
            let from = pos;
            let mut j = i;
            loop {
                let seg = &self.segs[j];
                pos = (seg.start + seg.len).min(off + len);
                j += 1;
                let next_follows = self.segs.get(j).is_some_and(|n| {
                    pos < off + len && seg.dev + seg.len as u64 == n.dev && n.start == pos
                });
                if !next_follows {
                    break;
                }
            }
            // SAFETY: the block is pinned memory of the engine, held in
            // `ring` (or deferred to the ring) until the completion recorded
            // after these DMAs fires; `skew + len` lies within it (the fill
            // put the plan's `len` bytes at `skew`); the device range is the
            // pieces `i..j`, which follow each other on the device, each in
            // its borrowed buffer or slice (checked when the read was made),
            // whose `in_flight` record (or the copy's wait on drop) keeps its
            // next use and its free behind the completion.
            issued = unsafe { raw.copy_h2d(dev, block.ptr().add(skew + from - off), pos - from) };
            if issued.is_err() {
                break;
            }
            i = j;
        }
        if i == first {
            self.engine.give_back(block);
            return issued;
        }
        let done = self.ring_block(raw, block, len)?;
        let mut noted: Option<*const InFlight> = None;
        for seg in &self.segs[first..i] {
            if let Some(f) = seg.in_flight {
                if noted != Some(f as *const InFlight) {
                    f.push(done.clone());
                    noted = Some(f);
                }
            }
        }
        issued
    }

    /// A file read: fills the next blocks (one, or half the ring for a
    /// direct read) and sends each.
    fn poll_file_in(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            if self.next >= self.total {
                return self.poll_last(cx);
            }
            let plans = self.plan_fill();
            // The blocks: ours once their DMA is done, or the engine's;
            // with one at least in hand, never a wait for the engine (two
            // copies each holding some would wait for each other).
            while self.filling.len() < plans.len() {
                match self.next_block(cx) {
                    Ok(Some(b)) => self.filling.push(b),
                    Ok(None) if self.filling.is_empty() || !self.ring.is_empty() => {
                        return Poll::Pending
                    }
                    Ok(None) => break,
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
            let mut blocks = std::mem::take(&mut self.filling);
            let plans = &plans[..blocks.len()];
            if let Err(e) = self.fill_file(&mut blocks, plans) {
                blocks.into_iter().for_each(|b| self.engine.give_back(b));
                return Poll::Ready(Err(e));
            }
            let mut blocks = blocks.into_iter();
            for p in plans {
                let Some(b) = blocks.next() else { break };
                if let Err(e) = self.issue(b, p.skew, p.len) {
                    blocks.for_each(|b| self.engine.give_back(b));
                    return Poll::Ready(Err(e));
                }
            }
        }
    }

    /// All sent toward the device: waits for the last DMA (the stream is
    /// in order, so its completion covers every DMA).
    fn poll_last(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let Some(last) = self.ring.back() else {
            return Poll::Ready(Ok(()));
        };
        match last.done.poll_done(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(r) => {
                while let Some(slot) = self.ring.pop_front() {
                    self.engine.give_back_when_done(slot);
                }
                Poll::Ready(r)
            }
        }
    }

    /// A copy to the device: each block is filled while the DMA of the
    /// block before it is issued (the driver's calls cost the workers
    /// nothing), and sent before any wait for a block.
    fn poll_h2d(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            let fill_at = self.next + self.filled.as_ref().map_or(0, |f| f.1);
            if fill_at >= self.total {
                if let Err(e) = self.send_filled() {
                    return Poll::Ready(Err(e));
                }
                return self.poll_last(cx);
            }
            let block = match self.next_block(cx) {
                Ok(Some(b)) => b,
                // No block yet: what is filled goes now, then wait (or
                // take the block its sending freed).
                Ok(None) if self.filled.is_some() => match self.send_filled() {
                    Ok(()) => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                },
                Ok(None) => return Poll::Pending,
                Err(e) => return Poll::Ready(Err(e)),
            };
            if let Err(e) = self.fill_sending(fill_at, block) {
                return Poll::Ready(Err(e));
            }
        }
    }

    /// Fills `block` with the piece at `fill_at` while the block filled
    /// before it is sent; on success it is the one filled.
    fn fill_sending(&mut self, fill_at: usize, mut block: PooledBuffer<u8>) -> Result<()> {
        let Dir::H2d(src) = self.dir else {
            self.engine.give_back(block);
            return Err(Error::Internal(
                "fill of a copy other than from host memory".into(),
            ));
        };
        let len = self.piece_len(fill_at);
        // SAFETY: `src` is the borrowed slice of `total` bytes, alive and
        // unchanged while this future lives; the piece lies in it.
        let piece = unsafe { std::slice::from_raw_parts(src.add(fill_at), len) };
        let engine = self.engine.clone();
        let (filled, sent) =
            engine
                .workers
                .copy_while(piece, &mut block.as_mut_slice()[..len], || {
                    self.send_filled()
                });
        match (filled, sent) {
            (Ok(()), Ok(())) => {
                self.filled = Some((block, len));
                Ok(())
            }
            (Err(e), _) | (Ok(()), Err(e)) => {
                self.engine.give_back(block);
                Err(e)
            }
        }
    }

    /// Sends the block filled last, if any.
    fn send_filled(&mut self) -> Result<()> {
        match self.filled.take() {
            Some((block, len)) => self.issue(block, 0, len),
            None => Ok(()),
        }
    }

    fn poll_d2h(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            // Fetch ahead into every block at hand.
            while self.next < self.total && self.ring.len() < self.engine.config.blocks {
                let cx_if_idle = if self.ring.is_empty() {
                    Some(&mut *cx)
                } else {
                    None
                };
                let block = match self.engine.take(cx_if_idle) {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(e) => return Poll::Ready(Err(e)),
                };
                let len = self.piece_len(self.next);
                if let Err(e) = self.issue(block, 0, len) {
                    return Poll::Ready(Err(e));
                }
            }
            let Some(front) = self.ring.front() else {
                // Nothing in flight: done, or waiting for a block (the
                // waker is registered with the engine).
                return if self.next >= self.total {
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                };
            };
            match front.done.poll_done(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
            }
            let Some(slot) = self.ring.pop_front() else {
                continue;
            };
            if let Err(e) = self.drain(slot.off, &slot.block.as_slice()[..slot.len]) {
                self.engine.give_back(slot.block);
                return Poll::Ready(Err(e));
            }
            if self.next < self.total {
                let len = self.piece_len(self.next);
                if let Err(e) = self.issue(slot.block, 0, len) {
                    return Poll::Ready(Err(e));
                }
            } else {
                self.engine.give_back(slot.block);
            }
        }
    }
}

impl Future for StagedCopy<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        match std::mem::replace(&mut this.state, State::Finished) {
            State::Refused(e) => return Poll::Ready(Err(e)),
            State::Finished => {
                return Poll::Ready(Err(Error::InvalidArgument(
                    "a staged copy polled after it finished".into(),
                )))
            }
            State::Running => this.state = State::Running,
        }
        let polled = if this.next == 0 && this.ring.is_empty() && this.gds {
            Poll::Ready(this.read_by_gds())
        } else if this.next == 0 && this.ring.is_empty() && this.route() == Route::Direct {
            Poll::Ready(this.direct())
        } else {
            if let Dir::FileIn = this.dir {
                this.poll_file_in(cx)
            } else if this.dir.is_upload() {
                this.poll_h2d(cx)
            } else {
                this.poll_d2h(cx)
            }
        };
        if polled.is_ready() {
            this.state = State::Finished;
        }
        polled
    }
}

impl Drop for StagedCopy<'_> {
    fn drop(&mut self) {
        // A read into slices of device memory (no record of staged DMAs):
        // its DMAs end before the borrow of those slices does.
        if self.waits_on_drop {
            for slot in &self.ring {
                let _ = slot.done.block();
            }
        }
        // DMAs still running read or write only their blocks and the device
        // buffer (which records them): the blocks go back when each is done.
        while let Some(slot) = self.ring.pop_front() {
            self.engine.give_back_when_done(slot);
        }
        // Blocks taken for a fill that never ran, or filled and not sent:
        // no DMA on them.
        for b in std::mem::take(&mut self.filling) {
            self.engine.give_back(b);
        }
        if let Some((b, _)) = self.filled.take() {
            self.engine.give_back(b);
        }
    }
}

// ---------------------------------------------------------------------
// Reads of many files into buffers or slices ([`Staging::read_files`]).
//
// Reads of many files through one staging engine, into buffers or slices
// of device memory ([`Staging::read_files`]): a model's shards in one
// stream through the ring, and strided pieces of a file (a column slice of
// a tensor) gathered into whole blocks before their DMA.
//
// The pieces of one read are planned as [`Staging::read_file_pieces`]
// plans its pieces: a block holds pieces that follow each other in one
// file (one `pread` for them, split among the workers), and never spans
// two files, so the ring stays full from one file into the next (the
// reads of the next file's first block overlap the DMA of the last
// block of the file before). Pieces of one file that follow each other on
// the device but not in the file (the rows of a column slice) are
// gathered: one block holds as many of them as it fits, each read by its
// own buffered `pread` (many in flight, spread over the workers), then
// sent by one DMA. A direct read ([`FileIo::Direct`]) reads gathered
// blocks buffered too: their pieces are not aligned.

/// Where a [`Staging::read_files`] lands: a device buffer (its record of
/// staged DMAs keeps its next use and its free behind them, as for every
/// staged copy) or a slice of device memory (a foreign allocation, say):
/// a read into slices waits, when dropped unfinished, for the DMAs it
/// issued (at most a ring of blocks), so none writes the slice after the
/// borrow ends.
pub struct ReadTarget<'a> {
    addr: u64,
    bytes: usize,
    device_id: usize,
    in_flight: Option<&'a InFlight>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> ReadTarget<'a> {
    /// The whole of `buf`, borrowed exclusively for the read.
    pub fn buffer<T: Pod>(buf: &'a mut DeviceBuffer<T>) -> ReadTarget<'a> {
        let (device, addr, in_flight) = buf.staging_parts();
        ReadTarget {
            addr,
            bytes: std::mem::size_of::<T>() * buf.len(),
            device_id: device.id(),
            in_flight: Some(in_flight),
            _borrow: PhantomData,
        }
    }

    /// A slice of device memory (a buffer's `view_mut`, or foreign memory
    /// through [`crate::interop::device_slice_mut`]), borrowed for the
    /// read.
    pub fn slice<T: Pod>(s: DeviceSliceMut<'a, T>) -> ReadTarget<'a> {
        ReadTarget {
            addr: s.addr,
            bytes: std::mem::size_of::<T>() * s.len,
            device_id: s.device_id,
            in_flight: None,
            _borrow: PhantomData,
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// One piece of a [`Staging::read_files`]: `len` bytes of `file` from
/// offset `at` into target number `target` from byte `offset`.
#[derive(Clone, Copy, Debug)]
pub struct FileRange<'a> {
    /// The file (borrowed for the read; pieces of one file name the same
    /// `File`).
    pub file: &'a std::fs::File,
    /// Offset in the file of the piece's first byte.
    pub at: u64,
    /// Index of its target in the read's targets.
    pub target: usize,
    /// Offset in the target of the piece's first byte.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Staging {
    /// Reads `ranges` (pieces of one or more files) into `targets` in one
    /// stream through the ring, in the order given: the pieces of several
    /// files (a model's shards) flow through the blocks without a pause
    /// between files, and pieces of one file that follow each other on the
    /// device (the rows of a column slice, in order) are gathered into
    /// whole blocks, one `pread` each, one DMA per block. `io` as for
    /// [`Staging::read_file_with`], decided per file (gathered blocks are
    /// read buffered).
    ///
    /// # Errors
    /// Every piece is checked before any byte is read: `OutOfBounds` for a
    /// piece outside its target (or a target index past `targets`),
    /// `InvalidArgument` for a target of another device or a file range
    /// past `u64::MAX`. As [`Staging::read_file_with`] otherwise (a file
    /// that ends before its last piece is full is `UnexpectedEof`; the
    /// targets then hold unspecified data).
    ///
    /// # Cancel safety
    /// As [`Staging::read_file`]; a read into slices waits, when dropped,
    /// for the DMAs it issued (see [`ReadTarget`]).
    pub fn read_files<'a>(
        &'a self,
        targets: Vec<ReadTarget<'a>>,
        ranges: &[FileRange<'a>],
        io: FileIo,
    ) -> StagedCopy<'a> {
        let device_id = self.engine.device.id();
        let mut check = Ok(());
        let mut fail = |e: Error| {
            if check.is_ok() {
                check = Err(e);
            }
        };
        if targets.iter().any(|t| t.device_id != device_id) {
            fail(Error::InvalidArgument(
                "a read target of another device (or backend) was given to this staging engine"
                    .into(),
            ));
        }
        let mut files: Vec<&'a std::fs::File> = Vec::new();
        let mut segs: Vec<Seg<'a>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            let Some(t) = targets.get(r.target) else {
                fail(Error::OutOfBounds {
                    start: r.target,
                    end: r.target.saturating_add(1),
                    len: targets.len(),
                });
                continue;
            };
            let end = r.offset.checked_add(r.len);
            match end {
                Some(end) if end <= t.bytes => {}
                _ => {
                    fail(Error::OutOfBounds {
                        start: r.offset,
                        end: end.unwrap_or(usize::MAX),
                        len: t.bytes,
                    });
                    continue;
                }
            }
            // Files by identity: the last one first (pieces of one file
            // usually come together).
            let file = match files.iter().rposition(|f| std::ptr::eq(*f, r.file)) {
                Some(i) => i,
                None => {
                    files.push(r.file);
                    files.len() - 1
                }
            };
            segs.push(Seg {
                file,
                file_at: r.at,
                dev: t.addr + r.offset as u64,
                len: r.len,
                start: 0,
                run_end: 0,
                join_end: 0,
                in_flight: t.in_flight,
            });
        }
        self.file_read(files, segs, check, io)
    }

    /// [`Staging::read_files`] for synchronous code: returns when every
    /// piece is on the device (or the read failed and its DMAs are over).
    ///
    /// # Errors
    /// As [`Staging::read_files`].
    pub fn read_files_blocking<'a>(
        &'a self,
        targets: Vec<ReadTarget<'a>>,
        ranges: &[FileRange<'a>],
        io: FileIo,
    ) -> Result<()> {
        crate::base::block::block_on(self.read_files(targets, ranges, io))
    }
}

impl StagedCopy<'_> {
    /// Fills `block` with the pieces of a gathered block at copy offset
    /// `off` (all of `file`, following each other on the device): pieces
    /// that follow each other in the file are read together, the rest each
    /// by its own buffered `pread`, spread over the workers.
    fn fill_gathered(&self, file: &std::fs::File, off: usize, block: &mut [u8]) -> Result<()> {
        let len = block.len();
        // (file offset, bytes) of each read, in block order.
        let mut reads: Vec<(u64, usize)> = Vec::new();
        let (mut i, mut pos) = (self.seg_at(off), off);
        while pos < off + len {
            let Some(seg) = self.segs.get(i) else {
                return Err(Error::Internal(
                    "a gathered block past the read's pieces".into(),
                ));
            };
            let at = seg.file_at + (pos - seg.start) as u64;
            let n = (seg.start + seg.len).min(off + len) - pos;
            match reads.last_mut() {
                Some((a, l)) if *a + *l as u64 == at => *l += n,
                _ => reads.push((at, n)),
            }
            pos += n;
            i += 1;
        }
        let mut parts = Vec::with_capacity(reads.len());
        let mut rest = block;
        for (at, n) in reads {
            let (dst, tail) = rest.split_at_mut(n);
            parts.push(crate::base::workers::ReadPart { at, dst });
            rest = tail;
        }
        self.engine.workers.read_scattered(file, &mut parts)
    }
}

#[cfg(test)]
mod piece_tests {
    use super::{piece_len, Way, RAMP_PIECE};

    /// The pieces of a whole copy, as `StagedCopy` takes them.
    fn pieces(way: Way, total: usize, block: usize) -> Vec<usize> {
        let (mut at, mut out) = (0, vec![]);
        while at < total {
            let n = piece_len(way, at, total, block);
            assert!(n > 0 && n <= block, "piece of {n} bytes at {at}");
            out.push(n);
            at += n;
        }
        out
    }

    #[test]
    fn host_to_device_pieces_start_small_and_double_to_a_block() {
        const M: usize = 1 << 20;
        assert_eq!(
            pieces(Way::ToDevice, 40 * M, 8 * M),
            [M, M, 2 * M, 4 * M, 8 * M, 8 * M, 8 * M, 8 * M]
        );
        assert_eq!(pieces(Way::ToDevice, M / 2, 8 * M), [M / 2]);
        assert_eq!(pieces(Way::ToDevice, 3 * M + 5, 8 * M), [M, M, M + 5]);
    }

    #[test]
    fn device_to_host_pieces_halve_toward_the_end() {
        const M: usize = 1 << 20;
        assert_eq!(
            pieces(Way::ToHost, 40 * M, 8 * M),
            [8 * M, 8 * M, 8 * M, 8 * M, 4 * M, 2 * M, M, M]
        );
        assert_eq!(pieces(Way::ToHost, M / 2, 8 * M), [M / 2]);
    }

    #[test]
    fn pieces_cover_every_byte_once_whatever_the_sizes() {
        let mut rng = fastrand::Rng::with_seed(0x91ec);
        for _ in 0..2000 {
            let block = rng.usize(4096..=64 << 20);
            let total = rng.usize(0..=1 << 30);
            for way in [Way::ToDevice, Way::ToHost] {
                let p = pieces(way, total, block);
                assert_eq!(p.iter().sum::<usize>(), total);
                // Never smaller than a ramp piece or a block, except the last.
                let least = RAMP_PIECE.min(block);
                assert!(p.iter().rev().skip(1).all(|&n| n >= least));
            }
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::{Route, StagingConfig};

    fn config(block_bytes: usize, blocks: usize) -> StagingConfig {
        StagingConfig {
            block_bytes,
            blocks,
            threads: 1,
            route: Route::Auto,
            direct_h2d_below: 0,
            direct_d2h_below: 0,
        }
    }

    #[test]
    fn the_bound_counts_each_block_at_the_pools_size_class() {
        // (block_bytes, what the pool hands out for it), written out.
        for (block, class) in [
            (4096, 4096),
            (4097, 8192),
            (12289, 16384),
            ((64 << 10) + 4, 72 << 10),
            (8 << 20, 8 << 20),
            (12 << 20, 12 << 20),
            ((8 << 20) + 1, 9 << 20),
        ] {
            assert_eq!(config(block, 3).total_bytes(), 3 * class, "{block}");
            assert_eq!(crate::runtime::pool::size_class(block), class, "{block}");
        }
    }

    #[test]
    fn a_ring_whose_bound_overflows_is_refused() {
        assert!(config(usize::MAX / 2, 3).check().is_err());
        assert!(config(8 << 20, usize::MAX / (8 << 20)).check().is_err());
        assert!(config(8 << 20, 4).check().is_ok());
    }
}
