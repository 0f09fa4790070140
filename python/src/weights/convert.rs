//! `load_model`'s dtype conversion (bfloat16, float16 and float32 into one
//! another, on the host: each converted tensor's part is read from its
//! file, converted by this thread, then uploaded; a device kernel is a
//! follow-up) and its results as `framework=` asks.

use crate::buffer::ContiguousView;
use crate::convert::IntoPy;
use crate::device::DeviceArray;
use crate::dtype::DType;
use gpufeed::weights::{Dtype, FileError, PlannedTensor};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::os::unix::fs::FileExt;

/// A `gpufeed::Error` of the weights code as the Python exception a file
/// error should be (see the module's notes); others as [`crate::convert::to_py`].
pub(crate) fn weights_error(e: gpufeed::Error) -> PyErr {
    let Some(f) = FileError::of(&e) else {
        return crate::convert::to_py(e);
    };
    let kind = match &e {
        gpufeed::Error::Io(io) => io.kind(),
        _ => std::io::ErrorKind::Other,
    };
    if kind == std::io::ErrorKind::InvalidData {
        return PyValueError::new_err(f.to_string());
    }
    let path = f.path.as_os_str().to_os_string();
    match f.errno {
        Some(code) => PyOSError::new_err((code, f.detail.clone(), path)),
        // No errno (a file shorter than its header says): the text as
        // `strerror`, the path as `filename`.
        None => PyOSError::new_err((py_none(), f.detail.clone(), path)),
    }
}

fn py_none() -> Option<i32> {
    None
}

/// The device dtype of a safetensors dtype (`None` for bool and 8-bit
/// floats, which have none).
pub(crate) fn device_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U64 => DType::U64,
        Dtype::U32 => DType::U32,
        Dtype::U16 => DType::U16,
        Dtype::U8 => DType::U8,
        Dtype::Bool | Dtype::F8E4M3 | Dtype::F8E5M2 => return None,
    })
}

/// Whether conversions take `d` (bfloat16, float16, float32).
pub(crate) fn is_float(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16 | DType::F32)
}

/// The bytes of `t`'s part from `path`, read piece by piece.
pub(crate) fn read_pieces(path: &std::path::Path, t: &PlannedTensor) -> gpufeed::Result<Vec<u8>> {
    let named = |e: std::io::Error| {
        gpufeed::Error::from(std::io::Error::new(
            e.kind(),
            format!("{}: {e}", path.display()),
        ))
    };
    let file = std::fs::File::open(path).map_err(named)?;
    let mut raw = vec![0u8; t.nbytes];
    for p in &t.pieces {
        file.read_exact_at(&mut raw[p.offset..p.offset + p.len], p.at)
            .map_err(named)?;
    }
    Ok(raw)
}

fn to_f32(d: DType, b: &[u8]) -> f32 {
    match d {
        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// `raw` (values of `from`) as values of `to`, rounded to nearest even
/// (as PyTorch's `.to(dtype)`; NaN stays NaN).
///
/// # Errors
/// `InvalidArgument` for a dtype conversions don't take.
pub(crate) fn convert(raw: &[u8], from: DType, to: DType) -> gpufeed::Result<Vec<u8>> {
    if !is_float(from) || !is_float(to) {
        return Err(gpufeed::Error::InvalidArgument(format!(
            "no conversion from {} to {}",
            from.name(),
            to.name()
        )));
    }
    if from == to {
        return Ok(raw.to_vec());
    }
    let mut out = Vec::with_capacity(raw.len() / from.size() * to.size());
    for b in raw.chunks_exact(from.size()) {
        let x = to_f32(from, b);
        match to {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            _ => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    Ok(out)
}

/// What `load_model` hands out for a new tensor.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Framework {
    /// gpufeed `DeviceArray`s.
    Gpufeed,
    /// PyTorch tensors (CUDA, without a copy; CPU tensors on the CPU
    /// emulation).
    Torch,
    /// CuPy arrays (CUDA only).
    Cupy,
    /// NumPy arrays (bfloat16 as its raw `uint16` bits).
    Numpy,
}

impl Framework {
    pub fn parse(name: &str) -> PyResult<Framework> {
        Ok(match name {
            "gpufeed" => Framework::Gpufeed,
            "torch" => Framework::Torch,
            "cupy" => Framework::Cupy,
            "numpy" => Framework::Numpy,
            other => {
                return Err(PyValueError::new_err(format!(
                    "load_model: framework {other:?} is not one of \"gpufeed\", \"torch\", \
                     \"cupy\", \"numpy\""
                )))
            }
        })
    }

    /// `array` as this framework's object.
    pub fn hand_out<'py>(
        self,
        py: Python<'py>,
        array: Py<DeviceArray>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = array.bind(py);
        let cuda = a.get().device.kind() == gpufeed::BackendKind::Cuda;
        match self {
            Framework::Gpufeed => Ok(a.clone().into_any()),
            Framework::Torch if cuda => py.import("torch")?.call_method1("from_dlpack", (a,)),
            Framework::Cupy if cuda => py.import("cupy")?.call_method1("from_dlpack", (a,)),
            Framework::Cupy => Err(PyValueError::new_err(
                "load_model: framework=\"cupy\" needs a GPU (this device is the CPU emulation)",
            )),
            Framework::Numpy | Framework::Torch => {
                let d = a.get();
                let np = py.import("numpy")?;
                let out =
                    np.call_method1("empty", (PyTuple::new(py, &d.shape)?, d.dtype.numpy_name()))?;
                let mut view = ContiguousView::get(&out, true)?;
                // SAFETY: a fresh array of ours, exported writable; no Python
                // code runs while the slice lives.
                let dst = unsafe { view.as_bytes_mut() };
                d.with_own_read("load_model", |buf| buf.copy_to_host_sync(dst).py())?;
                drop(view);
                if self == Framework::Numpy {
                    return Ok(out);
                }
                let torch = py.import("torch")?;
                let t = torch.call_method1("from_numpy", (out,))?;
                if d.dtype == DType::BF16 {
                    return t.call_method1("view", (torch.getattr("bfloat16")?,));
                }
                Ok(t)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::convert;
    use crate::dtype::DType;

    #[test]
    fn conversions_round_to_nearest_even_and_keep_specials() {
        let xs = [
            0.0f32,
            -1.5,
            1.0 + 1.0 / 256.0,
            65504.0,
            1e-8,
            f32::INFINITY,
        ];
        let raw: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf = convert(&raw, DType::F32, DType::BF16).unwrap();
        let back = convert(&bf, DType::BF16, DType::F32).unwrap();
        let got: Vec<f32> = back
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got[..2], [0.0, -1.5]);
        assert_eq!(got[2], 1.0); // 1 + 2**-8 is a tie in bf16: to even
        assert_eq!(got[5], f32::INFINITY);
        let h = convert(&bf, DType::BF16, DType::F16).unwrap();
        assert_eq!(h.len(), bf.len());
        assert!(convert(&raw, DType::F32, DType::I32).is_err());
    }
}
