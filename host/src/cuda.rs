//! The CUDA driver backend, over cudarc's `result`/`sys` layers (the driver is
//! loaded at run time, so one binary also runs where there is none).
//!
//! Completion source: each stream has a *watcher thread* fed, in stream order,
//! with the events recorded on it; it waits for each with `cuEventSynchronize`
//! and completes the matching [`Completion`]. Events of one stream finish in
//! order, so waiting for the oldest first is exact. The watcher also reports
//! faults: a trapped kernel makes `cuEventSynchronize` fail, and the error
//! reaches every awaiting future instead of a hang (a `cuLaunchHostFunc`
//! callback is never called once the context has failed, so it could not).
//! [`WaitMode`] picks how the watcher waits: spinning (lowest latency, one
//! busy core while work is pending), blocking-sync events (the thread
//! sleeps until the GPU interrupts) or polling with short sleeps. The
//! wake-latency benchmark measures all three.
//!
//! Watchers never free memory: a deferred release (a dropped job's buffers)
//! runs on the watcher, but `cuMemFree`/`cuMemFreeHost` may wait for the
//! whole device, which would hold the stream's later completions behind
//! unrelated work, or deadlock when that work waits for one of them (as do
//! `cuMemHostUnregister` and the allocations: all were measured waiting for
//! a kernel running on another stream). Such frees and unregistrations are
//! parked and done by the next allocation, free, (un)registration, new
//! stream or synchronize on another thread, or when the device goes.
//! Device memory is the exception where the driver has memory pools
//! ([`DeviceMemory::StreamOrdered`], the default): it comes from a pool of
//! the backend's own and is freed with `cuMemFreeAsync` on an internal
//! stream, which waits for nothing, so a watcher frees it at once.

use crate::backend::{
    Backend, DeviceInfo, HostAlloc, HostFlags, RawEvent, RawFunction, RawModule, RawStream, Timer,
};
use crate::completion::{lock, Completion};
use crate::error::{Error, Result};
use crate::kernel::RawLaunch;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// How watcher threads wait for GPU completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WaitMode {
    /// `cuEventSynchronize` spins (the context's automatic scheduling):
    /// lowest latency; a core is busy while a stream has pending work, and
    /// for 50 µs after (the watcher looks for the next point before it
    /// sleeps).
    #[default]
    Spin,
    /// Events carry `CU_EVENT_BLOCKING_SYNC`: the watcher sleeps until the
    /// GPU interrupts; no busy core, but the interrupt path is slow (on the
    /// H200: wake median about 65 us, p99 about 300 us).
    Blocking,
    /// The watcher asks the driver whether the event is done
    /// (`cuEventQuery`) and sleeps [`POLL_INTERVAL`] between asks, with its
    /// thread's timer slack lowered to 1 us so the sleeps are that short: no
    /// busy core (a few percent of one while work is pending; the latency
    /// part measures it), wake latency about the interval.
    Poll,
}

/// How device memory is allocated and freed on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceMemory {
    /// Stream-ordered (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`, a
    /// memory pool of the device handle's own) where the driver supports
    /// memory pools, else [`DeviceMemory::Plain`]: a free never waits for
    /// the device, and a cancelled job's buffers are freed the moment its
    /// work is done. Freed memory stays in the pool for reuse until the
    /// device handle goes.
    #[default]
    StreamOrdered,
    /// `cuMemAlloc` / `cuMemFree`, which wait while any kernel of the device
    /// runs; frees asked for on a completion thread are deferred to the next
    /// allocation, free or synchronize on another thread.
    Plain,
}

/// How long a [`WaitMode::Poll`] watcher sleeps between two queries.
pub const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_micros(20);

/// Lowers the calling thread's timer slack to 1 us (Linux's default, 50 us,
/// would stretch every short sleep by that much).
fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and affects only
    // the calling thread; it cannot fail in a way that matters here (the
    // sleeps would only be longer).
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
    }
}

/// Waits for `ev` by polling it every [`POLL_INTERVAL`].
fn poll_event(shared: &Shared, ev: sys::CUevent) -> Result<()> {
    loop {
        // SAFETY: the event is alive (the caller holds it) and was recorded.
        let r = unsafe { sys::cuEventQuery(ev) };
        if r != CUresult::CUDA_ERROR_NOT_READY {
            return shared.check("cuEventQuery", r);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no other precondition.
    unsafe { sys::is_culib_present() }
}

/// How many CUDA devices the driver reports (0 without a driver).
///
/// # Errors
/// The driver's error from `cuInit` or `cuDeviceGetCount`.
pub(crate) fn device_count() -> Result<usize> {
    if !driver_present() {
        return Ok(0);
    }
    let drv = |call: &'static str| {
        move |e: cudarc::driver::DriverError| Error::Driver {
            call,
            code: code_name(e.0),
        }
    };
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Errors after which the context cannot be used again.
fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

fn code_name(code: CUresult) -> String {
    let err = cudarc::driver::DriverError(code);
    match err.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{code:?}"),
    }
}

/// State shared by the backend, its streams and their watchers.
pub(crate) struct Shared {
    ctx: Arc<CudaContext>,
    broken: OnceLock<Error>,

    wait_mode: WaitMode,
    /// Recycled events, `[non-timing, timing]`: creating and destroying an
    /// event per recorded point cost a driver call each way on every awaited
    /// operation; a recycled one costs a lock.
    free_events: [Mutex<Vec<RawCuEvent>>; 2],
    /// Frees and unregistrations asked for on a watcher thread, done later on
    /// another thread (see the module docs).
    parked: Mutex<Vec<ParkedFree>>,
    /// `parked` is non-empty (lets every allocation skip the lock).
    has_parked: AtomicBool,
    /// Stream-ordered device memory, where the driver has memory pools.
    ordered: Option<OrderedMem>,
    /// The driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later).
    batch_copies: bool,
}

/// Stream-ordered device memory (`cuMemAllocFromPoolAsync` /
/// `cuMemFreeAsync`) from a memory pool of our own, through an internal
/// stream that carries nothing else. A free is enqueued there: it waits for
/// nothing (the memory's users have finished: the caller's guarantee), so a
/// watcher releasing a cancelled job's buffers frees at once instead of
/// parking a `cuMemFree`, which would wait for the whole device. The pool
/// keeps freed memory for reuse (release threshold: all of it) until the
/// device handle goes, like the pinned pool.
struct OrderedMem {
    stream: StreamHandle,
    pool: PoolHandle,
}

struct PoolHandle(sys::CUmemoryPool);
// SAFETY: CUmemoryPool is an opaque driver handle usable from any thread.
unsafe impl Send for PoolHandle {}
// SAFETY: as above.
unsafe impl Sync for PoolHandle {}

impl OrderedMem {
    /// A pool on `device` (`ordinal`) and its stream; the context is current.
    fn new(device: sys::CUdevice, ordinal: usize) -> std::result::Result<OrderedMem, CUresult> {
        // SAFETY: a plain C struct; all-zero is its documented default
        // (no handle types, no size limit) before the fields set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ordinal as i32;
        let _ = device;
        let mut pool = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; props is initialised.
        let r = unsafe { sys::cuMemPoolCreate(&mut pool, &props) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(r);
        }
        let mut keep_all: u64 = u64::MAX;
        // SAFETY: the attribute takes a u64, written from a local.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep_all as *mut u64).cast(),
            )
        };
        let mut s = std::ptr::null_mut();
        let r = if r == CUresult::CUDA_SUCCESS {
            // SAFETY: out-pointer to a local.
            unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            }
        } else {
            r
        };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: our pool, with nothing allocated from it.
            unsafe { sys::cuMemPoolDestroy(pool) };
            return Err(r);
        }
        Ok(OrderedMem {
            stream: StreamHandle(s),
            pool: PoolHandle(pool),
        })
    }

    /// Bytes allocated from the pool and not yet freed (a test hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    fn used_bytes(&self) -> Option<u64> {
        let mut used: u64 = 0;
        // SAFETY: the attribute is a u64, written to a local; the pool is alive.
        let r = unsafe {
            sys::cuMemPoolGetAttribute(
                self.pool.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            )
        };
        (r == CUresult::CUDA_SUCCESS).then_some(used)
    }
}

impl Drop for OrderedMem {
    fn drop(&mut self) {
        // SAFETY: our stream and pool; every buffer from the pool holds the
        // backend (and so this), so none is outstanding; a pool with frees
        // still pending is released by the driver once they complete.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream.0);
            sys::cuMemPoolDestroy(self.pool.0);
        }
    }
}

/// Memory the GPU is done with, to be freed or unregistered off the watchers.
enum ParkedFree {
    Device(u64),
    Host(*mut u8),
    /// A registered range, and what frees it once unregistered.
    Unregister(*mut u8, Box<dyn FnOnce() + Send>),
}
// SAFETY: a device address, a pinned host allocation or a registered range
// owned by nobody else (its owner was dropped; `release` is Send); freeing or
// unregistering it from another thread is allowed.
unsafe impl Send for ParkedFree {}

/// Whether the calling thread is a watcher (see `Shared::parked`).
fn on_watcher() -> bool {
    crate::completion::on_completion_thread()
}

/// Events kept for reuse per kind; more are destroyed.
const EVENT_POOL_CAP: usize = 4096;

/// A raw event handle in the free list.
struct RawCuEvent(sys::CUevent);
// SAFETY: CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for RawCuEvent {}

impl Drop for Shared {
    fn drop(&mut self) {
        // Every EventHandle holds an Arc<Shared>, so no pooled event is in use.
        let _ = self.bind();
        // Every stream holds an Arc<Shared> too: no work is left to wait for,
        // so even a watcher thread may free here.
        self.free_parked_now();
        // The memory pool and its stream go while the context is still
        // retained (`ctx`, a field, is released after this body).
        drop(self.ordered.take());
        for list in &self.free_events {
            for e in lock(list).drain(..) {
                // SAFETY: the event is ours and unused (see above).
                unsafe {
                    sys::cuEventDestroy_v2(e.0);
                }
            }
        }
    }
}

impl Shared {
    /// Checks a driver result; a sticky error marks the context broken.
    fn check(&self, call: &'static str, r: CUresult) -> Result<()> {
        if r == CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let err = Error::Driver {
            call,
            code: code_name(r),
        };
        if is_sticky(r) {
            let _ = self.broken.set(Error::ContextBroken(err.to_string()));
            return Err(self.broken.get().cloned().unwrap_or(err));
        }
        Err(err)
    }

    /// Fails at once when the context is broken.
    fn usable(&self) -> Result<()> {
        match self.broken.get() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Parks a free when called on a watcher thread; returns whether it did.
    fn park_on_watcher(&self, free: ParkedFree) -> bool {
        if !on_watcher() {
            return false;
        }
        self.park(free);
        true
    }

    fn park(&self, free: ParkedFree) {
        lock(&self.parked).push(free);
        self.has_parked.store(true, Ordering::Release);
    }

    /// Frees what watchers parked (called off the watchers: allocations,
    /// frees, new streams, synchronize, and at the end).
    fn free_parked(&self) {
        if self.has_parked.load(Ordering::Acquire) && !on_watcher() {
            self.free_parked_now();
        }
    }

    fn free_parked_now(&self) {
        let parked = {
            let mut p = lock(&self.parked);
            self.has_parked.store(false, Ordering::Release);
            std::mem::take(&mut *p)
        };
        if self.bind().is_err() {
            return; // nothing can be freed without the context; the driver reclaims it
        }
        for free in parked {
            // SAFETY: parked by free_device / free_host / unregister_host_then,
            // whose callers guaranteed the memory is ours and unused; nothing
            // else holds it.
            let (call, r) = unsafe {
                match free {
                    ParkedFree::Device(d) => ("cuMemFree", sys::cuMemFree_v2(d)),
                    ParkedFree::Host(h) => ("cuMemFreeHost", sys::cuMemFreeHost(h.cast())),
                    ParkedFree::Unregister(h, release) => {
                        let r = sys::cuMemHostUnregister(h.cast());
                        release();
                        ("cuMemHostUnregister", r)
                    }
                }
            };
            if let Err(e) = self.check(call, r) {
                eprintln!("warning: a deferred free failed: {e}");
            }
        }
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| Error::Driver {
            call: "cuCtxSetCurrent",
            code: code_name(e.0),
        })
    }
}

/// A loaded module, unloaded when the last function handle of it goes.
pub(crate) struct ModuleHandle {
    module: sys::CUmodule,
    shared: Arc<Shared>,
    /// Each entry's parameter sizes, read from the PTX text.
    entries: std::collections::HashMap<String, Vec<usize>>,
}
// SAFETY: CUmodule is an opaque driver handle; the driver API is thread-safe.
unsafe impl Send for ModuleHandle {}
// SAFETY: as above; the handle is never mutated on our side.
unsafe impl Sync for ModuleHandle {}

impl Drop for ModuleHandle {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: our module; every function handle of it holds this
            // handle's Arc, and a launch keeps its function until enqueued
            // (the driver keeps what queued work needs).
            unsafe {
                sys::cuModuleUnload(self.module);
            }
        }
    }
}

/// A kernel entry point; holds its module.
pub(crate) struct FunctionHandle {
    func: sys::CUfunction,
    _module: Arc<ModuleHandle>,
}
// SAFETY: CUfunction is an opaque driver handle; launching from several threads is allowed.
unsafe impl Send for FunctionHandle {}
// SAFETY: as above.
unsafe impl Sync for FunctionHandle {}

/// An owned CUDA event, recycled (or destroyed) on drop.
pub(crate) struct EventHandle {
    ev: sys::CUevent,
    timing: bool,
    shared: Arc<Shared>,
}
// SAFETY: CUevent is an opaque driver handle usable from any thread.
unsafe impl Send for EventHandle {}
// SAFETY: as above; record/query/synchronize are thread-safe driver calls.
unsafe impl Sync for EventHandle {}

impl EventHandle {
    /// `cuEventSynchronize` on the calling thread: the baseline the watcher's
    /// wake-up is measured against (a benchmark hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    pub(crate) fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is alive while &self is.
        let r = unsafe { sys::cuEventSynchronize(self.ev) };
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(Error::Driver {
                call: "cuEventSynchronize",
                code: code_name(r),
            })
        }
    }
}

impl Drop for EventHandle {
    fn drop(&mut self) {
        // Reuse is safe: nobody holds this handle any more, and a stream wait
        // already enqueued on it refers to the record made before it (a later
        // cuEventRecord does not change what an enqueued wait waits for).
        if self.shared.broken.get().is_none() {
            let mut free = lock(&self.shared.free_events[self.timing as usize]);
            if free.len() < EVENT_POOL_CAP {
                free.push(RawCuEvent(self.ev));
                return;
            }
        }
        // SAFETY: we own the event; the driver defers destruction of a pending event.
        unsafe {
            sys::cuEventDestroy_v2(self.ev);
        }
    }
}

/// The CUDA backend for one device.
pub(crate) struct CudaBackend {
    shared: Arc<Shared>,
    info: DeviceInfo,
}

impl CudaBackend {
    /// Opens device `ordinal` and loads the kernels' PTX.
    pub fn new(ordinal: usize, wait_mode: WaitMode, memory: DeviceMemory) -> Result<Self> {
        if !driver_present() {
            return Err(Error::BackendUnavailable(
                "the CUDA driver library (libcuda) is not installed".into(),
            ));
        }
        let drv = |call: &'static str| {
            move |e: cudarc::driver::DriverError| Error::Driver {
                call,
                code: code_name(e.0),
            }
        };
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice {
                index: ordinal,
                count,
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))? as u32;
        let name = ctx.name().map_err(drv("cuDeviceGetName"))?;
        // SAFETY: a valid device handle from the context.
        let total_memory = unsafe { cudarc::driver::result::device::total_mem(ctx.cu_device()) }
            .map_err(drv("cuDeviceTotalMem"))? as u64;
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(drv("cuDriverGetVersion"))?;

        let pools = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
            .unwrap_or(0)
            == 1;
        let ordered = match memory {
            DeviceMemory::StreamOrdered if pools => Some(
                OrderedMem::new(ctx.cu_device(), ordinal).map_err(|r| Error::Driver {
                    call: "cuMemPoolCreate",
                    code: code_name(r),
                })?,
            ),
            _ => None,
        };
        let info = DeviceInfo {
            backend: crate::BackendKind::Cuda,
            name,
            driver: Some(format!("{}.{}", version / 1000, (version % 1000) / 10)),
            compute_units: sm_count,
            total_memory,
            ordinal,
            stream_ordered_memory: ordered.is_some(),
        };
        Ok(CudaBackend {
            shared: Arc::new(Shared {
                ctx,
                broken: OnceLock::new(),
                wait_mode,
                free_events: Default::default(),
                parked: Mutex::new(Vec::new()),
                has_parked: AtomicBool::new(false),
                ordered,
                batch_copies: version >= 13000,
            }),
            info,
        })
    }
}

impl Backend for CudaBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn pci_bus_id(&self) -> Option<String> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: writes at most `len` bytes, NUL-terminated, into the buffer.
        let r = unsafe {
            sys::cuDeviceGetPCIBusId(
                buf.as_mut_ptr(),
                buf.len() as i32,
                self.shared.ctx.cu_device(),
            )
        };
        if r != CUresult::CUDA_SUCCESS {
            return None;
        }
        // SAFETY: NUL-terminated by the driver within the buffer.
        let id = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Some(id.to_string_lossy().to_ascii_lowercase())
    }

    fn enable_peer_access(&self, peer: &dyn Backend) -> Result<bool> {
        let Some(peer) = peer.as_any().downcast_ref::<CudaBackend>() else {
            return Ok(false);
        };
        let (me, them) = (self.shared.ctx.cu_device(), peer.shared.ctx.cu_device());
        if me == them {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: writes one int; both are valid device handles.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, me, them) };
        self.shared.check("cuDeviceCanAccessPeer", r)?;
        if can == 0 {
            return Ok(false);
        }
        self.shared.bind()?;
        // SAFETY: the peer's context is alive (we hold its backend); the
        // current context is ours.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.shared.ctx.cu_ctx(), 0) };
        if r == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(true);
        }
        self.shared.check("cuCtxEnablePeerAccess", r)?;
        Ok(true)
    }

    fn parked_frees(&self) -> usize {
        lock(&self.shared.parked)
            .iter()
            .filter(|f| matches!(f, ParkedFree::Device(_)))
            .count()
    }

    fn ordered_bytes_in_use(&self) -> Option<u64> {
        self.shared
            .ordered
            .as_ref()
            .and_then(OrderedMem::used_bytes)
    }

    fn broken(&self) -> Option<Error> {
        self.shared.broken.get().cloned()
    }

    fn alloc_host(&self, bytes: usize, flags: HostFlags, node: Option<u32>) -> Result<HostAlloc> {
        self.shared.usable()?;
        self.shared.free_parked();
        self.shared.bind()?;
        if let Some(node) = node {
            // Pages allocated on `node` first, then pinned in place.
            let ptr = crate::numa::map_on_node(bytes, node)?;
            let mut f = 0;
            if flags.portable {
                f |= sys::CU_MEMHOSTREGISTER_PORTABLE;
            }
            if flags.device_mapped {
                f |= sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            }
            // SAFETY: our fresh mapping, which stays put until free_host.
            let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), bytes, f) };
            if let Err(e) = self.shared.check("cuMemHostRegister", r) {
                // SAFETY: the mapping just made, never registered.
                unsafe { libc::munmap(ptr.cast(), bytes) };
                return Err(e);
            }
            return Ok(HostAlloc {
                ptr,
                bytes,
                locked: true,
                placed: true,
            });
        }
        let mut f = 0;
        if flags.portable {
            f |= sys::CU_MEMHOSTALLOC_PORTABLE;
        }
        if flags.write_combined {
            f |= sys::CU_MEMHOSTALLOC_WRITECOMBINED;
        }
        if flags.device_mapped {
            f |= sys::CU_MEMHOSTALLOC_DEVICEMAP;
        }
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context is current.
        let r = unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, f) };
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::LockFailed {
                bytes,
                reason: "the driver could not page-lock that much host memory".into(),
            });
        }
        self.shared.check("cuMemHostAlloc", r)?;
        Ok(HostAlloc {
            ptr: ptr.cast(),
            bytes,
            locked: true,
            placed: false,
        })
    }

    unsafe fn free_host(&self, alloc: &HostAlloc) -> Result<()> {
        if alloc.placed {
            let (ptr, bytes) = (alloc.ptr as usize, alloc.bytes);
            let unmap = Box::new(move || {
                // SAFETY: our mapping (alloc_host made it), unregistered by
                // now and used by nobody.
                unsafe { libc::munmap(ptr as *mut c_void, bytes) };
            });
            // SAFETY: registered by alloc_host and unused (caller); the
            // release unmaps our mapping once it is unregistered.
            return unsafe { self.unregister_host_then(alloc.ptr, alloc.bytes, unmap) };
        }
        if self.shared.park_on_watcher(ParkedFree::Host(alloc.ptr)) {
            return Ok(());
        }
        self.shared.free_parked();
        self.shared.bind()?;
        // SAFETY: the caller guarantees the allocation is ours and unused.
        let r = unsafe { sys::cuMemFreeHost(alloc.ptr.cast()) };
        self.shared.check("cuMemFreeHost", r)
    }

    unsafe fn register_host(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        self.shared.free_parked();
        self.shared.bind()?;
        // SAFETY: the caller guarantees the range is valid and stays put.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        self.shared.check("cuMemHostRegister", r)
    }

    unsafe fn unregister_host(&self, ptr: *mut u8, _bytes: usize) -> Result<()> {
        self.shared.free_parked();
        self.shared.bind()?;
        // SAFETY: registered by register_host, no operation pending (caller).
        let r = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        self.shared.check("cuMemHostUnregister", r)
    }

    unsafe fn unregister_host_then(
        &self,
        ptr: *mut u8,
        bytes: usize,
        release: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        if on_watcher() {
            self.shared.park(ParkedFree::Unregister(ptr, release));
            return Ok(());
        }
        // SAFETY: the caller's contract, passed on.
        let r = unsafe { self.unregister_host(ptr, bytes) };
        release();
        r
    }

    unsafe fn mapped_device_ptr(&self, ptr: *mut u8) -> Result<u64> {
        self.shared.bind()?;
        let mut d = 0;
        // SAFETY: ptr is in a device-mapped allocation (caller).
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr.cast(), 0) };
        self.shared.check("cuMemHostGetDevicePointer", r)?;
        Ok(d)
    }

    fn alloc_device(&self, bytes: usize) -> Result<u64> {
        self.shared.usable()?;
        self.shared.free_parked();
        if bytes == 0 {
            return Ok(0);
        }
        self.shared.bind()?;
        let mut d = 0;
        if let Some(o) = &self.shared.ordered {
            // SAFETY: out-pointer to a local; our pool and stream are alive.
            let r = unsafe { sys::cuMemAllocFromPoolAsync(&mut d, bytes, o.pool.0, o.stream.0) };
            self.shared.check("cuMemAllocFromPoolAsync", r)?;
            // The allocation is ordered on the internal stream only: wait for
            // it (and the frees before it) so any stream may use the memory.
            // SAFETY: our stream, alive.
            let r = unsafe { sys::cuStreamSynchronize(o.stream.0) };
            if let Err(e) = self.shared.check("cuStreamSynchronize", r) {
                // SAFETY: just allocated, never used.
                unsafe { sys::cuMemFreeAsync(d, o.stream.0) };
                return Err(e);
            }
            return Ok(d);
        }
        // SAFETY: out-pointer to a local; the context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut d, bytes) };
        self.shared.check("cuMemAlloc", r)?;
        Ok(d)
    }

    unsafe fn free_device(&self, ptr: u64) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        if let Some(o) = &self.shared.ordered {
            // Enqueued on the internal stream, where nothing else runs: it
            // waits for nothing, on a watcher too (no parking).
            self.shared.bind()?;
            // SAFETY: allocated from our pool by alloc_device; its users have
            // finished (the caller's guarantee), so freeing it in the
            // internal stream's order is freeing it now.
            let r = unsafe { sys::cuMemFreeAsync(ptr, o.stream.0) };
            return self.shared.check("cuMemFreeAsync", r);
        }
        if self.shared.park_on_watcher(ParkedFree::Device(ptr)) {
            return Ok(());
        }
        self.shared.free_parked();
        self.shared.bind()?;
        // SAFETY: allocated by alloc_device, unused (caller).
        let r = unsafe { sys::cuMemFree_v2(ptr) };
        self.shared.check("cuMemFree", r)
    }

    unsafe fn copy_h2d_sync(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        if bytes == 0 {
            return Ok(());
        }
        self.shared.bind()?;
        // SAFETY: valid ranges (caller); synchronous.
        let r = unsafe { sys::cuMemcpyHtoD_v2(dst, src.cast(), bytes) };
        self.shared.check("cuMemcpyHtoD", r)?;
        // From pageable memory the call returns once the data is staged, not
        // when it has landed; our streams don't wait for the legacy stream
        // the copy runs on, so wait for it here (it holds nothing else of ours).
        // SAFETY: the legacy default stream of the current context.
        let r = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
        self.shared.check("cuStreamSynchronize", r)
    }

    unsafe fn copy_d2h_sync(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        if bytes == 0 {
            return Ok(());
        }
        self.shared.bind()?;
        // SAFETY: valid ranges (caller); synchronous.
        let r = unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src, bytes) };
        self.shared.check("cuMemcpyDtoH", r)
    }

    fn load_module(&self, ptx: &str) -> Result<RawModule> {
        self.shared.usable()?;
        self.shared.bind()?;
        let text = std::ffi::CString::new(ptx)
            .map_err(|_| Error::InvalidArgument("PTX text contains a NUL byte".into()))?;
        // SAFETY: a NUL-terminated PTX image; the context is current on this thread.
        let module = unsafe { cudarc::driver::result::module::load_data(text.as_ptr().cast()) }
            .map_err(|e| Error::Driver {
                call: "cuModuleLoadData",
                code: code_name(e.0),
            })?;
        Ok(RawModule::Cuda(Arc::new(ModuleHandle {
            module,
            shared: self.shared.clone(),
            entries: crate::ptx_entries::entry_params(ptx),
        })))
    }

    fn get_function(
        &self,
        module: &Arc<RawModule>,
        name: &str,
        sizes: &[usize],
    ) -> Result<RawFunction> {
        let RawModule::Cuda(m) = &**module else {
            return Err(Error::InvalidArgument("a module of another backend".into()));
        };
        self.shared.bind()?;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument("kernel name with a NUL byte".into()))?;
        // SAFETY: the module is loaded and alive (m holds it).
        let func = unsafe { cudarc::driver::result::module::get_function(m.module, cname) }
            .map_err(|e| Error::Driver {
                call: "cuModuleGetFunction",
                code: code_name(e.0),
            })?;
        if let Some(found) = m.entries.get(name) {
            if found != sizes {
                return Err(Error::InvalidArgument(format!(
                    "kernel `{name}`: the PTX entry takes parameters of {found:?} bytes, the \
                     declaration {sizes:?}: the module was not built from this declaration"
                )));
            }
        }
        Ok(RawFunction::Cuda(FunctionHandle {
            func,
            _module: m.clone(),
        }))
    }

    fn new_stream(&self) -> Result<Box<dyn RawStream>> {
        self.shared.usable()?;
        self.shared.free_parked();
        self.shared.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local. Non-blocking: no implicit sync with stream 0.
        let r = unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        };
        self.shared.check("cuStreamCreate", r)?;
        let (tx, rx) = mpsc::channel();
        let shared = self.shared.clone();
        let sent = Arc::new(AtomicUsize::new(0));
        let counted = sent.clone();
        let thread = std::thread::Builder::new()
            .name("cuda-watcher".into())
            .spawn(move || watch(shared, rx, &counted))
            .map_err(|e| Error::Internal(format!("cannot start a watcher thread: {e}")))?;
        Ok(Box::new(CudaStream {
            stream: StreamHandle(s),
            shared: self.shared.clone(),
            watcher: Mutex::new(Some(tx)),
            sent,
            thread: Mutex::new(Some(thread)),
        }))
    }

    fn elapsed_ms(&self, start: &Timer, end: &Timer) -> Result<f32> {
        match (start, end) {
            (Timer::Cuda(a), Timer::Cuda(b)) => {
                self.shared.bind()?;
                let mut ms = 0.0f32;
                // SAFETY: both events are alive and were recorded with timing.
                let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, a.ev, b.ev) };
                if r == CUresult::CUDA_ERROR_NOT_READY {
                    return Err(Error::NotReady);
                }
                self.shared.check("cuEventElapsedTime", r)?;
                Ok(ms)
            }
            _ => Err(Error::NotTimed),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.usable()?;
        self.shared.bind()?;
        self.shared.free_parked();
        // SAFETY: the context is current on this thread.
        let r = unsafe { sys::cuCtxSynchronize() };
        self.shared.check("cuCtxSynchronize", r)
    }
}

/// What a stream sends its watcher: an event recorded on it and the completion it ends.
type WatchTx = mpsc::Sender<(Arc<EventHandle>, Completion)>;
type WatchRx = mpsc::Receiver<(Arc<EventHandle>, Completion)>;

/// The watcher: completes each recorded point of one stream, in order.
/// `sent` counts the points sent on `rx`.
fn watch(shared: Arc<Shared>, rx: WatchRx, sent: &AtomicUsize) {
    crate::completion::mark_completion_thread();
    let bound = shared.bind();
    let poll = shared.wait_mode == WaitMode::Poll;
    if poll {
        tight_timer_slack();
    }
    let spin = shared.wait_mode == WaitMode::Spin;
    let mut taken = 0usize;
    while let Some((event, completion)) = next_point(&rx, spin, sent, &mut taken) {
        let result = match (bound.clone(), shared.usable()) {
            (Err(e), _) | (_, Err(e)) => Err(e),
            _ if poll => poll_event(&shared, event.ev),
            // SAFETY: the event is alive (we hold it) and was recorded on our stream.
            _ => shared.check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(event.ev)
            }),
        };
        // Wake first: recycling the event is not on the waiter's path.
        completion.complete(result);
        drop(event);
    }
}

/// How long a spinning watcher keeps looking for the next point after its
/// queue runs dry, before it sleeps in the channel: back-to-back jobs (a
/// task awaiting one copy after another) then find it awake, and their
/// sender wakes no thread.
const IDLE_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// The next point recorded on the watcher's stream, in order; `None` once
/// the stream is gone. With `spin`, the count of points sent (`sent`, of
/// which `taken` were received) is watched for [`IDLE_SPIN`] before the
/// thread blocks in the channel.
fn next_point(
    rx: &WatchRx,
    spin: bool,
    sent: &AtomicUsize,
    taken: &mut usize,
) -> Option<(Arc<EventHandle>, Completion)> {
    if spin {
        let start = std::time::Instant::now();
        while sent.load(Ordering::Acquire) == *taken && start.elapsed() < IDLE_SPIN {
            std::hint::spin_loop();
        }
        // Counted after the send: a count ahead of `taken` means a point
        // waits in the channel (or the count is stale: the blocking receive
        // below then waits for it).
        match rx.try_recv() {
            Ok(point) => {
                *taken += 1;
                return Some(point);
            }
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
    }
    let point = rx.recv().ok()?;
    *taken += 1;
    Some(point)
}

struct StreamHandle(sys::CUstream);
// SAFETY: CUstream is an opaque driver handle; enqueueing from several threads is allowed.
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}

struct CudaStream {
    stream: StreamHandle,
    shared: Arc<Shared>,
    watcher: Mutex<Option<WatchTx>>,
    /// Points sent to the watcher so far: what a spinning watcher watches
    /// (one word) instead of the channel, whose lines the sender then
    /// writes without a reader pulling them away at every look.
    sent: Arc<AtomicUsize>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // Pending work still runs to completion; the driver releases the stream
        // afterwards. The watcher drains its queue (delivering the completions
        // and deferred releases still due) and exits when the sender goes.
        // SAFETY: we own the stream handle.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream.0);
        }
        drop(lock(&self.watcher).take());
        // Wait for it: a watcher left running could be the last owner of the
        // context and tear it down while the process exits, racing the
        // driver's own teardown (seen as heap corruption at exit under
        // compute-sanitizer). Not from the watcher itself (a deferred release
        // that drops its own stream).
        if let Some(t) = lock(&self.thread).take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl CudaStream {
    fn new_event(&self, timing: bool) -> Result<EventHandle> {
        let recycled = lock(&self.shared.free_events[timing as usize]).pop();
        if let Some(RawCuEvent(ev)) = recycled {
            return Ok(EventHandle {
                ev,
                timing,
                shared: self.shared.clone(),
            });
        }
        let mut flags = 0;
        if !timing {
            flags |= sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        }
        if self.shared.wait_mode == WaitMode::Blocking {
            flags |= sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        }
        let mut e = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuEventCreate(&mut e, flags) };
        self.shared.check("cuEventCreate", r)?;
        Ok(EventHandle {
            ev: e,
            timing,
            shared: self.shared.clone(),
        })
    }

    /// An event (recycled or new) recorded at this point of the stream.
    fn record_event(&self, timing: bool) -> Result<Arc<EventHandle>> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        let event = Arc::new(self.new_event(timing)?);
        // SAFETY: event and stream are alive.
        let r = unsafe { sys::cuEventRecord(event.ev, self.stream.0) };
        self.shared.check("cuEventRecord", r)?;
        Ok(event)
    }
}

impl RawStream for CudaStream {
    unsafe fn copy_h2d(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, self.stream.0) };
        self.shared.check("cuMemcpyHtoDAsync", r)
    }

    unsafe fn copy_d2h(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, self.stream.0) };
        self.shared.check("cuMemcpyDtoHAsync", r)
    }

    unsafe fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion (caller); the stream is ours.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream.0) };
        self.shared.check("cuMemcpyDtoDAsync", r)
    }

    unsafe fn copy_peer(
        &self,
        dst: u64,
        dst_dev: &dyn Backend,
        src: u64,
        src_dev: &dyn Backend,
        bytes: usize,
    ) -> Result<()> {
        let ctx = |b: &dyn Backend| {
            b.as_any()
                .downcast_ref::<CudaBackend>()
                .map(|c| c.shared.ctx.cu_ctx())
                .ok_or_else(|| {
                    Error::InvalidArgument("a peer copy to or from another backend".into())
                })
        };
        let (dst_ctx, src_ctx) = (ctx(dst_dev)?, ctx(src_dev)?);
        self.shared.usable()?;
        self.shared.bind()?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: ranges valid until completion, each in its context's
        // memory (caller); both contexts alive (the caller holds their
        // backends); the stream is ours.
        let r = unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, self.stream.0) };
        self.shared.check("cuMemcpyPeerAsync", r)
    }

    unsafe fn copy_batch(&self, copies: &[crate::transfer::RawCopy]) -> Result<()> {
        self.shared.usable()?;
        self.shared.bind()?;
        let copies: Vec<_> = copies.iter().filter(|c| c.bytes > 0).collect();
        if copies.len() < 2 || !self.shared.batch_copies {
            for c in copies {
                // SAFETY: ranges valid until completion (caller); unified
                // addressing names host and device memory alike; the
                // stream is ours.
                let r = unsafe { sys::cuMemcpyAsync(c.dst, c.src, c.bytes, self.stream.0) };
                self.shared.check("cuMemcpyAsync", r)?;
            }
            return Ok(());
        }
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.src).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.bytes).collect();
        // SAFETY: a C struct of integers and enums whose zero values are
        // valid (location hints of the "invalid" type: no hint; default
        // flags); the access order is set next.
        let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        // The sources are read in stream order: after the work before the
        // batch on this stream, which is what the job's ownership promises.
        attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut first = 0usize;
        // SAFETY: the three arrays have `len` entries and outlive the call;
        // one attribute applies from copy 0; the ranges are valid until
        // completion (caller); the driver has the entry point (checked at
        // creation: `batch_copies`); the stream is ours.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                dsts.len(),
                &mut attrs,
                &mut first,
                1,
                self.stream.0,
            )
        };
        self.shared.check("cuMemcpyBatchAsync", r)
    }

    unsafe fn launch(&self, mut launch: RawLaunch<'_>) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        let RawFunction::Cuda(f) = launch.function else {
            return Err(Error::InvalidArgument(
                "a kernel function of another backend".into(),
            ));
        };
        let mut params = launch.params.pointers();
        let c = launch.config;
        // SAFETY: the function comes from a loaded module of this context;
        // `params` points at one live value of each declared parameter type
        // (the declaration's tuple); ranges valid until completion (caller).
        let r = unsafe {
            sys::cuLaunchKernel(
                f.func,
                c.grid,
                1,
                1,
                c.block,
                1,
                1,
                0,
                self.stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.shared.check("cuLaunchKernel", r)
    }

    fn record(&self, timing: bool) -> Result<RawEvent> {
        let event = self.record_event(timing)?;
        let completion = Completion::new();
        lock(&self.watcher)
            .as_ref()
            .ok_or_else(|| Error::Internal("the stream's watcher has stopped".into()))?
            .send((event.clone(), completion.clone()))
            .map_err(|_| Error::Internal("the stream's watcher has stopped".into()))?;
        self.sent.fetch_add(1, Ordering::Release);
        Ok(RawEvent {
            completion,
            // The handle is kept for cross-stream waits; only timed events can be
            // measured (cuEventElapsedTime reports an error otherwise).
            timer: Timer::Cuda(event),
            timing,
        })
    }

    fn marker(&self, timing: bool) -> Result<RawEvent> {
        Ok(RawEvent {
            completion: Completion::new(),
            timer: Timer::Cuda(self.record_event(timing)?),
            timing,
        })
    }

    fn synchronize_in_driver(&self) -> Result<()> {
        self.shared.usable()?;
        self.shared.bind()?;
        // SAFETY: our stream, alive while self is.
        let r = unsafe { sys::cuStreamSynchronize(self.stream.0) };
        self.shared.check("cuStreamSynchronize", r)
    }

    fn wait(&self, event: &RawEvent) -> Result<()> {
        self.shared.usable()?;
        // Any thread may enqueue (tokio workers, watchers): make the context current.
        self.shared.bind()?;
        match &event.timer {
            Timer::Cuda(e) => {
                // SAFETY: both handles alive.
                let r = unsafe { sys::cuStreamWaitEvent(self.stream.0, e.ev, 0) };
                self.shared.check("cuStreamWaitEvent", r)
            }
            _ => Err(Error::InvalidArgument(
                "cannot wait for an event of another backend".into(),
            )),
        }
    }
}

impl EventHandle {
    /// The driver's handle, for [`crate::interop::raw_event`]: valid while
    /// `self` is alive.
    pub(crate) fn raw_handle(&self) -> sys::CUevent {
        self.ev
    }
}
