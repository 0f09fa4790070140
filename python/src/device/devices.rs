//! `Device`: the devices opened so far (one per backend and ordinal, so
//! that buffers of one can always be mixed), and the default device.

use crate::convert::IntoPy;
use crate::device::array::DeviceArray;
use crate::device::parse::{parse_dtype_or_f32, parse_shape};
use gpufeed::{BackendChoice, BackendKind, DeviceOptions};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Mutex;

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
