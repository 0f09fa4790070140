//! What every module of the extension shares, below them all: the Python
//! exception classes (one per `gpufeed::Error` variant), the conversion of
//! library errors into them, and the count argument type.

use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyRuntimeError};
use pyo3::prelude::*;

create_exception!(
    gpufeed,
    GpuFeedError,
    PyRuntimeError,
    "An error of the `host` library; `kind` names the Rust variant."
);
create_exception!(
    gpufeed,
    DriverError,
    GpuFeedError,
    "A CUDA driver call failed."
);
create_exception!(
    gpufeed,
    ContextBrokenError,
    GpuFeedError,
    "The device context is broken for good (a faulting kernel)."
);
create_exception!(gpufeed, KernelFaultError, GpuFeedError, "A kernel faulted.");
create_exception!(
    gpufeed,
    BackendUnavailableError,
    GpuFeedError,
    "No usable backend (CUDA forced without a GPU, say)."
);
create_exception!(
    gpufeed,
    NoSuchDeviceError,
    GpuFeedError,
    "A device index beyond the devices present."
);
create_exception!(
    gpufeed,
    LengthMismatchError,
    GpuFeedError,
    "Two buffers that must have equal lengths do not."
);
create_exception!(
    gpufeed,
    OutOfBoundsError,
    GpuFeedError,
    "A range outside a buffer."
);
create_exception!(
    gpufeed,
    SizeOverflowError,
    GpuFeedError,
    "A size that overflows the address space."
);
create_exception!(
    gpufeed,
    LockFailedError,
    GpuFeedError,
    "Page-locking was refused (memlock limit, not enough memory)."
);
create_exception!(
    gpufeed,
    InvalidArgumentError,
    GpuFeedError,
    "An argument invalid for the operation."
);
create_exception!(gpufeed, OverlapError, GpuFeedError, "Overlapping operands.");
create_exception!(
    gpufeed,
    NotTimedError,
    GpuFeedError,
    "Elapsed time of events recorded without timing."
);
create_exception!(
    gpufeed,
    NotReadyError,
    GpuFeedError,
    "Elapsed time of events not reached yet."
);
create_exception!(
    gpufeed,
    InternalError,
    GpuFeedError,
    "The library's own machinery failed."
);

/// `gpufeed.OutOfMemoryError`: subclasses both `GpuFeedError` and Python's
/// `MemoryError`, so `except MemoryError` catches out of memory from the
/// device or the pinned allocator as it does for NumPy. Made at module init
/// (`create_exception!` takes one base only).
static OUT_OF_MEMORY: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();

/// The `OutOfMemoryError` type (made on first use).
pub fn out_of_memory_error(py: Python<'_>) -> PyResult<&Bound<'_, pyo3::types::PyType>> {
    OUT_OF_MEMORY
        .get_or_try_init(py, || {
            let dict = pyo3::types::PyDict::new(py);
            dict.set_item("__module__", "gpufeed")?;
            dict.set_item(
                "__doc__",
                "Out of memory (device memory, or pinned host memory): a `GpuFeedError` and a \
                 `MemoryError`. `kind` is \"OutOfMemory\".",
            )?;
            let bases = (
                py.get_type::<GpuFeedError>(),
                py.get_type::<pyo3::exceptions::PyMemoryError>(),
            );
            py.get_type::<pyo3::types::PyType>()
                .call1(("OutOfMemoryError", bases, dict))?
                .cast_into::<pyo3::types::PyType>()
                .map(Bound::unbind)
                .map_err(PyErr::from)
        })
        .map(|t| t.bind(py))
}

/// An `OSError` for `io` with the message `text`: `OSError(errno, text)`
/// where the error has an errno (Python picks the subclass and sets
/// `errno`), else the subclass of its kind.
pub(crate) fn os_error(io: &std::io::Error, text: String) -> PyErr {
    match io.raw_os_error() {
        Some(code) => pyo3::exceptions::PyOSError::new_err((code, text)),
        None => PyErr::from(std::io::Error::new(io.kind(), text)),
    }
}

/// A `gpufeed::Error` as the Python exception of its variant, with its text;
/// `kind` (the variant's name) is its class's (set when the module loads),
/// or on the exception itself for an I/O error (an `OSError` subclass).
pub fn to_py(e: gpufeed::Error) -> PyErr {
    use gpufeed::Error as E;
    let text = e.to_string();
    match &e {
        E::Driver { .. } => DriverError::new_err(text),
        E::ContextBroken(_) => ContextBrokenError::new_err(text),
        E::KernelFault { .. } => KernelFaultError::new_err(text),
        E::BackendUnavailable(_) => BackendUnavailableError::new_err(text),
        E::NoSuchDevice { .. } => NoSuchDeviceError::new_err(text),
        E::LengthMismatch { .. } => LengthMismatchError::new_err(text),
        E::OutOfBounds { .. } => OutOfBoundsError::new_err(text),
        E::SizeOverflow { .. } => SizeOverflowError::new_err(text),
        E::LockFailed { .. } => LockFailedError::new_err(text),
        E::InvalidArgument(_) | E::InvalidLaunch { .. } => InvalidArgumentError::new_err(text),
        E::Overlap { .. } => OverlapError::new_err(text),
        E::NotTimed => NotTimedError::new_err(text),
        E::NotReady => NotReadyError::new_err(text),
        E::Internal(_) => InternalError::new_err(text),
        // The OSError subclass of its errno (FileNotFoundError, ...), with
        // `errno` set; of its kind where there is no errno.
        E::Io(io) => {
            let err = os_error(io, text);
            Python::attach(|py| {
                // Best effort: the exception is right without the attribute.
                let _ = err.value(py).setattr("kind", "Io");
            });
            err
        }
        E::OutOfMemory { .. } => Python::attach(|py| match out_of_memory_error(py) {
            Ok(t) => PyErr::from_type(t.clone(), text),
            Err(e) => e,
        }),
        _ => GpuFeedError::new_err(text),
    }
}

/// `Result<T, gpufeed::Error>` into `PyResult<T>`.
pub trait IntoPy<T> {
    /// Converts the error with [`to_py`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for gpufeed::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An argument that is a count or an offset: a Python int from 0 to
/// 2**64 - 1. A negative or larger int is a `ValueError` (pyo3's own
/// extraction says `OverflowError`); anything but an int a `TypeError`.
#[derive(Clone, Copy)]
pub struct Count(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for Count {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        obj.extract::<u64>().map(Count).map_err(|e| {
            if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "{} is not a count or offset (0 to 2**64 - 1)",
                    obj.as_any()
                ))
            } else {
                e
            }
        })
    }
}

impl Count {
    /// The count as a `u32`: `ValueError` naming `what` above 2**32 - 1.
    pub fn u32(self, what: &str) -> PyResult<u32> {
        u32::try_from(self.0).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "{what}: {} is above 2**32 - 1",
                self.0
            ))
        })
    }
}

/// A `BufferError` with `msg`.
pub fn buffer_error(msg: impl Into<String>) -> PyErr {
    PyBufferError::new_err(msg.into())
}
