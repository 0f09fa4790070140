//! `as_device_array`: a foreign CUDA array (a PyTorch tensor, a CuPy
//! array) wrapped in place, through DLPack or the CUDA array interface.

use crate::device::array::DeviceArray;
use crate::device::devices::{device_or_default, Device};
use crate::device::parse::nbytes;
use crate::device::state::{DevMem, StateCell};
use crate::dtype::DType;
use crate::foreign::{check_c_contiguous, Imported};
use crate::{convert::buffer_error, convert::IntoPy};
use gpufeed::BackendKind;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Wraps a foreign CUDA array (a PyTorch tensor, a CuPy array: anything
/// with `__dlpack__` or `__cuda_array_interface__`) in place as a
/// `DeviceArray`, so an operation or a pipeline can write it. Pending
/// writes of the producer are waited for first (the DLPack handshake on a
/// stream of ours, or the interface's `stream`). C-contiguous only. The
/// wrapper keeps the producer's memory alive; while an operation uses it,
/// don't touch the tensor from other code (as with any shared device memory).
/// A masked `__cuda_array_interface__` (a `mask` that isn't None) is refused
/// with `BufferError`. CUDA only.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn as_device_array(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let device = device_or_default(py, device)?;
    if !obj.hasattr("__dlpack__")? && obj.hasattr("__cuda_array_interface__")? {
        // What can't be imported on any backend is refused first.
        refuse_masked_cai(&obj.getattr("__cuda_array_interface__")?)?;
    }
    if device.kind() != BackendKind::Cuda {
        return Err(crate::convert::BackendUnavailableError::new_err(
            "as_device_array needs the CUDA backend (this is the CPU emulation)",
        ));
    }
    let imported = if obj.hasattr("__dlpack__")? {
        crate::dlpack::import_cuda(py, obj, &device)?
    } else if obj.hasattr("__cuda_array_interface__")? {
        import_cai(py, obj, &device)?
    } else {
        return Err(PyTypeError::new_err(
            "as_device_array takes an object with __dlpack__ or __cuda_array_interface__",
        ));
    };
    let nbytes = nbytes(&imported.shape, imported.dtype)?;
    // The address is the producer's word: the driver must know it as memory
    // of this device, long enough, before any command gets it.
    gpufeed::interop::check_foreign_device_range(&device, imported.addr, nbytes).py()?;
    Ok(DeviceArray {
        state: StateCell::ready(DevMem::Foreign {
            addr: imported.addr,
            bytes: nbytes,
            device: device.clone(),
            owner: imported.owner,
        }),
        dtype: imported.dtype,
        shape: imported.shape,
        nbytes,
        device,
        exports: Arc::default(),
        shared: AtomicBool::new(false),
        releases: Arc::default(),
    })
}

/// A `__cuda_array_interface__` with a `mask` (a masked array: the mask
/// says which elements are valid) is refused: the device would read and
/// write the masked-out elements as if they were data.
fn refuse_masked_cai(cai: &Bound<'_, PyAny>) -> PyResult<()> {
    if let Ok(mask) = cai.get_item("mask") {
        if !mask.is_none() {
            return Err(buffer_error(
                "the __cuda_array_interface__ has a mask (a masked array): masks are not \
                 supported (every element would be read and written as data): fill the masked \
                 elements and pass the array without its mask",
            ));
        }
    }
    Ok(())
}

fn import_cai(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: &gpufeed::Device,
) -> PyResult<Imported> {
    let cai = obj.getattr("__cuda_array_interface__")?;
    refuse_masked_cai(&cai)?;
    let shape: Vec<usize> = cai.get_item("shape")?.extract()?;
    let typestr: String = cai.get_item("typestr")?.extract()?;
    let dtype = DType::parse(&typestr)
        .filter(|_| !typestr.starts_with('>'))
        .ok_or_else(|| PyTypeError::new_err(format!("unsupported typestr {typestr:?}")))?;
    let (addr, readonly): (u64, bool) = cai.get_item("data")?.extract()?;
    if readonly {
        return Err(buffer_error("the foreign array is read-only"));
    }
    if let Ok(strides) = cai.get_item("strides") {
        if !strides.is_none() {
            let strides: Vec<isize> = strides.extract()?;
            check_c_contiguous(&shape, &strides, dtype.size())?;
        }
    }
    if let Ok(stream) = cai.get_item("stream") {
        if !stream.is_none() {
            let handle: u64 = stream.extract()?;
            // SAFETY: the producer gave this stream handle for consumers to
            // synchronize on (CAI v3), in the primary context it shares with us.
            py.detach(|| unsafe { gpufeed::interop::synchronize_foreign_stream(device, handle) })
                .py()?;
        }
    }
    Ok(Imported {
        addr,
        shape,
        dtype,
        owner: obj.clone().unbind(),
    })
}
