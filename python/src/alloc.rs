//! Pinned host memory for Python: `PinnedAllocator` (the seed's API over the
//! stream-aware pool), `PinnedBuffer` (NumPy views through the buffer
//! protocol, counted), and `pin` (pin-in-place of an existing array).

use crate::buffer::ContiguousView;
use crate::device::{
    device_or_default, nbytes, parse_dtype_or_f32, parse_shape, Device, State, StateCell,
};
use crate::dtype::DType;
use crate::{convert::buffer_error, convert::IntoPy};
use bytemuck::Pod;
use gpufeed::interop::{cast_host, cast_host_mut, RegisteredRaw};
use gpufeed::{HostSlice, HostSliceMut, PinnedArray, PinnedHost, PinnedPool, PooledBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Pinned host memory a `PinnedBuffer` holds.
pub enum HostMem {
    /// On loan from the pool; goes back to it when dropped (after the
    /// device is done, when an operation owned it).
    Pool(PooledBuffer<u8>),
    /// A foreign array's memory pinned in place; unregistered when dropped,
    /// then the array's export is released.
    Registered(RegisteredRaw),
}

impl HostMem {
    /// Whether the memory is page-locked (false only on the CPU emulation
    /// under a memlock limit its lock policy let pass).
    fn is_locked(&self) -> bool {
        match self {
            HostMem::Pool(b) => b.is_locked(),
            HostMem::Registered(r) => r.is_locked(),
        }
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            HostMem::Pool(b) => b.as_mut_slice().as_mut_ptr(),
            HostMem::Registered(r) => r.as_mut_ptr(),
        }
    }
}

impl PinnedHost<u8> for HostMem {
    fn host(&self) -> HostSlice<'_, u8> {
        match self {
            HostMem::Pool(b) => b.host(),
            HostMem::Registered(r) => r.host(),
        }
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, u8> {
        match self {
            HostMem::Pool(b) => b.host_mut(),
            HostMem::Registered(r) => r.host_mut(),
        }
    }
}

/// Host memory seen as `T` (for the pipeline, whose kernels are typed).
/// Built only for memory checked to hold whole, aligned `T`s (`typed`).
pub struct Typed<T> {
    pub mem: HostMem,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: Pod> Typed<T> {
    /// `mem` as `T`, or an error (with `mem` back) when it isn't whole aligned `T`s.
    #[allow(clippy::result_large_err)]
    pub fn new(mem: HostMem) -> Result<Self, (gpufeed::Error, HostMem)> {
        if let Err(e) = cast_host::<T>(mem.host()) {
            return Err((e, mem));
        }
        Ok(Typed {
            mem,
            _t: std::marker::PhantomData,
        })
    }
}

impl<T: Pod> PinnedHost<T> for Typed<T> {
    fn host(&self) -> HostSlice<'_, T> {
        match cast_host(self.mem.host()) {
            Ok(v) => v,
            Err(_) => checked_cast_failed(),
        }
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        match cast_host_mut(self.mem.host_mut()) {
            Ok(v) => v,
            Err(_) => checked_cast_failed(),
        }
    }
}

/// `Typed::new` checked the cast on the same memory, so this is never
/// reached; abort rather than unwind across the Python boundary.
fn checked_cast_failed() -> ! {
    eprintln!("gpufeed: internal error: a typed view failed its checked cast");
    std::process::abort()
}

impl<T: Pod> PinnedArray for Typed<T> {
    type Elem = T;
    fn source(&self) -> HostSlice<'_, T> {
        self.host()
    }
    fn destination(&mut self) -> HostSliceMut<'_, T> {
        self.host_mut()
    }
}

/// The caching allocator of pinned host memory (the seed's API): `alloc`,
/// `free`, `get_array`, with the pool's statistics, cap and `empty_cache`.
/// Blocks freed while an operation still uses them return to the pool only
/// when the device is done.
#[pyclass(module = "gpufeed", frozen)]
pub struct PinnedAllocator {
    pool: PinnedPool,
    device: gpufeed::Device,
    cap: AtomicUsize,
}

#[pymethods]
impl PinnedAllocator {
    /// `PinnedAllocator(device=None, max_cached_bytes=None)`.
    #[new]
    #[pyo3(signature = (device=None, max_cached_bytes=None))]
    fn new(
        py: Python<'_>,
        device: Option<&Device>,
        max_cached_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let device = device_or_default(py, device)?;
        let pool = PinnedPool::new(&device);
        let cap = max_cached_bytes.unwrap_or(usize::MAX);
        pool.set_max_cached_bytes(cap);
        Ok(PinnedAllocator {
            pool,
            device,
            cap: AtomicUsize::new(cap),
        })
    }

    /// A pinned buffer of `shape` and `dtype`. Contents are unspecified (a
    /// reused block keeps old data) unless `zero=True`.
    #[pyo3(signature = (shape, dtype=None, zero=false))]
    fn alloc(
        &self,
        py: Python<'_>,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        zero: bool,
    ) -> PyResult<PinnedBuffer> {
        let shape = parse_shape(shape)?;
        let dtype = parse_dtype_or_f32(dtype)?;
        let bytes = nbytes(&shape, dtype)?;
        let mut buf = py.detach(|| self.pool.alloc::<u8>(bytes)).py()?;
        if zero {
            buf.as_mut_slice().fill(0);
        }
        Ok(PinnedBuffer::new(
            HostMem::Pool(buf),
            dtype,
            &shape,
            &self.device,
            None,
        ))
    }

    /// Frees `buf` (back to the pool; refused while it has live views).
    fn free(&self, buf: &Bound<'_, PinnedBuffer>) -> PyResult<()> {
        buf.get().free_inner(buf.py(), "freed by free()")
    }

    /// A NumPy array over `buf`'s pinned memory, no copy (see `PinnedBuffer.get_array`).
    fn get_array<'py>(&self, buf: &Bound<'py, PinnedBuffer>) -> PyResult<Bound<'py, PyAny>> {
        PinnedBuffer::get_array(buf)
    }

    /// Pins `obj` in place on this allocator's device (see `gpufeed.pin`).
    fn pin(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PinnedBuffer> {
        pin_on(py, obj, &self.device)
    }

    /// The pool's statistics: bytes in use / cached / peak, blocks in use,
    /// hits, misses, driver allocations and frees with their times.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let d = PyDict::new(py);
        d.set_item("in_use_bytes", s.in_use_bytes)?;
        d.set_item("cached_bytes", s.cached_bytes)?;
        d.set_item("peak_in_use_bytes", s.peak_in_use_bytes)?;
        d.set_item("blocks_in_use", s.blocks_in_use)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("driver_allocs", s.driver_allocs)?;
        d.set_item("driver_frees", s.driver_frees)?;
        d.set_item("failed_frees", s.failed_frees)?;
        d.set_item("driver_alloc_ns", s.driver_alloc_ns)?;
        d.set_item("driver_free_ns", s.driver_free_ns)?;
        Ok(d)
    }

    /// The cap on bytes kept in free blocks (None: no cap).
    #[getter]
    fn get_max_cached_bytes(&self) -> Option<usize> {
        Some(self.cap.load(Ordering::Relaxed)).filter(|&c| c != usize::MAX)
    }

    /// Sets the cap (None: no cap); blocks beyond it are freed now.
    #[setter]
    fn set_max_cached_bytes(&self, py: Python<'_>, cap: Option<usize>) {
        let cap = cap.unwrap_or(usize::MAX);
        self.cap.store(cap, Ordering::Relaxed);
        py.detach(|| self.pool.set_max_cached_bytes(cap));
    }

    /// Frees every cached block (blocks in use are untouched).
    fn empty_cache(&self, py: Python<'_>) {
        py.detach(|| self.pool.empty_cache());
    }

    /// The allocator's device.
    #[getter]
    fn device(&self) -> Device {
        Device {
            inner: self.device.clone(),
        }
    }
}

/// Pinned host memory of a shape and dtype: from a `PinnedAllocator`, or an
/// existing array pinned in place (`gpufeed.pin`).
///
/// NumPy sees it without a copy (`buf.get_array()`, `np.asarray(buf)`),
/// through counted views ([`PinnedView`]): while any is alive it can't be
/// freed or given to an operation (`BufferError`). It has no buffer protocol:
/// a memoryview can be released while the NumPy arrays built on it still
/// point at the memory, so a count kept through it could be dropped early. Given to an operation, its memory moves into the
/// operation (state `in-flight`: every access raises `BufferError`) and
/// comes back when the operation is waited for.
///
/// `__dlpack__` exports it as kDLCPU (what PyTorch, NumPy and CuPy accept for
/// host memory), or kDLCUDAHost with `dlpack_device = "cuda_host"` (NumPy
/// accepts it; PyTorch does not). bfloat16 is exported to NumPy as its raw
/// bits (`uint16`), to DLPack as kDLBfloat.
#[pyclass(module = "gpufeed", frozen)]
pub struct PinnedBuffer {
    pub(crate) state: StateCell<HostMem>,
    /// Live views ([`PinnedView`]s); raised under the state's lock.
    exports: Arc<AtomicUsize>,
    pub(crate) dtype: DType,
    shape: Box<[isize]>,
    pub(crate) nbytes: usize,
    pub(crate) device: gpufeed::Device,
    /// Pinned in place: the object whose memory this is (until the buffer
    /// is released), and the range pinned.
    origin: Option<Origin>,
    cuda_host: AtomicBool,
    /// The memory is page-locked (see `HostMem::is_locked`).
    locked: bool,
    /// Pinned in place: cleared when this object goes (see [`PinClaim`]).
    pin_alive: Option<Arc<AtomicBool>>,
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Some(a) = &self.pin_alive {
            a.store(false, Ordering::SeqCst);
        }
    }
}

/// References to a pinned-in-place object that are ours: `origin` and the
/// memoryview's managed buffer that keeps it exported.
const OUR_REFS: isize = 2;

/// What a buffer pinned in place knows of its object: the object, held
/// until the buffer is released (`free()`, `unpin()`: it then holds nothing,
/// and the object can be pinned again and given to operations), and the
/// range pinned (address, bytes).
pub(crate) struct Origin {
    obj: std::sync::Mutex<Option<Py<PyAny>>>,
    ptr: usize,
    len: usize,
}

impl Origin {
    fn held(&self) -> std::sync::MutexGuard<'_, Option<Py<PyAny>>> {
        self.obj.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new reference to the object, unless released. Python code is
    /// never run under the lock: the object is called through this one.
    fn object(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.held().as_ref().map(|o| o.clone_ref(py))
    }
}

impl PinnedBuffer {
    fn new(
        mem: HostMem,
        dtype: DType,
        shape: &[usize],
        device: &gpufeed::Device,
        origin: Option<Origin>,
    ) -> Self {
        let nbytes = shape.iter().product::<usize>() * dtype.size();
        let locked = mem.is_locked();
        PinnedBuffer {
            state: StateCell::ready(mem),
            exports: Arc::new(AtomicUsize::new(0)),
            dtype,
            shape: shape.iter().map(|&d| d as isize).collect(),
            nbytes,
            device: device.clone(),
            origin,
            cuda_host: AtomicBool::new(false),
            locked,
            pin_alive: None,
        }
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.shape.iter().product::<isize>() as usize
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape.
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| d as usize).collect()
    }

    /// Checks that the buffer may be given to an operation, with its state
    /// locked: ready, no live views, a pinned-in-place object unreachable but
    /// through us (no other reference; `weak`: whether it has weak ones,
    /// asked before the lock, since asking runs Python code).
    fn check_for_operation(&self, py: Python<'_>, weak: bool) -> PyResult<()> {
        let views = self.exports.load(Ordering::SeqCst);
        if views > 0 {
            return Err(buffer_error(format!(
                "the pinned buffer has {views} live view(s) (NumPy arrays, memoryviews, DLPack \
                 tensors): delete them before giving it to an operation"
            )));
        }
        if let Some(origin) = &self.origin {
            let held = origin.held();
            let Some(o) = held.as_ref() else {
                return Ok(()); // released: the state says so
            };
            let o = o.bind(py);
            // SAFETY: a live object (we hold a reference), GIL held; reading
            // counts calls no Python code.
            let n = unsafe { ffi::Py_REFCNT(o.as_ptr()) } - OUR_REFS;
            if n > 0 {
                return Err(buffer_error(format!(
                    "the array pinned in place is still referenced elsewhere ({n} reference(s)): \
                     Python could read or write it while the device does; drop them (`del x`) and \
                     reach it through the PinnedBuffer (get_array(), unpin())"
                )));
            }
            if weak {
                return Err(buffer_error(
                    "the array pinned in place has weak references: Python could reach it through \
                     them while the device uses it; drop them first",
                ));
            }
        }
        Ok(())
    }

    /// Moves the memory out for an operation (state: in-flight).
    pub(crate) fn take_for_operation(&self, py: Python<'_>) -> PyResult<HostMem> {
        // First what calls into Python (a call can run any code: the
        // garbage collector's finalizers too, which could replace the
        // array's memory), then the memory check and the take, between
        // which nothing runs Python code; none runs under the state's lock.
        let weak = self
            .origin
            .as_ref()
            .and_then(|o| o.object(py))
            .is_some_and(|o| has_weak_references(o.bind(py)));
        self.check_origin(py)?;
        self.state
            .take("the pinned buffer", |_| self.check_for_operation(py, weak))
    }

    /// Frees (or unpins) the buffer, saying `why` from then on; refused
    /// while views are alive or an operation holds it.
    fn free_inner(&self, py: Python<'_>, why: &str) -> PyResult<()> {
        let _ = py;
        let mem = self.state.take("the pinned buffer", |_| {
            let views = self.exports.load(Ordering::SeqCst);
            if views > 0 {
                return Err(buffer_error(format!(
                    "the pinned buffer has {views} live view(s): delete them before freeing it"
                )));
            }
            Ok(())
        })?;
        self.state.set(State::Freed(why.into()));
        drop(mem);
        Ok(())
    }

    /// For a buffer pinned in place: checks that its object still has the
    /// memory that was pinned. NumPy can replace an array's memory under a
    /// live export (`ndarray.__setstate__`, `resize(refcheck=False)`),
    /// freeing the pinned range: the buffer is then gone (it would read
    /// freed memory), and says why.
    fn check_origin(&self, py: Python<'_>) -> PyResult<()> {
        let Some(origin) = &self.origin else {
            return Ok(());
        };
        if !matches!(&*self.state.lock(), State::Ready(_)) {
            return Ok(()); // in flight (unreachable meanwhile) or gone already
        }
        let Some(o) = origin.object(py) else {
            return Ok(()); // released
        };
        if still_exports(o.bind(py), origin.ptr, origin.len).unwrap_or(false) {
            return Ok(());
        }
        let why = "the pinned array's memory was replaced or freed by its owner while pinned \
                   (ndarray.__setstate__, resize(refcheck=False)): the buffer is gone";
        let mut s = self.state.lock();
        if matches!(&*s, State::Ready(_)) && self.exports.load(Ordering::SeqCst) == 0 {
            let old = std::mem::replace(&mut *s, State::Freed(why.into()));
            drop(s);
            drop(old);
        }
        Err(buffer_error(why))
    }

    /// A counted view of the memory: the base object of the arrays handed
    /// out (see [`PinnedView`]).
    fn view<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PinnedView>> {
        let this = slf.get();
        this.check_origin(slf.py())?;
        let ptr = {
            // Counted under the state's lock: an operation or a free can't
            // take the memory between the check and the count.
            let mut state = this.state.lock();
            let ptr = state.get_mut("the pinned buffer")?.ptr() as usize;
            this.exports.fetch_add(1, Ordering::SeqCst);
            ptr
        };
        // Made before anything can fail, so its Drop takes the count back.
        let view = PinnedView {
            _buf: slf.clone().unbind(),
            exports: this.exports.clone(),
            ptr,
            shape: this.shape.clone(),
            typestr: this.dtype.typestr(),
        };
        Bound::new(slf.py(), view)
    }

    pub(crate) fn get_array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let view = Self::view(slf)?;
        slf.py().import("numpy")?.call_method1("asarray", (view,))
    }
}

/// Whether `obj` still exports the range `ptr..ptr + len` (a fresh
/// writable, C-contiguous export; no Python code runs for the types `pin()`
/// takes).
fn still_exports(obj: &Bound<'_, PyAny>, ptr: usize, len: usize) -> PyResult<bool> {
    ContiguousView::get(obj, true).map(|v| v.ptr as usize == ptr && v.len == len)
}

/// Whether `obj` has weak references (`weakref.ref(obj)` alive somewhere).
fn has_weak_references(obj: &Bound<'_, PyAny>) -> bool {
    Taken::get(obj.py())
        .and_then(|t| t.getweakrefcount.bind(obj.py()).call1((obj,)))
        .and_then(|n| n.extract::<usize>())
        .map_or(true, |n| n > 0)
}

/// What `pin()` and the operation checks use from Python, taken once, when
/// the module loads: rebinding `numpy.ndarray` or `weakref.getweakrefcount`
/// later changes nothing.
pub(crate) struct Taken {
    ndarray: Py<PyAny>,
    ndarray_flags: Py<PyAny>,
    ndarray_base: Py<PyAny>,
    bytearray: Py<PyAny>,
    array: Py<PyAny>,
    memoryview: Py<PyAny>,
    pickle_buffer: Py<PyAny>,
    getweakrefcount: Py<PyAny>,
}

static TAKEN: pyo3::sync::PyOnceLock<Taken> = pyo3::sync::PyOnceLock::new();

impl Taken {
    /// Taken now (the module's init calls it), or the earlier take.
    pub(crate) fn get(py: Python<'_>) -> PyResult<&'static Taken> {
        TAKEN.get_or_try_init(py, || {
            let ndarray = py.import("numpy")?.getattr("ndarray")?;
            Ok(Taken {
                ndarray_flags: ndarray.getattr("flags")?.unbind(),
                ndarray_base: ndarray.getattr("base")?.unbind(),
                ndarray: ndarray.unbind(),
                bytearray: py.import("builtins")?.getattr("bytearray")?.unbind(),
                array: py.import("array")?.getattr("array")?.unbind(),
                memoryview: py.import("builtins")?.getattr("memoryview")?.unbind(),
                pickle_buffer: py.import("pickle")?.getattr("PickleBuffer")?.unbind(),
                getweakrefcount: py.import("_weakref")?.getattr("getweakrefcount")?.unbind(),
            })
        })
    }
}

#[pymethods]
impl PinnedBuffer {
    /// A NumPy array over the pinned memory, no copy; its base keeps this
    /// buffer alive, and it counts as a live view until it is deleted.
    #[pyo3(name = "get_array")]
    fn py_get_array<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::get_array(slf)
    }

    /// Frees the buffer now (back to the pool; a pinned-in-place array is
    /// unpinned). Refused while views are alive or an operation holds it.
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        self.free_inner(py, "freed by free()")?;
        // Released: a buffer pinned in place no longer holds its object.
        let obj = self.origin.as_ref().and_then(|o| o.held().take());
        drop(obj);
        Ok(())
    }

    /// Unpins an array pinned in place and returns it (refused while views
    /// are alive or an operation holds it).
    fn unpin(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(origin) = &self.origin else {
            return Err(PyTypeError::new_err(
                "unpin() is for arrays pinned in place (gpufeed.pin); use free()",
            ));
        };
        self.free_inner(py, "unpinned by unpin()")?;
        // Released: the object goes to the caller, and the buffer holds
        // nothing (the array can be pinned again and used at once).
        let obj = origin.held().take();
        obj.ok_or_else(|| buffer_error("the pinned buffer was released already"))
    }

    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.shape.iter())
    }

    /// The dtype's name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Element count.
    #[getter]
    fn size(&self) -> usize {
        self.len()
    }

    fn __len__(&self) -> usize {
        self.shape.first().map_or(1, |&d| d as usize)
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    #[getter]
    fn state(&self) -> &'static str {
        self.state.name()
    }

    /// Live views (buffer-protocol exports: NumPy arrays, memoryviews, DLPack).
    #[getter]
    fn exports(&self) -> usize {
        self.exports.load(Ordering::SeqCst)
    }

    /// The device the memory is pinned for.
    #[getter]
    fn device(&self) -> Device {
        Device {
            inner: self.device.clone(),
        }
    }

    /// Whether this is an existing array pinned in place.
    #[getter]
    fn pinned_in_place(&self) -> bool {
        self.origin.is_some()
    }

    /// Whether the memory is page-locked: always on CUDA; False only on the
    /// CPU emulation when the memlock limit (`ulimit -l`) refused to lock it
    /// (the emulation's default policy then hands out unlocked memory), for
    /// allocated buffers and arrays pinned in place alike.
    #[getter]
    fn locked(&self) -> bool {
        self.locked
    }

    /// The address of the first byte (an integer).
    #[getter]
    fn ptr(&self, py: Python<'_>) -> PyResult<usize> {
        self.check_origin(py)?;
        Ok(self.state.lock().get_mut("the pinned buffer")?.ptr() as usize)
    }

    /// The DLPack device of `__dlpack__`: `"cpu"` (kDLCPU, default) or
    /// `"cuda_host"` (kDLCUDAHost).
    #[getter]
    fn get_dlpack_device(&self) -> &'static str {
        if self.cuda_host.load(Ordering::Relaxed) {
            "cuda_host"
        } else {
            "cpu"
        }
    }

    #[setter]
    fn set_dlpack_device(&self, kind: &str) -> PyResult<()> {
        let cuda_host = match kind {
            "cpu" => false,
            "cuda_host" => true,
            other => {
                return Err(PyValueError::new_err(format!(
                    "dlpack_device is \"cpu\" or \"cuda_host\", not {other:?}"
                )))
            }
        };
        self.cuda_host.store(cuda_host, Ordering::Relaxed);
        Ok(())
    }

    /// `(device_type, device_id)`: `(1, 0)` (kDLCPU) or `(3, 0)` (kDLCUDAHost).
    fn __dlpack_device__(&self) -> (i32, i32) {
        if self.cuda_host.load(Ordering::Relaxed) {
            (3, 0)
        } else {
            (1, 0)
        }
    }

    /// DLPack export without a copy. The capsule holds a view of the buffer
    /// (counted like a NumPy view) until the consumer lets go. `stream` is
    /// ignored (host memory; a ready buffer has no pending device work);
    /// `dl_device` may ask for `(1, 0)` or `(3, 0)`.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = stream;
        if copy == Some(true) {
            return Err(buffer_error(
                "__dlpack__(copy=True) is not supported: export without a copy",
            ));
        }
        let py = slf.py();
        let this = slf.get();
        let device = match dl_device {
            None => this.__dlpack_device__(),
            Some(d @ ((1, 0) | (3, 0))) => d,
            Some(d) => {
                return Err(buffer_error(format!(
                    "a pinned host buffer exports as (1, 0) kDLCPU or (3, 0) kDLCUDAHost, not {d:?}"
                )))
            }
        };
        // A counted view, kept by the capsule (it fails for a buffer in
        // flight or freed).
        let view = Self::view(slf)?;
        let spec = crate::dlpack::Spec {
            data: view.get().ptr as *mut std::ffi::c_void,
            device,
            dtype: this.dtype,
            shape: this.shape.iter().map(|&d| d as i64).collect(),
            readonly: false,
        };
        crate::dlpack::export(
            py,
            spec,
            crate::dlpack::Keep::Host(view.into_any().unbind()),
            max_version,
        )
    }

    /// `np.asarray(buf)` (NumPy's array protocol): a counted view, as
    /// `get_array()`; with `dtype` (or `copy=True`) NumPy's own conversion
    /// of it.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let arr = Self::get_array(slf)?;
        if dtype.is_none() && copy != Some(true) {
            return Ok(arr);
        }
        let kwargs = PyDict::new(slf.py());
        kwargs.set_item("dtype", dtype)?;
        kwargs.set_item("copy", copy)?;
        slf.py()
            .import("numpy")?
            .getattr("array")?
            .call((arr,), Some(&kwargs))
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpufeed.PinnedBuffer shape={:?} dtype={} {}{}>",
            self.shape,
            self.dtype.name(),
            self.state.name(),
            if self.origin.is_some() {
                " pinned-in-place"
            } else {
                ""
            }
        )
    }
}

/// A counted view of a `PinnedBuffer`'s memory: the base object of every
/// NumPy array the buffer hands out (`get_array()`, `np.asarray(buf)`) and
/// what a DLPack capsule of it keeps. It holds the buffer (so its memory)
/// and one count of the buffer's live views until the last array over it
/// goes; nothing can release it earlier, unlike a memoryview. NumPy reads
/// the memory through its `__array_interface__`.
#[pyclass(module = "gpufeed", frozen)]
pub struct PinnedView {
    _buf: Py<PinnedBuffer>,
    exports: Arc<AtomicUsize>,
    ptr: usize,
    shape: Box<[isize]>,
    typestr: &'static str,
}

#[pymethods]
impl PinnedView {
    /// NumPy's array interface (v3) of the memory: C-contiguous, writable.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, self.shape.iter())?)?;
        d.set_item("typestr", self.typestr)?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpufeed.PinnedView shape={:?} {}>",
            self.shape, self.typestr
        )
    }
}

impl Drop for PinnedView {
    fn drop(&mut self) {
        let _ = self
            .exports
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
}

/// A buffer export of a pinned-in-place object, held for the registration.
/// A raw `Py_buffer` inside an opaque object of ours, not a memoryview: the
/// garbage collector lists every memoryview (`gc.get_objects()`), whose
/// `.obj` would hand Python the array in flight. Ours has nothing to read
/// and no references to visit. The registration holds it as a `Py`, so a
/// drop without the GIL (on a completion thread) defers the release to
/// PyO3's pool, and the export is released with the GIL held.
#[pyclass(frozen)]
struct Export(ExportView);

/// The filled `Py_buffer` of an [`Export`].
struct ExportView(Box<ffi::Py_buffer>);
// SAFETY: the Py_buffer is only read (`ptr`, `len`) and released with the
// GIL held: it lives inside a Python object, deallocated with the GIL.
unsafe impl Send for ExportView {}
// SAFETY: as above; nothing mutates it until its release.
unsafe impl Sync for ExportView {}

impl Drop for ExportView {
    fn drop(&mut self) {
        // SAFETY: filled by a successful PyObject_GetBuffer, released once;
        // dropped only when its Python object is deallocated, with the GIL.
        unsafe { ffi::PyBuffer_Release(&mut *self.0) };
    }
}

impl Export {
    /// A writable, C-contiguous export of `obj`.
    fn get<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Export>> {
        // SAFETY: Py_buffer is a plain C struct; all-zero is its "empty" state.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_WRITABLE;
        // SAFETY: obj is a live object (GIL held); view points to writable memory.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Bound::new(obj.py(), Export(ExportView(view)))
    }

    fn ptr(&self) -> usize {
        self.0 .0.buf as usize
    }

    fn len(&self) -> usize {
        self.0 .0.len.max(0) as usize
    }
}

/// Keeps a Python object until dropped; dropping without the GIL defers the
/// decref to PyO3's pool, so the completion thread that drops it never
/// needs the GIL. The registration's claim on its range goes with it (after
/// the range is unregistered).
struct PyOwner(#[allow(dead_code)] Py<PyAny>, #[allow(dead_code)] PinClaim);

/// A range pinned in place, and who holds it (for the error of a second
/// `pin()` of the same memory).
struct Pinned {
    id: u64,
    start: usize,
    len: usize,
    shape: Vec<usize>,
    dtype: DType,
    /// Cleared when the `PinnedBuffer` object goes (an operation dropped
    /// before `wait()` may keep the range registered after it).
    buffer_alive: Arc<AtomicBool>,
}

/// Every range pinned in place by `pin()` and not yet unregistered.
static PINNED: std::sync::Mutex<Vec<Pinned>> = std::sync::Mutex::new(Vec::new());

/// A range's entry in [`PINNED`], removed on drop: it lives inside the
/// registration's owner, which goes only after the range is unregistered.
struct PinClaim(u64);

impl Drop for PinClaim {
    fn drop(&mut self) {
        let mut pinned = PINNED.lock().unwrap_or_else(|p| p.into_inner());
        pinned.retain(|p| p.id != self.0);
    }
}

impl PinClaim {
    /// Claims `start..start + len` for a new registration, or says who holds
    /// (part of) it already: the driver refuses to register memory twice,
    /// and two buffers over one memory would let an operation write what
    /// another reads.
    fn new(
        start: usize,
        len: usize,
        shape: &[usize],
        dtype: DType,
        buffer_alive: &Arc<AtomicBool>,
    ) -> PyResult<PinClaim> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut pinned = PINNED.lock().unwrap_or_else(|p| p.into_inner());
        let end = start.saturating_add(len);
        if let Some(h) = pinned
            .iter()
            .find(|p| len > 0 && p.len > 0 && p.start < end && start < p.start + p.len)
        {
            let dims: Vec<String> = h.shape.iter().map(|d| d.to_string()).collect();
            let shape = match dims.len() {
                1 => format!("({},)", dims[0]),
                _ => format!("({})", dims.join(", ")),
            };
            let holder = format!(
                "<gpufeed.PinnedBuffer shape={shape} dtype={} ptr={:#x} nbytes={}>",
                h.dtype.name(),
                h.start,
                h.len
            );
            let how = if h.buffer_alive.load(Ordering::SeqCst) {
                "That PinnedBuffer is still alive: use it (buf.get_array() reaches the array), or \
                 release it first with buf.unpin() (which returns the array) or buf.free(), or \
                 drop every reference to it (del buf); if an operation holds it, op.wait() first. \
                 (If NumPy replaced that array's memory under the pin, with ndarray.__setstate__ \
                 or resize(refcheck=False), and gave it to this object, that buffer is gone: \
                 free() it or drop it.)"
            } else {
                "That PinnedBuffer is gone, but an operation dropped before wait() still uses its \
                 memory: it is unpinned when the device finishes that work \
                 (device.synchronize())"
            };
            return Err(buffer_error(format!(
                "pin(): the memory {start:#x}..{end:#x} ({len} bytes) is pinned already, by \
                 {holder}. {how}"
            )));
        }
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        pinned.push(Pinned {
            id,
            start,
            len,
            shape: shape.to_vec(),
            dtype,
            buffer_alive: buffer_alive.clone(),
        });
        Ok(PinClaim(id))
    }
}

/// Pins an existing array in place (`cuMemHostRegister`; `mlock` on the CPU
/// emulation) and returns it as a `PinnedBuffer`: copies and pipelines then
/// use it directly, with no staging copy.
///
/// Refused with `BufferError` when it can't be done safely: read-only or
/// non-C-contiguous memory, a NumPy view of another array (pin the array that
/// owns the memory), a memoryview (pin the object it views). The array is
/// kept exported while pinned, so its owner can't resize or free it. To give
/// the buffer to an operation, drop your other references to the array
/// (`del x`): Python must not reach memory the device is using; use
/// `buf.get_array()` for counted views, and `buf.unpin()` to get the array back.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn pin(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<PinnedBuffer> {
    let device = device_or_default(py, device)?;
    pin_on(py, obj, &device)
}

/// Only objects that own the memory they export can be pinned, and only of
/// exact types whose export can't be redirected: a `numpy.ndarray` that owns
/// its data (read through ndarray's own descriptors), a `bytearray`, an
/// `array.array`. A subclass could hide the array its memory
/// belongs to (`base`), or export another object's memory (`__buffer__`).
fn check_pinnable(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let ty = obj.get_type();
    let taken = Taken::get(py)?;
    let ndarray = taken.ndarray.bind(py);
    if ty.is(ndarray) {
        let owns = taken
            .ndarray_flags
            .bind(py)
            .call_method1("__get__", (obj,))?
            .getattr("owndata")?
            .extract::<bool>()?;
        let base = taken
            .ndarray_base
            .bind(py)
            .call_method1("__get__", (obj,))?;
        if !owns || !base.is_none() {
            return Err(buffer_error(
                "pin() of a view of another array: pin the array that owns the memory (the \
                 other array could be written while the device uses it)",
            ));
        }
        return Ok(());
    }
    // Not mmap.mmap: a file's pages are reachable through another mapping
    // of it, or plain file I/O, while the device uses them.
    if ty.is(taken.bytearray.bind(py)) || ty.is(taken.array.bind(py)) {
        return Ok(());
    }
    if obj.is_instance(ndarray)? {
        return Err(buffer_error(format!(
            "pin() of a subclass of numpy.ndarray ({}): pin a plain ndarray (np.asarray(x) if \
             it owns its data): a subclass can hide whose memory it is",
            ty.name()?
        )));
    }
    let name = ty.name()?;
    let why = if name.to_str().is_ok_and(|n| n == "mmap") {
        " (an mmap's pages can be reached through the file)"
    } else {
        ""
    };
    Err(PyTypeError::new_err(format!(
        "pin() takes a numpy.ndarray that owns its memory, a bytearray or an array.array, not \
         {name}{why}"
    )))
}

pub(crate) fn pin_on(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: &gpufeed::Device,
) -> PyResult<PinnedBuffer> {
    let taken = Taken::get(py)?;
    let memoryview = taken.memoryview.bind(py);
    if obj.is_instance(memoryview)? {
        return Err(buffer_error(
            "pin() of a memoryview: pin the object it views (its owner could free the memory)",
        ));
    }
    if obj.is_instance(taken.pickle_buffer.bind(py))? {
        return Err(buffer_error(
            "pin() of a pickle.PickleBuffer: pin the object it wraps (it stays reachable, and its \
             owner could free the memory)",
        ));
    }
    if obj.is_instance_of::<PinnedBuffer>() {
        return Err(buffer_error("a PinnedBuffer is pinned already"));
    }
    check_pinnable(py, obj)?;
    let mv = memoryview.call1((obj,)).map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
            PyTypeError::new_err(format!("pin() needs a buffer-protocol object: {e}"))
        } else {
            e
        }
    })?;
    if mv.getattr("readonly")?.extract::<bool>()? {
        return Err(buffer_error(
            "pin() of read-only memory: the device could write it",
        ));
    }
    if !mv.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(buffer_error(
            "pin() of non-contiguous memory: copies need one contiguous range (np.ascontiguousarray)",
        ));
    }
    let shape: Vec<usize> = mv.getattr("shape")?.extract()?;
    let format: String = mv.getattr("format")?.extract()?;
    let itemsize: usize = mv.getattr("itemsize")?.extract()?;
    let dtype = DType::from_format(&format)
        .filter(|d| d.size() == itemsize)
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "pin() of an unsupported element type (format {format:?}, {itemsize} bytes)"
            ))
        })?;
    // The memoryview only inspected the buffer: it goes now (a memoryview
    // kept would be reachable through the garbage collector), and the
    // registration holds an export of its own.
    drop(mv);
    let export = Export::get(obj)?;
    let (ptr, len) = (export.get().ptr(), export.get().len());
    // Python code may have run since the ownership check (the inspection
    // allocates, and the garbage collector's finalizers run then: one could
    // make the array a view of another object). Checked again now that the
    // export holds the memory, then the memory the object exports compared
    // with the export's, with nothing Python in between; later changes show
    // at every use (`check_origin`).
    check_pinnable(py, obj)?;
    if !still_exports(obj, ptr, len)? {
        return Err(buffer_error(
            "the object's memory changed while it was being pinned (a finalizer?): pin it again",
        ));
    }
    if len != nbytes(&shape, dtype)? {
        return Err(buffer_error("the buffer's length does not match its shape"));
    }
    let buffer_alive = Arc::new(AtomicBool::new(true));
    let claim = PinClaim::new(ptr, len, &shape, dtype, &buffer_alive)?;
    let owner: Box<dyn Send> = Box::new(PyOwner(export.into_any().unbind(), claim));
    let reg = py
        .detach(move || {
            // SAFETY: `owner` holds an export of `obj`, so its memory stays
            // allocated and unmoved (an exporter may not free or resize while
            // exported; where NumPy does anyway, every use checks first:
            // `check_origin`) until the owner is dropped, which the guard does
            // only after unregistering. Exclusive use while an operation holds
            // the guard is enforced by `check_for_operation` (no other
            // reference to the array, weak or strong, no live view of the
            // buffer, nothing of ours the garbage collector can see).
            unsafe { RegisteredRaw::new(device, ptr as *mut u8, len, owner) }
        })
        .py()?;
    let mut buf = PinnedBuffer::new(
        HostMem::Registered(reg),
        dtype,
        &shape,
        device,
        Some(Origin {
            obj: std::sync::Mutex::new(Some(obj.clone().unbind())),
            ptr,
            len,
        }),
    );
    buf.pin_alive = Some(buffer_alive);
    Ok(buf)
}
