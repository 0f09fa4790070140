//! `to_device` and `to_host`: ordinary (pageable) arrays to the device and
//! back at the link's speed, through the `host` staging engine (a bounded
//! ring of pinned blocks filled by native worker threads).
//!
//! The GIL stays held while a copy reads or writes the caller's array: NumPy
//! lets another thread replace an array's memory under a live buffer export
//! (`__setstate__`), so no other Python code may run while our threads
//! touch it. The copy's own threads need no GIL; only other Python threads
//! wait, for about the copy's duration (20 ms per GiB on the H200).

use crate::buffer::ContiguousView;
use crate::device::{device_or_default, Device, DeviceArray};
use crate::dtype::DType;
use crate::IntoPy;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::collections::HashMap;
use std::sync::Mutex;

/// One staging engine per device (keyed by the device's identity), made at
/// first use and kept: its pinned ring (32 MiB by default) is reused by
/// every copy.
static ENGINES: Mutex<Vec<(host::Device, host::Staging)>> = Mutex::new(Vec::new());

fn engine(device: &host::Device) -> host::Result<host::Staging> {
    let mut engines = ENGINES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, s)) = engines.iter().find(|(d, _)| d.same_as(device)) {
        return Ok(s.clone());
    }
    let s = host::Staging::new(device)?;
    engines.push((device.clone(), s.clone()));
    Ok(s)
}

/// The device's staging engine, made at first use (GIL released meanwhile).
pub(crate) fn engine_for(py: Python<'_>, device: &host::Device) -> PyResult<host::Staging> {
    py.detach(|| engine(device)).py()
}

/// A C-contiguous view of `obj`: its own buffer export, or, for objects
/// without one (a PyTorch CPU tensor), NumPy's view of it (no copy; a
/// non-contiguous tensor is refused, never copied).
fn contiguous<'py>(
    obj: &Bound<'py, PyAny>,
    writable: bool,
) -> PyResult<(ContiguousView, Option<Bound<'py, PyAny>>)> {
    match ContiguousView::get(obj, writable) {
        Ok(v) => Ok((v, None)),
        Err(first) => {
            let py = obj.py();
            if first.is_instance_of::<pyo3::exceptions::PyValueError>(py) {
                // NumPy's refusal of a C-contiguous export of a strided array.
                return Err(crate::buffer_error(format!(
                    "to_device/to_host take C-contiguous arrays only (no hidden copy): {first}"
                )));
            }
            if !obj.hasattr("__array__")? {
                return Err(first);
            }
            let np = obj.py().import("numpy")?;
            let arr = np.call_method1("asarray", (obj,))?;
            let v = ContiguousView::get(&arr, writable).map_err(|_| first)?;
            Ok((v, Some(arr)))
        }
    }
}

/// The dtype of a view, from its format.
fn dtype_of(view: &ContiguousView) -> PyResult<DType> {
    let format = view.format.as_deref().unwrap_or("B");
    DType::from_format(format)
        .filter(|d| d.size() == view.itemsize)
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "to_device: an element format {format:?} of {} bytes has no device dtype",
                view.itemsize
            ))
        })
}

/// `to_device(obj, device=None)`: a new `DeviceArray` holding a copy of
/// `obj`, any C-contiguous buffer (a NumPy array, a memory map, a PyTorch
/// CPU tensor, `bytes`), of the same shape and dtype.
///
/// Large arrays go through the staging ring (parallel host copies
/// overlapped with the DMAs: the link's speed from ordinary memory); small
/// ones (below 512 KiB) as one driver copy. The result exports to PyTorch
/// and CuPy without a copy (`torch.from_dlpack(arr)`, `cupy.asarray(arr)`).
///
/// Raises `BufferError` for a non-contiguous object, `TypeError` for an
/// element type the device has no dtype for.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn to_device(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let device = device_or_default(py, device)?;
    let staging = py.detach(|| engine(&device)).py()?;
    // The view last: nothing Python runs between it and the copy.
    let (view, _keep) = contiguous(obj, false)?;
    let dtype = dtype_of(&view)?;
    let shape = view.shape.clone();
    let array = DeviceArray::alloc(&device, shape, dtype)?;
    array.with_own("to_device()", |buf| {
        // GIL held (see the module's notes): the workers read the array.
        staging.h2d_blocking(view.as_bytes(), buf).py()
    })?;
    drop(view);
    Ok(array)
}

/// `to_host(array, out=None)`: the contents of a `DeviceArray` allocated by
/// gpufeed, copied into `out` (any writable C-contiguous buffer of the same
/// byte size: a NumPy array, a memory map, a PyTorch CPU tensor) and
/// returned; into a new NumPy array of the array's shape and dtype when
/// `out` is omitted.
///
/// Raises `ValueError` when `out`'s size differs, `BufferError` for an
/// `out` that is read-only or not contiguous.
#[pyfunction]
#[pyo3(signature = (array, out=None))]
pub fn to_host<'py>(
    py: Python<'py>,
    array: &Bound<'py, DeviceArray>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let a = array.get();
    let staging = py.detach(|| engine(&a.device)).py()?;
    let out = match out {
        Some(o) => o.clone(),
        None => {
            let np = py.import("numpy")?;
            np.call_method1("empty", (PyTuple::new(py, &a.shape)?, a.dtype.numpy_name()))?
        }
    };
    let (mut view, _keep) = contiguous(&out, true)?;
    if view.len != a.nbytes {
        return Err(PyValueError::new_err(format!(
            "to_host: out holds {} bytes, the device array {}",
            view.len, a.nbytes
        )));
    }
    a.with_own_read("to_host()", |buf| {
        // SAFETY: the export keeps `len` writable bytes at `ptr` while
        // `view` lives; the GIL is held, so no Python code (which could
        // replace the memory) runs until the copy returns.
        let dst = unsafe { view.as_bytes_mut() };
        staging.d2h_blocking(buf, dst).py()
    })?;
    drop(view);
    Ok(out)
}

/// Names the statistics of a device's staging engine (its pinned ring).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn staging_stats(py: Python<'_>, device: Option<&Device>) -> PyResult<HashMap<String, u64>> {
    let device = device_or_default(py, device)?;
    let s = py.detach(|| engine(&device)).py()?;
    let (stats, c) = (s.pool_stats(), s.config());
    Ok(HashMap::from([
        ("in_use_bytes".into(), stats.in_use_bytes),
        ("peak_in_use_bytes".into(), stats.peak_in_use_bytes),
        ("bound_bytes".into(), c.total_bytes() as u64),
        ("block_bytes".into(), c.block_bytes as u64),
        ("blocks".into(), c.blocks as u64),
        ("threads".into(), c.threads as u64),
        ("direct_h2d_below".into(), c.direct_h2d_below as u64),
        ("direct_d2h_below".into(), c.direct_d2h_below as u64),
    ]))
}
