//! The one interface both backends implement: raw memory, streams, events and
//! launches over byte addresses. The safe types (`PinnedBuffer`,
//! `DeviceBuffer`, `Stream`, ...) are built on it, so everything works the same
//! on the CUDA driver and on the CPU emulation.
//!
//! Device addresses are `u64` on both backends (on the CPU, a host address).
//! The commands the backends execute are described here too ([`RawLaunch`],
//! [`RawCopy`]): the safe layer above builds them from checked views.

pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod ptx_entries;

use crate::base::completion::Completion;
use crate::base::error::Result;
pub(crate) use crate::base::fork::Generation;
use std::any::Any;
use std::sync::Arc;

/// Which backend runs the work.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendKind, Device};
/// let device = Device::from_env()?; // CUDA when present, else the CPU emulation
/// match device.kind() {
///     BackendKind::Cuda => println!("on a GPU: {}", device.info().name),
///     BackendKind::Cpu => println!("on the CPU emulation"),
/// }
/// assert_eq!(Device::cpu().kind(), BackendKind::Cpu);
/// assert_eq!(BackendKind::Cpu.to_string(), "cpu-emulation");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
pub enum BackendKind {
    /// The CUDA driver (through cudarc, loaded at run time).
    Cuda,
    /// The CPU emulation: locked host memory, worker-thread streams.
    Cpu,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Cpu => "cpu-emulation",
        })
    }
}

/// Host allocation flags (driver semantics; the CPU backend records them).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, HostFlags, PinnedBuffer};
/// let device = Device::cpu();
/// // A buffer the CPU only writes and the GPU only reads: write-combined.
/// let flags = HostFlags { write_combined: true, ..HostFlags::DEFAULT };
/// let upload = PinnedBuffer::<f32>::with_flags(&device, 1024, flags)?;
/// assert_eq!(upload.flags(), flags);
/// assert!(upload.flags().portable); // kept from `DEFAULT` (`default()` has it off)
/// assert_eq!(PinnedBuffer::<f32>::new(&device, 1)?.flags(), HostFlags::DEFAULT);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct HostFlags {
    /// Pinned for every context, not only the allocating one (default: on).
    pub portable: bool,
    /// Write-combined: faster host writes and PCIe reads by the GPU, but CPU
    /// reads are uncached and very slow. Only for buffers the CPU only writes.
    pub write_combined: bool,
    /// Mapped into the device address space: kernels can read and write it
    /// over PCIe (zero-copy). Costs nothing to set on 64-bit unified addressing.
    pub device_mapped: bool,
}

impl HostFlags {
    /// Portable, cached, not mapped: right for staging buffers.
    pub const DEFAULT: HostFlags = HostFlags {
        portable: true,
        write_combined: false,
        device_mapped: false,
    };
}

/// A raw host allocation made by a backend.
#[derive(Debug)]
pub(crate) struct HostAlloc {
    pub ptr: *mut u8,
    pub bytes: usize,
    /// False when the CPU backend fell back to unlocked memory.
    pub locked: bool,
    /// Placed on a NUMA node: an anonymous mapping (bound to the node, then
    /// locked or registered), not the driver's own allocation.
    pub placed: bool,
}

/// Device-info shown in banners and results.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendKind, Device, DeviceInfo};
/// let device = Device::cpu();
/// let info: &DeviceInfo = device.info();
/// assert_eq!(info.backend, BackendKind::Cpu);
/// assert_eq!(info.driver, None); // a GPU: `Some("13.0")`, say
/// assert!(info.compute_units >= 1); // the emulation's worker threads
/// assert!(info.total_memory > 0);
/// assert!(!info.stream_ordered_memory);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct DeviceInfo {
    /// Backend kind.
    pub backend: BackendKind,
    /// GPU name, or a CPU description.
    pub name: String,
    /// Driver version (`13.0`), or `None` on the CPU backend.
    pub driver: Option<String>,
    /// Multiprocessors (GPU) or worker threads (CPU).
    pub compute_units: u32,
    /// Device memory in bytes (CPU backend: physical memory).
    pub total_memory: u64,
    /// Device ordinal.
    pub ordinal: usize,
    /// Device memory is stream-ordered ([`crate::DeviceMemory`]); false on
    /// the CPU emulation, whose frees never wait.
    pub stream_ordered_memory: bool,
    /// What a kernel launch may ask of this device.
    pub limits: LaunchLimits,
    /// The GPU's compute capability (`(9, 0)` for an H100); `None` on the
    /// CPU emulation, which runs every kernel.
    pub compute_capability: Option<(u32, u32)>,
}

/// The largest launch a device runs: a launch beyond any of these is
/// refused before anything is queued (`Error::InvalidLaunch`). The CUDA
/// backend reads them from the driver; the CPU emulation has a GPU's
/// (an H100's shared memory), so that a launch one backend refuses the
/// other refuses too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct LaunchLimits {
    /// Threads in a block, all dimensions together (1024).
    pub max_threads_per_block: u32,
    /// Threads in a block along x, y, z (1024, 1024, 64).
    pub max_block_dims: [u32; 3],
    /// Blocks in the grid along x, y, z (2^31 - 1, 65535, 65535).
    pub max_grid_dims: [u32; 3],
    /// Shared memory a block may have, static and dynamic together, with
    /// the opt-in above the default 48 KiB (227 KiB on an H100).
    pub max_shared_bytes_per_block: u32,
}

impl LaunchLimits {
    /// CUDA's limits from compute capability 7.0 on, with an H100's
    /// shared memory per block: what the CPU emulation enforces.
    pub const GPU: LaunchLimits = LaunchLimits {
        max_threads_per_block: 1024,
        max_block_dims: [1024, 1024, 64],
        max_grid_dims: [i32::MAX as u32, 65535, 65535],
        max_shared_bytes_per_block: 227 * 1024,
    };
}

/// The completion threads of dropped streams still finishing their queues.
///
/// A stream dropped on a completion thread (in the release of a cancelled
/// job whose bundle held its last handle) is not joined there: that thread
/// may be the one the stream's own work waits for, and joining would wait
/// forever. Its completion thread drains its queue on its own, counted here
/// until it exits, so the backend's `synchronize` (and so
/// [`Device::synchronize`](crate::Device::synchronize)) still waits for it.
pub(crate) struct Draining {
    count: std::sync::Mutex<usize>,
    exited: std::sync::Condvar,
    /// A `fork()` child has none of the draining threads: nothing to wait for.
    generation: Generation,
}

impl Default for Draining {
    fn default() -> Self {
        Draining {
            count: Default::default(),
            exited: Default::default(),
            generation: Generation::now(),
        }
    }
}

impl Draining {
    /// A stream's completion thread starts draining (its stream is dropped).
    pub fn begin(&self) {
        *crate::base::completion::lock(&self.count) += 1;
    }

    /// A draining completion thread has delivered its last completion.
    pub fn end(&self) {
        let mut n = crate::base::completion::lock(&self.count);
        *n = n.saturating_sub(1);
        self.exited.notify_all();
    }

    /// Waits until no dropped stream's completion thread is still draining.
    pub fn wait(&self) {
        if !self.generation.is_current() {
            return;
        }
        let mut n = crate::base::completion::lock(&self.count);
        while *n > 0 {
            n = self.exited.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The frees and unregistrations of a device's memory that failed (see
/// [`Device::release_failures`](crate::Device::release_failures)): those
/// made on drop, which have no caller to return an error to, and those
/// whose error an explicit form (`try_into_inner`) returned. Each is also
/// logged (`log::warn!`, target `gpufeed::release`).
#[derive(Default)]
pub(crate) struct ReleaseFailures(std::sync::atomic::AtomicU64);

impl ReleaseFailures {
    /// Counts and logs one failed release: `what` failed with `error`.
    pub fn note(&self, what: &str, error: &crate::base::error::Error) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        log::warn!(target: "gpufeed::release", "{what} failed: {error}");
    }

    /// The failures counted so far.
    pub fn count(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Timing and completion of a recorded point in a stream.
pub(crate) struct RawEvent {
    pub completion: Completion,
    pub timer: Timer,
    /// Recorded with timing (only such events can be measured).
    pub timing: bool,
}

/// A backend's own object behind a handle of the safe layer: opaque above
/// the backends, so nothing there names a backend's types. Each backend
/// downcasts its own ([`Opaque::get`]) and refuses another backend's.
#[derive(Clone)]
pub(crate) struct Opaque(Arc<dyn Any + Send + Sync>);

impl Opaque {
    /// Wraps a backend's object.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        Opaque(Arc::new(value))
    }

    /// Wraps a backend's object that the backend shares itself.
    pub fn shared<T: Any + Send + Sync>(value: Arc<T>) -> Self {
        Opaque(value)
    }

    /// The object, if it is a `T` (one of the asking backend's own).
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }

    /// The object as shared, if it is a `T`.
    pub fn get_shared<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        self.0.clone().downcast().ok()
    }
}

/// What measures elapsed time between two recorded points (a CUDA event; the
/// instant the CPU emulation reached the point).
pub(crate) type Timer = Opaque;

/// A loaded module (a CUDA module; nothing on the CPU emulation, which runs
/// the kernels' host build).
pub(crate) type RawModule = Opaque;

/// A kernel entry point of a loaded module (it keeps its module loaded).
pub(crate) type RawFunction = Opaque;

/// The alignment every device allocation has (CUDA's `cuMemAlloc` gives
/// at least 256 bytes; the CPU emulation allocates so): element types
/// aligned beyond it are refused in device memory.
pub(crate) const DEVICE_ALIGN: usize = 256;

/// A launch ready for a backend: the parameters, the grid and both ways to
/// run the kernel (the GPU's entry point, the CPU body).
pub(crate) struct RawLaunch<'f> {
    pub name: &'static str,
    pub function: &'f RawFunction,
    /// Blocks in the grid, threads per block, dynamic shared bytes: checked
    /// against the device's [`LaunchLimits`].
    pub config: kernel_abi::thread::Launch,
    pub params: Box<dyn ErasedParams>,
}

/// Parameters of any kernel, type-erased for the backends.
pub(crate) trait ErasedParams: Send {
    /// One pointer per parameter, in order (for `cuLaunchKernel`).
    fn pointers(&mut self) -> Vec<*mut std::ffi::c_void>;
    /// Runs the kernel's CPU body over the launch's grid (the CPU
    /// emulation): the threads of a block meet at barriers, each block has
    /// its shared memory; a fault is the emulation's typed error.
    fn emulate(
        &self,
        launch: &kernel_abi::thread::Launch,
        workers: usize,
    ) -> std::result::Result<(), kernel_abi::thread::EmulationError>;
}

/// A checked copy of a batch, as addresses (host pointers as integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawCopy {
    pub dst: u64,
    pub src: u64,
    pub bytes: usize,
}

/// Raw device operations.
///
/// # Safety contract for implementors and callers
/// Addresses passed to the unsafe methods must be valid for the stated bytes
/// until the operation completes (for stream methods: until a later recorded
/// point of that stream completes). The safe layer guarantees this by owning
/// the buffers until completion.
pub(crate) trait Backend: Send + Sync {
    /// Device frees deferred to another thread, not yet done (a test hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    fn parked_frees(&self) -> usize {
        0
    }
    /// Bytes allocated from the stream-ordered pool and not yet freed (a
    /// test hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    fn ordered_bytes_in_use(&self) -> Option<u64> {
        None
    }
    /// Makes the next `n` host frees or unregistrations report a failure
    /// (after doing their work): a test hook, a no-op where unsupported.
    #[cfg(feature = "hooks")]
    fn plant_release_failures(&self, _n: usize) {}
    fn info(&self) -> &DeviceInfo;
    /// The device's count of failed frees and unregistrations.
    fn release_failures(&self) -> &ReleaseFailures;
    /// The first unrecoverable error, if the context is broken.
    fn broken(&self) -> Option<crate::base::error::Error>;
    /// For a backend to recognise another of its kind (peer copies): the
    /// backend, or the part of it that a peer operation needs (on CUDA, the
    /// device's shared state).
    fn as_any(&self) -> &dyn std::any::Any;
    /// The device's PCI address (`0000:17:00.0`), where it has one.
    fn pci_bus_id(&self) -> Option<String>;
    /// Whether copies between this device and `peer` go directly (enabling
    /// that where the topology allows): GPUs with peer access, or two
    /// emulated devices (both host memory). `false`: copies are staged
    /// through host memory by the driver.
    ///
    /// # Errors
    /// A driver error other than "not supported".
    fn enable_peer_access(&self, peer: &dyn Backend) -> Result<bool>;

    /// Pinned host memory of `bytes > 0` bytes (the safe layer handles empty
    /// buffers itself, here and in the three calls below), on NUMA `node`
    /// when one is given (its pages bound there before first touch).
    fn alloc_host(&self, bytes: usize, flags: HostFlags, node: Option<u32>) -> Result<HostAlloc>;
    /// # Safety
    /// `alloc` came from `alloc_host` of this backend and is no longer used.
    unsafe fn free_host(&self, alloc: &HostAlloc) -> Result<()>;
    /// Pins `ptr..ptr+bytes` in place; returns whether its pages are locked
    /// (always on CUDA; false on the CPU emulation when the memlock limit
    /// refused and its [`LockPolicy`](crate::LockPolicy) allowed unlocked
    /// memory).
    ///
    /// # Safety
    /// `ptr..ptr+bytes` (`bytes > 0`) is valid host memory that stays put until `unregister_host`.
    unsafe fn register_host(&self, ptr: *mut u8, bytes: usize) -> Result<bool>;
    /// As [`Backend::register_host`], for memory the device only reads
    /// (a read-only file mapping may be registered this way).
    ///
    /// # Safety
    /// As for `register_host`, with the range valid for reads only.
    unsafe fn register_host_read_only(&self, ptr: *mut u8, bytes: usize) -> Result<bool> {
        // SAFETY: forwarded.
        unsafe { self.register_host(ptr, bytes) }
    }
    /// # Safety
    /// `ptr` was registered with `register_host` and no operation uses it.
    unsafe fn unregister_host(&self, ptr: *mut u8, bytes: usize) -> Result<()>;
    /// Unregisters like `unregister_host`, then runs `release` (which frees
    /// the memory). A backend may do both later, on another thread (CUDA
    /// does when called on a completion thread, where the driver's call can
    /// wait for the whole device).
    ///
    /// # Safety
    /// As `unregister_host`; `release` must be sound to run on any thread
    /// once the range is unregistered, and nothing else may use the memory.
    unsafe fn unregister_host_then(
        &self,
        ptr: *mut u8,
        bytes: usize,
        release: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        let r = unsafe { self.unregister_host(ptr, bytes) };
        release();
        r
    }
    /// # Safety
    /// `ptr` lies in an allocation made with `device_mapped`.
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    unsafe fn mapped_device_ptr(&self, ptr: *mut u8) -> Result<u64>;

    fn alloc_device(&self, bytes: usize) -> Result<u64>;
    /// # Safety
    /// `ptr` came from `alloc_device` and no pending operation uses it.
    unsafe fn free_device(&self, ptr: u64) -> Result<()>;

    /// Synchronous copies (the pageable-memory path).
    /// # Safety
    /// Both ranges valid for `bytes`.
    unsafe fn copy_h2d_sync(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()>;
    /// # Safety
    /// Both ranges valid for `bytes`.
    unsafe fn copy_d2h_sync(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()>;

    /// Loads a PTX module.
    fn load_module(&self, ptx: &str) -> Result<RawModule>;
    /// The entry point `name` of `module`, whose parameters must have the
    /// byte sizes `sizes` (checked where the PTX text lists them).
    fn get_function(
        &self,
        module: &std::sync::Arc<RawModule>,
        name: &str,
        sizes: &[usize],
    ) -> Result<RawFunction>;

    fn new_stream(&self) -> Result<Box<dyn RawStream>>;
    /// Milliseconds between two timed events: [`Error::NotReady`](crate::Error::NotReady)
    /// when either has not been reached yet (the safe layer checks timing).
    fn elapsed_ms(&self, start: &Timer, end: &Timer) -> Result<f32>;
    /// Blocks until all work on the device is done.
    fn synchronize(&self) -> Result<()>;
    /// The driver's handle of a recorded point (`CUevent`), where the
    /// backend has one (for interop).
    fn event_handle(&self, _timer: &Timer) -> Option<u64> {
        None
    }
    /// Blocks in the driver's own wait for a recorded point, where the
    /// backend has one (a benchmark baseline); `None` otherwise.
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    fn synchronize_event(&self, _timer: &Timer) -> Option<Result<()>> {
        None
    }
}

/// Raw stream operations: each is enqueued and returns at once.
pub(crate) trait RawStream: Send + Sync {
    /// # Safety
    /// See [`Backend`]: `src` (pinned host) and `dst` valid until completion.
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()>;
    /// # Safety
    /// See [`Backend`]: `dst` (pinned host) and `src` valid until completion.
    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()>;
    /// # Safety
    /// Both device ranges valid for `bytes` until completion.
    unsafe fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// A copy from device memory of `src_dev` to device memory of `dst_dev`
    /// (one of them this stream's device).
    ///
    /// # Safety
    /// Both device ranges valid for `bytes` until completion, each of the
    /// device given with it; both backends of this stream's kind.
    unsafe fn copy_peer(
        &self,
        dst: u64,
        dst_dev: &dyn Backend,
        src: u64,
        src_dev: &dyn Backend,
        bytes: usize,
    ) -> Result<()>;
    /// # Safety
    /// The launch's device ranges are valid for their lengths until
    /// completion, and its function belongs to this backend.
    unsafe fn launch(&self, launch: RawLaunch<'_>) -> Result<()>;
    /// Several copies in one command, in any order among themselves
    /// (`cuMemcpyBatchAsync` where the driver has it; else one copy after
    /// another). Every range may be host (pinned) or device memory of this
    /// stream's device.
    ///
    /// # Safety
    /// Every range valid for its length until completion; no copy's
    /// destination overlaps a range of another copy of the batch, nor its
    /// own source ([`crate::runtime::transfer::check`]).
    unsafe fn copy_batch(&self, copies: &[RawCopy]) -> Result<()>;
    /// Records a point; its completion fires when all work before it is done.
    fn record(&self, timing: bool) -> Result<RawEvent>;
    /// Records a point only other streams wait for: nothing watches it (its
    /// completion never fires on CUDA), so it costs no watcher wake-up.
    /// `timing`: it can also be timed (`elapsed_ms`).
    fn marker(&self, timing: bool) -> Result<RawEvent>;
    /// Makes later work on this stream wait for `event`.
    fn wait(&self, event: &RawEvent) -> Result<()>;
    /// Blocks the calling thread until everything queued on this stream so
    /// far has finished, in the driver's own wait where there is one
    /// (`cuStreamSynchronize`: no event, no completion thread).
    fn synchronize_in_driver(&self) -> Result<()>;
}
