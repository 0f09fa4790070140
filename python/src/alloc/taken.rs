//! What `pin()` and the operation checks take from Python once, when the
//! module loads.

use pyo3::prelude::*;

/// What `pin()` and the operation checks use from Python, taken once, when
/// the module loads: rebinding `numpy.ndarray` or `weakref.getweakrefcount`
/// later changes nothing.
pub(crate) struct Taken {
    pub(super) ndarray: Py<PyAny>,
    pub(super) ndarray_flags: Py<PyAny>,
    pub(super) ndarray_base: Py<PyAny>,
    pub(super) bytearray: Py<PyAny>,
    pub(super) array: Py<PyAny>,
    pub(super) memoryview: Py<PyAny>,
    pub(super) pickle_buffer: Py<PyAny>,
    pub(super) getweakrefcount: Py<PyAny>,
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
