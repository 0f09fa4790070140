//! `Loader`: a training loop's feeder. Batches of rows of a NumPy array, a
//! memory map, `.npy` files or a safetensors file (or a dict of those) are
//! gathered by index in native threads straight into pinned blocks and
//! sent to the device on the loader's own stream, `prefetch` batches ahead
//! (the `host` crate's [`gpufeed::Loader`]); they come out as torch tensors,
//! CuPy arrays or `DeviceArray`s without a copy.
//!
//! Threads: a producer thread of the loader's own runs the epoch (the
//! gathers, on it and the staging workers, and the waits for the DMAs),
//! without the GIL, while Python runs; `next()` takes the batches it has
//! finished (waiting with the GIL released, in slices that let Ctrl-C
//! through). So the gather of the next batch overlaps both the last one's
//! DMA and the training step's Python. The source's memory is kept alive
//! by buffer exports for the loader's life; replacing it under them (NumPy
//! allows `ndarray.__setstate__` and `resize(refcheck=False)` on an array
//! with exports) while a loader reads it is not allowed (see the README's
//! "Not guaranteed").
//!
//! Device memory: every batch is a fresh allocation. A batch handed to
//! torch or CuPy is kept by the loader until the consumer's tensor is gone
//! (its DLPack export released) and an event recorded then on the
//! consumer's current stream has completed: only then is its memory freed
//! for reuse, so a later batch never lands in memory a queued kernel still
//! reads.

use crate::buffer::ContiguousView;
use crate::convert::Count;
use crate::convert::IntoPy;
use crate::device::{DevMem, Device, DeviceArray, StateCell};
use crate::dtype::DType;
use crate::files::{safetensors_entries, SafetensorsEntry};
use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What batches come out as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framework {
    Torch,
    Cupy,
    Gpufeed,
    Numpy,
}

/// One field of the source (the array itself, or one entry of a dict).
struct Field {
    /// The dict key (None for a lone source).
    name: Option<String>,
    dtype: DType,
    /// The shape of one row (the source's shape without its first axis).
    row_shape: Vec<usize>,
    rows: usize,
    row_bytes: usize,
    /// (address, rows) of each piece of memory, concatenated (addresses as
    /// integers: the memory is `Keep`'s exports').
    segments: Vec<(usize, usize)>,
}

/// What keeps a source's memory alive and unmoved: its buffer exports.
struct Keep {
    views: Vec<ContiguousView>,
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
fn row_sources(
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
    let view = ContiguousView::get(obj, false).map_err(|e| {
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
    })?;
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

/// This process's (rank, world size, local rank) under torch.distributed
/// or torchrun, or the explicit arguments.
pub(crate) fn distributed(
    py: Python<'_>,
    rank: Option<usize>,
    world_size: Option<usize>,
) -> PyResult<(usize, usize, Option<usize>)> {
    let env = |k: &str| -> PyResult<Option<usize>> {
        match std::env::var(k) {
            Ok(v) => v.trim().parse().map(Some).map_err(|_| {
                PyValueError::new_err(format!(
                    "Loader: environment variable {k}={v:?} is not a count"
                ))
            }),
            Err(_) => Ok(None),
        }
    };
    let local = env("LOCAL_RANK")?;
    match (rank, world_size) {
        (Some(r), Some(w)) => return Ok((r, w, local)),
        (None, None) => {}
        _ => {
            return Err(PyValueError::new_err(
                "Loader: give both rank= and world_size=, or neither",
            ))
        }
    }
    // A process group initialized: torch.distributed is imported already.
    let modules = py.import("sys")?.getattr("modules")?;
    if modules.contains("torch.distributed")? {
        let dist = py.import("torch.distributed")?;
        if dist.call_method0("is_available")?.extract::<bool>()?
            && dist.call_method0("is_initialized")?.extract::<bool>()?
        {
            let r = dist.call_method0("get_rank")?.extract()?;
            let w = dist.call_method0("get_world_size")?.extract()?;
            return Ok((r, w, local));
        }
    }
    match (env("RANK")?, env("WORLD_SIZE")?) {
        (Some(r), Some(w)) => Ok((r, w, local)),
        _ => Ok((0, 1, local)),
    }
}

fn importable(py: Python<'_>, name: &str) -> bool {
    py.import(name).is_ok()
}

/// `Loader(source, batch_size, shuffle=False, seed=0, drop_last=False,
/// prefetch=2, device=None, framework="auto", rank=None, world_size=None)`:
/// batches of rows for a training loop.
///
/// - `source`: a NumPy array or memory map (rows: the first axis), a list
///   of `.npy` paths (memory-mapped, concatenated along axis 0), a
///   safetensors path (each tensor a field), or a dict of name → any of
///   those (equal row counts; each batch is then a dict).
/// - `iter(loader)` starts an epoch and returns its iterator (a
///   `LoaderIterator`, itself its own iterator); a later `iter(loader)`
///   starts afresh and the older iterator raises `RuntimeError`. A loader
///   can be used from any thread, one at a time (a second thread taking a
///   batch meanwhile gets `RuntimeError`). `len(loader)` is an epoch's
///   batch count. The order
///   is `0..n`, or with `shuffle` a permutation that is a deterministic
///   function of `(seed, epoch)` (SplitMix64 Fisher–Yates, the same in any
///   process); `set_epoch(e)` picks the epoch, as with
///   `DistributedSampler` (the epoch does not advance by itself).
/// - Under torch.distributed (a process group initialized, or torchrun's
///   `RANK`/`WORLD_SIZE`), or with `rank=` and `world_size=`, each rank
///   takes its shard with `DistributedSampler`'s semantics, and batches go
///   to GPU `LOCAL_RANK` unless `device` is given.
/// - `framework`: `"torch"`, `"cupy"`, `"gpufeed"` (`DeviceArray`s) or
///   `"numpy"` (host arrays, a copy); `"auto"`: torch if it sees the device, else
///   CuPy (on a GPU), else `DeviceArray`s. On the CPU emulation torch
///   tensors are CPU tensors (device memory there is host memory).
/// - Each batch is handed out once its copy is complete: ready on the
///   consumer's current stream (and any other) with nothing to wait for.
///   A thread of the loader's own runs the epoch without the GIL.
/// - `state_dict()` / `load_state_dict(d)`: resume mid-epoch.
#[pyclass(module = "gpufeed")]
pub struct Loader {
    /// The producer thread running the epochs (None once stopped).
    producer: Option<Producer>,
    /// Where the batches are gathered.
    gather: gpufeed::Gather,
    fields: Vec<Field>,
    as_dict: bool,
    framework: Framework,
    device: gpufeed::Device,
    rows: usize,
    batches_per_epoch: usize,
    /// The next `__iter__` starts here (a loaded state), then 0.
    resume_at: usize,
    epoch: u64,
    config: gpufeed::LoaderConfig,
    /// The epoch running: its generation (batches of older ones are
    /// dropped), its first batch, batches handed out, whether it ended.
    generation: u64,
    running: bool,
    /// The epoch the running (or last) iteration runs: `epoch` may have
    /// been set to the next one since.
    running_epoch: u64,
    skip: usize,
    handed_out: usize,
    finished: bool,
    /// The process that made the loader: a fork() child has no producer.
    pid: u32,
    /// Batches handed to torch or CuPy, kept until their export is released.
    handed: Vec<Py<DeviceArray>>,
    /// Released batches, each with an event on the consumer's stream: freed
    /// once it completes.
    retiring: Vec<(Py<DeviceArray>, Py<PyAny>)>,
    /// Last: the exports keeping the source's memory alive (released after
    /// the producer has stopped, in `Drop`).
    _keep: Keep,
}

/// The batches of one epoch of a [`Loader`]: what `iter(loader)` returns
/// (its own `iter()` is itself, so `it = iter(loader); next(it)` then
/// `for b in it` goes on with the same epoch).
#[pyclass(module = "gpufeed")]
pub struct LoaderIterator {
    loader: Py<Loader>,
    /// The epoch run this iterator belongs to.
    generation: u64,
}

#[pymethods]
impl LoaderIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next batch; `RuntimeError` once a later `iter(loader)` has
    /// started the epoch afresh, or while another thread is in this
    /// loader's `next`.
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let mut loader = self.loader.bind(py).try_borrow_mut().map_err(|_| {
            PyRuntimeError::new_err(
                "Loader: another thread is taking a batch from this loader; use it from one \
                 thread at a time",
            )
        })?;
        if loader.generation != self.generation {
            return Err(PyRuntimeError::new_err(
                "Loader: this iterator's epoch was started afresh by a later iter(loader); \
                 iterate the newer iterator",
            ));
        }
        match loader.next_batch(py)? {
            Some(b) => Ok(b),
            None => Err(PyStopIteration::new_err(())),
        }
    }
}

/// What the producer is told.
enum Command {
    /// Run `epoch` from batch `skip`, tagging its batches `generation`.
    Start {
        epoch: u64,
        skip: usize,
        generation: u64,
    },
}

/// What the producer hands over, tagged with its epoch's generation.
enum Message {
    Batch(gpufeed::Batch<u8>),
    End,
    Failed(gpufeed::Error),
}

/// The producer thread and its two channels.
struct Producer {
    commands: std::sync::mpsc::Sender<Command>,
    /// Behind a mutex only so that the `Loader` is `Sync` (a `Receiver` is
    /// not); reached through `&mut`, never locked.
    batches: std::sync::Mutex<std::sync::mpsc::Receiver<(u64, Message)>>,
    thread: std::thread::JoinHandle<()>,
}

impl Producer {
    /// Starts the thread that owns `loader`: it runs each epoch it is
    /// told to, handing over every batch once its data is on the device
    /// (at most one finished batch waits in the channel besides the one
    /// being handed over; `prefetch` more are in flight in the loader).
    fn start(mut loader: gpufeed::Loader<'static, u8>) -> PyResult<Producer> {
        use std::sync::mpsc::{channel, sync_channel, TryRecvError};
        let (commands, command_rx) = channel::<Command>();
        let (batch_tx, batches) = sync_channel::<(u64, Message)>(1);
        let thread = std::thread::Builder::new()
            .name("gpufeed-loader".into())
            .spawn(move || {
                let mut active: Option<u64> = None;
                loop {
                    let command = if active.is_some() {
                        match command_rx.try_recv() {
                            Ok(c) => Some(c),
                            Err(TryRecvError::Empty) => None,
                            Err(TryRecvError::Disconnected) => return,
                        }
                    } else {
                        match command_rx.recv() {
                            Ok(c) => Some(c),
                            Err(_) => return,
                        }
                    };
                    if let Some(Command::Start {
                        epoch,
                        skip,
                        generation,
                    }) = command
                    {
                        loader.start_epoch(epoch, skip);
                        active = Some(generation);
                    }
                    let Some(generation) = active else { continue };
                    let message = match gpufeed::block_on(futures::StreamExt::next(&mut loader)) {
                        Some(Ok(b)) => Message::Batch(b),
                        Some(Err(e)) => {
                            active = None;
                            Message::Failed(e)
                        }
                        None => {
                            active = None;
                            Message::End
                        }
                    };
                    if batch_tx.send((generation, message)).is_err() {
                        return; // the Python object is gone
                    }
                }
            })
            .map_err(|e| {
                crate::convert::InternalError::new_err(format!(
                    "cannot start the loader's thread: {e}"
                ))
            })?;
        Ok(Producer {
            commands,
            batches: std::sync::Mutex::new(batches),
            thread,
        })
    }

    /// Stops the thread (dropping its channels makes it return after the
    /// step it is in) and joins it.
    fn stop(self) {
        let Producer {
            commands,
            batches,
            thread,
        } = self;
        drop(commands);
        drop(batches);
        let _ = thread.join();
    }
}

impl Loader {
    fn cuda(&self) -> bool {
        self.device.kind() == gpufeed::BackendKind::Cuda
    }

    /// The consumer's current stream object (torch or CuPy), on CUDA.
    fn consumer_stream<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if !self.cuda() {
            return Ok(None);
        }
        let ordinal = self.device.info().ordinal;
        match self.framework {
            Framework::Torch => Ok(Some(
                py.import("torch.cuda")?
                    .call_method1("current_stream", (ordinal,))?,
            )),
            Framework::Cupy => Ok(Some(
                py.import("cupy.cuda")?.call_method0("get_current_stream")?,
            )),
            _ => Ok(None),
        }
    }

    /// Frees (drops) the batches whose consumers are done: a released
    /// export gets an event on the consumer's stream; a completed event
    /// lets its batch go.
    fn reap(&mut self, py: Python<'_>, stream: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let event = |s: &Bound<'_, PyAny>| -> PyResult<Py<PyAny>> {
            let module = match self.framework {
                Framework::Cupy => "cupy.cuda",
                _ => "torch.cuda",
            };
            let ev = py.import(module)?.getattr("Event")?.call0()?;
            ev.call_method1("record", (s,))?;
            Ok(ev.unbind())
        };
        // On an error every batch not yet looked at stays where it was
        // (none is freed without its event).
        let mut handed = std::mem::take(&mut self.handed).into_iter();
        while let Some(a) = handed.next() {
            if a.get().exports.load(Ordering::SeqCst) > 0 {
                self.handed.push(a);
                continue;
            }
            let Some(s) = stream else {
                continue; // no consumer stream (not CUDA): dropped now
            };
            match event(s) {
                Ok(ev) => self.retiring.push((a, ev)),
                Err(e) => {
                    self.handed.push(a);
                    self.handed.extend(handed);
                    return Err(e);
                }
            }
        }
        let mut retiring = std::mem::take(&mut self.retiring).into_iter();
        while let Some((a, ev)) = retiring.next() {
            let ev_b = ev.bind(py);
            let done = match self.framework {
                Framework::Cupy => ev_b.getattr("done").and_then(|d| d.extract::<bool>()),
                _ => ev_b.call_method0("query").and_then(|d| d.extract::<bool>()),
            };
            match done {
                Ok(true) => {} // the consumer is done with it: freed now
                Ok(false) => self.retiring.push((a, ev)),
                Err(e) => {
                    self.retiring.push((a, ev));
                    self.retiring.extend(retiring);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// One field's device buffer as the framework's object.
    fn convert<'py>(
        &mut self,
        py: Python<'py>,
        field: usize,
        mut buf: gpufeed::DeviceBuffer<u8>,
        rows: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let f = &self.fields[field];
        let mut shape = vec![rows];
        shape.extend(&f.row_shape);
        let (dtype, nbytes) = (f.dtype, buf.len());
        let on_host = !self.cuda() && self.framework == Framework::Torch
            || self.framework == Framework::Numpy;
        if on_host {
            let np = py.import("numpy")?;
            let out = np.call_method1("empty", (PyTuple::new(py, &shape)?, dtype.numpy_name()))?;
            let mut view = ContiguousView::get(&out, true)?;
            // SAFETY: a fresh array of ours, exported writable; no Python
            // code runs while the slice lives.
            let dst = unsafe { view.as_bytes_mut() };
            buf.copy_to_host_sync(dst).py()?;
            drop(view);
            if self.framework == Framework::Numpy {
                return Ok(out);
            }
            let torch = py.import("torch")?;
            let t = torch.call_method1("from_numpy", (out,))?;
            if dtype == DType::BF16 {
                return t.call_method1("view", (torch.getattr("bfloat16")?,));
            }
            return Ok(t);
        }
        let array = Py::new(
            py,
            DeviceArray {
                state: StateCell::ready(DevMem::Own(buf)),
                dtype,
                shape,
                nbytes,
                device: self.device.clone(),
                exports: Arc::default(),
                shared: AtomicBool::new(false),
                releases: Arc::default(),
            },
        )?;
        match self.framework {
            Framework::Torch => {
                let t = py
                    .import("torch")?
                    .call_method1("from_dlpack", (array.bind(py),))?;
                self.handed.push(array);
                Ok(t)
            }
            Framework::Cupy => {
                let c = py
                    .import("cupy")?
                    .call_method1("from_dlpack", (array.bind(py),))?;
                self.handed.push(array);
                Ok(c)
            }
            _ => Ok(array.into_bound(py).into_any()),
        }
    }

    /// Tells the producer to run the current epoch from `skip`.
    fn start(&mut self, skip: usize) -> PyResult<()> {
        self.generation += 1;
        self.skip = skip;
        self.handed_out = 0;
        self.finished = false;
        self.running = true;
        self.running_epoch = self.epoch;
        let command = Command::Start {
            epoch: self.epoch,
            skip,
            generation: self.generation,
        };
        match &self.producer {
            Some(p) if p.commands.send(command).is_ok() => Ok(()),
            _ => Err(crate::convert::InternalError::new_err(
                "the loader's thread has stopped",
            )),
        }
    }

    /// The producer's next message of the current epoch (older epochs'
    /// batches dropped), waiting with the GIL released in slices of 50 ms
    /// (Python's signal handlers run between: Ctrl-C interrupts).
    fn receive(&mut self, py: Python<'_>) -> PyResult<Message> {
        use std::sync::mpsc::RecvTimeoutError;
        let current = self.generation;
        let Some(p) = &mut self.producer else {
            return Err(crate::convert::InternalError::new_err(
                "the loader's thread has stopped",
            ));
        };
        let rx = p.batches.get_mut().unwrap_or_else(|e| e.into_inner());
        loop {
            let r = &mut *rx; // `&mut Receiver` is Send (Receiver is not Sync)
            let got = py.detach(move || r.recv_timeout(std::time::Duration::from_millis(50)));
            match got {
                Ok((generation, message)) if generation == current => return Ok(message),
                Ok(_) => continue, // a batch of an epoch left behind: freed here
                Err(RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(crate::convert::InternalError::new_err(
                        "the loader's thread has stopped",
                    ))
                }
            }
        }
    }

    fn next_batch<'py>(&mut self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if std::process::id() != self.pid {
            return Err(crate::convert::InvalidArgumentError::new_err(
                "a Loader can't be used in a fork() child of the process that made it (its thread \
                 did not survive the fork): make one in the child",
            ));
        }
        if self.finished {
            return Ok(None);
        }
        let stream = self.consumer_stream(py)?;
        self.reap(py, stream.as_ref())?;
        let batch = match self.receive(py)? {
            Message::Batch(b) => b,
            Message::End => {
                self.finished = true;
                return Ok(None);
            }
            Message::Failed(e) => {
                self.finished = true;
                return Err(crate::convert::to_py(e));
            }
        };
        self.handed_out += 1;
        // The batch's DMAs are complete (the producer hands batches over
        // only then): it is ready on every stream, the consumer's current
        // one included, with no wait to enqueue.
        let rows = batch.rows;
        let mut out = Vec::with_capacity(batch.fields.len());
        for (i, buf) in batch.fields.into_iter().enumerate() {
            out.push(self.convert(py, i, buf, rows)?);
        }
        if self.as_dict {
            let d = PyDict::new(py);
            for (f, v) in self.fields.iter().zip(out) {
                d.set_item(f.name.as_deref().unwrap_or(""), v)?;
            }
            Ok(Some(d.into_any()))
        } else {
            Ok(out.pop())
        }
    }
}

#[pymethods]
impl Loader {
    #[new]
    #[pyo3(
        signature = (source, batch_size, shuffle=false, seed=Count(0), drop_last=false, prefetch=Count(2), device=None, framework="auto", rank=None, world_size=None),
        text_signature = "(source, batch_size, shuffle=False, seed=0, drop_last=False, prefetch=2, device=None, framework=\"auto\", rank=None, world_size=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        batch_size: Count,
        shuffle: bool,
        seed: Count,
        drop_last: bool,
        prefetch: Count,
        device: Option<&Bound<'_, PyAny>>,
        framework: &str,
        rank: Option<Count>,
        world_size: Option<Count>,
    ) -> PyResult<Self> {
        let (batch_size, seed, prefetch) = (batch_size.0, seed.0, prefetch.0);
        let (rank, world_size) = (rank.map(|r| r.0 as usize), world_size.map(|w| w.0 as usize));
        if batch_size < 1 {
            return Err(PyValueError::new_err(format!(
                "Loader: batch_size must be at least 1, not {batch_size}"
            )));
        }
        if prefetch < 1 {
            return Err(PyValueError::new_err(format!(
                "Loader: prefetch must be at least 1, not {prefetch}"
            )));
        }
        let (rank, world_size, local_rank) = distributed(py, rank, world_size)?;
        if world_size > gpufeed::MAX_WORLD_SIZE {
            return Err(PyValueError::new_err(format!(
                "Loader: world_size {world_size} is above {}",
                gpufeed::MAX_WORLD_SIZE
            )));
        }
        if world_size == 0 || rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "Loader: rank {rank} must be below world_size {world_size} (at least 1)"
            )));
        }
        let device: gpufeed::Device = match device {
            Some(d) => match d.cast::<Device>() {
                Ok(d) => d.get().inner.clone(),
                Err(_) => {
                    let ordinal: usize = d.extract().map_err(|_| {
                        PyTypeError::new_err("Loader: device is a gpufeed.Device or an ordinal")
                    })?;
                    py.get_type::<Device>()
                        .call1((py.None(), ordinal))?
                        .cast::<Device>()?
                        .get()
                        .inner
                        .clone()
                }
            },
            None => {
                let ordinal = if world_size > 1 {
                    local_rank.unwrap_or(0)
                } else {
                    0
                };
                py.get_type::<Device>()
                    .call1((py.None(), ordinal))?
                    .cast::<Device>()?
                    .get()
                    .inner
                    .clone()
            }
        };
        let cuda = device.kind() == gpufeed::BackendKind::Cuda;
        let framework = match framework {
            "torch" => Framework::Torch,
            "cupy" => Framework::Cupy,
            "gpufeed" => Framework::Gpufeed,
            "numpy" => Framework::Numpy,
            "auto" => {
                let torch_fits = |py: Python<'_>| -> bool {
                    // On a GPU, only a torch that sees it (not a CPU build).
                    py.import("torch").is_ok_and(|t| {
                        !cuda
                            || t.getattr("cuda")
                                .and_then(|c| c.call_method0("is_available"))
                                .and_then(|v| v.extract::<bool>())
                                .unwrap_or(false)
                    })
                };
                if torch_fits(py) {
                    Framework::Torch
                } else if cuda && importable(py, "cupy") {
                    Framework::Cupy
                } else {
                    Framework::Gpufeed
                }
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "Loader: framework {other:?} is not one of \"auto\", \"torch\", \"cupy\", \
                     \"gpufeed\", \"numpy\""
                )))
            }
        };
        if framework == Framework::Cupy && !cuda {
            return Err(PyValueError::new_err(
                "Loader: framework=\"cupy\" needs a GPU (this device is the CPU emulation)",
            ));
        }
        let mut keep = Keep { views: Vec::new() };
        let (fields, as_dict) = if let Ok(d) = source.cast::<PyDict>() {
            if d.is_empty() {
                return Err(PyValueError::new_err("Loader: an empty dict source"));
            }
            let mut fields = Vec::new();
            // A snapshot of the items: reading a value may run Python
            // code that changes the dict (iterating it live would panic).
            for item in d.items().iter() {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
                let k: String = k.extract().map_err(|_| {
                    PyTypeError::new_err("Loader: a dict source's keys are strings")
                })?;
                fields.extend(value_fields(py, &v, Some(k), &mut keep)?);
            }
            (fields, true)
        } else {
            let fields = value_fields(py, source, None, &mut keep)?;
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
        let plain: Vec<(Vec<(usize, usize)>, usize)> = fields
            .iter()
            .map(|f| (f.segments.clone(), f.row_bytes))
            .collect();
        let sources = py.detach(|| row_sources(&device, &plain)).py()?;
        let mut config = gpufeed::LoaderConfig::new(batch_size as usize);
        config.shuffle = shuffle;
        config.seed = seed;
        config.drop_last = drop_last;
        config.prefetch = prefetch as usize;
        config.rank = rank;
        config.world_size = world_size;
        let inner = py
            .detach(|| gpufeed::Loader::<u8>::new(&device, sources, config))
            .py()?;
        let (rows, batches_per_epoch, gather) = (inner.rows(), inner.len(), inner.gather());
        let producer = Producer::start(inner)?;
        Ok(Loader {
            producer: Some(producer),
            gather,
            fields,
            as_dict,
            framework,
            device,
            rows,
            batches_per_epoch,
            resume_at: 0,
            epoch: 0,
            config,
            generation: 0,
            running: false,
            running_epoch: 0,
            skip: 0,
            handed_out: 0,
            finished: false,
            pid: std::process::id(),
            handed: Vec::new(),
            retiring: Vec::new(),
            _keep: keep,
        })
    }

    /// Where batches are gathered: "device" (the source pinned in place,
    /// read by a kernel where it is) or "host" (native threads copy the
    /// rows into pinned blocks).
    #[getter]
    fn gather(&self) -> &'static str {
        match self.gather {
            gpufeed::Gather::Device => "device",
            gpufeed::Gather::Host => "host",
        }
    }

    /// Batches in one epoch (this rank's).
    fn __len__(&self) -> usize {
        self.batches_per_epoch
    }

    /// Starts an epoch (the one `set_epoch` chose; from the batch a loaded
    /// state names, else from the start) and returns its iterator. A later
    /// `iter(loader)` starts the epoch afresh; iterators of earlier ones
    /// then raise `RuntimeError`.
    fn __iter__(mut slf: PyRefMut<'_, Self>) -> PyResult<LoaderIterator> {
        let skip = std::mem::take(&mut slf.resume_at);
        slf.start(skip)?;
        let generation = slf.generation;
        Ok(LoaderIterator {
            loader: slf.into(),
            generation,
        })
    }

    /// Chooses the epoch the next iteration runs (its shuffled order); a
    /// loaded state's position is dropped when it names another epoch.
    fn set_epoch(&mut self, epoch: Count) {
        if epoch.0 != self.epoch {
            // Another epoch next: a loaded position was of the old one.
            self.resume_at = 0;
        }
        self.epoch = epoch.0;
    }

    /// The epoch the next (or current) iteration runs.
    #[getter]
    fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Rows in the source (all ranks').
    #[getter]
    fn rows(&self) -> usize {
        self.rows
    }

    /// `(rank, world_size)` of this loader's shard.
    #[getter]
    fn shard(&self) -> (usize, usize) {
        (self.config.rank, self.config.world_size)
    }

    /// The framework batches come out as (`"torch"`, `"cupy"`,
    /// `"gpufeed"`, `"numpy"`).
    #[getter]
    fn framework(&self) -> &'static str {
        match self.framework {
            Framework::Torch => "torch",
            Framework::Cupy => "cupy",
            Framework::Gpufeed => "gpufeed",
            Framework::Numpy => "numpy",
        }
    }

    /// The rows this rank reads in `epoch` (default: the current one), in
    /// order; batch `i` is `indices[i*batch_size:(i+1)*batch_size]`.
    #[pyo3(signature = (epoch=None))]
    fn indices(&self, epoch: Option<Count>) -> Vec<usize> {
        gpufeed::epoch_indices(self.rows, &self.config, epoch.map_or(self.epoch, |e| e.0))
    }

    /// `{"epoch", "batches" (handed out so far this epoch), "seed",
    /// "shuffle", "batch_size", "drop_last", "rank", "world_size",
    /// "rows"}`.
    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let c = &self.config;
        // The running iteration's position, unless the next iteration is
        // already set to start elsewhere (a loaded state, another epoch).
        let position = if self.resume_at > 0 || !self.running || self.epoch != self.running_epoch {
            self.resume_at
        } else {
            (self.skip + self.handed_out).min(self.batches_per_epoch)
        };
        d.set_item("epoch", self.epoch)?;
        d.set_item("batches", position)?;
        d.set_item("seed", c.seed)?;
        d.set_item("shuffle", c.shuffle)?;
        d.set_item("batch_size", c.batch_size)?;
        d.set_item("drop_last", c.drop_last)?;
        d.set_item("rank", c.rank)?;
        d.set_item("world_size", c.world_size)?;
        d.set_item("rows", self.rows)?;
        Ok(d)
    }

    /// Resumes from a `state_dict()`: the next iteration runs its epoch
    /// from the batch after the last one it had handed out. Raises
    /// `ValueError` when the state was made with another order (seed,
    /// shuffle, batch size, drop_last, shard, row count).
    fn load_state_dict(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> { state.get_item(k) };
        let need = |k: &str| -> PyResult<u64> {
            get(k)?
                .ok_or_else(|| PyValueError::new_err(format!("Loader.load_state_dict: no {k:?}")))?
                .extract()
                .map_err(|_| {
                    PyValueError::new_err(format!("Loader.load_state_dict: {k:?} is not a count"))
                })
        };
        let epoch = need("epoch")?;
        let batches = need("batches")? as usize;
        let c = self.config;
        let mine: [(&str, u64); 7] = [
            ("seed", c.seed),
            ("shuffle", c.shuffle as u64),
            ("batch_size", c.batch_size as u64),
            ("drop_last", c.drop_last as u64),
            ("rank", c.rank as u64),
            ("world_size", c.world_size as u64),
            ("rows", self.rows as u64),
        ];
        for (k, v) in mine {
            if let Some(got) = get(k)? {
                let got: u64 = got.extract().map_err(|_| {
                    PyValueError::new_err(format!("Loader.load_state_dict: {k:?} is not a count"))
                })?;
                if got != v {
                    return Err(PyValueError::new_err(format!(
                        "Loader.load_state_dict: the state has {k}={got}, this loader {k}={v}: \
                         the order would differ"
                    )));
                }
            }
        }
        if batches > self.batches_per_epoch {
            return Err(PyValueError::new_err(format!(
                "Loader.load_state_dict: {batches} batches consumed, but an epoch has {}",
                self.batches_per_epoch
            )));
        }
        self.epoch = epoch;
        self.resume_at = batches;
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "<gpufeed.Loader {} rows, batch_size {}, {} batches/epoch, shuffle={}, rank {}/{}, {}>",
            self.rows,
            self.config.batch_size,
            self.batches_per_epoch,
            self.config.shuffle,
            self.config.rank,
            self.config.world_size,
            self.framework()
        )
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // The producer first: no thread reads the source once `keep` goes.
        if let Some(p) = self.producer.take() {
            if std::process::id() == self.pid {
                p.stop();
            } else {
                // A fork() child: the thread is the parent's; nothing to join.
                std::mem::forget(p);
            }
        }
        // Batches whose consumers' events are pending: wait for them, so
        // their memory is not reused under a queued kernel.
        // Batches released since the last `next`: their consumers' work
        // is whatever the current stream holds now.
        Python::attach(|py| {
            for (_, ev) in &self.retiring {
                let _ = ev.bind(py).call_method0("synchronize");
            }
            let released = self
                .handed
                .iter()
                .any(|a| a.get().exports.load(Ordering::SeqCst) == 0);
            if released {
                if let Ok(Some(s)) = self.consumer_stream(py) {
                    let _ = s.call_method0("synchronize");
                }
            }
        });
    }
}
