//! Files to the device and back: `load` / `save` (`.npy`), `load_safetensors`
//! and `read_file` (raw bytes), through the staging engine's ring (parallel
//! `pread`s by native threads into pinned blocks, each block's DMA
//! overlapping the next reads). The GIL is released while the file is
//! read or written: only the file and device memory of ours are touched.

use crate::device::{device_or_default, Device, DeviceArray};
use crate::dtype::DType;
use crate::IntoPy;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::fs::File;

/// The OSError subclass of an I/O error (`FileNotFoundError`,
/// `PermissionError`, `IsADirectoryError`...), its message naming `path`.
fn open_error(path: &str, e: std::io::Error) -> PyErr {
    PyErr::from(std::io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// Reads `array.nbytes` bytes of `path` from `offset` into `array` (ours).
fn fill_from_file(py: Python<'_>, array: &DeviceArray, path: &str, offset: u64) -> PyResult<()> {
    let file = File::open(path).map_err(|e| open_error(path, e))?;
    let staging = crate::staging::engine_for(py, &array.device)?;
    array.with_own("load", |buf| {
        py.detach(|| staging.read_file_blocking(&file, offset, buf))
            .py()
    })
}

/// `read_file(path, dtype, shape=None, offset=0, device=None)`: the raw
/// bytes of `path` from `offset`, as a new `DeviceArray` of `dtype` and
/// `shape` (default: as many elements as the rest of the file holds).
///
/// Raises `OSError` (missing file, a directory, permission denied;
/// `EOFError`-like `OSError` for a file shorter than the shape asks),
/// `ValueError` for a bad shape.
#[pyfunction]
#[pyo3(signature = (path, dtype, shape=None, offset=0, device=None))]
pub fn read_file(
    py: Python<'_>,
    path: std::path::PathBuf,
    dtype: &Bound<'_, PyAny>,
    shape: Option<&Bound<'_, PyAny>>,
    offset: u64,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let path = path.to_string_lossy().into_owned();
    let dtype = crate::device::parse_dtype_or_f32(Some(dtype))?;
    let shape = match shape {
        Some(s) => crate::device::parse_shape(s)?,
        None => {
            let len = std::fs::metadata(&path)
                .map_err(|e| open_error(&path, e))?
                .len();
            let rest = len.checked_sub(offset).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{path}: offset {offset} is past its end ({len} bytes)"
                ))
            })?;
            vec![(rest / dtype.size() as u64) as usize]
        }
    };
    let device = device_or_default(py, device)?;
    let array = DeviceArray::alloc(&device, shape, dtype)?;
    fill_from_file(py, &array, &path, offset)?;
    Ok(array)
}

/// The `.npy` header of `path`: (shape, dtype, data offset).
fn npy_header(py: Python<'_>, path: &str) -> PyResult<(Vec<usize>, DType, u64)> {
    let format = py.import("numpy.lib.format")?;
    let io = py.import("io")?;
    let f = io.call_method1("open", (path, "rb"))?;
    let read = || -> PyResult<(Vec<usize>, DType, u64)> {
        let (major, _minor): (u8, u8) = format.call_method1("read_magic", (&f,))?.extract()?;
        let header = match major {
            1 => format.call_method1("read_array_header_1_0", (&f,))?,
            2 => format.call_method1("read_array_header_2_0", (&f,))?,
            v => {
                return Err(PyValueError::new_err(format!(
                    "{path}: .npy format version {v} is not supported (1 and 2 are)"
                )))
            }
        };
        let (shape, fortran, descr): (Vec<usize>, bool, Bound<'_, PyAny>) = header.extract()?;
        let offset: u64 = f.call_method0("tell")?.extract()?;
        let name: String = descr.getattr("str")?.extract()?;
        let dtype = DType::parse(&name)
            .filter(|_| !name.starts_with('>'))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{path}: dtype {name:?} has no device dtype (little-endian numbers only)"
                ))
            })?;
        if fortran && shape.iter().filter(|&&d| d > 1).count() > 1 {
            return Err(PyValueError::new_err(format!(
                "{path}: the array is stored in Fortran order; load it with numpy.load and \
                 pass numpy.ascontiguousarray(a) to to_device"
            )));
        }
        Ok((shape, dtype, offset))
    };
    let r = read();
    f.call_method0("close")?;
    r
}

/// `load(path, device=None)`: a `.npy` file as a new `DeviceArray` of its
/// shape and dtype, read straight from the file into pinned blocks and on
/// to the device (no NumPy array in between).
///
/// Raises `ValueError` for a corrupt header, an unknown or big-endian
/// dtype, or Fortran order; `OSError` as `read_file`.
#[pyfunction]
#[pyo3(signature = (path, device=None))]
pub fn load(
    py: Python<'_>,
    path: std::path::PathBuf,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let path = path.to_string_lossy().into_owned();
    let (shape, dtype, offset) = npy_header(py, &path)?;
    let device = device_or_default(py, device)?;
    let array = DeviceArray::alloc(&device, shape, dtype)?;
    fill_from_file(py, &array, &path, offset)?;
    Ok(array)
}

/// `save(path, array)`: a `DeviceArray` as a `.npy` file that NumPy reads
/// back bit for bit. Written to `path + ".partial"` and renamed when
/// complete: a failed save (a full disk) leaves no file at `path`.
#[pyfunction]
pub fn save(
    py: Python<'_>,
    path: std::path::PathBuf,
    array: &Bound<'_, DeviceArray>,
) -> PyResult<()> {
    let path = path.to_string_lossy().into_owned();
    let a = array.get();
    if a.dtype == DType::BF16 {
        return Err(PyValueError::new_err(
            "save: NumPy has no bfloat16; convert it first (or read the raw bytes with to_host)",
        ));
    }
    let tmp = format!("{path}.partial");
    let format = py.import("numpy.lib.format")?;
    let io = py.import("io")?;
    let header = PyDict::new(py);
    header.set_item("descr", a.dtype.typestr())?;
    header.set_item("fortran_order", false)?;
    header.set_item("shape", PyTuple::new(py, &a.shape)?)?;
    let f = io.call_method1("open", (&tmp, "wb"))?;
    let wrote = format.call_method1("write_array_header_1_0", (&f, &header));
    let offset: PyResult<u64> = wrote.and_then(|_| f.call_method0("tell")?.extract());
    f.call_method0("close")?;
    let result = offset.and_then(|offset| {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .map_err(|e| open_error(&tmp, e))?;
        let staging = crate::staging::engine_for(py, &a.device)?;
        a.with_own("save", |buf| {
            py.detach(|| -> host::Result<()> {
                staging.write_file_blocking(buf, &file, offset)?;
                file.set_len(offset + buf.len() as u64)?;
                file.sync_data()?;
                Ok(())
            })
            .py()
        })?;
        std::fs::rename(&tmp, &path).map_err(|e| open_error(&path, e))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The device dtype of a safetensors dtype name.
fn safetensors_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I64" => DType::I64,
        "I32" => DType::I32,
        "I16" => DType::I16,
        "I8" => DType::I8,
        "U64" => DType::U64,
        "U32" => DType::U32,
        "U16" => DType::U16,
        "U8" => DType::U8,
        _ => return None,
    })
}

/// `load_safetensors(path, device=None)`: every tensor of a safetensors
/// file as a dict of name → `DeviceArray` (`{k: torch.from_dlpack(v) for k,
/// v in d.items()}` gives torch tensors without a copy).
///
/// Raises `ValueError` for a corrupt header (bad length, bad JSON, offsets
/// outside the file or not matching the shape), an unknown dtype;
/// `OSError` as `read_file`.
#[pyfunction]
#[pyo3(signature = (path, device=None))]
pub fn load_safetensors<'py>(
    py: Python<'py>,
    path: std::path::PathBuf,
    device: Option<&Device>,
) -> PyResult<Bound<'py, PyDict>> {
    use std::io::Read;
    let path = path.to_string_lossy().into_owned();
    let bad = |why: String| PyValueError::new_err(format!("{path}: not a safetensors file: {why}"));
    let mut file = File::open(&path).map_err(|e| open_error(&path, e))?;
    let size = file.metadata().map_err(|e| open_error(&path, e))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 || 8 + n > size {
        return Err(bad(format!(
            "header length {n} does not fit the file ({size} bytes)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(|_| bad("header cut short".into()))?;
    let json = py.import("json")?;
    let text = String::from_utf8(header).map_err(|_| bad("header is not UTF-8".into()))?;
    let parsed = json
        .call_method1("loads", (text,))
        .map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let entries = parsed
        .cast::<PyDict>()
        .map_err(|_| bad("header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let device = device_or_default(py, device)?;
    let out = PyDict::new(py);
    for (name, meta) in entries.iter() {
        let name: String = name.extract()?;
        if name == "__metadata__" {
            continue;
        }
        let field = |k: &str| -> PyResult<Bound<'py, PyAny>> {
            meta.get_item(k)
                .map_err(|_| bad(format!("tensor {name:?} has no {k:?}")))
        };
        let dtype_name: String = field("dtype")?
            .extract()
            .map_err(|_| bad(format!("tensor {name:?}: dtype is not a string")))?;
        let dtype = safetensors_dtype(&dtype_name).ok_or_else(|| {
            bad(format!(
                "tensor {name:?}: dtype {dtype_name:?} is not supported"
            ))
        })?;
        let shape: Vec<usize> = field("shape")?
            .extract()
            .map_err(|_| bad(format!("tensor {name:?}: shape is not a list of sizes")))?;
        let offsets: Vec<u64> = field("data_offsets")?
            .extract()
            .map_err(|_| bad(format!("tensor {name:?}: data_offsets is not [begin, end]")))?;
        let [begin, end] = offsets[..] else {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets is not [begin, end]"
            )));
        };
        let elems = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {name:?}: shape overflows")))?;
        let nbytes = elems
            .checked_mul(dtype.size())
            .ok_or_else(|| bad(format!("tensor {name:?}: size overflows")))?;
        if end < begin || end - begin != nbytes as u64 || data_start + end > size {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] do not hold {nbytes} bytes inside the file"
            )));
        }
        let array = DeviceArray::alloc(&device, shape, dtype)?;
        fill_from_file(py, &array, &path, data_start + begin)?;
        out.set_item(name, Py::new(py, array)?)?;
    }
    Ok(out)
}
