//! One typed error for the whole crate.

use std::sync::Arc;

/// Everything that can go wrong, each with enough context to act on.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {code}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        code: String,
    },
    /// The context hit an unrecoverable fault (a trapping kernel, an illegal
    /// address); every later operation on the device reports this.
    #[error("the device context is broken for good: {0}")]
    ContextBroken(String),
    /// A kernel faulted (on the CPU backend: the emulated trap).
    #[error("kernel `{kernel}` faulted: {reason}")]
    KernelFault {
        /// Kernel name.
        kernel: &'static str,
        /// What happened.
        reason: String,
    },
    /// No usable backend: forced CUDA without a driver or device, say.
    #[error("backend unavailable: {0}")]
    BackendUnavailable(String),
    /// A device index beyond the devices present.
    #[error("device {index} does not exist ({count} present)")]
    NoSuchDevice {
        /// Asked for.
        index: usize,
        /// Present.
        count: usize,
    },
    /// Two buffers that must have equal lengths do not.
    #[error("length mismatch: {what}: expected {expected} elements, got {got}")]
    LengthMismatch {
        /// Which operands.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A range outside a buffer.
    #[error("range {start}..{end} is out of bounds for a buffer of {len} elements")]
    OutOfBounds {
        /// Range start.
        start: usize,
        /// Range end.
        end: usize,
        /// Buffer length.
        len: usize,
    },
    /// An element count whose byte size does not fit in `usize`.
    #[error("{count} elements of {elem_size} bytes overflow the address space")]
    SizeOverflow {
        /// Elements asked for.
        count: usize,
        /// Bytes per element.
        elem_size: usize,
    },
    /// Page-locking was refused (memlock limit, or not enough memory).
    #[error("cannot lock {bytes} bytes of host memory: {reason}")]
    LockFailed {
        /// Bytes asked for.
        bytes: usize,
        /// The OS's reason, with the limit when known.
        reason: String,
    },
    /// An argument that is invalid for the operation.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An I/O error (results, plots).
    #[error("I/O: {0}")]
    Io(Arc<std::io::Error>),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(Arc::new(e))
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Byte size of `count` values of `T`, or [`Error::SizeOverflow`].
pub fn byte_size<T>(count: usize) -> Result<usize> {
    count
        .checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Error::SizeOverflow {
            count,
            elem_size: std::mem::size_of::<T>(),
        })
}
