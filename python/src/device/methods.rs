//! The Python methods of `DeviceArray`: copies to and from the host, the
//! DLPack and CUDA array interface exports, release.

use crate::device::array::DeviceArray;
use crate::device::state::{DevMem, State};
use crate::{convert::buffer_error, convert::IntoPy};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::Ordering;

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
