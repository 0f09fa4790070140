//! The CPU emulation backend: the seed's fallback for machines without a GPU,
//! made real behind the same interface.
//!
//! - Pinned memory: `mmap` + `mlock` (page-locked). When the memlock limit
//!   refuses, [`LockPolicy`] decides: a [`Error::LockFailed`] naming the limit,
//!   or unlocked memory that is reported as such (`PinnedBuffer::is_locked`,
//!   `Registered::is_locked`).
//! - Registration (pin in place): `mlock` of the range, `munlock` at the
//!   end. The kernel's page locks are not counted, and two registered
//!   ranges may share a page (two small `Vec`s): the ranges locked by every
//!   emulated device are kept in one counted set ([`LOCKED`]), and an
//!   unregistration unlocks only the pages no other locked range covers.
//! - Device memory: ordinary host memory; device addresses are host addresses.
//! - Streams: one worker thread each, running its queue in order, so copies
//!   are asynchronous for the caller. Events complete when the worker reaches
//!   them; `wait` makes a worker block until another stream's event is done:
//!   CUDA's ordering semantics.
//! - Kernels: the host build of the kernel crate, every thread of the grid
//!   run with emulated indices, blocks spread over CPU threads.
//! - Faults: the `trap` kernel breaks the emulated context for good, as a GPU
//!   trap does.

use crate::backend::{
    Backend, BackendKind, DeviceInfo, Draining, Generation, HostAlloc, HostFlags, RawCopy,
    RawEvent, RawFunction, RawLaunch, RawModule, RawStream, Timer, DEVICE_ALIGN,
};
use crate::base::completion::{lock, Completion};
use crate::base::error::{Error, Result};
use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Instant;

/// What the CPU backend does when the OS refuses to lock memory.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendChoice, Device, DeviceOptions, LockPolicy, PinnedBuffer};
/// let device = Device::open(DeviceOptions {
///     backend: BackendChoice::Cpu,
///     lock_policy: LockPolicy::Require,
///     ..Default::default()
/// })?;
/// match PinnedBuffer::<u8>::new(&device, 4096) {
///     Ok(buffer) => assert!(buffer.is_locked()), // within the memlock limit
///     Err(e) => assert!(matches!(e, gpufeed::Error::LockFailed { .. })),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum LockPolicy {
    /// Fail with [`Error::LockFailed`].
    Require,
    /// Use unlocked memory and report it (`is_locked() == false`).
    #[default]
    BestEffort,
}

/// When a recorded point was reached (set by the stream worker).
type Stamp = OnceLock<Instant>;

/// The CPU emulation's "module": nothing to load, the kernels' host build runs.
struct CpuModule;

/// The CPU emulation's kernel entry point: the host build of the kernel.
struct CpuFunction;

struct Shared {
    broken: OnceLock<Error>,
    workers: usize,
    /// Workers of dropped streams still running their queues.
    draining: Draining,
}

impl Shared {
    fn usable(&self) -> Result<()> {
        self.broken.get().map_or(Ok(()), |e| Err(e.clone()))
    }
}

/// The CPU emulation backend.
pub(crate) struct CpuBackend {
    shared: Arc<Shared>,
    info: DeviceInfo,
    policy: LockPolicy,
    /// Each device allocation's address → (the allocator's block, its layout).
    device_allocs: Mutex<HashMap<u64, (usize, Layout)>>,
    release_failures: crate::backend::ReleaseFailures,
    /// Host frees or unregistrations still to report a failure (a test hook).
    #[cfg(feature = "hooks")]
    planted_failures: std::sync::atomic::AtomicUsize,
}

/// The byte ranges `[start, end)` the emulation has locked (allocations and
/// registrations of every emulated device in the process), each with how
/// many times it is locked now. `mlock` is not counted by the kernel: a page
/// is unlocked by any `munlock` of it. Unregistering a range therefore
/// unlocks only those of its pages that no other range here covers, and
/// mlock, munlock and changes of the set happen under its lock, so an
/// unregistration never unlocks a page another registration has just
/// locked. (Pages the program locked itself, outside the emulation, are not
/// known here.)
static LOCKED: Mutex<BTreeMap<(usize, usize), usize>> = Mutex::new(BTreeMap::new());

/// The whole pages of `[start, end)`.
fn page_span((start, end): (usize, usize)) -> (usize, usize) {
    let page = crate::base::numa::page_size();
    let first = start - start % page;
    let last = end.div_ceil(page).saturating_mul(page);
    (first, last)
}

/// The ranges of `span`'s pages that no range in `locked` touches, in order.
fn uncovered_pages(
    locked: &BTreeMap<(usize, usize), usize>,
    span: (usize, usize),
) -> Vec<(usize, usize)> {
    let (first, last) = page_span(span);
    let mut covers: Vec<(usize, usize)> = locked
        .keys()
        .map(|&r| page_span(r))
        .filter(|&(s, e)| s < last && e > first)
        .collect();
    covers.sort_unstable();
    let mut out = Vec::new();
    let mut at = first;
    for (s, e) in covers {
        if s > at {
            out.push((at, s.min(last)));
        }
        at = at.max(e);
        if at >= last {
            break;
        }
    }
    if at < last {
        out.push((at, last));
    }
    out
}

/// Unlocks the pages of `span` that no range in `locked` covers.
fn unlock_uncovered(locked: &BTreeMap<(usize, usize), usize>, span: (usize, usize)) -> Result<()> {
    let mut first_error = None;
    for (s, e) in uncovered_pages(locked, span) {
        // SAFETY: munlock changes no memory, only whether pages may be
        // swapped; the pages are in the caller's mapped range.
        if unsafe { libc::munlock(s as *const libc::c_void, e - s) } != 0 {
            first_error.get_or_insert_with(std::io::Error::last_os_error);
        }
    }
    first_error.map_or(Ok(()), |e| Err(e.into()))
}

/// Takes one count of `span` out of `locked`; whether it was there.
fn forget_range(locked: &mut BTreeMap<(usize, usize), usize>, span: (usize, usize)) -> bool {
    match locked.get_mut(&span) {
        Some(n) if *n > 1 => {
            *n -= 1;
            true
        }
        Some(_) => {
            locked.remove(&span);
            true
        }
        None => false,
    }
}

impl CpuBackend {
    /// One emulated device (ordinal 0).
    pub fn new(policy: LockPolicy) -> Self {
        Self::with_ordinal(policy, 0)
    }

    /// The emulated device `ordinal` (of several, for multi-device code).
    pub fn with_ordinal(policy: LockPolicy, ordinal: usize) -> Self {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: sysconf has no preconditions.
        let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) }.max(0) as u64;
        let page = crate::base::numa::page_size() as u64;
        CpuBackend {
            shared: Arc::new(Shared {
                broken: OnceLock::new(),
                workers,
                draining: Draining::default(),
            }),
            info: DeviceInfo {
                backend: BackendKind::Cpu,
                name: if ordinal == 0 {
                    format!("CPU emulation ({workers} threads)")
                } else {
                    format!("CPU emulation, device {ordinal} ({workers} threads)")
                },
                driver: None,
                compute_units: workers as u32,
                total_memory: pages * page,
                ordinal,
                stream_ordered_memory: false,
                limits: crate::backend::LaunchLimits::GPU,
                compute_capability: None,
            },
            policy,
            device_allocs: Mutex::new(HashMap::new()),
            release_failures: Default::default(),
            #[cfg(feature = "hooks")]
            planted_failures: Default::default(),
        }
    }

    /// A failure planted by the test hook, if one is left to report.
    fn planted_failure(&self) -> Result<()> {
        #[cfg(feature = "hooks")]
        {
            use std::sync::atomic::Ordering;
            let planted = &self.planted_failures;
            if planted
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(Error::Internal(
                    "a release failure planted by a test (hooks)".into(),
                ));
            }
        }
        Ok(())
    }

    /// Locks `ptr..ptr+bytes` and counts it in [`LOCKED`]; whether it is
    /// locked (false: refused, and the policy allows unlocked memory).
    fn lock_range(&self, ptr: *mut u8, bytes: usize) -> Result<bool> {
        let span = (ptr as usize, ptr as usize + bytes);
        // Counted before it is locked, so an unregistration meanwhile leaves
        // its pages locked; the mlock itself (which faults every page in)
        // runs outside the set's lock.
        *lock(&LOCKED).entry(span).or_default() += 1;
        // SAFETY: ptr..ptr+bytes is mapped memory (callers).
        if unsafe { libc::mlock(ptr.cast(), bytes) } == 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        {
            let mut locked = lock(&LOCKED);
            forget_range(&mut locked, span);
            // A refusal may have locked part of the range: unlock what no
            // other locked range covers (a best effort; the refusal is what
            // counts).
            let _ = unlock_uncovered(&locked, span);
        }
        match self.policy {
            LockPolicy::BestEffort => Ok(false),
            LockPolicy::Require => Err(Error::LockFailed {
                bytes,
                reason: format!("mlock: {err} (RLIMIT_MEMLOCK is {})", memlock_limit()),
            }),
        }
    }
}

/// The soft limit on locked memory (`RLIMIT_MEMLOCK`).
///
/// ```rust
/// use gpufeed::{memlock_limit, MemlockLimit};
/// match memlock_limit() {
///     MemlockLimit::Unlimited => println!("any amount of memory may be pinned"),
///     MemlockLimit::Bytes(b) => println!("at most {b} bytes may be pinned"),
///     MemlockLimit::Unknown => println!("getrlimit failed"),
/// }
/// assert_eq!(MemlockLimit::Bytes(65536).to_string(), "65536 bytes");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemlockLimit {
    /// No limit.
    Unlimited,
    /// At most this many bytes.
    Bytes(u64),
    /// `getrlimit` failed.
    Unknown,
}

impl std::fmt::Display for MemlockLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemlockLimit::Unlimited => f.write_str("unlimited"),
            MemlockLimit::Bytes(b) => write!(f, "{b} bytes"),
            MemlockLimit::Unknown => f.write_str("unknown"),
        }
    }
}

/// The soft memlock limit of this process.
pub fn memlock_limit() -> MemlockLimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: writes one rlimit struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return MemlockLimit::Unknown;
    }
    if lim.rlim_cur == libc::RLIM_INFINITY {
        MemlockLimit::Unlimited
    } else {
        MemlockLimit::Bytes(lim.rlim_cur)
    }
}

impl Backend for CpuBackend {
    #[cfg(feature = "hooks")]
    fn plant_release_failures(&self, n: usize) {
        self.planted_failures
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    fn release_failures(&self) -> &crate::backend::ReleaseFailures {
        &self.release_failures
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn broken(&self) -> Option<Error> {
        self.shared.broken.get().cloned()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn pci_bus_id(&self) -> Option<String> {
        None
    }

    fn enable_peer_access(&self, peer: &dyn Backend) -> Result<bool> {
        // Emulated devices share the host's memory: copies are direct.
        Ok(peer.as_any().is::<CpuBackend>())
    }

    fn alloc_host(&self, bytes: usize, _flags: HostFlags, node: Option<u32>) -> Result<HostAlloc> {
        self.shared.usable()?;
        let ptr = match node {
            Some(node) => crate::base::numa::map_on_node(bytes, node)?,
            None => crate::base::numa::map_anonymous(bytes).map_err(|e| {
                if e.raw_os_error() == Some(libc::ENOMEM) {
                    Error::OutOfMemory {
                        what: "pinned host memory on the CPU emulation (mmap)",
                        bytes,
                    }
                } else {
                    Error::LockFailed {
                        bytes,
                        reason: format!("mmap: {e}"),
                    }
                }
            })?,
        };
        match self.lock_range(ptr, bytes) {
            Ok(locked) => Ok(HostAlloc {
                ptr,
                bytes,
                locked,
                placed: node.is_some(),
            }),
            Err(e) => {
                // SAFETY: the mapping we just made.
                unsafe { libc::munmap(ptr.cast(), bytes) };
                Err(e)
            }
        }
    }

    unsafe fn free_host(&self, alloc: &HostAlloc) -> Result<()> {
        if alloc.locked {
            // Our own mapping: its pages are unlocked by the munmap, and no
            // other range shares them.
            forget_range(
                &mut lock(&LOCKED),
                (alloc.ptr as usize, alloc.ptr as usize + alloc.bytes),
            );
        }
        // SAFETY: our mapping, unused (caller). munlock is implied by munmap.
        if unsafe { libc::munmap(alloc.ptr.cast(), alloc.bytes) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        self.planted_failure()
    }

    unsafe fn register_host(&self, ptr: *mut u8, bytes: usize) -> Result<bool> {
        self.shared.usable()?;
        // As CUDA: memory registered (or pinned) already can't be again.
        let span = (ptr as usize, ptr as usize + bytes);
        if lock(&LOCKED).keys().any(|&(s, e)| s < span.1 && span.0 < e) {
            return Err(Error::Driver {
                call: "register_host (cpu)",
                code: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (the range overlaps host memory \
                       registered or pinned already)"
                    .into(),
            });
        }
        self.lock_range(ptr, bytes)
    }

    unsafe fn unregister_host(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        let span = (ptr as usize, ptr as usize + bytes);
        let mut locked = lock(&LOCKED);
        // Not in the set: registered unlocked (the policy allowed it),
        // nothing to unlock.
        if forget_range(&mut locked, span) {
            // The range was registered (caller): only its pages that no
            // other locked range covers are unlocked.
            unlock_uncovered(&locked, span)?;
        }
        drop(locked);
        self.planted_failure()
    }

    unsafe fn mapped_device_ptr(&self, ptr: *mut u8) -> Result<u64> {
        Ok(ptr as u64)
    }

    fn alloc_device(&self, bytes: usize) -> Result<u64> {
        self.shared.usable()?;
        if bytes == 0 {
            return Ok(0);
        }
        // Allocated at the allocator's own alignment and aligned by hand: a
        // zeroed allocation of that alignment is `calloc`, whose large blocks
        // are fresh zero pages (an alignment above it is a memset of every
        // byte: seconds for gigabytes, before the copy even starts).
        let layout = bytes
            .checked_add(DEVICE_ALIGN)
            .and_then(|b| Layout::from_size_align(b, 16).ok())
            .ok_or(Error::SizeOverflow {
                count: bytes,
                elem_size: 1,
            })?;
        // SAFETY: non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::OutOfMemory {
                what: "device memory on the CPU emulation (the host allocator)",
                bytes,
            });
        }
        let aligned = p.wrapping_add(p.align_offset(DEVICE_ALIGN));
        lock(&self.device_allocs).insert(aligned as u64, (p as usize, layout));
        Ok(aligned as u64)
    }

    unsafe fn free_device(&self, ptr: u64) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let (base, layout) = lock(&self.device_allocs)
            .remove(&ptr)
            .ok_or_else(|| Error::Internal(format!("{ptr:#x} is not a device allocation")))?;
        // SAFETY: allocated by alloc_device at `base` with this layout;
        // unused (caller).
        unsafe { std::alloc::dealloc(base as *mut u8, layout) };
        Ok(())
    }

    unsafe fn copy_h2d_sync(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // SAFETY: valid, non-overlapping ranges (caller).
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn copy_d2h_sync(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // SAFETY: valid, non-overlapping ranges (caller).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, bytes) };
        Ok(())
    }

    fn load_module(&self, _ptx: &str) -> Result<RawModule> {
        self.shared.usable()?;
        Ok(RawModule::new(CpuModule))
    }

    fn get_function(
        &self,
        module: &Arc<RawModule>,
        _name: &str,
        _sizes: &[usize],
    ) -> Result<RawFunction> {
        match module.get::<CpuModule>() {
            Some(CpuModule) => Ok(RawFunction::new(CpuFunction)),
            None => Err(Error::InvalidArgument("a module of another backend".into())),
        }
    }

    fn new_stream(&self) -> Result<Box<dyn RawStream>> {
        self.shared.usable()?;
        let (tx, rx) = mpsc::channel::<Task>();
        let shared = self.shared.clone();
        let worker = std::thread::Builder::new()
            .name("cpu-stream".into())
            .spawn(move || {
                crate::base::completion::mark_completion_thread();
                let mut failed: Option<Error> = None;
                while let Ok(task) = rx.recv() {
                    // A panic in the library's own task (none is expected)
                    // fails the stream's later work instead of ending the
                    // worker, whose queue holds later points to complete.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        task(&shared, &mut failed)
                    }));
                    if ran.is_err() {
                        failed.get_or_insert(Error::Internal(
                            "a CPU emulation stream task panicked".into(),
                        ));
                    }
                }
                // The stream was dropped (the only sender went) and its
                // queue has run.
                shared.draining.end();
            })
            .map_err(|e| Error::Internal(format!("cannot start a stream worker: {e}")))?;
        Ok(Box::new(CpuStream {
            generation: Generation::now(),
            tx: Mutex::new(Some(tx)),
            shared: self.shared.clone(),
            worker: Mutex::new(Some(worker)),
        }))
    }

    fn elapsed_ms(&self, start: &Timer, end: &Timer) -> Result<f32> {
        match (start.get::<Stamp>(), end.get::<Stamp>()) {
            (Some(a), Some(b)) => match (a.get(), b.get()) {
                // Signed, as CUDA's: negative when `end` was reached first.
                (Some(a), Some(b)) if b >= a => Ok(b.duration_since(*a).as_secs_f32() * 1e3),
                (Some(a), Some(b)) => Ok(-(a.duration_since(*b).as_secs_f32() * 1e3)),
                _ => Err(Error::NotReady),
            },
            _ => Err(Error::NotTimed),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.draining.wait();
        self.shared.usable()
    }
}

/// A unit of work on a stream worker: gets the device state and the
/// stream's first failure.
type Task = Box<dyn FnOnce(&Shared, &mut Option<Error>) + Send>;

struct CpuStream {
    /// The process the worker runs in (not a `fork()` child).
    generation: Generation,
    /// `None` once the stream is being dropped.
    tx: Mutex<Option<mpsc::Sender<Task>>>,
    shared: Arc<Shared>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        // As on CUDA: the queued work runs to completion and its completions
        // are delivered before the drop returns (the worker drains its queue
        // and exits when the sender goes). Not on a completion thread (a
        // deferred release, on this worker or on one this worker's work may
        // wait for): there the worker drains on its own, counted in
        // `draining` for `synchronize`.
        if !self.generation.is_current() {
            // A fork() child: the worker is the parent's, there is no
            // thread to join (its queue went with it).
            if let Some(w) = lock(&self.worker).take() {
                std::mem::forget(w);
            }
            return;
        }
        self.shared.draining.begin();
        drop(lock(&self.tx).take());
        if let Some(w) = lock(&self.worker).take() {
            if !crate::base::completion::on_completion_thread() {
                let _ = w.join();
            }
        }
    }
}

impl CpuStream {
    fn send(&self, task: Task) -> Result<()> {
        // In a fork() child nothing would run it: refused, not a hang.
        self.generation.check("a stream")?;
        lock(&self.tx)
            .as_ref()
            .ok_or_else(|| Error::Internal("the stream is being dropped".into()))?
            .send(task)
            .map_err(|_| Error::Internal("the stream worker has stopped".into()))
    }
}

/// A raw address that may cross to the worker thread: the safe layer keeps
/// the memory alive and untouched until the work completes.
#[derive(Clone, Copy)]
struct Addr(u64);

impl CpuStream {
    fn push(&self, op: impl FnOnce(&Shared) -> Result<()> + Send + 'static) -> Result<()> {
        self.shared.usable()?;
        let task: Task = Box::new(move |shared, failed| {
            if failed.is_some() {
                return;
            }
            if let Err(e) = shared.usable().and_then(|_| op(shared)) {
                *failed = Some(e);
            }
        });
        self.send(task)
    }
}

impl RawStream for CpuStream {
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        let src = Addr(src as u64);
        self.push(move |_| {
            // SAFETY: both ranges valid until completion (caller of copy_h2d).
            unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst as *mut u8, bytes) };
            Ok(())
        })
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        let dst = Addr(dst as u64);
        self.push(move |_| {
            // SAFETY: both ranges valid until completion (caller of copy_d2h).
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.0 as *mut u8, bytes) };
            Ok(())
        })
    }

    unsafe fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.push(move |_| {
            // SAFETY: both ranges valid until completion (caller of copy_d2d).
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
            Ok(())
        })
    }

    unsafe fn copy_peer(
        &self,
        dst: u64,
        _dst_dev: &dyn Backend,
        src: u64,
        _src_dev: &dyn Backend,
        bytes: usize,
    ) -> Result<()> {
        // Emulated device memory of every device is host memory.
        // SAFETY: the caller's contract, as for copy_d2d.
        unsafe { self.copy_d2d(dst, src, bytes) }
    }

    unsafe fn copy_batch(&self, copies: &[RawCopy]) -> Result<()> {
        let copies = copies.to_vec();
        self.push(move |_| {
            for c in &copies {
                // SAFETY: every range valid until completion, a destination
                // overlapping no other range (caller of copy_batch).
                unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.bytes) };
            }
            Ok(())
        })
    }

    unsafe fn launch(&self, launch: RawLaunch<'_>) -> Result<()> {
        if launch.function.get::<CpuFunction>().is_none() {
            return Err(Error::InvalidArgument(
                "a kernel function of another backend".into(),
            ));
        }
        let RawLaunch {
            name,
            config,
            params,
            ..
        } = launch;
        self.push(move |shared| {
            // The kernel's host build over the grid. A trap or a panic in any
            // thread breaks the emulated context, as a GPU trap does; so does
            // a fault the emulation detects (a barrier or warp operation not
            // every thread reaches, an access out of bounds), which on a GPU
            // would hang or fault: the launch reports it as the kernel's
            // fault, naming the kernel, block and thread.
            params.emulate(&config, shared.workers).map_err(|e| {
                use kernel_abi::thread::FaultKind;
                let broken = Error::ContextBroken(format!(
                    "kernel `{name}` faulted ({e}; CPU emulation of a GPU trap)"
                ));
                let _ = shared.broken.set(broken.clone());
                match e.kind {
                    FaultKind::Trap | FaultKind::Panic(_) => broken,
                    _ => Error::KernelFault {
                        kernel: name,
                        reason: e.to_string(),
                    },
                }
            })
        })
    }

    fn record(&self, timing: bool) -> Result<RawEvent> {
        let completion = Completion::new();
        let stamp = Arc::new(OnceLock::new());
        let (c, s) = (completion.clone(), stamp.clone());
        // Recorded even on a broken context: the point completes (with the
        // error) only after the work queued before it, so whoever waits for it
        // still releases memory at the right time.
        let task: Task = Box::new(move |shared, failed| {
            let _ = s.set(Instant::now());
            let result = match (failed.as_ref(), shared.broken.get()) {
                (_, Some(e)) | (Some(e), None) => Err(e.clone()),
                (None, None) => Ok(()),
            };
            c.complete(result);
        });
        self.send(task)?;
        Ok(RawEvent {
            completion,
            timer: Timer::shared(stamp),
            timing,
        })
    }

    fn marker(&self, timing: bool) -> Result<RawEvent> {
        self.record(timing)
    }

    fn synchronize_in_driver(&self) -> Result<()> {
        self.record(false)?.completion.block()
    }

    fn wait(&self, event: &RawEvent) -> Result<()> {
        let c = event.completion.clone();
        // A wait always waits, even on a stream that has failed: later points of
        // this stream must not complete (and release memory) while the other
        // stream may still be touching it.
        let task: Task = Box::new(move |_, failed| {
            if let Err(e) = c.block() {
                failed.get_or_insert(e);
            }
        });
        self.send(task)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_allocations_are_aligned_zeroed_and_freed_at_any_size() {
        let b = CpuBackend::new(LockPolicy::default());
        for bytes in [1, 255, 256, 4097, 1 << 20, (64 << 20) + 3] {
            let p = b.alloc_device(bytes).unwrap();
            assert_eq!(p as usize % DEVICE_ALIGN, 0, "{bytes} bytes at {p:#x}");
            // SAFETY: `bytes` bytes at `p`, ours until freed below.
            let mem = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, bytes) };
            assert!(mem.iter().all(|&x| x == 0), "{bytes} bytes not zeroed");
            // The whole range is writable.
            mem.fill(0xA5);
            // SAFETY: allocated above, unused now.
            unsafe { b.free_device(p) }.unwrap();
        }
        // SAFETY: not an allocation: refused, nothing freed.
        assert!(unsafe { b.free_device(256) }.is_err());
    }
}
