//! `Device` (a backend, shared per backend and ordinal) and `DeviceArray`
//! (device memory: our own, or a PyTorch/CuPy allocation wrapped in place).

use crate::dtype::DType;
use crate::foreign::{check_c_contiguous, Imported};
use crate::{convert::buffer_error, convert::IntoPy};
use gpufeed::{BackendChoice, BackendKind, DeviceBuffer, DeviceOptions, DeviceSliceMut};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Devices opened so far, one per (backend, ordinal): buffers of two
/// `gpufeed::Device` handles can't be mixed, so every `Device(...)` of the same
/// backend and ordinal is the same device.
static DEVICES: Mutex<Option<HashMap<(u8, usize), gpufeed::Device>>> = Mutex::new(None);

fn open(choice: BackendChoice, ordinal: usize) -> gpufeed::Result<gpufeed::Device> {
    let key = (choice as u8, ordinal);
    let mut map = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(d) = map.get(&key) {
        return Ok(d.clone());
    }
    // The CPU emulation offers HOST_CPU_DEVICES devices, as in Rust (a
    // rank's LOCAL_RANK device on a machine without GPUs).
    let emulated_devices = DeviceOptions::from_env().map_or(1, |o| o.emulated_devices);
    let d = gpufeed::Device::open(DeviceOptions {
        backend: choice,
        ordinal,
        emulated_devices,
        ..Default::default()
    })?;
    map.insert(key, d.clone());
    Ok(d)
}

/// A device: the CUDA driver when a GPU is present, else the CPU emulation
/// (`HOST_BACKEND=cpu|cuda|auto` or `backend=` chooses).
#[pyclass(module = "gpufeed", frozen)]
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: gpufeed::Device,
}

#[pymethods]
impl Device {
    /// `Device(backend=None, ordinal=0)`: `backend` is `"auto"`, `"cuda"`,
    /// `"cpu"`, or None for `HOST_BACKEND` (default auto). The same backend
    /// and ordinal always give the same device.
    #[new]
    #[pyo3(
        signature = (backend=None, ordinal=crate::convert::Count(0)),
        text_signature = "(backend=None, ordinal=0)"
    )]
    fn new(
        py: Python<'_>,
        backend: Option<&str>,
        ordinal: crate::convert::Count,
    ) -> PyResult<Self> {
        let ordinal = ordinal.0 as usize;
        let choice = match backend {
            Some(b) => b.parse::<BackendChoice>().py()?,
            None => DeviceOptions::from_env().py()?.backend,
        };
        let inner = py.detach(|| open(choice, ordinal)).py()?;
        Ok(Device { inner })
    }

    /// `"cuda"` or `"cpu"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner.kind() {
            BackendKind::Cuda => "cuda",
            _ => "cpu",
        }
    }

    /// The device's name.
    #[getter]
    fn name(&self) -> String {
        self.inner.info().name.clone()
    }

    /// The CUDA ordinal.
    #[getter]
    fn ordinal(&self) -> usize {
        self.inner.info().ordinal
    }

    /// How many frees and unregistrations of the device's memory failed
    /// (those on drop paths have no caller to raise to; each is also logged
    /// through Rust's `log` crate).
    #[getter]
    fn release_failures(&self) -> u64 {
        self.inner.release_failures()
    }

    /// One line saying which backend runs and why.
    fn banner(&self) -> String {
        self.inner.banner()
    }

    /// Waits (GIL released) until all work queued on the device has finished.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.synchronize()).py()
    }

    /// A `DeviceArray` of `shape` and `dtype` (contents unspecified on CUDA).
    #[pyo3(signature = (shape, dtype=None))]
    fn empty(
        &self,
        py: Python<'_>,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DeviceArray> {
        DeviceArray::alloc(
            py,
            &self.inner,
            parse_shape(shape)?,
            parse_dtype_or_f32(dtype)?,
        )
    }

    fn __repr__(&self) -> String {
        format!("<gpufeed.Device {}>", self.inner.banner())
    }
}

/// The device `HOST_BACKEND` picks (auto by default), shared by everything
/// that is given no device.
#[pyfunction]
pub fn default_device(py: Python<'_>) -> PyResult<Device> {
    Device::new(py, None, crate::convert::Count(0))
}

/// `device` or the default device.
pub fn device_or_default(py: Python<'_>, device: Option<&Device>) -> PyResult<gpufeed::Device> {
    match device {
        Some(d) => Ok(d.inner.clone()),
        None => Ok(default_device(py)?.inner),
    }
}

/// A shape: an int or a sequence of ints.
pub fn parse_shape(shape: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    // An int (anything with `__index__`), or a sequence of them; a
    // negative or too large dimension is a `ValueError`, an exception the
    // object's own `__index__` raises propagates as it is.
    let dims: Vec<Bound<'_, PyAny>> = if shape.hasattr("__index__")? {
        vec![shape.clone()]
    } else if shape.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(
            "shape must be an int or a sequence of ints, not a str",
        ));
    } else {
        shape
            .try_iter()
            .map_err(|_| PyTypeError::new_err("shape must be an int or a sequence of ints"))?
            .collect::<PyResult<_>>()?
    };
    dims.iter()
        .map(|d| d.extract::<crate::convert::Count>().map(|c| c.0 as usize))
        .collect()
}

/// A dtype: a name (`"float32"`, `"f4"`), a NumPy dtype or type, a PyTorch dtype.
pub fn parse_dtype(dtype: &Bound<'_, PyAny>) -> PyResult<DType> {
    // A NumPy dtype of the other byte order reads as "float32" by name, but
    // its bytes are not ours: refused rather than misread.
    if let Ok(native) = dtype.getattr("isnative").and_then(|n| n.extract::<bool>()) {
        if !native {
            return Err(PyTypeError::new_err(format!(
                "unsupported dtype {}: not in the machine's byte order (use .newbyteorder('=') \
                 on the data, or astype of a native dtype)",
                dtype.repr().map(|r| r.to_string()).unwrap_or_default()
            )));
        }
    }
    let mut names = Vec::new();
    if let Ok(s) = dtype.extract::<String>() {
        names.push(s);
    } else {
        if let Ok(n) = dtype.getattr("name").and_then(|n| n.extract::<String>()) {
            names.push(n);
        }
        if let Ok(n) = dtype
            .getattr("__name__")
            .and_then(|n| n.extract::<String>())
        {
            names.push(n);
        }
        if let Ok(s) = dtype.str() {
            names.push(s.to_string());
        }
    }
    names.iter().find_map(|n| DType::parse(n)).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "unsupported dtype {}: use one of {}",
            dtype.repr().map(|r| r.to_string()).unwrap_or_default(),
            crate::dtype::ALL
                .iter()
                .map(|d| d.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// A dtype, float32 when None.
pub fn parse_dtype_or_f32(dtype: Option<&Bound<'_, PyAny>>) -> PyResult<DType> {
    dtype.map_or(Ok(DType::F32), parse_dtype)
}

/// Bytes of `shape` of `dtype`, or an error. The strides must fit too
/// (the product of the non-zero dimensions, in bytes, within `isize`), even
/// when a zero dimension makes the array empty.
pub fn nbytes(shape: &[usize], dtype: DType) -> PyResult<usize> {
    let fits = |skip_zeros: bool| {
        shape
            .iter()
            .filter(|&&d| !skip_zeros || d > 0)
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .filter(|&b| b <= isize::MAX as usize)
    };
    let overflow =
        || PyValueError::new_err(format!("shape {shape:?} of {} overflows", dtype.name()));
    fits(true).ok_or_else(overflow)?;
    fits(false).ok_or_else(overflow)
}

/// Device memory a `DeviceArray` holds.
pub enum DevMem {
    /// Ours.
    Own(DeviceBuffer<u8>),
    /// A foreign allocation (PyTorch, CuPy) used in place; `owner` (the
    /// DLPack capsule or the exporting object) keeps it allocated.
    Foreign {
        addr: u64,
        bytes: usize,
        device: gpufeed::Device,
        #[allow(dead_code)]
        owner: Py<PyAny>,
    },
}

impl DevMem {
    /// A write view of the whole memory, for a batch that owns `self`.
    pub fn view_mut(&mut self) -> DeviceSliceMut<'_, u8> {
        match self {
            DevMem::Own(b) => b.view_mut(),
            DevMem::Foreign {
                addr,
                bytes,
                device,
                ..
            } => {
                // SAFETY: `owner` keeps the allocation alive while `self` lives,
                // and the view is borrowed from `&mut self`, which a job owns
                // until its commands are done; the producer's pending writes
                // were waited for when it was wrapped (`as_device_array`).
                // What other code does with that memory meanwhile is the
                // caller's (documented) responsibility, as with any foreign
                // device pointer; the driver knew the range as this device's
                // memory when it was imported (`check_foreign_device_range`).
                unsafe { gpufeed::interop::device_slice_mut(device, *addr, *bytes) }
            }
        }
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        match self {
            DevMem::Own(b) => gpufeed::interop::device_ptr(b),
            DevMem::Foreign { addr, .. } => *addr,
        }
    }
}

/// Where a buffer object's memory is.
pub enum State<M> {
    /// Here, usable.
    Ready(M),
    /// Owned by an operation until it is waited for.
    InFlight,
    /// Gone (freed, or released by an operation dropped unwaited), with why.
    Freed(String),
}

impl<M> State<M> {
    /// The memory, or a `BufferError` saying why not.
    pub fn get(&self, what: &str) -> PyResult<&M> {
        match self {
            State::Ready(m) => Ok(m),
            State::InFlight => Err(buffer_error(format!(
                "{what} is in use by an operation: wait() for it first"
            ))),
            State::Freed(why) => Err(buffer_error(format!("{what} is gone: {why}"))),
        }
    }

    /// The memory mutably, or a `BufferError`.
    pub fn get_mut(&mut self, what: &str) -> PyResult<&mut M> {
        match self {
            State::Ready(m) => Ok(m),
            State::InFlight => Err(buffer_error(format!(
                "{what} is in use by an operation: wait() for it first"
            ))),
            State::Freed(why) => Err(buffer_error(format!("{what} is gone: {why}"))),
        }
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    pub fn name(&self) -> &'static str {
        match self {
            State::Ready(_) => "ready",
            State::InFlight => "in-flight",
            State::Freed(_) => "freed",
        }
    }
}

/// A buffer object's [`State`], changed through `&self`: the buffer classes
/// are frozen, so an operation handing its buffers back from anywhere (its
/// `Drop`, run by the garbage collector inside another method of the same
/// object) never meets a borrow flag. The lock is held for plain Rust work
/// only, never across a Python call or a GIL release, and a replaced state
/// is dropped after it is let go (dropping memory may run Python code).
pub struct StateCell<M>(Mutex<State<M>>);

impl<M> StateCell<M> {
    /// Ready with `mem`.
    pub fn ready(mem: M) -> Self {
        StateCell(Mutex::new(State::Ready(mem)))
    }

    /// The state, locked (briefly: see the type's docs).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, State<M>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the state; the old one is dropped after the lock is let go.
    pub fn set(&self, state: State<M>) {
        let old = std::mem::replace(&mut *self.lock(), state);
        drop(old);
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    pub fn name(&self) -> &'static str {
        self.lock().name()
    }

    /// Moves the memory out (state: in-flight) if ready, after `check`
    /// passes on it; the lock is held across both, so nothing changes the
    /// state in between.
    pub fn take(&self, what: &str, check: impl FnOnce(&M) -> PyResult<()>) -> PyResult<M> {
        let mut s = self.lock();
        check(s.get(what)?)?;
        match std::mem::replace(&mut *s, State::InFlight) {
            State::Ready(m) => Ok(m),
            other => {
                *s = other;
                Err(buffer_error(format!("{what} is not ready")))
            }
        }
    }
}

/// Device memory of a shape and dtype: allocated here (`Device.empty`), or
/// a PyTorch/CuPy CUDA array wrapped in place (`as_device_array`).
///
/// Exported without a copy through `__dlpack__` (counted: while a consumer
/// holds it, the array can't be freed or given to an operation) and
/// `__cuda_array_interface__` (not counted: once asked for, the array can't be
/// freed or given to an operation any more; it is freed when the last
/// reference goes, after a device-wide synchronize, since the interface
/// never says which stream its consumers used). A DLPack export's release
/// waits for the consumer's stream given to `__dlpack__(stream=...)`: the
/// memory is freed, and the array used again, only once that stream is
/// past the release. On the CPU emulation both raise `BufferError`: there
/// device memory is host memory that no GPU library can use; use
/// `download()` or a copy into a `PinnedBuffer`.
#[pyclass(module = "gpufeed", frozen)]
pub struct DeviceArray {
    pub(crate) state: StateCell<DevMem>,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) nbytes: usize,
    pub(crate) device: gpufeed::Device,
    /// Live DLPack exports.
    pub(crate) exports: Arc<AtomicUsize>,
    /// Handed out through `__cuda_array_interface__` (uncounted).
    pub(crate) shared: AtomicBool,
    /// Released DLPack exports whose consumers may still be at work.
    pub(crate) releases: Arc<crate::dlpack::Releases>,
}

impl Drop for DeviceArray {
    /// An array handed out through `__cuda_array_interface__` is freed only
    /// after a device-wide synchronize (on the release thread; this thread
    /// does not wait): its consumers' streams are unknown. Otherwise the
    /// memory goes at once (the usual stream-ordered free).
    fn drop(&mut self) {
        if !self.shared.load(Ordering::SeqCst) || self.device.kind() != BackendKind::Cuda {
            return;
        }
        let state = std::mem::replace(&mut *self.state.lock(), State::Freed("dropped".into()));
        if let State::Ready(mem) = state {
            gpufeed::interop::release_after_device_idle(&self.device).defer(move || drop(mem));
        }
    }
}

impl DeviceArray {
    /// A new array (the allocation runs with the GIL released: the CPU
    /// emulation zeroes it, some 0.2 s for 256 MiB).
    pub(crate) fn alloc(
        py: Python<'_>,
        device: &gpufeed::Device,
        shape: Vec<usize>,
        dtype: DType,
    ) -> PyResult<Self> {
        let nbytes = nbytes(&shape, dtype)?;
        let buf = py.detach(|| DeviceBuffer::<u8>::new(device, nbytes)).py()?;
        Ok(DeviceArray {
            state: StateCell::ready(DevMem::Own(buf)),
            dtype,
            shape,
            nbytes,
            device: device.clone(),
            exports: Arc::default(),
            shared: AtomicBool::new(false),
            releases: Arc::default(),
        })
    }

    /// Moves the memory out (state: in-flight) once every released DLPack
    /// export's consumer is past its release (waited for, GIL released),
    /// and `check` passes.
    fn take_settled(&self, check: impl Fn(&DevMem) -> PyResult<()>) -> PyResult<DevMem> {
        loop {
            self.releases.settle();
            let mut again = false;
            let r = self.state.take("the device array", |m| {
                // A release since the wait: wait for it too.
                if !self.releases.pending().is_empty() {
                    again = true;
                    return Err(buffer_error("a DLPack export was just released"));
                }
                check(m)
            });
            if !again {
                return r;
            }
        }
    }

    /// Moves the memory out for an operation (state: in-flight).
    pub(crate) fn take_for_operation(&self) -> PyResult<DevMem> {
        self.take_settled(|_| {
            let n = self.exports.load(Ordering::SeqCst);
            if n > 0 {
                return Err(buffer_error(format!(
                    "the device array has {n} live DLPack export(s): drop the consumers' tensors \
                     first"
                )));
            }
            if self.shared.load(Ordering::SeqCst) {
                return Err(buffer_error(
                    "the device array was exported through __cuda_array_interface__, which can't \
                     tell when its consumers are done: it can't be given to an operation any more \
                     (export with __dlpack__, which is counted)",
                ));
            }
            Ok(())
        })
    }

    /// Runs `f` on the memory of an array allocated here, moved out for the
    /// call (state: in-flight, so any other use meanwhile gets a
    /// `BufferError` instead of waiting), and puts it back after. `f` may
    /// write: released DLPack exports' consumers are waited for first (GIL
    /// released).
    pub(crate) fn with_own<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        self.with_own_inner(what, true, f)
    }

    /// As [`DeviceArray::with_own`], for an `f` that only reads: a released
    /// export's consumer still reading is no conflict, so nothing is waited
    /// for and the GIL is never released here (a caller may hold a view of
    /// NumPy memory that only the GIL keeps in place).
    pub(crate) fn with_own_read<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        self.with_own_inner(what, false, f)
    }

    fn with_own_inner<R>(
        &self,
        what: &str,
        writes: bool,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut mem = self.take_own(what, writes)?;
        let result = match &mut mem {
            DevMem::Own(buf) => f(buf),
            DevMem::Foreign { .. } => Err(buffer_error("not an array allocated by gpufeed")),
        };
        self.state.set(State::Ready(mem));
        result
    }

    /// Moves the memory of an array allocated here out (state: in-flight)
    /// for work that outlives the call; [`DeviceArray::put_back`] returns it.
    /// `writes`: as [`DeviceArray::with_own`] (released DLPack exports'
    /// consumers waited for first, GIL released), else as
    /// [`DeviceArray::with_own_read`].
    pub(crate) fn take_own(&self, what: &str, writes: bool) -> PyResult<DevMem> {
        let check = |m: &DevMem| match m {
            DevMem::Own(_) => Ok(()),
            DevMem::Foreign { .. } => Err(buffer_error(format!(
                "{what} works on arrays allocated by gpufeed"
            ))),
        };
        if writes {
            self.take_settled(check)
        } else {
            self.state.take("the device array", check)
        }
    }

    /// Returns memory taken by [`DeviceArray::take_own`] (state: ready).
    pub(crate) fn put_back(&self, mem: DevMem) {
        self.state.set(State::Ready(mem));
    }

    fn cuda_only(&self, what: &str) -> PyResult<()> {
        if self.device.kind() != BackendKind::Cuda {
            return Err(buffer_error(format!(
                "{what}: this device array lives on the CPU emulation, where device memory is \
                 host memory no GPU library can use; download() it or copy it into a PinnedBuffer"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl DeviceArray {
    /// The shape.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
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
        self.shape.iter().product()
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    #[getter]
    fn state(&self) -> &'static str {
        self.state.name()
    }

    /// Whether it wraps a foreign (PyTorch/CuPy) allocation.
    #[getter]
    fn is_foreign(&self) -> bool {
        matches!(&*self.state.lock(), State::Ready(DevMem::Foreign { .. }))
    }

    /// The device address (an integer; a host address on the CPU emulation).
    #[getter]
    fn ptr(&self) -> PyResult<u64> {
        Ok(self.state.lock().get("the device array")?.addr())
    }

    /// Frees the memory now (refused while exported or in flight). After a
    /// DLPack export's release, waits (GIL released) until the consumer's
    /// stream given at export is past it.
    fn free(&self) -> PyResult<()> {
        let mem = self.take_settled(|_| {
            let n = self.exports.load(Ordering::SeqCst);
            if n > 0 || self.shared.load(Ordering::SeqCst) {
                return Err(buffer_error(
                    "the device array is exported (DLPack or __cuda_array_interface__): it is \
                     freed when its last consumer lets go",
                ));
            }
            Ok(())
        })?;
        self.state.set(State::Freed("freed by free()".into()));
        drop(mem);
        Ok(())
    }

    /// Copies `array` (any C-contiguous buffer of `nbytes` bytes, pageable is
    /// fine) to the device synchronously, GIL released.
    fn upload(&self, py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<()> {
        let nbytes = self.nbytes;
        // The source's view first (asking for it may run Python code).
        let view = crate::buffer::ContiguousView::get(array, false)?;
        if view.len != nbytes {
            return Err(PyValueError::new_err(format!(
                "upload of {} bytes into a device array of {nbytes} bytes",
                view.len
            )));
        }
        // Copied out while the GIL is held: NumPy may free an array's memory
        // under a live export (`__setstate__` from another thread), so the
        // copy with the GIL released reads only memory of ours.
        let staged = view.as_bytes().to_vec();
        drop(view);
        self.with_own("upload()", |buf| {
            py.detach(|| buf.copy_from_host_sync(&staged)).py()
        })
    }

    /// The contents as a new NumPy array (a synchronous copy, GIL released).
    fn download<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut out = vec![0u8; self.nbytes];
        self.with_own_read("download()", |buf| {
            py.detach(|| buf.copy_to_host_sync(&mut out)).py()
        })?;
        crate::buffer::numpy_from_bytes(py, &out, self.dtype, &self.shape)
    }

    /// `__cuda_array_interface__` v3 (CUDA only). No `stream`: a ready array
    /// has no pending work (operations hand arrays back only when done).
    /// Marks the array shared: it can't be freed or given to an operation
    /// any more.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.cuda_only("__cuda_array_interface__")?;
        let addr = {
            let s = self.state.lock();
            let addr = s.get("the device array")?.addr();
            // Under the state's lock: an operation can't take it meanwhile.
            self.shared.store(true, Ordering::SeqCst);
            addr
        };
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", self.dtype.typestr())?;
        d.set_item("data", (addr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// DLPack export (CUDA only): `(kDLCUDA, ordinal)`. `stream` is the
    /// consumer's; a ready array has no pending work, so nothing is enqueued
    /// now. The release waits for it: the memory is freed (and the array
    /// used again) only once that stream is past the point where the
    /// consumer let go. `None` or 1: the legacy default stream; 2 (the
    /// per-thread default stream) and -1 (no synchronization): a
    /// device-wide synchronize, the consumer's stream being unknown then.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        slf: &Bound<'py, Self>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let this = slf.get();
        this.cuda_only("__dlpack__")?;
        let consumer = consumer_stream(stream)?;
        if copy == Some(true) {
            return Err(buffer_error(
                "__dlpack__(copy=True) is not supported: export without a copy",
            ));
        }
        let ordinal = this.device.info().ordinal as i32;
        if let Some(d) = dl_device {
            if d != (2, ordinal) {
                return Err(buffer_error(format!(
                    "the array is on (kDLCUDA, {ordinal}); dl_device={d:?} would need a copy"
                )));
            }
        }
        let exports = this.exports.clone();
        let addr = {
            let s = this.state.lock();
            let addr = s.get("the device array")?.addr();
            // Counted under the state's lock: an operation can't take it meanwhile.
            exports.fetch_add(1, Ordering::SeqCst);
            addr
        };
        let spec = crate::dlpack::Spec {
            data: addr as *mut std::ffi::c_void,
            device: (2, ordinal),
            dtype: this.dtype,
            shape: this.shape.iter().map(|&d| d as i64).collect(),
            readonly: false,
        };
        let keep = crate::dlpack::Keep::Device(crate::dlpack::DeviceKeep {
            array: Some(slf.clone().unbind().into_any()),
            exports,
            releases: this.releases.clone(),
            device: this.device.clone(),
            consumer,
        });
        crate::dlpack::export(slf.py(), spec, keep, max_version)
    }

    /// `(kDLCUDA, ordinal)` (CUDA only).
    fn __dlpack_device__(&self) -> PyResult<(i32, i32)> {
        self.cuda_only("__dlpack_device__")?;
        Ok((2, self.device.info().ordinal as i32))
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpufeed.DeviceArray shape={:?} dtype={} {}>",
            self.shape,
            self.dtype.name(),
            self.state.name()
        )
    }
}

/// The consumer's stream of `__dlpack__(stream=...)` (CUDA): None or 1
/// the legacy default stream; 0, which DLPack disallows for CUDA, read as
/// the NULL stream, which is the legacy default stream too; 2, the
/// per-thread default stream, is that of the consumer's thread, which the
/// release may not run on: unknown, as is -1 (no synchronization asked).
fn consumer_stream(stream: Option<&Bound<'_, PyAny>>) -> PyResult<crate::dlpack::Consumer> {
    use crate::dlpack::Consumer;
    let Some(s) = stream.filter(|s| !s.is_none()) else {
        return Ok(Consumer::Stream(1));
    };
    let handle: i128 = s.extract().map_err(|_| {
        PyTypeError::new_err("__dlpack__(stream=...) takes an integer stream handle or None")
    })?;
    match handle {
        -1 | 2 => Ok(Consumer::Unknown),
        0 | 1 => Ok(Consumer::Stream(1)),
        h if h > 2 && h <= u64::MAX as i128 => Ok(Consumer::Stream(h as u64)),
        h => Err(PyValueError::new_err(format!(
            "__dlpack__(stream={h}): not a CUDA stream handle (None, -1, 1, 2 or a handle)"
        ))),
    }
}

/// Wraps a foreign CUDA array (a PyTorch tensor, a CuPy array: anything
/// with `__dlpack__` or `__cuda_array_interface__`) in place as a
/// `DeviceArray`, so an operation or a pipeline can write it. Pending
/// writes of the producer are waited for first (the DLPack handshake on a
/// stream of ours, or the interface's `stream`). C-contiguous only. The
/// wrapper keeps the producer's memory alive; while an operation uses it,
/// don't touch the tensor from other code (as with any shared device memory).
/// A masked `__cuda_array_interface__` (a `mask` that isn't None) is refused
/// with `BufferError`. CUDA only.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn as_device_array(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let device = device_or_default(py, device)?;
    if !obj.hasattr("__dlpack__")? && obj.hasattr("__cuda_array_interface__")? {
        // What can't be imported on any backend is refused first.
        refuse_masked_cai(&obj.getattr("__cuda_array_interface__")?)?;
    }
    if device.kind() != BackendKind::Cuda {
        return Err(crate::convert::BackendUnavailableError::new_err(
            "as_device_array needs the CUDA backend (this is the CPU emulation)",
        ));
    }
    let imported = if obj.hasattr("__dlpack__")? {
        crate::dlpack::import_cuda(py, obj, &device)?
    } else if obj.hasattr("__cuda_array_interface__")? {
        import_cai(py, obj, &device)?
    } else {
        return Err(PyTypeError::new_err(
            "as_device_array takes an object with __dlpack__ or __cuda_array_interface__",
        ));
    };
    let nbytes = nbytes(&imported.shape, imported.dtype)?;
    // The address is the producer's word: the driver must know it as memory
    // of this device, long enough, before any command gets it.
    gpufeed::interop::check_foreign_device_range(&device, imported.addr, nbytes).py()?;
    Ok(DeviceArray {
        state: StateCell::ready(DevMem::Foreign {
            addr: imported.addr,
            bytes: nbytes,
            device: device.clone(),
            owner: imported.owner,
        }),
        dtype: imported.dtype,
        shape: imported.shape,
        nbytes,
        device,
        exports: Arc::default(),
        shared: AtomicBool::new(false),
        releases: Arc::default(),
    })
}

/// A `__cuda_array_interface__` with a `mask` (a masked array: the mask
/// says which elements are valid) is refused: the device would read and
/// write the masked-out elements as if they were data.
fn refuse_masked_cai(cai: &Bound<'_, PyAny>) -> PyResult<()> {
    if let Ok(mask) = cai.get_item("mask") {
        if !mask.is_none() {
            return Err(buffer_error(
                "the __cuda_array_interface__ has a mask (a masked array): masks are not \
                 supported (every element would be read and written as data): fill the masked \
                 elements and pass the array without its mask",
            ));
        }
    }
    Ok(())
}

fn import_cai(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: &gpufeed::Device,
) -> PyResult<Imported> {
    let cai = obj.getattr("__cuda_array_interface__")?;
    refuse_masked_cai(&cai)?;
    let shape: Vec<usize> = cai.get_item("shape")?.extract()?;
    let typestr: String = cai.get_item("typestr")?.extract()?;
    let dtype = DType::parse(&typestr)
        .filter(|_| !typestr.starts_with('>'))
        .ok_or_else(|| PyTypeError::new_err(format!("unsupported typestr {typestr:?}")))?;
    let (addr, readonly): (u64, bool) = cai.get_item("data")?.extract()?;
    if readonly {
        return Err(buffer_error("the foreign array is read-only"));
    }
    if let Ok(strides) = cai.get_item("strides") {
        if !strides.is_none() {
            let strides: Vec<isize> = strides.extract()?;
            check_c_contiguous(&shape, &strides, dtype.size())?;
        }
    }
    if let Ok(stream) = cai.get_item("stream") {
        if !stream.is_none() {
            let handle: u64 = stream.extract()?;
            // SAFETY: the producer gave this stream handle for consumers to
            // synchronize on (CAI v3), in the primary context it shares with us.
            py.detach(|| unsafe { gpufeed::interop::synchronize_foreign_stream(device, handle) })
                .py()?;
        }
    }
    Ok(Imported {
        addr,
        shape,
        dtype,
        owner: obj.clone().unbind(),
    })
}
