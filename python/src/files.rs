//! Files to the device and back: `load` / `save` (`.npy`), `load_safetensors`
//! / `save_safetensors` and `read_file` (raw bytes), through the staging
//! engine's ring (parallel `pread`s by native threads into pinned blocks,
//! each block's DMA overlapping the next reads; buffered, or `O_DIRECT`
//! with `direct=True`). The GIL is released while the
//! file is read or written: only the file and device memory of ours are
//! touched. With `progress=`, a file is read or written in ranges of
//! [`PROGRESS_STEP`] bytes and the callback called with the GIL between
//! them; an exception it raises stops the transfer and propagates.

use crate::convert::IntoPy;
use crate::device::{device_or_default, DevMem, Device, DeviceArray, State};
use crate::dtype::DType;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use std::fs::File;
use std::path::{Path, PathBuf};

/// With a progress callback, a file is read or written in ranges of this
/// many bytes, the callback called after each.
pub const PROGRESS_STEP: usize = 64 << 20;

/// `direct=None|True|False` as the staging engine's [`gpufeed::FileIo`].
fn file_io(direct: Option<bool>) -> gpufeed::FileIo {
    match direct {
        None => gpufeed::FileIo::Auto,
        Some(true) => gpufeed::FileIo::Direct,
        Some(false) => gpufeed::FileIo::Buffered,
    }
}

/// A progress callback `progress(done_bytes, total_bytes)`, or none.
struct Progress<'py> {
    call: Option<Bound<'py, PyAny>>,
    done: u64,
    total: u64,
}

impl<'py> Progress<'py> {
    fn new(call: Option<Bound<'py, PyAny>>, total: u64) -> PyResult<Self> {
        if let Some(c) = &call {
            if !c.is_callable() {
                return Err(pyo3::exceptions::PyTypeError::new_err(
                    "progress must be a callable progress(done_bytes, total_bytes)",
                ));
            }
        }
        Ok(Progress {
            call,
            done: 0,
            total,
        })
    }

    /// The size of the ranges a transfer of `len` bytes goes in.
    fn step(&self, len: usize) -> usize {
        if self.call.is_some() {
            PROGRESS_STEP
        } else {
            len.max(1)
        }
    }

    /// `bytes` more done: calls the callback (its exception returned).
    fn advance(&mut self, bytes: usize) -> PyResult<()> {
        self.done += bytes as u64;
        match &self.call {
            Some(c) => c.call1((self.done, self.total)).map(|_| ()),
            None => Ok(()),
        }
    }
}

/// The OSError subclass of an I/O error (`FileNotFoundError`,
/// `PermissionError`, `IsADirectoryError`...) as Python's own `open` gives
/// it: `errno`, `strerror` and `filename` set, so its message reads
/// `[Errno 2] No such file or directory: 'x.npy'`.
pub(crate) fn open_error(path: &Path, e: std::io::Error) -> PyErr {
    match e.raw_os_error() {
        Some(code) => {
            let text = e.to_string();
            let strerror = text
                .strip_suffix(&format!(" (os error {code})"))
                .unwrap_or(&text)
                .to_string();
            PyOSError::new_err((code, strerror, path.as_os_str().to_os_string()))
        }
        None => crate::convert::os_error(&e, format!("{}: {e}", path.display())),
    }
}

/// `path` opened for reading, a directory refused as Python's own `open`
/// refuses it (`IsADirectoryError`): Linux opens a directory read-only,
/// and only a read of it fails (which a short read could hide).
pub(crate) fn open_file(path: &Path) -> PyResult<File> {
    /// EISDIR (21 on Linux, as on every Unix this builds for).
    const EISDIR: i32 = 21;
    let file = File::open(path).map_err(|e| open_error(path, e))?;
    if file.metadata().map_err(|e| open_error(path, e))?.is_dir() {
        return Err(open_error(path, std::io::Error::from_raw_os_error(EISDIR)));
    }
    Ok(file)
}

/// Reads `array.nbytes` bytes of `path` from `offset` into `array` (ours),
/// in ranges between which `progress` is called.
fn fill_from_file(
    py: Python<'_>,
    array: &DeviceArray,
    path: &Path,
    offset: u64,
    io: gpufeed::FileIo,
    progress: &mut Progress<'_>,
) -> PyResult<()> {
    let file = open_file(path)?;
    let staging = crate::staging::engine_for(py, &array.device)?;
    array.with_own("load", |buf| {
        let len = buf.len();
        let step = progress.step(len);
        let mut pos = 0;
        while pos < len {
            let end = len.min(pos + step);
            py.detach(|| {
                staging.read_file_with_blocking(&file, offset + pos as u64, buf, pos..end, io)
            })
            .py()?;
            progress.advance(end - pos)?;
            pos = end;
        }
        Ok(())
    })
}

/// Writes `array` (ours) to `file` from `offset`, in ranges between which
/// `progress` is called.
fn drain_to_file(
    py: Python<'_>,
    array: &DeviceArray,
    file: &File,
    offset: u64,
    progress: &mut Progress<'_>,
) -> PyResult<()> {
    let staging = crate::staging::engine_for(py, &array.device)?;
    array.with_own_read("save", |buf| {
        let len = buf.len();
        let step = progress.step(len);
        let mut pos = 0;
        while pos < len {
            let end = len.min(pos + step);
            py.detach(|| {
                staging.write_file_with_blocking(buf, pos..end, file, offset + pos as u64)
            })
            .py()?;
            progress.advance(end - pos)?;
            pos = end;
        }
        Ok(())
    })
}

/// Where a file is written before its rename to `path`: `path` +
/// ".partial-<pid>-<n>", a name of this save alone (two saves to one path
/// at once each write their own, and the last rename wins whole), created
/// exclusively by the caller; the name kept byte for byte, UTF-8 or not.
fn partial(path: &Path) -> PathBuf {
    static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SAVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".partial-{}-{n}", std::process::id()));
    PathBuf::from(name)
}

/// Finishes a file written at `tmp`: its length, its data on the disk,
/// then its name; removes it on any failure (of `written` too).
fn finish_atomically(
    py: Python<'_>,
    file: File,
    tmp: &Path,
    path: &Path,
    len: u64,
    written: PyResult<()>,
) -> PyResult<()> {
    let result = written.and_then(|()| {
        py.detach(|| -> std::io::Result<()> {
            file.set_len(len)?;
            file.sync_data()
        })
        .map_err(|e| open_error(tmp, e))?;
        drop(file);
        std::fs::rename(tmp, path).map_err(|e| open_error(path, e))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result
}

/// `read_file(path, dtype, shape=None, offset=0, device=None, direct=None,
/// progress=None)`: the raw bytes of `path` from `offset`, as a new
/// `DeviceArray` of `dtype` and `shape` (default: as many elements as the
/// rest of the file holds). `direct`: `None` or `False` buffered, `True`
/// with `O_DIRECT` (`OSError` where the file system refuses): no page
/// cache filled.
/// `progress(done_bytes, total_bytes)` is called every 64 MiB.
///
/// Raises `OSError` (missing file, a directory, permission denied;
/// `EOFError`-like `OSError` for a file shorter than the shape asks),
/// `ValueError` for a bad shape.
#[pyfunction]
#[pyo3(
    signature = (path, dtype, shape=None, offset=crate::convert::Count(0), device=None, direct=None, progress=None),
    text_signature = "(path, dtype, shape=None, offset=0, device=None, direct=None, progress=None)"
)]
#[allow(clippy::too_many_arguments)]
pub fn read_file(
    py: Python<'_>,
    path: PathBuf,
    dtype: &Bound<'_, PyAny>,
    shape: Option<&Bound<'_, PyAny>>,
    offset: crate::convert::Count,
    device: Option<&Device>,
    direct: Option<bool>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<DeviceArray> {
    let offset = offset.0;
    let dtype = crate::device::parse_dtype_or_f32(Some(dtype))?;
    let shape = match shape {
        Some(s) => crate::device::parse_shape(s)?,
        None => {
            let len = std::fs::metadata(&path)
                .map_err(|e| open_error(&path, e))?
                .len();
            let rest = len.checked_sub(offset).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{}: offset {offset} is past its end ({len} bytes)",
                    path.display()
                ))
            })?;
            let size = dtype.size() as u64;
            if rest % size != 0 {
                return Err(PyValueError::new_err(format!(
                    "{}: the {rest} bytes from offset {offset} to its end are not a whole number \
                     of {} elements ({size} bytes each): pass shape= to read part of them",
                    path.display(),
                    dtype.numpy_name()
                )));
            }
            vec![(rest / size) as usize]
        }
    };
    let device = device_or_default(py, device)?;
    let array = DeviceArray::alloc(py, &device, shape, dtype)?;
    let mut progress = Progress::new(progress, array.nbytes as u64)?;
    fill_from_file(py, &array, &path, offset, file_io(direct), &mut progress)?;
    Ok(array)
}

/// `err` from NumPy's parse of a `.npy` header, as documented: a header
/// its parser rejects with `tokenize.TokenError` or `SyntaxError` (an
/// unterminated dict or string) is a `ValueError` naming the file (NumPy
/// raises `ValueError` itself for the rest).
pub(crate) fn npy_header_error(py: Python<'_>, path: &Path, err: PyErr) -> PyErr {
    let token_error = py
        .import("tokenize")
        .and_then(|t| t.getattr("TokenError"))
        .is_ok_and(|t| err.matches(py, t).unwrap_or(false));
    if !token_error && !err.is_instance_of::<pyo3::exceptions::PySyntaxError>(py) {
        return err;
    }
    let e = PyValueError::new_err(format!(
        "{}: not a .npy file NumPy can read: its header does not parse ({err})",
        path.display()
    ));
    e.set_cause(py, Some(err));
    e
}

/// The `.npy` header of `path`: (shape, dtype, data offset).
fn npy_header(py: Python<'_>, path: &Path) -> PyResult<(Vec<usize>, DType, u64)> {
    let format = py.import("numpy.lib.format")?;
    let io = py.import("io")?;
    let f = io.call_method1("open", (path.as_os_str(), "rb"))?;
    let read = || -> PyResult<(Vec<usize>, DType, u64)> {
        let (major, _minor): (u8, u8) = format.call_method1("read_magic", (&f,))?.extract()?;
        let header = match major {
            1 => format.call_method1("read_array_header_1_0", (&f,))?,
            2 => format.call_method1("read_array_header_2_0", (&f,))?,
            v => {
                return Err(PyValueError::new_err(format!(
                    "{}: .npy format version {v} is not supported (1 and 2 are)",
                    path.display()
                )))
            }
        };
        let (shape, fortran, descr): (Bound<'_, PyAny>, bool, Bound<'_, PyAny>) =
            header.extract()?;
        // Each dimension a size: not negative, not past 64 bits.
        let shape: Vec<usize> = shape
            .extract::<Vec<Bound<'_, PyAny>>>()
            .ok()
            .and_then(|dims| dims.iter().map(|d| d.extract::<usize>().ok()).collect())
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{}: the header's shape {shape} is not a tuple of sizes (a dimension is \
                     negative or too large)",
                    path.display()
                ))
            })?;
        let offset: u64 = f.call_method0("tell")?.extract()?;
        let name: String = descr.getattr("str")?.extract()?;
        let dtype = DType::parse(&name)
            .filter(|_| !name.starts_with('>'))
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "{}: dtype {name:?} has no device dtype (little-endian numbers only)",
                    path.display()
                ))
            })?;
        if fortran && shape.iter().filter(|&&d| d > 1).count() > 1 {
            return Err(PyValueError::new_err(format!(
                "{}: the array is stored in Fortran order; load it with numpy.load and \
                 pass numpy.ascontiguousarray(a) to to_device",
                path.display()
            )));
        }
        Ok((shape, dtype, offset))
    };
    let r = read().map_err(|e| npy_header_error(py, path, e));
    f.call_method0("close")?;
    r
}

/// `load(path, device=None, direct=None, progress=None)`: a `.npy` file as
/// a new `DeviceArray` of its shape and dtype, read straight from the file
/// into pinned blocks and on to the device (no NumPy array in between).
/// `direct` and `progress` as for `read_file`.
///
/// Raises `ValueError` for a corrupt header, an unknown or big-endian
/// dtype, or Fortran order; `OSError` as `read_file`.
#[pyfunction]
#[pyo3(signature = (path, device=None, direct=None, progress=None))]
pub fn load(
    py: Python<'_>,
    path: PathBuf,
    device: Option<&Device>,
    direct: Option<bool>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<DeviceArray> {
    let (shape, dtype, offset) = npy_header(py, &path)?;
    let device = device_or_default(py, device)?;
    let array = DeviceArray::alloc(py, &device, shape, dtype)?;
    let mut progress = Progress::new(progress, array.nbytes as u64)?;
    fill_from_file(py, &array, &path, offset, file_io(direct), &mut progress)?;
    Ok(array)
}

/// `save(path, array, progress=None)`: a `DeviceArray` as a `.npy` file
/// that NumPy reads back bit for bit. Written to a name of its own beside
/// it (`path + ".partial-<pid>-<n>"`) and renamed when complete: a failed
/// save (a full disk, an exception from `progress`) leaves no file at
/// `path`.
#[pyfunction]
#[pyo3(signature = (path, array, progress=None))]
pub fn save(
    py: Python<'_>,
    path: PathBuf,
    array: &Bound<'_, DeviceArray>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<()> {
    let a = array.get();
    if a.dtype == DType::BF16 {
        return Err(PyValueError::new_err(
            "save: NumPy has no bfloat16; convert it first (or read the raw bytes with to_host)",
        ));
    }
    let mut progress = Progress::new(progress, a.nbytes as u64)?;
    let tmp = partial(&path);
    let format = py.import("numpy.lib.format")?;
    let io = py.import("io")?;
    let header = PyDict::new(py);
    header.set_item("descr", a.dtype.typestr())?;
    header.set_item("fortran_order", false)?;
    header.set_item("shape", PyTuple::new(py, &a.shape)?)?;
    let f = io.call_method1("open", (tmp.as_os_str(), "xb"))?;
    let wrote = format.call_method1("write_array_header_1_0", (&f, &header));
    let offset: PyResult<u64> = wrote.and_then(|_| f.call_method0("tell")?.extract());
    // A failed close (the header not flushed) fails the save like the rest.
    let closed = f.call_method0("close");
    let offset = match closed.and(offset) {
        Ok(o) => o,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    let file = match std::fs::OpenOptions::new().write(true).open(&tmp) {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(open_error(&tmp, e));
        }
    };
    let written = drain_to_file(py, a, &file, offset, &mut progress);
    finish_atomically(py, file, &tmp, &path, offset + a.nbytes as u64, written)
}

/// The device dtype of a safetensors dtype name.
pub(crate) fn safetensors_dtype(name: &str) -> Option<DType> {
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

/// Whether a safetensors tensor's `data_offsets` `[begin, end]` span
/// exactly `nbytes` bytes.
fn offsets_span(begin: u64, end: u64, nbytes: usize) -> bool {
    end >= begin && end - begin == nbytes as u64
}

/// Where a safetensors tensor ending at data offset `end` ends in the file
/// (its data region starting at `data_start`); `None` past 2**64 bytes.
/// Checked arithmetic: the offsets are the file's, any u64 (a sum that
/// wrapped would pass and read the header as data).
fn file_end(end: u64, data_start: u64) -> Option<u64> {
    data_start.checked_add(end)
}

/// One tensor of a safetensors file, as its header gives it, checked
/// against the file: `nbytes` bytes from file offset `at` lie inside it,
/// after the header.
pub(crate) struct SafetensorsEntry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// File offset of the tensor's first byte.
    pub at: u64,
    pub nbytes: usize,
}

/// The safetensors file `path`, opened, and its tensors, in the header's
/// order, `__metadata__` left out; every entry checked before any tensor
/// byte is read. A dtype with no device dtype is
/// `unsupported(tensor name, dtype name)`'s error; anything else wrong
/// (length, UTF-8, JSON, a field missing or of the wrong type, `__metadata__`
/// not an object of strings, a size that
/// overflows, offsets that don't span the tensor, two tensors sharing
/// bytes) a `ValueError` naming the file; a tensor past the file's end
/// (the file cut short) an `OSError`.
pub(crate) fn safetensors_entries(
    py: Python<'_>,
    path: &Path,
    unsupported: impl Fn(&str, &str) -> PyErr,
) -> PyResult<(File, Vec<SafetensorsEntry>)> {
    use std::io::Read;
    let bad = |why: String| {
        PyValueError::new_err(format!("{}: not a safetensors file: {why}", path.display()))
    };
    let mut file = open_file(path)?;
    let size = file.metadata().map_err(|e| open_error(path, e))?.len();
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
    let text = String::from_utf8(header).map_err(|_| bad("header is not UTF-8".into()))?;
    let parsed = py
        .import("json")?
        .call_method1("loads", (text,))
        .map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let entries = parsed
        .cast::<PyDict>()
        .map_err(|_| bad("header is not a JSON object".into()))?;
    let data_start = 8 + n;
    let mut out = Vec::new();
    let mut spans = Vec::new();
    for (name, meta) in entries.iter() {
        let name: String = name.extract()?;
        if name == "__metadata__" {
            // An object of strings, as the format has it (the safetensors
            // package refuses anything else).
            let strings = meta.cast::<PyDict>().is_ok_and(|m| {
                m.iter()
                    .all(|(k, v)| k.is_instance_of::<PyString>() && v.is_instance_of::<PyString>())
            });
            if !strings {
                return Err(bad(
                    "__metadata__ is not an object mapping strings to strings".into(),
                ));
            }
            continue;
        }
        let field = |k: &str| {
            meta.get_item(k)
                .map_err(|_| bad(format!("tensor {name:?} has no {k:?}")))
        };
        let dtype_name: String = field("dtype")?
            .extract()
            .map_err(|_| bad(format!("tensor {name:?}: dtype is not a string")))?;
        let dtype =
            safetensors_dtype(&dtype_name).ok_or_else(|| unsupported(&name, &dtype_name))?;
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
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("tensor {name:?}: size overflows")))?;
        if !offsets_span(begin, end, nbytes) {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] do not span its {nbytes} bytes"
            )));
        }
        let Some(ends_at) = file_end(end, data_start) else {
            return Err(bad(format!(
                "tensor {name:?}: data_offsets [{begin}, {end}] lie past 2**64 bytes"
            )));
        };
        if ends_at > size {
            return Err(PyOSError::new_err(format!(
                "{}: the file is cut short: its header puts tensor {name:?} at data_offsets \
                 [{begin}, {end}] after a {data_start}-byte header, the file has {size} bytes",
                path.display()
            )));
        }
        if end > begin {
            spans.push((begin, end, name.clone()));
        }
        out.push(SafetensorsEntry {
            name,
            dtype,
            shape,
            at: data_start + begin,
            nbytes,
        });
    }
    // No two tensors share bytes (the safetensors package refuses such
    // files too): one would alias the other's data.
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(bad(format!(
            "tensors {:?} (data_offsets [{}, {}]) and {:?} ([{}, {}]) overlap",
            w[0].2, w[0].0, w[0].1, w[1].2, w[1].0, w[1].1
        )));
    }
    Ok((file, out))
}

/// `load_safetensors(path, device=None, direct=None, progress=None)`: every
/// tensor of a safetensors file as a dict of name → `DeviceArray`
/// (`{k: torch.from_dlpack(v) for k, v in d.items()}` gives torch tensors
/// without a copy). Every tensor's memory is allocated first and the data
/// read in one stream through the ring (the blocks flow from one tensor
/// into the next). `direct` as for `read_file`; `progress(done_bytes,
/// total_bytes)` every 64 MiB of the data (and at its end).
///
/// Raises `ValueError` for a corrupt header (bad length, bad JSON, offsets
/// not matching the shape, tensors that overlap), an unknown dtype;
/// `OSError` as `read_file`, and for a file shorter than its header says.
#[pyfunction]
#[pyo3(signature = (path, device=None, direct=None, progress=None))]
pub fn load_safetensors<'py>(
    py: Python<'py>,
    path: PathBuf,
    device: Option<&Device>,
    direct: Option<bool>,
    progress: Option<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let (file, plan) = safetensors_entries(py, &path, |name, dtype| {
        PyValueError::new_err(format!(
            "{}: not a safetensors file: tensor {name:?}: dtype {dtype:?} is not supported",
            path.display()
        ))
    })?;
    let device = device_or_default(py, device)?;
    let io = file_io(direct);
    let total: u64 = plan.iter().map(|e| e.nbytes as u64).sum();
    let mut progress = Progress::new(progress, total)?;
    // Every tensor's memory first, then the whole data region in one stream
    // through the ring (per 64 MiB with a progress callback).
    let mut arrays = Vec::with_capacity(plan.len());
    for e in &plan {
        arrays.push(DeviceArray::alloc(py, &device, e.shape.clone(), e.dtype)?);
    }
    let staging = crate::staging::engine_for(py, &device)?;
    let mut bufs = Vec::with_capacity(arrays.len());
    for a in &arrays {
        match a.state.take("the device array", |_| Ok(()))? {
            DevMem::Own(b) => bufs.push(b),
            DevMem::Foreign { .. } => {
                return Err(crate::convert::buffer_error(
                    "a fresh allocation that is not ours",
                ))
            }
        }
    }
    let offsets: Vec<u64> = plan.iter().map(|e| e.at).collect();
    let read = read_pieces(py, &staging, &file, &offsets, &mut bufs, io, &mut progress);
    for (a, b) in arrays.iter().zip(bufs) {
        a.state.set(State::Ready(DevMem::Own(b)));
    }
    read?;
    let out = PyDict::new(py);
    for (e, array) in plan.into_iter().zip(arrays) {
        out.set_item(e.name, Py::new(py, array)?)?;
    }
    Ok(out)
}

/// Reads each buffer whole from `file` at its offset, in one stream through
/// the ring ([`gpufeed::Staging::read_file_pieces`]); with a progress callback,
/// in ranges of [`PROGRESS_STEP`] bytes of all of them, the callback called
/// after each (once, with no bytes, when there are none).
fn read_pieces(
    py: Python<'_>,
    staging: &gpufeed::Staging,
    file: &File,
    offsets: &[u64],
    bufs: &mut [gpufeed::DeviceBuffer<u8>],
    io: gpufeed::FileIo,
    progress: &mut Progress<'_>,
) -> PyResult<()> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    let step = progress.step(total);
    let mut pos = 0;
    loop {
        let end = total.min(pos + step);
        // The parts of the buffers in `pos..end` of their concatenation.
        let mut pieces = Vec::new();
        let mut base = 0;
        for (b, &at) in bufs.iter_mut().zip(offsets) {
            let len = b.len();
            let (lo, hi) = (pos.max(base), end.min(base + len));
            if lo < hi {
                pieces.push(gpufeed::FilePiece {
                    at: at + (lo - base) as u64,
                    dst: b,
                    range: lo - base..hi - base,
                });
            }
            base += len;
        }
        py.detach(|| staging.read_file_pieces_blocking(file, pieces, io))
            .py()?;
        progress.advance(end - pos)?;
        pos = end;
        if pos >= total {
            return Ok(());
        }
    }
}

/// `file_read_mode(path, direct=None, device=None)`: how a read of `path`
/// would go, `"direct"` (`O_DIRECT`) or `"buffered"`, with `direct` as
/// `read_file` takes it (`None`: buffered). Nothing is read.
///
/// Raises `OSError` as `read_file` (`IsADirectoryError` for a directory,
/// and for `direct=True` where the file system refuses `O_DIRECT`).
#[pyfunction]
#[pyo3(signature = (path, direct=None, device=None))]
pub fn file_read_mode(
    py: Python<'_>,
    path: PathBuf,
    direct: Option<bool>,
    device: Option<&Device>,
) -> PyResult<&'static str> {
    let file = open_file(&path)?;
    let device = device_or_default(py, device)?;
    let staging = crate::staging::engine_for(py, &device)?;
    let way = py
        .detach(|| staging.file_io_for(&file, file_io(direct)))
        .py()?;
    Ok(match way {
        gpufeed::FileIo::Direct => "direct",
        _ => "buffered",
    })
}

/// The safetensors dtype name of a device dtype.
fn safetensors_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "F64",
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::I64 => "I64",
        DType::I32 => "I32",
        DType::I16 => "I16",
        DType::I8 => "I8",
        DType::U64 => "U64",
        DType::U32 => "U32",
        DType::U16 => "U16",
        DType::U8 => "U8",
    }
}

/// `save_safetensors(path, tensors, metadata=None, progress=None)`: a dict
/// of name → `DeviceArray` (or anything `to_device` takes: it is copied to
/// the device first) as a safetensors file, which `safetensors` and
/// `load_safetensors` read back bit for bit. `metadata`: a dict of str →
/// str, stored as `__metadata__`. Each tensor written from the device
/// through the staging ring; to `path + ".partial-<pid>-<n>"`, renamed when
/// complete: a failed save leaves no file at `path`. `progress(done_bytes,
/// total_bytes)` after each tensor (and every 64 MiB of a large one).
///
/// Raises `TypeError` for a key or metadata entry that is not a string,
/// `ValueError` for a tensor named `__metadata__`, `BufferError` for an
/// array gpufeed did not allocate, `OSError` for the file.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata=None, progress=None))]
pub fn save_safetensors(
    py: Python<'_>,
    path: PathBuf,
    tensors: &Bound<'_, PyDict>,
    metadata: Option<&Bound<'_, PyDict>>,
    progress: Option<Bound<'_, PyAny>>,
) -> PyResult<()> {
    use pyo3::exceptions::PyTypeError;
    let mut arrays: Vec<(String, Bound<'_, DeviceArray>)> = Vec::with_capacity(tensors.len());
    // A snapshot of the items: converting a value may run Python code
    // that changes the dict (iterating it live would panic).
    for item in tensors.items().iter() {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let name: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("save_safetensors: tensor names must be strings"))?;
        if name == "__metadata__" {
            return Err(PyValueError::new_err(
                "save_safetensors: __metadata__ is not a tensor name (pass metadata=)",
            ));
        }
        let array = match v.cast::<DeviceArray>() {
            Ok(a) => a.clone(),
            Err(_) => Bound::new(py, crate::staging::to_device(py, &v, None)?)?,
        };
        arrays.push((name, array));
    }
    let json = py.import("json")?;
    let header = PyDict::new(py);
    let mut pos = 0u64;
    for (name, a) in &arrays {
        let a = a.get();
        let entry = PyDict::new(py);
        entry.set_item("dtype", safetensors_name(a.dtype))?;
        entry.set_item("shape", a.shape.clone())?;
        entry.set_item("data_offsets", (pos, pos + a.nbytes as u64))?;
        header.set_item(name, entry)?;
        pos += a.nbytes as u64;
    }
    if let Some(m) = metadata {
        for (k, v) in m.iter() {
            if k.extract::<String>().is_err() || v.extract::<String>().is_err() {
                return Err(PyTypeError::new_err(
                    "save_safetensors: metadata must map strings to strings",
                ));
            }
        }
        header.set_item("__metadata__", m)?;
    }
    let kw = PyDict::new(py);
    kw.set_item("separators", (",", ":"))?;
    let text: String = json
        .call_method("dumps", (&header,), Some(&kw))?
        .extract()?;
    let mut head = text.into_bytes();
    // Padded with spaces to 8 bytes, as the format's own writer does.
    head.resize(head.len().next_multiple_of(8), b' ');
    let data_start = 8 + head.len() as u64;
    let mut progress = Progress::new(progress, pos)?;
    let tmp = partial(&path);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| open_error(&tmp, e))?;
    let written = (|| -> PyResult<()> {
        use std::os::unix::fs::FileExt;
        let mut first = (head.len() as u64).to_le_bytes().to_vec();
        first.extend_from_slice(&head);
        file.write_all_at(&first, 0)
            .map_err(|e| open_error(&tmp, e))?;
        let mut at = data_start;
        for (_, a) in &arrays {
            let a = a.get();
            drain_to_file(py, a, &file, at, &mut progress)?;
            if a.nbytes == 0 {
                progress.advance(0)?;
            }
            at += a.nbytes as u64;
        }
        Ok(())
    })();
    finish_atomically(py, file, &tmp, &path, data_start + pos, written)
}

/// `gds_status(device=None)`: what the GPUDirect Storage probe found for the
/// device, as a dict: `available` (bool: file reads that go `O_DIRECT`
/// use cuFile, straight into device memory, where the file's system is
/// supported), `reason` (`"available"`, `"not_cuda"`, `"no_kernel_module"`, `"no_library"`,
/// `"driver_open_failed"`, `"compatibility_mode_only"`) and `message`.
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn gds_status<'py>(py: Python<'py>, device: Option<&Device>) -> PyResult<Bound<'py, PyDict>> {
    use gpufeed::GdsStatus as G;
    let device = device_or_default(py, device)?;
    let status = py.detach(|| gpufeed::gds_status(&device));
    let reason = match &status {
        G::Available { .. } => "available",
        G::NotCuda => "not_cuda",
        G::NoKernelModule => "no_kernel_module",
        G::NoLibrary => "no_library",
        G::DriverOpenFailed(_) => "driver_open_failed",
        G::CompatibilityModeOnly { .. } => "compatibility_mode_only",
    };
    let d = PyDict::new(py);
    d.set_item("available", status.is_available())?;
    d.set_item("reason", reason)?;
    d.set_item("message", status.to_string())?;
    Ok(d)
}
