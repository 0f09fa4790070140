//! `PinnedBuffer`: pinned memory of a shape and dtype, what it knows of an
//! object pinned in place, the checks before an operation takes it, and
//! `PinnedView`, the counted view that every NumPy array over it keeps.

use crate::alloc::host_mem::HostMem;
use crate::alloc::taken::Taken;
use crate::buffer::ContiguousView;
use crate::convert::buffer_error;
use crate::device::{State, StateCell};
use crate::dtype::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

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
    pub(super) exports: Arc<AtomicUsize>,
    pub(crate) dtype: DType,
    pub(super) shape: Box<[isize]>,
    pub(crate) nbytes: usize,
    pub(crate) device: gpufeed::Device,
    /// Pinned in place: the object whose memory this is (until the buffer
    /// is released), and the range pinned.
    pub(super) origin: Option<Origin>,
    pub(super) cuda_host: AtomicBool,
    /// The memory is page-locked (see `HostMem::is_locked`).
    pub(super) locked: bool,
    /// Pinned in place: cleared when this object goes (see [`PinClaim`]).
    pub(super) pin_alive: Option<Arc<AtomicBool>>,
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
    pub(super) obj: std::sync::Mutex<Option<Py<PyAny>>>,
    pub(super) ptr: usize,
    pub(super) len: usize,
}

impl Origin {
    pub(super) fn held(&self) -> std::sync::MutexGuard<'_, Option<Py<PyAny>>> {
        self.obj.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new reference to the object, unless released. Python code is
    /// never run under the lock: the object is called through this one.
    pub(super) fn object(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.held().as_ref().map(|o| o.clone_ref(py))
    }
}

impl PinnedBuffer {
    pub(super) fn new(
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
    pub(super) fn check_for_operation(&self, py: Python<'_>, weak: bool) -> PyResult<()> {
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
    pub(super) fn free_inner(&self, py: Python<'_>, why: &str) -> PyResult<()> {
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
    pub(super) fn check_origin(&self, py: Python<'_>) -> PyResult<()> {
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
    pub(super) fn view<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PinnedView>> {
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
pub(super) fn still_exports(obj: &Bound<'_, PyAny>, ptr: usize, len: usize) -> PyResult<bool> {
    ContiguousView::get(obj, true).map(|v| v.ptr as usize == ptr && v.len == len)
}

/// Whether `obj` has weak references (`weakref.ref(obj)` alive somewhere).
fn has_weak_references(obj: &Bound<'_, PyAny>) -> bool {
    Taken::get(obj.py())
        .and_then(|t| t.getweakrefcount.bind(obj.py()).call1((obj,)))
        .and_then(|n| n.extract::<usize>())
        .map_or(true, |n| n > 0)
}

/// A counted view of a `PinnedBuffer`'s memory: the base object of every
/// NumPy array the buffer hands out (`get_array()`, `np.asarray(buf)`) and
/// what a DLPack capsule of it keeps. It holds the buffer (so its memory)
/// and one count of the buffer's live views until the last array over it
/// goes; nothing can release it earlier, unlike a memoryview. NumPy reads
/// the memory through its `__array_interface__`.
#[pyclass(module = "gpufeed", frozen)]
pub struct PinnedView {
    pub(super) _buf: Py<PinnedBuffer>,
    pub(super) exports: Arc<AtomicUsize>,
    pub(super) ptr: usize,
    pub(super) shape: Box<[isize]>,
    pub(super) typestr: &'static str,
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
