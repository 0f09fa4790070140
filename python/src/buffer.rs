//! Python buffers as bytes: a C-contiguous buffer-protocol view of an
//! object, and a NumPy array made from bytes.

use crate::dtype::DType;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// A C-contiguous buffer-protocol view of an object, released on drop (with
/// the GIL held: it never leaves the thread that holds it).
pub struct ContiguousView {
    view: Box<ffi::Py_buffer>,
    /// First byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
    /// Bytes per item.
    pub itemsize: usize,
    /// The struct-module format, when given.
    pub format: Option<String>,
    /// The exporter's shape (`[]` for a 0-d array; `[len / itemsize]` when it
    /// gives none).
    pub shape: Vec<usize>,
}

impl ContiguousView {
    /// Asks `obj` for a C-contiguous view (writable if asked); `BufferError`
    /// (Python's own, with its reason) when it can't give one.
    pub fn get(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        // SAFETY: Py_buffer is a plain C struct; all-zero is its "empty" state.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        let mut flags = ffi::PyBUF_C_CONTIGUOUS | ffi::PyBUF_FORMAT;
        if writable {
            flags |= ffi::PyBUF_WRITABLE;
        }
        // SAFETY: obj is a live object (GIL held); view points to writable memory.
        let r = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if r != 0 {
            return Err(PyErr::fetch(obj.py()));
        }
        let format = if view.format.is_null() {
            None
        } else {
            // SAFETY: a non-null format is a NUL-terminated string owned by the export.
            Some(
                unsafe { std::ffi::CStr::from_ptr(view.format) }
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        let (len, itemsize) = (view.len.max(0) as usize, view.itemsize.max(0) as usize);
        let shape = if view.ndim == 0 && len == itemsize {
            vec![] // a 0-d array: one value, no axes
        } else if view.shape.is_null() || view.ndim < 0 {
            vec![len / itemsize.max(1)]
        } else {
            // SAFETY: a non-null shape has `ndim` entries owned by the export.
            unsafe { std::slice::from_raw_parts(view.shape, view.ndim as usize) }
                .iter()
                .map(|&d| d.max(0) as usize)
                .collect()
        };
        Ok(ContiguousView {
            ptr: view.buf.cast(),
            len,
            itemsize,
            format,
            shape,
            view,
        })
    }

    /// The bytes, writable.
    ///
    /// # Safety
    /// The view was asked for writable, and nothing else reads or writes
    /// the bytes while the slice lives.
    pub unsafe fn as_bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the export keeps `len` writable bytes at `ptr` valid while
        // `self` lives (writable export: the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the export keeps `len` bytes at `ptr` valid while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for ContiguousView {
    fn drop(&mut self) {
        // SAFETY: filled by a successful PyObject_GetBuffer, released once;
        // the view is only dropped on a thread holding the GIL (it is not Send).
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

/// A NumPy array of `dtype` and `shape` holding a copy of `bytes`.
pub fn numpy_from_bytes<'py>(
    py: Python<'py>,
    bytes: &[u8],
    dtype: DType,
    shape: &[usize],
) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    let ba = pyo3::types::PyByteArray::new(py, bytes);
    np.call_method1("frombuffer", (ba, dtype.numpy_name()))?
        .call_method1("reshape", (PyTuple::new(py, shape)?,))
}
