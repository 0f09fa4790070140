//! `pin()`: an existing array pinned in place, only where that is safe (an
//! owning array of an exact type, writable and contiguous), held exported,
//! and claimed so that no two buffers share its memory.

use crate::alloc::buffer::{still_exports, Origin, PinnedBuffer};
use crate::alloc::host_mem::HostMem;
use crate::alloc::taken::Taken;
use crate::device::{device_or_default, nbytes, Device};
use crate::dtype::DType;
use crate::{convert::buffer_error, convert::IntoPy};
use gpufeed::interop::RegisteredRaw;
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    pub(super) fn get<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, Export>> {
        // SAFETY: Py_buffer is a plain C struct; all-zero is its "empty" state.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_WRITABLE;
        // SAFETY: obj is a live object (GIL held); view points to writable memory.
        if unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) } != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        Bound::new(obj.py(), Export(ExportView(view)))
    }

    pub(super) fn ptr(&self) -> usize {
        self.0 .0.buf as usize
    }

    pub(super) fn len(&self) -> usize {
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
pub(super) struct Pinned {
    id: u64,
    start: usize,
    pub(super) len: usize,
    pub(super) shape: Vec<usize>,
    pub(super) dtype: DType,
    /// Cleared when the `PinnedBuffer` object goes (an operation dropped
    /// before `wait()` may keep the range registered after it).
    buffer_alive: Arc<AtomicBool>,
}

/// Every range pinned in place by `pin()` and not yet unregistered.
static PINNED: std::sync::Mutex<Vec<Pinned>> = std::sync::Mutex::new(Vec::new());

/// A range's entry in [`PINNED`], removed on drop: it lives inside the
/// registration's owner, which goes only after the range is unregistered.
pub(super) struct PinClaim(u64);

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
    pub(super) fn new(
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
    let (shape, dtype) = inspect(py, obj, memoryview)?;
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

/// The shape and element type of `obj`'s buffer, through a memoryview
/// (`memoryview`, the type taken at load), which goes before this returns:
/// refused when the memory is read-only, not contiguous, or of an element
/// type without a device dtype.
fn inspect(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    memoryview: &Bound<'_, PyAny>,
) -> PyResult<(Vec<usize>, DType)> {
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
    Ok((shape, dtype))
}
