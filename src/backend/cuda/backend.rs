//! The CUDA backend for one device: memory, registration, modules, streams.

use super::driver::{code_name, device_count, driver_present, StreamHandle};
use super::event::EventHandle;
use super::module::{FunctionHandle, ModuleHandle};
use super::options::{DeviceMemory, WaitMode};
use super::ordered::OrderedMem;
use super::shared::{on_watcher, ParkedFree, Shared};
use super::stream::CudaStream;
use super::watch;
use crate::backend::{
    Backend, DeviceInfo, HostAlloc, HostFlags, RawFunction, RawModule, RawStream, Timer,
};
use crate::base::completion::lock;
use crate::base::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::CudaContext;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// The CUDA backend for one device.
pub(crate) struct CudaBackend {
    pub(super) shared: Arc<Shared>,
    pub(super) info: DeviceInfo,
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
        let attr = |a| {
            ctx.attribute(a)
                .map_err(drv("cuDeviceGetAttribute"))
                .map(|v| v as u32)
        };
        use sys::CUdevice_attribute as A;
        let limits = crate::backend::LaunchLimits {
            max_threads_per_block: attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_block_dims: [
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z)?,
            ],
            max_grid_dims: [
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
            ],
            max_shared_bytes_per_block: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
        };
        let info = DeviceInfo {
            backend: crate::backend::BackendKind::Cuda,
            name,
            driver: Some(format!("{}.{}", version / 1000, (version % 1000) / 10)),
            compute_units: sm_count,
            total_memory,
            ordinal,
            stream_ordered_memory: ordered.is_some(),
            limits,
            compute_capability: Some((
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            )),
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
                draining: Default::default(),
                release_failures: Default::default(),
                generation: crate::backend::Generation::now(),
            }),
            info,
        })
    }

    /// Pins `ptr..ptr+bytes` in place (`cuMemHostRegister`: portable,
    /// device-mapped, and `extra` flags); `call` names it in an error.
    ///
    /// # Safety
    /// As for [`Backend::register_host`], with the range valid for what
    /// `extra` lets the device do.
    unsafe fn register(
        &self,
        ptr: *mut u8,
        bytes: usize,
        extra: u32,
        call: &'static str,
    ) -> Result<bool> {
        self.shared.usable()?;
        self.shared.free_parked();
        self.shared.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP | extra;
        // SAFETY: the caller guarantees the range is valid and stays put.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), bytes, flags) };
        self.shared.check(call, r)?;
        Ok(true) // the driver locks what it registers, or fails
    }
}

impl Backend for CudaBackend {
    fn release_failures(&self) -> &crate::backend::ReleaseFailures {
        &self.shared.release_failures
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn as_any(&self) -> &dyn std::any::Any {
        // What a peer operation needs of another CUDA device: its context.
        &*self.shared
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
        let Some(peer) = peer.as_any().downcast_ref::<Shared>() else {
            return Ok(false);
        };
        let (me, them) = (self.shared.ctx.cu_device(), peer.ctx.cu_device());
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
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
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
            let ptr = crate::base::numa::map_on_node(bytes, node)?;
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
            return Err(Error::OutOfMemory {
                what: "CUDA pinned host memory (cuMemHostAlloc)",
                bytes,
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

    unsafe fn register_host(&self, ptr: *mut u8, bytes: usize) -> Result<bool> {
        // SAFETY: forwarded (valid, stays put).
        unsafe { self.register(ptr, bytes, 0, "cuMemHostRegister") }
    }

    unsafe fn register_host_read_only(&self, ptr: *mut u8, bytes: usize) -> Result<bool> {
        // SAFETY: forwarded (valid for reads, stays put).
        unsafe {
            self.register(
                ptr,
                bytes,
                sys::CU_MEMHOSTREGISTER_READ_ONLY,
                "cuMemHostRegister (read-only)",
            )
        }
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
            if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                return Err(Error::OutOfMemory {
                    what: "CUDA device memory (cuMemAllocFromPoolAsync)",
                    bytes,
                });
            }
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
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(Error::OutOfMemory {
                what: "CUDA device memory (cuMemAlloc)",
                bytes,
            });
        }
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
        Ok(RawModule::new(ModuleHandle {
            module,
            shared: self.shared.clone(),
            entries: crate::backend::ptx_entries::entry_params(ptx),
        }))
    }

    fn get_function(
        &self,
        module: &Arc<RawModule>,
        name: &str,
        sizes: &[usize],
    ) -> Result<RawFunction> {
        let Some(m) = module.get_shared::<ModuleHandle>() else {
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
        Ok(RawFunction::new(FunctionHandle {
            func,
            _module: m,
            dynamic_optin: Default::default(),
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
            .spawn(move || {
                let draining = shared.clone();
                watch::watch(shared, rx, &counted);
                // The stream was dropped and every point it sent is done.
                draining.draining.end();
            })
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
        match (start.get::<EventHandle>(), end.get::<EventHandle>()) {
            (Some(a), Some(b)) => {
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
        // Dropped streams' watchers still delivering completions.
        self.shared.draining.wait();
        self.shared.check("cuCtxSynchronize", r)
    }

    fn event_handle(&self, timer: &Timer) -> Option<u64> {
        timer.get::<EventHandle>().map(|h| h.raw_handle() as u64)
    }

    fn synchronize_event(&self, timer: &Timer) -> Option<Result<()>> {
        timer.get::<EventHandle>().map(EventHandle::synchronize)
    }
}
