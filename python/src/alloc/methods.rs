//! The Python methods of `PinnedBuffer`: its arrays and views, release
//! (`free`, `unpin`), the buffer protocol's and DLPack's exports.

use crate::alloc::buffer::PinnedBuffer;
use crate::convert::buffer_error;
use crate::device::Device;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::Ordering;

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
