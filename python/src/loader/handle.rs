//! The Python [`Loader`] and its [`LoaderIterator`]: the state of the
//! epochs, and a batch taken (received from the producer, converted to the
//! framework's objects) and freed once its consumer is done with it.

use crate::buffer::ContiguousView;
use crate::convert::IntoPy;
use crate::device::{DevMem, DeviceArray, StateCell};
use crate::dtype::DType;
use crate::loader::fields::{Field, Keep};
use crate::loader::producer::{Command, Message, Producer};
use crate::loader::setup::Framework;
use pyo3::exceptions::{PyRuntimeError, PyStopIteration};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
    pub(super) producer: Option<Producer>,
    /// Where the batches are gathered.
    pub(super) gather: gpufeed::Gather,
    pub(super) fields: Vec<Field>,
    pub(super) as_dict: bool,
    pub(super) framework: Framework,
    pub(super) device: gpufeed::Device,
    pub(super) rows: usize,
    pub(super) batches_per_epoch: usize,
    /// The next `__iter__` starts here (a loaded state), then 0.
    pub(super) resume_at: usize,
    pub(super) epoch: u64,
    pub(super) config: gpufeed::LoaderConfig,
    /// The epoch running: its generation (batches of older ones are
    /// dropped), its first batch, batches handed out, whether it ended.
    pub(super) generation: u64,
    pub(super) running: bool,
    /// The epoch the running (or last) iteration runs: `epoch` may have
    /// been set to the next one since.
    pub(super) running_epoch: u64,
    pub(super) skip: usize,
    pub(super) handed_out: usize,
    pub(super) finished: bool,
    /// The process that made the loader: a fork() child has no producer.
    pub(super) pid: u32,
    /// Batches handed to torch or CuPy, kept until their export is released.
    pub(super) handed: Vec<Py<DeviceArray>>,
    /// Released batches, each with an event on the consumer's stream: freed
    /// once it completes.
    pub(super) retiring: Vec<(Py<DeviceArray>, Py<PyAny>)>,
    /// Last: the exports keeping the source's memory alive (released after
    /// the producer has stopped, in `Drop`).
    pub(super) _keep: Keep,
}

/// The batches of one epoch of a [`Loader`]: what `iter(loader)` returns
/// (its own `iter()` is itself, so `it = iter(loader); next(it)` then
/// `for b in it` goes on with the same epoch).
#[pyclass(module = "gpufeed")]
pub struct LoaderIterator {
    pub(super) loader: Py<Loader>,
    /// The epoch run this iterator belongs to.
    pub(super) generation: u64,
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

impl Loader {
    pub(super) fn cuda(&self) -> bool {
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
    pub(super) fn convert<'py>(
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
    pub(super) fn start(&mut self, skip: usize) -> PyResult<()> {
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
