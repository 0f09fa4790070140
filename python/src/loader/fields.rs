//! A loader's source read into fields: a NumPy array or memory map, `.npy`
//! files (concatenated), a safetensors file (a field per tensor), or a dict
//! of those; the buffer exports that keep their memory; and the library's
//! row sources over them (pinned in place when it can be).

use crate::buffer::ContiguousView;
use crate::dtype::DType;
use crate::files::{safetensors_entries, SafetensorsEntry};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

/// One field of the source (the array itself, or one entry of a dict).
pub(super) struct Field {
    /// The dict key (None for a lone source).
    pub(super) name: Option<String>,
    pub(super) dtype: DType,
    /// The shape of one row (the source's shape without its first axis).
    pub(super) row_shape: Vec<usize>,
    pub(super) rows: usize,
    pub(super) row_bytes: usize,
    /// (address, rows) of each piece of memory, concatenated (addresses as
    /// integers: the memory is `Keep`'s exports').
    pub(super) segments: Vec<(usize, usize)>,
}

/// What keeps a source's memory alive and unmoved: its buffer exports.
pub(super) struct Keep {
    pub(super) views: Vec<ContiguousView>,
}

// SAFETY: the exports are released only when the `Loader` holding them is
// dropped, which pyo3 does with the GIL held (on whichever thread drops
// the last reference); nothing reads through `Keep` (the producer thread
// sees only the addresses, copied out before it starts).
unsafe impl Send for Keep {}
// SAFETY: `&Keep` gives access to nothing.
unsafe impl Sync for Keep {}

/// The loader's row sources: each field pinned in place (read-only) when
/// every field is one piece of memory that can be, so the device gathers
/// the batches itself; else plain sources the host gathers from.
/// Each field: its (address, rows) segments and its row size.
pub(super) fn row_sources(
    device: &gpufeed::Device,
    fields: &[(Vec<(usize, usize)>, usize)],
) -> gpufeed::Result<Vec<gpufeed::RowSource<'static>>> {
    let mut pinned = Vec::with_capacity(fields.len());
    for (segments, row_bytes) in fields {
        let [(ptr, rows)] = segments[..] else {
            break;
        };
        let bytes = rows * row_bytes;
        // SAFETY: the field's memory is kept alive and unmoved by `keep`'s
        // buffer exports until after the loader (which holds the guard)
        // is gone (`Drop` joins the producer first); only read through it.
        let guard = unsafe {
            gpufeed::interop::RegisteredRaw::new_read_only(
                device,
                ptr as *mut u8,
                bytes,
                Box::new(()),
            )
        };
        let Ok(guard) = guard else { break };
        // SAFETY: as above; nothing writes the source while the loader
        // reads it (the module's documented contract).
        pinned.push(unsafe {
            gpufeed::RowSource::from_registered_raw(std::sync::Arc::new(guard), (*row_bytes).max(1))
        }?);
    }
    if pinned.len() == fields.len() {
        return Ok(pinned);
    }
    drop(pinned); // unregistered: the host gathers instead
    fields
        .iter()
        .map(|(segments, row_bytes)| {
            let segments: Vec<(*const u8, usize)> =
                segments.iter().map(|&(p, r)| (p as *const u8, r)).collect();
            // SAFETY: `keep` holds a buffer export of every segment until
            // the producer thread (which owns the loader) has been joined
            // (`Drop`), or, if construction fails, until the loader is
            // dropped (locals go in reverse order); an export keeps the
            // memory from being freed, resized or unmapped. Replacing an
            // array's memory under its exports (`__setstate__`,
            // `resize(refcheck=False)`) while the loader lives is excluded
            // by the documented contract (the module's notes).
            unsafe { gpufeed::RowSource::from_raw_parts(&segments, (*row_bytes).max(1)) }
        })
        .collect()
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The error for an object whose buffer could not be exported: a dtype
/// with no buffer format, an array held strided, or not an array at all.
fn export_error(obj: &Bound<'_, PyAny>, what: &str, e: PyErr) -> PyErr {
    let c_contiguous = obj
        .getattr("flags")
        .and_then(|f| f.getattr("c_contiguous"))
        .and_then(|c| c.extract::<bool>())
        .ok();
    if e.is_instance_of::<PyValueError>(obj.py()) && c_contiguous == Some(true) {
        // NumPy's refusal to export a C-contiguous array: its elements
        // (datetime64, objects...) have no buffer format.
        let described = obj
            .getattr("dtype")
            .map(|d| d.to_string())
            .unwrap_or_else(|_| "?".into());
        PyTypeError::new_err(format!(
            "Loader: {what} has dtype {described}, which has no device dtype (numbers of \
             1-8 bytes are supported): {e}"
        ))
    } else if e.is_instance_of::<PyValueError>(obj.py()) {
        // NumPy's refusal to export an array it holds strided.
        PyValueError::new_err(format!("Loader: {what} has no C-contiguous buffer: {e}"))
    } else {
        PyTypeError::new_err(format!(
            "Loader: {what} must be a NumPy array or memory map, a list of .npy paths, a \
             safetensors path or a dict of those, not {} (a CPU tensor: pass t.numpy(), \
             which shares its memory)",
            type_name(obj)
        ))
    }
}

/// The rows of one array-like object (a NumPy array, a memory map, anything
/// exporting a C-contiguous buffer with a shape).
fn array_field(
    obj: &Bound<'_, PyAny>,
    name: Option<String>,
    what: &str,
    keep: &mut Keep,
) -> PyResult<Field> {
    if let Ok(ndim) = obj.getattr("ndim") {
        if ndim.extract::<usize>().ok() == Some(0) {
            return Err(PyValueError::new_err(format!(
                "Loader: {what} is 0-dimensional; rows are its first axis"
            )));
        }
    }
    if let Ok(flags) = obj.getattr("flags") {
        if let Ok(c) = flags.getattr("c_contiguous") {
            if !c.extract::<bool>()? {
                return Err(PyValueError::new_err(format!(
                    "Loader: {what} is not C-contiguous (a strided view or Fortran order); \
                     pass numpy.ascontiguousarray(a) (the loader makes no hidden copy)"
                )));
            }
        }
    }
    let view = ContiguousView::get(obj, false).map_err(|e| export_error(obj, what, e))?;
    let format = view.format.clone().unwrap_or_else(|| "B".into());
    let dtype = DType::from_format(&format)
        .filter(|d| d.size() == view.itemsize)
        .ok_or_else(|| {
            let described = obj
                .getattr("dtype")
                .map(|d| d.to_string())
                .unwrap_or_else(|_| format!("format {format:?}"));
            PyTypeError::new_err(format!(
                "Loader: {what} has dtype {described}, which has no device dtype (numbers of \
                 1-8 bytes are supported)"
            ))
        })?;
    let Some((&rows, row_shape)) = view.shape.split_first() else {
        return Err(PyValueError::new_err(format!(
            "Loader: {what} is 0-dimensional; rows are its first axis"
        )));
    };
    let row_elems: usize = row_shape.iter().product();
    let row_bytes = row_elems * dtype.size();
    if row_bytes == 0 && rows > 0 {
        return Err(PyValueError::new_err(format!(
            "Loader: {what}'s rows (shape {:?}) hold no bytes",
            view.shape
        )));
    }
    let field = Field {
        name,
        dtype,
        row_shape: row_shape.to_vec(),
        rows,
        row_bytes,
        segments: vec![(view.ptr as usize, rows)],
    };
    keep.views.push(view);
    Ok(field)
}

/// `np.load(path, mmap_mode="r")`, or an empty array for a file of no rows.
fn npy_map<'py>(py: Python<'py>, path: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("mmap_mode", "r")?;
    np.getattr("load")?
        .call((path,), Some(&kwargs))
        .map_err(|e| match as_path(path) {
            Some(p) => crate::files::npy_header_error(py, &p, e),
            None => e,
        })
}

/// Several `.npy` files as one field, concatenated along axis 0.
fn npy_list_field(
    py: Python<'_>,
    paths: &Bound<'_, PyAny>,
    name: Option<String>,
    keep: &mut Keep,
) -> PyResult<Field> {
    let mut field: Option<Field> = None;
    for (i, p) in paths.try_iter()?.enumerate() {
        let p = p?;
        let what = format!("file {i} ({})", p.str()?);
        let m = npy_map(py, &p)?;
        let f = array_field(&m, name.clone(), &what, keep)?;
        match &mut field {
            None => field = Some(f),
            Some(acc) => {
                if acc.dtype != f.dtype || acc.row_shape != f.row_shape {
                    return Err(PyValueError::new_err(format!(
                        "Loader: the .npy files must agree in dtype and row shape: file 0 has {} \
                         rows of {:?}, {what} {} rows of {:?}",
                        acc.dtype.name(),
                        acc.row_shape,
                        f.dtype.name(),
                        f.row_shape
                    )));
                }
                acc.rows += f.rows;
                acc.segments.extend(f.segments);
            }
        }
    }
    field.ok_or_else(|| PyValueError::new_err("Loader: an empty list of .npy files"))
}

/// Every tensor of a safetensors file as a field (rows: its first axis),
/// memory-mapped.
fn safetensors_fields(
    py: Python<'_>,
    path: &std::path::Path,
    keep: &mut Keep,
) -> PyResult<Vec<Field>> {
    let shown = path.display();
    let (_, entries) = safetensors_entries(py, path, |name, dtype| {
        PyTypeError::new_err(format!(
            "{shown}: tensor {name:?} has dtype {dtype}, which the loader does not support"
        ))
    })?;
    let np = py.import("numpy")?;
    let mut fields = Vec::new();
    for SafetensorsEntry {
        name,
        dtype,
        shape,
        at,
        nbytes,
    } in entries
    {
        let what = format!("tensor {name:?} of {shown}");
        let Some((&rows, row_shape)) = shape.split_first() else {
            return Err(PyValueError::new_err(format!(
                "Loader: {what} is 0-dimensional; rows are its first axis"
            )));
        };
        let row_bytes = row_shape.iter().product::<usize>() * dtype.size();
        if row_bytes == 0 && rows > 0 {
            return Err(PyValueError::new_err(format!(
                "Loader: {what}'s rows hold no bytes"
            )));
        }
        let ptr = if nbytes == 0 {
            std::ptr::NonNull::<u64>::dangling().as_ptr() as *const u8
        } else {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", "uint8")?;
            kwargs.set_item("mode", "r")?;
            kwargs.set_item("offset", at)?;
            kwargs.set_item("shape", (nbytes,))?;
            let m = np
                .getattr("memmap")?
                .call((path.as_os_str(),), Some(&kwargs))?;
            let view = ContiguousView::get(&m, false)?;
            let p = view.ptr as *const u8;
            keep.views.push(view);
            p
        };
        fields.push(Field {
            name: Some(name),
            dtype,
            row_shape: row_shape.to_vec(),
            rows,
            row_bytes,
            segments: vec![(ptr as usize, rows)],
        });
    }
    if fields.is_empty() {
        return Err(PyValueError::new_err(format!(
            "Loader: {shown} holds no tensor"
        )));
    }
    Ok(fields)
}

/// A path-like object as a path (its bytes as given, UTF-8 or not), if it
/// is one.
fn as_path(obj: &Bound<'_, PyAny>) -> Option<std::path::PathBuf> {
    if obj.is_instance_of::<PyString>() || obj.hasattr("__fspath__").unwrap_or(false) {
        let os = obj.py().import("os").ok()?;
        os.call_method1("fspath", (obj,)).ok()?.extract().ok()
    } else {
        None
    }
}

/// The fields of one source value (not a dict), `name` its dict key.
fn value_fields(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: Option<String>,
    keep: &mut Keep,
) -> PyResult<Vec<Field>> {
    let what = match &name {
        Some(n) => format!("source[{n:?}]"),
        None => "the source".into(),
    };
    if let Some(path) = as_path(obj) {
        if path
            .as_os_str()
            .as_encoded_bytes()
            .ends_with(b".safetensors")
        {
            let mut fields = safetensors_fields(py, &path, keep)?;
            if let (Some(n), [f]) = (&name, &mut fields[..]) {
                f.name = Some(n.clone());
            } else if name.is_some() {
                return Err(PyValueError::new_err(format!(
                    "Loader: {what} is a safetensors file of several tensors; give it as the \
                     whole source (each tensor becomes a field) or one tensor per file"
                )));
            }
            return Ok(fields);
        }
        let list = PyList::new(py, [obj])?;
        return Ok(vec![npy_list_field(py, list.as_any(), name, keep)?]);
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        for item in obj.try_iter()? {
            if as_path(&item?).is_none() {
                return Err(PyTypeError::new_err(format!(
                    "Loader: {what} is a list: it must hold .npy file paths"
                )));
            }
        }
        return Ok(vec![npy_list_field(py, obj, name, keep)?]);
    }
    Ok(vec![array_field(obj, name, &what, keep)?])
}

/// The fields of a loader's `source` (a dict: one or more per key; else one
/// or more of the value), all of equal row counts, and whether a batch is a
/// dict.
pub(super) fn source_fields(
    py: Python<'_>,
    source: &Bound<'_, PyAny>,
    keep: &mut Keep,
) -> PyResult<(Vec<Field>, bool)> {
    let (fields, as_dict) = if let Ok(d) = source.cast::<PyDict>() {
        if d.is_empty() {
            return Err(PyValueError::new_err("Loader: an empty dict source"));
        }
        let mut fields = Vec::new();
        // A snapshot of the items: reading a value may run Python
        // code that changes the dict (iterating it live would panic).
        for item in d.items().iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
            let k: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("Loader: a dict source's keys are strings"))?;
            fields.extend(value_fields(py, &v, Some(k), keep)?);
        }
        (fields, true)
    } else {
        let fields = value_fields(py, source, None, keep)?;
        let as_dict = fields.len() > 1 || fields[0].name.is_some();
        (fields, as_dict)
    };
    let rows0 = fields[0].rows;
    for f in &fields {
        if f.rows != rows0 {
            return Err(PyValueError::new_err(format!(
                "Loader: the source's fields must have equal row counts: {:?} has {}, {:?} {}",
                fields[0].name.as_deref().unwrap_or("source"),
                rows0,
                f.name.as_deref().unwrap_or("source"),
                f.rows
            )));
        }
    }
    Ok((fields, as_dict))
}
