//! One typed error for the whole crate.

use std::sync::Arc;

/// Everything that can go wrong, each with enough context to act on.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceBuffer, Error, Pipeline};
/// let device = Device::cpu();
/// let mut dev = DeviceBuffer::<f32>::new(&device, 4)?;
/// match dev.copy_from_host_sync(&[1.0; 3]) {
///     Err(Error::LengthMismatch { expected, got, .. }) => assert_eq!((expected, got), (4, 3)),
///     Err(other) => return Err(other), // non-exhaustive: keep a catch-all arm
///     Ok(()) => unreachable!("3 values into a buffer of 4"),
/// }
/// let err = Pipeline::new(&device, 0).err().expect("a pipeline of no streams");
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// assert_eq!(err.to_string(), "invalid argument: a pipeline needs at least one stream");
/// # Ok(()) }
/// ```
///
/// Non-exhaustive: match the variants you act on and keep a `_` arm.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
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
    /// A launch the device can't run: a grid or block dimension of zero or
    /// above the device's limit, too many threads in a block, more shared
    /// memory than a block may have. Refused before anything is queued, on
    /// every backend alike.
    #[error("launch of kernel `{kernel}` refused: {reason}")]
    InvalidLaunch {
        /// Kernel name.
        kernel: &'static str,
        /// Which limit, and the device's value.
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
    /// An allocation the backend could not satisfy: device memory
    /// (`CUDA_ERROR_OUT_OF_MEMORY` from the driver, a null from the CPU
    /// emulation's allocator) or pinned host memory (`cuMemHostAlloc` out of
    /// memory, `mmap` refused with `ENOMEM` on the emulation). A refused
    /// page-lock of memory that was allocated is [`Error::LockFailed`].
    #[error("out of memory: {bytes} bytes of {what}")]
    OutOfMemory {
        /// The memory and the backend, e.g. "CUDA device memory (cuMemAlloc)".
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// An argument that is invalid for the operation.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Two device ranges a command reads and writes share memory without
    /// being the same range (same-range operands are allowed where the
    /// operation is elementwise).
    #[error("overlapping operands: {what}")]
    Overlap {
        /// Which command and operands.
        what: &'static str,
    },
    /// Elapsed time asked of an event recorded without timing.
    #[error("elapsed time needs two events recorded with timing (`record_timed`)")]
    NotTimed,
    /// Elapsed time asked of an event the stream has not reached yet.
    #[error("the event has not completed yet: await it first")]
    NotReady,
    /// The library's own machinery failed (a stream's worker or completion
    /// thread is gone, a thread could not start): not the caller's mistake.
    #[error("internal failure: {0}")]
    Internal(String),
    /// A worker thread of a staging engine panicked while copying: the copy
    /// stopped there; the engine and the buffers stay usable.
    #[error("a staging worker panicked: {0}")]
    WorkerPanicked(String),
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
///
/// ```rust
/// use gpufeed::{Device, DeviceBuffer};
/// fn first_value(device: &Device) -> gpufeed::Result<f32> {
///     let mut dev = DeviceBuffer::<f32>::new(device, 1)?;
///     let mut out = [f32::NAN];
///     dev.copy_to_host_sync(&mut out)?;
///     Ok(out[0])
/// }
/// assert_eq!(first_value(&Device::cpu()).unwrap(), 0.0); // zeroed on the CPU emulation
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Byte size of `count` values of `T`, or [`Error::SizeOverflow`].
pub(crate) fn byte_size<T>(count: usize) -> Result<usize> {
    count
        .checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(Error::SizeOverflow {
            count,
            elem_size: std::mem::size_of::<T>(),
        })
}

/// A failed job's error, with the job's bundle handed back whenever the GPU
/// is known to be done with it (always, except when work was queued and its
/// end can't be observed on a live context: then the buffers are leaked
/// rather than freed under the GPU, and `bundle` is `None`).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Error, JobError, PinnedBuffer, Stream};
/// let device = Device::cpu();
/// let host = PinnedBuffer::<f32>::new(&device, 4)?;
/// let dev = DeviceBuffer::<f32>::new(&device, 8)?; // not the host buffer's length
/// let err: JobError<_> = block_on(Stream::new(&device)?.copy_h2d(host, dev)).unwrap_err();
/// assert!(matches!(err.error, Error::LengthMismatch { expected: 4, got: 8, .. }));
/// let (host, dev) = err.bundle.expect("nothing ran: the buffers come back");
/// assert_eq!((host.len(), dev.len()), (4, 8));
/// # Ok(()) }
/// ```
///
/// Converts into [`Error`] (dropping the bundle), so `?` works in functions
/// returning [`Result`].
pub struct JobError<B> {
    /// What went wrong.
    pub error: Error,
    /// The buffers the job held, when they can be handed back.
    pub bundle: Option<B>,
}

impl<B> JobError<B> {
    /// The error and the bundle.
    pub fn into_parts(self) -> (Error, Option<B>) {
        (self.error, self.bundle)
    }
}

impl<B> std::fmt::Debug for JobError<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobError")
            .field("error", &self.error)
            .field("bundle_returned", &self.bundle.is_some())
            .finish()
    }
}

impl<B> std::fmt::Display for JobError<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<B> std::error::Error for JobError<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<JobError<B>> for Error {
    fn from(e: JobError<B>) -> Error {
        e.error
    }
}
