//! `save_async`: a checkpoint written in the background from a snapshot.
//!
//! The call takes a snapshot of every tensor (device-to-device copies into
//! fresh device memory, all on one stream and waited for; host copies of
//! host arrays), hands it to a writer thread and returns a [`SaveHandle`]:
//! from then on the tensors may change. The writer streams each piece of
//! the snapshot through the device's staging engine into its shard (a
//! temporary name, synced and renamed when complete), frees it, and writes
//! the index last. The snapshot's memory is bounded by `snapshot_bytes`:
//! beyond it the snapshot is taken in pieces, each waiting for the writer to
//! free room, so the call returns once what is left fits the bound (the
//! rest is on the disk by then).

use crate::convert::IntoPy;
use crate::device::{DevMem, DeviceArray};
use crate::dtype::DType;
use gpufeed::weights::{CheckpointWriter, Dtype, Snapshot};
use gpufeed::{BackendKind, DeviceBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};

/// A tensor to save: a device array (ours or wrapped), or host memory.
enum Src {
    Array(Py<DeviceArray>),
    Host {
        view: crate::buffer::ContiguousView,
        _keep: Option<Py<PyAny>>,
    },
}

fn safetensors_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::U16 => Dtype::U16,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
    }
}

/// Whether `obj` is CUDA memory (a CUDA tensor, a CuPy array).
fn on_cuda(obj: &Bound<'_, PyAny>) -> bool {
    if obj.hasattr("__cuda_array_interface__").unwrap_or(false) {
        return true;
    }
    obj.call_method0("__dlpack_device__")
        .and_then(|d| d.get_item(0)?.extract::<i32>())
        .is_ok_and(|t| t == 2)
}

/// What the writer and the caller share.
struct Shared {
    state: Mutex<Progress>,
    changed: Condvar,
    /// The caller gave up (its error is raised by the call): the writer
    /// drops what it has written.
    aborted: AtomicBool,
}

struct Progress {
    /// Snapshot bytes not yet written (and freed).
    held: u64,
    /// The outcome once the writer is done: the index's path.
    done: Option<gpufeed::Result<PathBuf>>,
    /// The writer's first error, as soon as it happens (the caller stops
    /// snapshotting).
    failed: bool,
    write_seconds: f64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One snapshot piece: bytes `offset..` of tensor `tensor`.
struct Piece {
    tensor: usize,
    offset: u64,
    data: Snapshot,
}

/// The writer thread: writes each piece as it comes and frees it; the
/// index once every piece is written (not after an abort or an error).
fn writer(mut w: CheckpointWriter, pieces: mpsc::Receiver<Piece>, shared: Arc<Shared>) {
    let started = std::time::Instant::now();
    let mut result: gpufeed::Result<()> = Ok(());
    for p in pieces {
        let len = p.data.len() as u64;
        if result.is_ok() && !shared.aborted.load(Ordering::SeqCst) {
            result = w.write(p.tensor, p.offset, &p.data);
            if result.is_err() {
                shared.lock().failed = true;
            }
        }
        drop(p);
        shared.lock().held -= len;
        shared.changed.notify_all();
    }
    let outcome = match result {
        Ok(()) if shared.aborted.load(Ordering::SeqCst) => Err(gpufeed::Error::InvalidArgument(
            "the save was abandoned".into(),
        )),
        Ok(()) => w.finish(),
        Err(e) => {
            drop(w);
            Err(e)
        }
    };
    let mut s = shared.lock();
    s.write_seconds = started.elapsed().as_secs_f64();
    s.done = Some(outcome);
    drop(s);
    shared.changed.notify_all();
}

/// A checkpoint being written in the background (`save_async`): `wait()`
/// (GIL released; Ctrl-C interrupts the wait, not the write) returns the
/// index's path or raises the write's error; `done()`; `await handle`.
/// Dropping it lets the write go on (its errors are then lost).
#[pyclass(module = "gpufeed", frozen)]
pub struct SaveHandle {
    shared: Arc<Shared>,
    /// Seconds the call blocked its caller (the snapshot).
    #[pyo3(get)]
    blocked_seconds: f64,
    /// Bytes of the tensors.
    #[pyo3(get)]
    nbytes: u64,
    /// The shard files (names in the directory).
    #[pyo3(get)]
    shards: Vec<String>,
    /// The directory.
    #[pyo3(get)]
    path: PathBuf,
}

#[pymethods]
impl SaveHandle {
    /// Waits for the write (GIL released) and returns the index's path;
    /// raises its error (`OSError` subclasses with `errno` and `filename`
    /// for the files). With `timeout` (seconds), `TimeoutError` when it is
    /// still running then.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PathBuf> {
        let deadline = timeout
            .map(|t| std::time::Instant::now() + std::time::Duration::from_secs_f64(t.max(0.0)));
        loop {
            if let Some(r) = &self.shared.lock().done {
                return r.clone().map_err(super::convert::weights_error);
            }
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(pyo3::exceptions::PyTimeoutError::new_err(
                    "save_async: the checkpoint is still being written",
                ));
            }
            py.detach(|| {
                let s = self.shared.lock();
                if s.done.is_none() {
                    let _ = self
                        .shared
                        .changed
                        .wait_timeout(s, crate::ops::SIGNAL_CHECK);
                }
            });
            py.check_signals()?;
        }
    }

    /// Whether the write has ended (`wait()` then returns at once).
    fn done(&self) -> bool {
        self.shared.lock().done.is_some()
    }

    /// Seconds the writer has taken (so far, or in all once done).
    #[getter]
    fn write_seconds(&self) -> f64 {
        self.shared.lock().write_seconds
    }

    /// `await handle` in asyncio: `wait()` on the loop's default executor.
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        crate::ops::await_wait(slf.as_any())
    }

    fn __repr__(&self) -> String {
        let s = match &self.shared.lock().done {
            None => "writing",
            Some(Ok(_)) => "done",
            Some(Err(_)) => "failed",
        };
        format!("<gpufeed.SaveHandle {} {s}>", self.path.display())
    }
}

/// `save_async(state_dict, path, max_shard_bytes=5 * 2**30,
/// snapshot_bytes=None, metadata=None, device=None)`: see the README's
/// "Model weights".
#[pyfunction]
#[pyo3(signature = (state_dict, path, max_shard_bytes=crate::convert::Count(5 << 30), snapshot_bytes=None, metadata=None, device=None))]
pub fn save_async(
    py: Python<'_>,
    state_dict: &Bound<'_, PyAny>,
    path: PathBuf,
    max_shard_bytes: crate::convert::Count,
    snapshot_bytes: Option<crate::convert::Count>,
    metadata: Option<&Bound<'_, PyDict>>,
    device: Option<&crate::device::Device>,
) -> PyResult<SaveHandle> {
    let started = std::time::Instant::now();
    let dict = if !state_dict.is_instance_of::<PyDict>() && state_dict.hasattr("state_dict")? {
        state_dict
            .call_method0("state_dict")?
            .cast_into::<PyDict>()?
    } else {
        state_dict.clone().cast_into::<PyDict>().map_err(|_| {
            PyTypeError::new_err("save_async: state_dict is a dict of tensors or a module")
        })?
    };
    let device = crate::device::device_or_default(py, device)?;
    let cuda = device.kind() == BackendKind::Cuda;
    let mut names = Vec::with_capacity(dict.len());
    let mut srcs = Vec::with_capacity(dict.len());
    let mut specs = Vec::with_capacity(dict.len());
    for item in dict.items().iter() {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let name: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("save_async: tensor names must be strings"))?;
        let (src, shape, dtype) = if let Ok(a) = v.cast::<DeviceArray>() {
            let d = a.get();
            (Src::Array(a.clone().unbind()), d.shape.clone(), d.dtype)
        } else if cuda && on_cuda(&v) {
            let dev = crate::device::Device {
                inner: device.clone(),
            };
            let a = crate::device::as_device_array(py, &v, Some(&dev))?;
            let (shape, dtype) = (a.shape.clone(), a.dtype);
            (Src::Array(Py::new(py, a)?), shape, dtype)
        } else {
            let host = crate::staging::contiguous(&v, false)?;
            let dtype = crate::staging::dtype_of(&host, "save_async")?;
            let crate::staging::Exported { view, keep, .. } = host;
            let shape = view.shape.clone();
            (
                Src::Host {
                    view,
                    _keep: keep.map(Bound::unbind),
                },
                shape,
                dtype,
            )
        };
        if let Src::Array(a) = &src {
            if !a.bind(py).get().device.same_as(&device) {
                return Err(PyValueError::new_err(format!(
                    "save_async: tensor {name:?} lives on another device than device="
                )));
            }
        }
        specs.push((name.clone(), safetensors_dtype(dtype), shape));
        names.push(name);
        srcs.push(src);
    }
    let mut meta = Vec::new();
    if let Some(m) = metadata {
        for (k, v) in m.iter() {
            let (Ok(k), Ok(v)) = (k.extract::<String>(), v.extract::<String>()) else {
                return Err(PyTypeError::new_err(
                    "save_async: metadata must map strings to strings",
                ));
            };
            meta.push((k, v));
        }
    }
    // Pending work of PyTorch on the tensors first: the snapshot is of
    // their values as the program sees them now.
    if cuda {
        if let Ok(torch) = py.import("sys")?.getattr("modules")?.get_item("torch") {
            let cuda_mod = torch.getattr("cuda")?;
            if cuda_mod.call_method0("is_initialized")?.is_truthy()? {
                cuda_mod.call_method0("synchronize")?;
            }
        }
    }
    let staging = crate::staging::engine_for(py, &device)?;
    let writer_state = py
        .detach(|| CheckpointWriter::create(&staging, &path, &specs, max_shard_bytes.0, &meta))
        .map_err(|e| match e {
            gpufeed::Error::InvalidArgument(m) => PyValueError::new_err(format!("save_async: {m}")),
            e => super::convert::weights_error(e),
        })?;
    let plan = writer_state.plan();
    let nbytes = plan.total_size();
    let shards: Vec<String> = plan.shards.iter().map(|s| s.name.clone()).collect();
    let sizes: Vec<u64> = plan.tensors.iter().map(|t| t.nbytes).collect();
    let bound = snapshot_bytes.map_or(nbytes, |b| b.0).max(1);
    let shared = Arc::new(Shared {
        state: Mutex::new(Progress {
            held: 0,
            done: None,
            failed: false,
            write_seconds: 0.0,
        }),
        changed: Condvar::new(),
        aborted: AtomicBool::new(false),
    });
    let (tx, rx) = mpsc::channel::<Piece>();
    let s2 = shared.clone();
    std::thread::Builder::new()
        .name("gpufeed-save".into())
        .spawn(move || writer(writer_state, rx, s2))
        .map_err(|e| {
            crate::convert::InternalError::new_err(format!("save_async: no writer thread: {e}"))
        })?;
    let snapped = snapshot(py, &device, &srcs, &sizes, bound, &tx, &shared);
    drop(tx);
    if let Err(e) = snapped {
        shared.aborted.store(true, Ordering::SeqCst);
        return Err(e);
    }
    Ok(SaveHandle {
        shared,
        blocked_seconds: started.elapsed().as_secs_f64(),
        nbytes,
        shards,
        path,
    })
}

/// Takes the snapshot in batches of at most `bound` bytes (a tensor larger
/// than that in pieces of `bound`), each batch once the writer has freed
/// room for it, and hands each piece to the writer.
fn snapshot(
    py: Python<'_>,
    device: &gpufeed::Device,
    srcs: &[Src],
    sizes: &[u64],
    bound: u64,
    tx: &mpsc::Sender<Piece>,
    shared: &Arc<Shared>,
) -> PyResult<()> {
    // Every piece: (tensor, offset, length), each at most `bound` (empty
    // tensors have none: their shard is whole without them).
    let mut todo = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let mut off = 0;
        while off < n {
            let len = (n - off).min(bound);
            todo.push((i, off, len));
            off += len;
        }
    }
    let stream = py.detach(|| gpufeed::Stream::new(device)).py()?;
    // Unbounded (the bound holds every piece): one batch, one allocation
    // for all its device pieces (freed with the last one written).
    let one_area = todo.iter().map(|p| p.2).sum::<u64>() <= bound;
    let mut next = 0;
    while next < todo.len() {
        // A batch: the pieces that fit the room the writer leaves (at
        // least the next one: wait for that much).
        let want = todo[next].2;
        let room = py.detach(|| {
            let mut s = shared.lock();
            loop {
                if s.failed || s.done.is_some() {
                    return 0;
                }
                if bound - s.held.min(bound) >= want {
                    return bound - s.held;
                }
                s = shared.changed.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        });
        if room == 0 {
            // The writer failed: its error comes back through the handle.
            return Ok(());
        }
        let mut batch = Vec::new();
        let mut bytes = 0;
        while next < todo.len() && bytes + todo[next].2 <= room {
            bytes += todo[next].2;
            batch.push(todo[next]);
            next += 1;
        }
        let pieces = take_batch(py, device, &stream, srcs, &batch, one_area)?;
        shared.lock().held += bytes;
        for p in pieces {
            if tx.send(p).is_err() {
                return Err(crate::convert::InternalError::new_err(
                    "save_async: the writer is gone",
                ));
            }
        }
    }
    Ok(())
}

/// The snapshot of `batch`'s pieces: device pieces copied on `stream` into
/// new device memory (one wait for all), host pieces copied on the host.
fn take_batch(
    py: Python<'_>,
    device: &gpufeed::Device,
    stream: &gpufeed::Stream,
    srcs: &[Src],
    batch: &[(usize, u64, u64)],
    one_area: bool,
) -> PyResult<Vec<Piece>> {
    // The device arrays' memory, taken out for the copies.
    let mut held: Vec<(usize, DevMem)> = Vec::new();
    let mut failed = Ok(());
    for &(i, _, _) in batch {
        if let Src::Array(a) = &srcs[i] {
            if held.iter().any(|(j, _)| *j == i) {
                continue;
            }
            match a.bind(py).get().take_own("save_async", false).or_else(|_| {
                // A wrapped tensor: its memory is taken the same way.
                a.bind(py).get().take_for_operation()
            }) {
                Ok(m) => held.push((i, m)),
                Err(e) => {
                    failed = Err(e);
                    break;
                }
            }
        }
    }
    let result = failed.and_then(|()| {
        let hosts: Vec<(usize, u64, usize)> = srcs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Src::Host { view, .. } => Some((i, view.ptr as u64, view.len)),
                Src::Array(_) => None,
            })
            .collect();
        py.detach(|| copy_batch(device, stream, &held, &hosts, batch, one_area))
            .py()
    });
    for (i, m) in held {
        if let Src::Array(a) = &srcs[i] {
            a.bind(py).get().put_back(m);
        }
    }
    result
}

fn copy_batch(
    device: &gpufeed::Device,
    stream: &gpufeed::Stream,
    held: &[(usize, DevMem)],
    hosts: &[(usize, u64, usize)],
    batch: &[(usize, u64, u64)],
    one_area: bool,
) -> gpufeed::Result<Vec<Piece>> {
    let mut out: Vec<Piece> = Vec::with_capacity(batch.len());
    let mut device_pieces: Vec<(usize, u64, u64)> = Vec::new();
    for &(i, off, len) in batch {
        if let Some(&(_, addr, total)) = hosts.iter().find(|h| h.0 == i) {
            let (off, len) = (off as usize, len as usize);
            if off + len > total {
                return Err(gpufeed::Error::Internal(
                    "a host piece past its array".into(),
                ));
            }
            // SAFETY: a live buffer export (held by the caller with the
            // GIL-side view) of `total` readable bytes; only read here.
            let src =
                unsafe { std::slice::from_raw_parts((addr as usize + off) as *const u8, len) };
            out.push(Piece {
                tensor: i,
                offset: off as u64,
                data: Snapshot::Host(src.to_vec()),
            });
        } else {
            device_pieces.push((i, off, len));
        }
    }
    if one_area {
        // One allocation for the whole snapshot, each piece a range of it.
        let total: u64 = device_pieces.iter().map(|p| p.2).sum();
        let buf = DeviceBuffer::<u8>::new(device, total as usize)?;
        let mut ranges = Vec::with_capacity(device_pieces.len());
        let mut at = 0usize;
        for &(_, _, len) in &device_pieces {
            ranges.push(at..at + len as usize);
            at += len as usize;
        }
        let sources = sources_of(held, &device_pieces)?;
        let (buf, ()) = stream
            .run_sync(buf, |c, b| {
                let whole = b.view_mut();
                for (r, &src) in ranges.iter().zip(&sources) {
                    if r.is_empty() {
                        continue;
                    }
                    let dst = whole.range(r.clone())?;
                    // SAFETY: as below: `src` lies in a device array's
                    // memory, taken out of it for this call.
                    let s = unsafe { gpufeed::interop::device_slice::<u8>(device, src, r.len()) };
                    c.copy_d2d(s, dst)?;
                }
                Ok(())
            })
            .map_err(|e| e.error)?;
        let buf = std::sync::Arc::new(buf);
        for ((i, off, _), r) in device_pieces.into_iter().zip(ranges) {
            out.push(Piece {
                tensor: i,
                offset: off,
                data: Snapshot::Shared(buf.clone(), r),
            });
        }
        return Ok(out);
    }
    let mut bufs = Vec::with_capacity(device_pieces.len());
    for &(_, _, len) in &device_pieces {
        bufs.push(DeviceBuffer::<u8>::new(device, len as usize)?);
    }
    let sources = sources_of(held, &device_pieces)?;
    let (bufs, ()) = stream
        .run_sync(bufs, |c, bufs| {
            for (b, &src) in bufs.iter_mut().zip(&sources) {
                if b.is_empty() {
                    continue;
                }
                // SAFETY: `src` is inside a device array's memory, taken out
                // of it (in flight) for this call, so nothing of ours writes
                // it meanwhile (a wrapped tensor: PyTorch's pending work was
                // waited for first).
                let s = unsafe { gpufeed::interop::device_slice::<u8>(device, src, b.len()) };
                c.copy_d2d(s, b.view_mut())?;
            }
            Ok(())
        })
        .map_err(|e| e.error)?;
    for ((i, off, _), b) in device_pieces.into_iter().zip(bufs) {
        out.push(Piece {
            tensor: i,
            offset: off,
            data: Snapshot::Device(b),
        });
    }
    Ok(out)
}

/// The device address of each device piece's bytes.
fn sources_of(held: &[(usize, DevMem)], pieces: &[(usize, u64, u64)]) -> gpufeed::Result<Vec<u64>> {
    pieces
        .iter()
        .map(|&(i, off, _)| {
            held.iter()
                .find(|(j, _)| *j == i)
                .map(|(_, m)| m.addr() + off)
                .ok_or_else(|| gpufeed::Error::Internal("a device piece without memory".into()))
        })
        .collect()
}
