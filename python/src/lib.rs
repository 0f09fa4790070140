//! `gpufeed`: Python bindings of the `host` crate (PyO3, one abi3 wheel for
//! CPython 3.11+).
//!
//! - [`alloc::PinnedAllocator`] / [`alloc::PinnedBuffer`]: pinned host memory
//!   from the stream-aware pool, seen from NumPy through the buffer protocol
//!   (no copy), with pin-in-place of existing arrays ([`alloc::pin`]).
//! - [`ops::Stream`] / [`ops::Operation`]: copies and the in-tree kernels as
//!   operations that own their buffers until the device is done.
//! - [`pipe::Pipeline`]: the chunked overlap pipeline, run with the GIL released.
//! - [`loader::Loader`]: a training loop's feeder (batches gathered by index
//!   into pinned blocks, sent ahead, handed out as torch/CuPy tensors).
//! - [`dlpack`]: DLPack and `__cuda_array_interface__` exchange.
//!
//! The ownership rules (what makes it sound): a buffer given to an
//! operation moves out of its Python object (whose state becomes in-flight:
//! every access raises `BufferError`) and comes back when the operation is
//! waited for; a buffer with live exports (NumPy views, memoryviews, DLPack
//! capsules) can't be given to an operation or freed.

use pyo3::prelude::*;

pub mod alloc;
pub mod buffer;
pub mod convert;
pub mod device;
pub mod dlpack;
pub mod dtype;
pub mod files;
pub mod foreign;
pub mod kernels;
pub mod loader;
pub mod ops;
pub mod pipe;
pub mod staging;
pub mod weights;

use convert::*;

#[pymodule]
#[pyo3(name = "gpufeed")]
fn gpufeed_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    alloc::Taken::get(py)?;
    // Each error class, with its `kind` (the Rust variant's name) as a class
    // attribute: an error raised anywhere carries it, not only those made
    // by `to_py`.
    let errors = [
        ("GpuFeedError", py.get_type::<GpuFeedError>(), "Other"),
        ("DriverError", py.get_type::<DriverError>(), "Driver"),
        (
            "ContextBrokenError",
            py.get_type::<ContextBrokenError>(),
            "ContextBroken",
        ),
        (
            "KernelFaultError",
            py.get_type::<KernelFaultError>(),
            "KernelFault",
        ),
        (
            "BackendUnavailableError",
            py.get_type::<BackendUnavailableError>(),
            "BackendUnavailable",
        ),
        (
            "NoSuchDeviceError",
            py.get_type::<NoSuchDeviceError>(),
            "NoSuchDevice",
        ),
        (
            "LengthMismatchError",
            py.get_type::<LengthMismatchError>(),
            "LengthMismatch",
        ),
        (
            "OutOfBoundsError",
            py.get_type::<OutOfBoundsError>(),
            "OutOfBounds",
        ),
        (
            "SizeOverflowError",
            py.get_type::<SizeOverflowError>(),
            "SizeOverflow",
        ),
        (
            "LockFailedError",
            py.get_type::<LockFailedError>(),
            "LockFailed",
        ),
        (
            "InvalidArgumentError",
            py.get_type::<InvalidArgumentError>(),
            "InvalidArgument",
        ),
        ("OverlapError", py.get_type::<OverlapError>(), "Overlap"),
        ("NotTimedError", py.get_type::<NotTimedError>(), "NotTimed"),
        ("NotReadyError", py.get_type::<NotReadyError>(), "NotReady"),
        ("InternalError", py.get_type::<InternalError>(), "Internal"),
        (
            "OutOfMemoryError",
            out_of_memory_error(py)?.clone(),
            "OutOfMemory",
        ),
    ];
    for (name, class, kind) in errors {
        class.setattr("kind", kind)?;
        m.add(name, class)?;
    }
    m.add_class::<device::Device>()?;
    m.add_class::<device::DeviceArray>()?;
    m.add_class::<alloc::PinnedAllocator>()?;
    m.add_class::<alloc::PinnedBuffer>()?;
    m.add_class::<alloc::PinnedView>()?;
    m.add_class::<ops::Stream>()?;
    m.add_class::<ops::Operation>()?;
    m.add_class::<staging::Transfer>()?;
    m.add_class::<pipe::Pipeline>()?;
    m.add_class::<loader::Loader>()?;
    m.add_class::<loader::LoaderIterator>()?;
    m.add_function(wrap_pyfunction!(device::default_device, m)?)?;
    m.add_function(wrap_pyfunction!(device::as_device_array, m)?)?;
    m.add_function(wrap_pyfunction!(alloc::pin, m)?)?;
    m.add_function(wrap_pyfunction!(pipe::compare_sync_async, m)?)?;
    m.add_function(wrap_pyfunction!(staging::to_device, m)?)?;
    m.add_function(wrap_pyfunction!(files::read_file, m)?)?;
    m.add_function(wrap_pyfunction!(files::load, m)?)?;
    m.add_function(wrap_pyfunction!(files::save, m)?)?;
    m.add_function(wrap_pyfunction!(files::load_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(files::save_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(files::gds_status, m)?)?;
    m.add_function(wrap_pyfunction!(files::file_read_mode, m)?)?;
    m.add_function(wrap_pyfunction!(staging::to_host, m)?)?;
    m.add_function(wrap_pyfunction!(staging::to_device_async, m)?)?;
    m.add_function(wrap_pyfunction!(staging::to_host_async, m)?)?;
    m.add_function(wrap_pyfunction!(staging::staging_stats, m)?)?;
    m.add_function(wrap_pyfunction!(ops::foreign_stream_wait, m)?)?;
    weights::register(m)?;
    kernels::submodule(m)?;
    m.add(
        "DTYPES",
        dtype::ALL.iter().map(|d| d.name()).collect::<Vec<_>>(),
    )?;
    Ok(())
}
