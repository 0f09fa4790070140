//! `PinnedPool`: a caching allocator of pinned host memory.
//!
//! Pinned allocation costs the driver tens to hundreds of milliseconds per
//! GiB, far too slow for a hot path; the pool keeps freed blocks and hands
//! them out again in about a microsecond.
//!
//! - Stream-aware reuse: a pool buffer in flight is owned by its [`Job`]
//!   (crate::Job), and a job that is dropped early releases its buffers from
//!   the completion source when the GPU is done. So a block returns to the
//!   free list only after all GPU work on it has completed, with no blocking
//!   on drop and no polling at the next allocation (unlike PyTorch's
//!   CachingHostAllocator, which queries events lazily when allocating).
//! - Size classes: 4 KiB minimum, then eight classes per power of two, so a
//!   block wastes less than 1/8 of its size; a request may take a cached
//!   block up to 1/4 larger than its class (best fit) before going to the
//!   driver, so mixed sizes converge on a stable set of blocks.
//! - No driver call under a lock: the free lists are locked only to push or
//!   pop a block; allocation and freeing by the driver happen outside.
//! - Statistics, a cap on cached bytes, and `empty_cache`. By default the
//!   cache holds at most as many bytes as were ever in use at once, and at
//!   least [`DEFAULT_CACHE_FLOOR`]: a program's pinned memory stays within
//!   twice its peak need, and a steady workload never misses. A block
//!   returned beyond the cap is freed at once, and an allocation that
//!   misses while the cache is at its cap first frees idle blocks (largest
//!   first) to make room for its block, so the cache follows the working
//!   set: a cache full of idle blocks of an old size doesn't make every
//!   allocation of a new size miss.

use crate::backend::{HostAlloc, HostFlags};
use crate::base::completion::lock;
use crate::base::error::{byte_size, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::{
    check_align, host_slice, host_slice_mut, raw_slice, raw_slice_mut, HostSlice, HostSliceMut,
    PinnedHost,
};
use bytemuck::Pod;
use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Smallest block handed out.
pub const MIN_BLOCK: usize = 4096;

/// The default cap on cached bytes never falls below this (64 MiB): the
/// cap is the larger of this and the peak bytes in use so far.
pub const DEFAULT_CACHE_FLOOR: usize = 64 << 20;

/// The block size serving a request of `bytes`: at least [`MIN_BLOCK`], then
/// rounded up to a multiple of 1/8 of the power of two below it (waste < 12.5%).
pub fn size_class(bytes: usize) -> usize {
    if bytes <= MIN_BLOCK {
        return MIN_BLOCK;
    }
    let pow = 1usize << (usize::BITS - 1 - bytes.leading_zeros());
    let step = (pow / 8).max(MIN_BLOCK);
    bytes.div_ceil(step).saturating_mul(step)
}

/// Pool statistics (a snapshot).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, PinnedPool, PoolStats};
/// let pool = PinnedPool::new(&Device::cpu());
/// let buf = pool.alloc::<u8>(10_000)?;
/// let stats: PoolStats = pool.stats();
/// assert_eq!(stats.blocks_in_use, 1);
/// assert_eq!(stats.in_use_bytes, buf.block_bytes() as u64); // its size class: 12 KiB
/// drop(buf); // back to the cache
/// assert_eq!(pool.stats().cached_bytes, stats.in_use_bytes);
/// pool.empty_cache();
/// assert_eq!((pool.stats().cached_bytes, pool.stats().driver_frees), (0, 1));
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PoolStats {
    /// Bytes in blocks handed out now.
    pub in_use_bytes: u64,
    /// Bytes in free blocks kept for reuse.
    pub cached_bytes: u64,
    /// Most bytes in use at once.
    pub peak_in_use_bytes: u64,
    /// Blocks currently handed out.
    pub blocks_in_use: u64,
    /// Allocations served from the cache.
    pub hits: u64,
    /// Allocations that went to the driver.
    pub misses: u64,
    /// Driver allocations and frees made.
    pub driver_allocs: u64,
    /// Driver frees made (those that succeeded).
    pub driver_frees: u64,
    /// Driver frees that failed: the block is lost to the pool (and
    /// possibly leaked); each is also counted in
    /// [`Device::release_failures`](crate::Device::release_failures) and
    /// logged.
    pub failed_frees: u64,
    /// The cap on cached bytes in force now (the default one follows the
    /// peak in use; `u64::MAX`: none).
    pub max_cached_bytes: u64,
    /// Nanoseconds spent in driver allocation.
    pub driver_alloc_ns: u64,
    /// Nanoseconds spent in driver free.
    pub driver_free_ns: u64,
}

#[derive(Default)]
struct Counters {
    in_use: AtomicU64,
    cached: AtomicU64,
    peak: AtomicU64,
    blocks: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
    failed_frees: AtomicU64,
    alloc_ns: AtomicU64,
    free_ns: AtomicU64,
}

struct Block {
    alloc: HostAlloc,
}
// SAFETY: a block is exclusively owned pinned memory; moving it between threads is fine.
unsafe impl Send for Block {}

struct Inner {
    device: Device,
    flags: HostFlags,
    /// The NUMA node blocks are placed on (`None`: where the driver puts them).
    node: Option<u32>,
    free: Mutex<BTreeMap<usize, Vec<Block>>>,
    /// A cap set by [`PinnedPool::set_max_cached_bytes`]; unused while
    /// `default_cap` holds.
    max_cached: AtomicUsize,
    /// The default cap: the larger of [`DEFAULT_CACHE_FLOOR`] and the peak in use.
    default_cap: AtomicBool,
    c: Counters,
}

impl Inner {
    /// The cap on cached bytes in force now.
    fn cap(&self) -> usize {
        if self.default_cap.load(Ordering::Relaxed) {
            let peak = self.c.peak.load(Ordering::Relaxed);
            DEFAULT_CACHE_FLOOR.max(usize::try_from(peak).unwrap_or(usize::MAX))
        } else {
            self.max_cached.load(Ordering::Relaxed)
        }
    }
}

/// A caching allocator of pinned host memory; cheap to clone, safe from many threads.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, PinnedPool};
/// let pool = PinnedPool::new(&Device::cpu());
/// let mut a = pool.alloc::<f32>(1000)?; // the driver's allocation: slow
/// a.as_mut_slice().fill(1.0);
/// drop(a); // back to the pool, not to the driver
/// let b = pool.alloc::<f32>(1000)?; // from the cache: well under a microsecond
/// assert_eq!(b.len(), 1000);
/// let stats = pool.stats();
/// assert_eq!((stats.misses, stats.hits), (1, 1));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl PinnedPool {
    /// A pool of portable pinned memory, with the default cap on cached
    /// bytes (the larger of [`DEFAULT_CACHE_FLOOR`] and the peak in use).
    pub fn new(device: &Device) -> Self {
        Self::with_flags(device, HostFlags::DEFAULT)
    }

    /// A pool whose blocks are allocated with `flags`.
    pub fn with_flags(device: &Device, flags: HostFlags) -> Self {
        Self::build(device, flags, None)
    }

    /// A pool whose blocks sit on NUMA node `node` of the host: each block's
    /// pages are bound to the node before they are first touched, then
    /// pinned in place (`cuMemHostRegister` on CUDA). An allocation fails
    /// with `InvalidArgument` naming the node when the host has no such
    /// node online. The override of [`PinnedPool::near`].
    pub fn on_node(device: &Device, node: u32) -> Self {
        Self::build(device, HostFlags::DEFAULT, Some(node))
    }

    /// A pool whose blocks sit on the NUMA node closest to `device`
    /// ([`Device::numa_node`]), so its copies do not cross the link between
    /// sockets; the same as [`PinnedPool::new`] when the host has one node
    /// or the node is unknown (the platform says `-1`, as VMs do).
    pub fn near(device: &Device) -> Self {
        let node = device
            .numa_node()
            .filter(|_| crate::base::numa::online_nodes().len() > 1);
        Self::build(device, HostFlags::DEFAULT, node)
    }

    /// The NUMA node this pool places its blocks on (`None`: the driver's
    /// placement, usually the node of the thread that allocates).
    pub fn node(&self) -> Option<u32> {
        self.inner.node
    }

    fn build(device: &Device, flags: HostFlags, node: Option<u32>) -> Self {
        PinnedPool {
            inner: Arc::new(Inner {
                device: device.clone(),
                flags,
                node,
                free: Mutex::new(BTreeMap::new()),
                max_cached: AtomicUsize::new(usize::MAX),
                default_cap: AtomicBool::new(true),
                c: Counters::default(),
            }),
        }
    }

    /// Caps the bytes kept in free blocks at `bytes` (`usize::MAX`: no
    /// cap), replacing the default cap; cached blocks beyond it are freed
    /// now, and blocks returned beyond it are freed on return.
    pub fn set_max_cached_bytes(&self, bytes: usize) {
        self.inner.max_cached.store(bytes, Ordering::Relaxed);
        self.inner.default_cap.store(false, Ordering::Relaxed);
        self.trim(bytes);
    }

    /// A buffer of `len` values. Contents are unspecified (a reused block keeps
    /// old data; a fresh one is zeroed).
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<PooledBuffer<T>> {
        check_align::<T>()?;
        let bytes = byte_size::<T>(len)?;
        let class = size_class(bytes);
        let c = &self.inner.c;
        // Best fit: the smallest cached block of this class or up to two
        // classes above (at most 1/4 more), so a mix of sizes reuses what the
        // cache holds instead of pinning more memory for each class.
        let reused = {
            let mut free = lock(&self.inner.free);
            free.range_mut(class..=class + class / 4)
                .find_map(|(_, blocks)| blocks.pop())
        };
        let block = match reused {
            Some(b) => {
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.cached.fetch_sub(b.alloc.bytes as u64, Ordering::Relaxed);
                b
            }
            None => {
                c.misses.fetch_add(1, Ordering::Relaxed);
                // A cache at its cap would free this block on return, and
                // every allocation of this size would miss again: make room
                // now by freeing idle blocks (largest first), so the cache
                // follows the working set instead of jamming on old sizes.
                let cap = self.inner.cap();
                if (c.cached.load(Ordering::Relaxed) as usize).saturating_add(class) > cap {
                    self.trim(cap.saturating_sub(class));
                }
                let t = Instant::now();
                let alloc = self.inner.device.backend.alloc_host(
                    class,
                    self.inner.flags,
                    self.inner.node,
                )?;
                c.alloc_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                c.allocs.fetch_add(1, Ordering::Relaxed);
                // SAFETY: a fresh allocation of `class` bytes: zero it so every
                // element is initialised.
                unsafe { std::ptr::write_bytes(alloc.ptr, 0, class) };
                Block { alloc }
            }
        };
        let size = block.alloc.bytes as u64;
        let now = c.in_use.fetch_add(size, Ordering::Relaxed) + size;
        c.peak.fetch_max(now, Ordering::Relaxed);
        c.blocks.fetch_add(1, Ordering::Relaxed);
        Ok(PooledBuffer {
            block: Some(block),
            len,
            pool: self.inner.clone(),
            _t: PhantomData,
        })
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> PoolStats {
        let c = &self.inner.c;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PoolStats {
            in_use_bytes: l(&c.in_use),
            cached_bytes: l(&c.cached),
            peak_in_use_bytes: l(&c.peak),
            blocks_in_use: l(&c.blocks),
            hits: l(&c.hits),
            misses: l(&c.misses),
            driver_allocs: l(&c.allocs),
            driver_frees: l(&c.frees),
            failed_frees: l(&c.failed_frees),
            driver_alloc_ns: l(&c.alloc_ns),
            driver_free_ns: l(&c.free_ns),
            max_cached_bytes: u64::try_from(self.inner.cap()).unwrap_or(u64::MAX),
        }
    }

    /// Frees every cached block (blocks in use are untouched).
    pub fn empty_cache(&self) {
        self.trim(0);
    }

    fn trim(&self, keep: usize) {
        let mut victims = Vec::new();
        {
            let mut free = lock(&self.inner.free);
            let mut cached = self.inner.c.cached.load(Ordering::Relaxed) as usize;
            // Largest blocks first: fewest driver calls to get under the cap.
            while cached > keep {
                let Some(mut entry) = free.last_entry() else {
                    break;
                };
                match entry.get_mut().pop() {
                    Some(b) => {
                        cached -= b.alloc.bytes;
                        self.inner
                            .c
                            .cached
                            .fetch_sub(b.alloc.bytes as u64, Ordering::Relaxed);
                        victims.push(b);
                    }
                    None => {
                        entry.remove();
                    }
                }
            }
        }
        for b in victims {
            self.inner.free_block(b); // outside the lock
        }
    }
}

impl Inner {
    fn free_block(&self, b: Block) {
        let t = Instant::now();
        // SAFETY: the block came from this backend and nobody uses it any more.
        let r = unsafe { self.device.backend.free_host(&b.alloc) };
        self.c
            .free_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match r {
            Ok(()) => self.c.frees.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                let failures = self.device.backend.release_failures();
                failures.note("freeing a pooled pinned block", &e);
                self.c.failed_frees.fetch_add(1, Ordering::Relaxed)
            }
        };
    }

    fn give_back(&self, b: Block) {
        let class = b.alloc.bytes;
        self.c.in_use.fetch_sub(class as u64, Ordering::Relaxed);
        self.c.blocks.fetch_sub(1, Ordering::Relaxed);
        let cap = self.cap();
        let cached = self.c.cached.load(Ordering::Relaxed) as usize;
        if cached.saturating_add(class) > cap {
            self.free_block(b);
            return;
        }
        self.c.cached.fetch_add(class as u64, Ordering::Relaxed);
        lock(&self.free).entry(class).or_default().push(b);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let blocks: Vec<Block> = std::mem::take(&mut *lock(&self.free))
            .into_values()
            .flatten()
            .collect();
        for b in blocks {
            self.free_block(b);
        }
    }
}

/// A pinned buffer on loan from a [`PinnedPool`]; returns to it on drop.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, PinnedPool, PooledBuffer, Stream};
/// let device = Device::cpu();
/// let pool = PinnedPool::new(&device);
/// let mut buf: PooledBuffer<u32> = pool.alloc(1000)?;
/// buf.as_mut_slice().fill(7); // a reused block keeps old data: write before reading
/// assert!(buf.block_bytes() >= 4000);
/// // Pinned memory: a job's buffer, back to the pool when dropped.
/// let (stream, dev) = (Stream::new(&device)?, DeviceBuffer::<u32>::new(&device, 1000)?);
/// let ((buf, mut dev), ()) = block_on(stream.copy_h2d(buf, dev))?;
/// let mut out = vec![0u32; 1000];
/// dev.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, buf.as_slice());
/// # Ok(()) }
/// ```
pub struct PooledBuffer<T: Pod> {
    block: Option<Block>,
    len: usize,
    pool: Arc<Inner>,
    _t: PhantomData<T>,
}

// SAFETY: owns its block exclusively; T: Pod.
unsafe impl<T: Pod> Send for PooledBuffer<T> {}
// SAFETY: shared access only reads.
unsafe impl<T: Pod> Sync for PooledBuffer<T> {}

impl<T: Pod> std::fmt::Debug for PooledBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Pod> PooledBuffer<T> {
    pub(crate) fn ptr(&self) -> *mut T {
        self.block
            .as_ref()
            .map_or(std::ptr::null_mut(), |b| b.alloc.ptr.cast())
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the block is page-locked: always on CUDA; false only on the
    /// CPU emulation when locking was refused and the device's
    /// [`LockPolicy`](crate::LockPolicy) allowed unlocked memory.
    pub fn is_locked(&self) -> bool {
        self.block.as_ref().is_some_and(|b| b.alloc.locked)
    }

    /// The NUMA node holding the buffer's pages, asked of the kernel
    /// (`get_mempolicy`), not assumed: `None` when they are spread over
    /// several nodes or the buffer is empty.
    ///
    /// # Errors
    /// The system error (`ENOSYS` on a kernel without NUMA support).
    pub fn numa_node(&self) -> Result<Option<u32>> {
        match &self.block {
            // SAFETY: the block's mapping is ours and its pages are touched
            // (zeroed at allocation).
            Some(b) => unsafe { crate::base::numa::node_of_range(b.alloc.ptr, b.alloc.bytes) },
            None => Ok(None),
        }
    }

    /// Bytes of the block serving the buffer (its size class).
    pub fn block_bytes(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.alloc.bytes)
    }

    /// The contents.
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: len values inside the block (len*size <= class), initialised.
        unsafe { raw_slice(self.ptr(), self.len) }
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, exclusive through &mut self.
        unsafe { raw_slice_mut(self.ptr(), self.len) }
    }

    /// Address of the first element (for tests of reuse; a test hook).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn as_ptr(&self) -> *const T {
        self.ptr()
    }
}

impl<T: Pod> Drop for PooledBuffer<T> {
    fn drop(&mut self) {
        if let Some(b) = self.block.take() {
            self.pool.give_back(b);
        }
    }
}

impl<T: Pod> PinnedHost<T> for PooledBuffer<T> {
    fn host(&self) -> HostSlice<'_, T> {
        host_slice(self.ptr(), self.len, self.pool.device.host_domain())
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        host_slice_mut(self.ptr(), self.len, self.pool.device.host_domain())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_bound_waste_below_one_eighth() {
        let mut prev = 0;
        for bytes in (1..(1 << 22))
            .step_by(997)
            .chain([1 << 30, (1 << 30) + 1, 3 << 29])
        {
            let c = size_class(bytes);
            assert!(c >= bytes);
            assert!(c >= MIN_BLOCK);
            if bytes > MIN_BLOCK {
                assert!((c - bytes) * 8 < c.max(8 * MIN_BLOCK), "{bytes} -> {c}");
            }
            assert!(c >= prev, "classes are monotone");
            prev = c;
        }
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), (1 << 20) + (1 << 17));
    }
}
