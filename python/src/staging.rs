//! `to_device` and `to_host`: ordinary (pageable) arrays to the device and
//! back at the link's speed, through the `host` staging engine (a bounded
//! ring of pinned blocks filled by native worker threads); `to_device_async`
//! and `to_host_async`, the same as a [`Transfer`] run by a thread of its own
//! and awaited (or waited for) later.
//!
//! The GIL is released while a copy reads or writes the caller's array; the
//! buffer export taken first is held until no thread of ours touches the
//! memory any more. NumPy lets another thread replace an array's memory under
//! a live export (`ndarray.__setstate__`, `resize(refcheck=False)`): doing
//! that during a copy is the caller's to avoid (README, "Not guaranteed"), as
//! for a `Loader`'s source.

use crate::buffer::ContiguousView;
use crate::device::{device_or_default, DevMem, Device, DeviceArray};
use crate::dtype::DType;
use crate::ops::SIGNAL_CHECK;
use crate::{convert::to_py, convert::IntoPy};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// One staging engine per device (keyed by the device's identity) and
/// process, made at first use and kept: its pinned ring (32 MiB by
/// default) is reused by every copy.
static ENGINES: Mutex<Vec<Engine>> = Mutex::new(Vec::new());

/// A kept engine: the process that made it, its device, the engine.
struct Engine {
    pid: u32,
    device: gpufeed::Device,
    staging: gpufeed::Staging,
}

fn engine(device: &gpufeed::Device) -> gpufeed::Result<gpufeed::Staging> {
    let mut engines = ENGINES.lock().unwrap_or_else(|p| p.into_inner());
    // In a fork() child the parent's engines have no workers (they refuse
    // every copy): forgotten, not dropped (their threads and blocks are the
    // parent's), and the child makes its own.
    let pid = std::process::id();
    if engines.iter().any(|e| e.pid != pid) {
        let (ours, parents): (Vec<Engine>, Vec<Engine>) = std::mem::take(&mut *engines)
            .into_iter()
            .partition(|e| e.pid == pid);
        std::mem::forget(parents);
        *engines = ours;
    }
    if let Some(e) = engines.iter().find(|e| e.device.same_as(device)) {
        return Ok(e.staging.clone());
    }
    let staging = gpufeed::Staging::new(device)?;
    engines.push(Engine {
        pid,
        device: device.clone(),
        staging: staging.clone(),
    });
    Ok(staging)
}

/// The device's staging engine, made at first use (GIL released meanwhile).
pub(crate) fn engine_for(py: Python<'_>, device: &gpufeed::Device) -> PyResult<gpufeed::Staging> {
    py.detach(|| engine(device)).py()
}

/// A host object's memory, exported: the view, what it was taken from when
/// that isn't the caller's object (NumPy's view of a PyTorch tensor), and
/// the dtype when the view's format doesn't say it (a bfloat16 tensor,
/// seen as int16).
pub(crate) struct Exported<'py> {
    pub(crate) view: ContiguousView,
    pub(crate) keep: Option<Bound<'py, PyAny>>,
    pub(crate) dtype: Option<DType>,
}

/// A C-contiguous view of `obj`: its own buffer export, or, for objects
/// without one (a PyTorch CPU tensor), NumPy's view of it (no copy; a
/// non-contiguous tensor is refused, never copied).
pub(crate) fn contiguous<'py>(obj: &Bound<'py, PyAny>, writable: bool) -> PyResult<Exported<'py>> {
    let first = match ContiguousView::get(obj, writable) {
        Ok(view) => {
            return Ok(Exported {
                view,
                keep: None,
                dtype: None,
            })
        }
        Err(first) => first,
    };
    let py = obj.py();
    if first.is_instance_of::<PyValueError>(py) {
        // NumPy's refusal to export: a strided or read-only array, or a
        // dtype a buffer can't describe (datetime64).
        return Err(refusal(obj, writable, first));
    }
    if !obj.hasattr("__array__")? {
        return Err(first);
    }
    // A bfloat16 tensor: NumPy has no such dtype, so its memory is seen as
    // int16 (the same two bytes per value; no copy).
    let bf16 = obj
        .getattr("dtype")
        .and_then(|d| d.str())
        .is_ok_and(|d| d.to_str().is_ok_and(|d| d == "torch.bfloat16"));
    let seen = if bf16 {
        obj.call_method1("view", (py.import("torch")?.getattr("int16")?,))?
    } else {
        obj.clone()
    };
    let np = py.import("numpy")?;
    let arr = np.call_method1("asarray", (&seen,))?;
    let view = match ContiguousView::get(&arr, writable) {
        Ok(v) => v,
        Err(e) if e.is_instance_of::<PyValueError>(py) => return Err(refusal(&arr, writable, e)),
        Err(_) => return Err(first),
    };
    if writable && view.len > 0 && !exposes(obj, view.ptr as usize) {
        // NumPy made new memory: a copy into it would be lost.
        return Err(crate::convert::buffer_error(format!(
            "to_host: `out` ({}) gives NumPy only a copy of its memory, so the data would \
             never reach it: pass an object whose memory is written (a NumPy array, a \
             memory map, a bytearray, a PyTorch CPU tensor)",
            obj.get_type().name()?
        )));
    }
    Ok(Exported {
        view,
        keep: Some(arr),
        dtype: bf16.then_some(DType::BF16),
    })
}

/// The error for NumPy's refusal (`err`, a `ValueError`) to export `arr`:
/// `BufferError` for memory that is not C-contiguous (or read-only, when
/// written), `TypeError` for elements a buffer can't describe.
fn refusal(arr: &Bound<'_, PyAny>, writable: bool, err: PyErr) -> PyErr {
    let flag = |name: &str| -> Option<bool> {
        arr.getattr("flags")
            .and_then(|f| f.getattr(name))
            .and_then(|v| v.extract())
            .ok()
    };
    let c_contiguous = flag("c_contiguous");
    if c_contiguous == Some(false) {
        return crate::convert::buffer_error(format!(
            "to_device/to_host take C-contiguous arrays only (no hidden copy): {err}"
        ));
    }
    if writable && flag("writeable") == Some(false) {
        return crate::convert::buffer_error(format!("to_host: `out` is read-only: {err}"));
    }
    if c_contiguous == Some(true) {
        return PyTypeError::new_err(format!(
            "to_device/to_host: the array's elements have no device dtype (plain numbers \
             only): {err}"
        ));
    }
    crate::convert::buffer_error(format!("to_device/to_host: no C-contiguous export: {err}"))
}

/// Whether `obj` says its memory starts at `ptr`: a PyTorch tensor's
/// `data_ptr()`, or the `__array_interface__`'s data address. Objects
/// that say neither are taken to have copied.
fn exposes(obj: &Bound<'_, PyAny>, ptr: usize) -> bool {
    let torch = obj
        .call_method0("data_ptr")
        .and_then(|p| p.extract::<usize>());
    let interface = || {
        obj.getattr("__array_interface__")
            .and_then(|i| i.get_item("data")?.get_item(0)?.extract::<usize>())
    };
    torch.ok() == Some(ptr) || interface().ok() == Some(ptr)
}

/// The dtype of a view, from its format; `TypeError` naming `what` (the
/// call and its argument) for elements that are not plain numbers of a
/// device dtype (Python objects, structured or byte-swapped fields).
pub(crate) fn dtype_of(host: &Exported<'_>, what: &str) -> PyResult<DType> {
    let view = &host.view;
    if let Some(d) = host.dtype {
        return Ok(d);
    }
    let format = view.format.as_deref().unwrap_or("B");
    DType::from_format(format)
        .filter(|d| d.size() == view.itemsize)
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{what}: an element format {format:?} of {} bytes has no device dtype: plain \
                 numbers only (a NumPy array of a numeric dtype, a bytearray, a CPU tensor)",
                view.itemsize
            ))
        })
}

/// `to_device(obj, device=None)`: a new `DeviceArray` holding a copy of
/// `obj`, any C-contiguous buffer (a NumPy array, a memory map, a PyTorch
/// CPU tensor, `bytes`), of the same shape and dtype.
///
/// Large arrays go through the staging ring (parallel host copies
/// overlapped with the DMAs: the link's speed from ordinary memory); small
/// ones (below 512 KiB) as one driver copy. The result exports to PyTorch
/// and CuPy without a copy (`torch.from_dlpack(arr)`, `cupy.asarray(arr)`).
///
/// Raises `BufferError` for a non-contiguous object, `TypeError` for an
/// element type the device has no dtype for.
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn to_device(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<DeviceArray> {
    let device = device_or_default(py, device)?;
    let staging = engine_for(py, &device)?;
    // The view last: the array is exported (its owner can't resize it)
    // until the copy is over.
    let host = contiguous(obj, false)?;
    let dtype = dtype_of(&host, "to_device")?;
    let view = host.view;
    let array = DeviceArray::alloc(py, &device, view.shape.clone(), dtype)?;
    let src = view.as_bytes();
    array.with_own("to_device()", |buf| {
        in_ranges(
            src.len(),
            first_range(&staging),
            |r| {
                let at = r.start;
                py.detach(|| gpufeed::block_on(staging.h2d_at(&src[r], buf, at)))
                    .py()
            },
            || py.check_signals(),
        )
    })?;
    drop(view);
    Ok(array)
}

/// The first range of a copy done in ranges (see [`in_ranges`]), by
/// backend: about 20 ms at the H200's link speed (so a copy of up to 1 GiB
/// is one range: no refill of the ring between two), and about as long on
/// the CPU emulation's few GB/s. Later ranges follow the measured rate.
fn first_range(staging: &gpufeed::Staging) -> usize {
    match staging.device().kind() {
        gpufeed::BackendKind::Cuda => 1 << 30,
        _ => 64 << 20,
    }
}

/// The smallest range after the first.
const MIN_RANGE: usize = 64 << 20;

/// A copy of `len` bytes as consecutive ranges, `copy(range)` running each
/// to its end, `between()` after each but the last (its error stops the
/// copy there). Each range after the first is sized to take about
/// [`SIGNAL_CHECK`] at the rate of the one before (at least
/// [`MIN_RANGE`]): Python's signal handlers (Ctrl-C) run, or a dropped
/// transfer is seen, within about that, at the cost of one refill of the
/// staging ring per range (some 2 GiB a range at the H200's link speed).
/// One staged copy alone can't be stopped between polls: it may make
/// progress without ever waiting.
fn in_ranges<E>(
    len: usize,
    first: usize,
    mut copy: impl FnMut(std::ops::Range<usize>) -> Result<(), E>,
    mut between: impl FnMut() -> Result<(), E>,
) -> Result<(), E> {
    let (mut pos, mut step) = (0, first);
    while pos < len {
        let end = len.min(pos.saturating_add(step));
        let started = std::time::Instant::now();
        copy(pos..end)?;
        let took = started.elapsed().as_secs_f64().max(1e-6);
        let rate = (end - pos) as f64 / took;
        step = ((rate * SIGNAL_CHECK.as_secs_f64()) as usize).max(MIN_RANGE);
        pos = end;
        if pos < len {
            between()?;
        }
    }
    Ok(())
}

/// `to_host(array, out=None)`: the contents of a `DeviceArray` allocated by
/// gpufeed, copied into `out` (any writable C-contiguous buffer of the same
/// byte size: a NumPy array, a memory map, a PyTorch CPU tensor) and
/// returned; into a new NumPy array of the array's shape and dtype when
/// `out` is omitted.
///
/// Raises `ValueError` when `out`'s size differs, `TypeError` for an `out`
/// whose elements are not plain numbers (an object array), `BufferError`
/// for an `out` that is read-only, not contiguous, or that NumPy can only
/// copy (the data would never reach it).
#[pyfunction]
#[pyo3(signature = (array, out=None))]
pub fn to_host<'py>(
    py: Python<'py>,
    array: &Bound<'py, DeviceArray>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    let a = array.get();
    let staging = engine_for(py, &a.device)?;
    let (out, mut view, _keep) = host_out(py, a, out)?;
    // SAFETY: the export keeps `len` writable bytes at `ptr` while `view`
    // lives (asked writable), and nothing of ours reads or writes them
    // meanwhile but this copy.
    let dst = unsafe { view.as_bytes_mut() };
    a.with_own_read("to_host()", |buf| {
        in_ranges(
            dst.len(),
            first_range(&staging),
            |r| {
                let at = r.start;
                py.detach(|| gpufeed::block_on(staging.d2h_at(buf, at, &mut dst[r])))
                    .py()
            },
            || py.check_signals(),
        )
    })?;
    drop(view);
    Ok(out)
}

/// `to_host`'s destination: `out` or a new NumPy array of the array's
/// shape and dtype, exported writable and checked to be of its size.
#[allow(clippy::type_complexity)]
fn host_out<'py>(
    py: Python<'py>,
    a: &DeviceArray,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, ContiguousView, Option<Bound<'py, PyAny>>)> {
    let out = match out {
        Some(o) => o.clone(),
        None => {
            let np = py.import("numpy")?;
            np.call_method1("empty", (PyTuple::new(py, &a.shape)?, a.dtype.numpy_name()))?
        }
    };
    let host = contiguous(&out, true)?;
    // Raw bytes go only into plain numbers: never over an object array's
    // references (or a structured or byte-swapped dtype's fields).
    dtype_of(&host, "to_host: `out`")?;
    let Exported { view, keep, .. } = host;
    if view.len != a.nbytes {
        return Err(PyValueError::new_err(format!(
            "to_host: out holds {} bytes, the device array {}",
            view.len, a.nbytes
        )));
    }
    Ok((out, view, keep))
}

/// The host side of a transfer: a buffer export, released (with the GIL)
/// only once the transfer's thread no longer touches its memory.
struct HeldView {
    view: ContiguousView,
    /// What the export was taken from, when it isn't the caller's object
    /// (NumPy's view of a PyTorch tensor).
    _keep: Option<Py<PyAny>>,
}

// SAFETY: the view is released only with the GIL held: it lives in a
// `Transfer` (a Python object, deallocated with the GIL) and is taken out
// only by `Transfer::wait`/`Drop`, which hold the GIL. The transfer's
// thread sees only its `HostRange`, never the view.
unsafe impl Send for HeldView {}
// SAFETY: as above; `&HeldView` gives nothing but reads of plain fields.
unsafe impl Sync for HeldView {}

/// The host bytes a transfer's thread copies from or into.
#[derive(Clone, Copy)]
struct HostRange {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a range of a buffer export that the `Transfer` holds until its
// thread has finished with it (see `Transfer`); the thread is the only
// user of the range meanwhile.
unsafe impl Send for HostRange {}

/// How far a transfer is.
enum Stage {
    /// Its thread is copying (and holds the device memory).
    Running,
    /// The thread is done (the host memory is no longer touched): its
    /// result and the device memory, to hand back.
    Finished(gpufeed::Result<()>, DevMem),
    /// Handed back: the result, for later waiters.
    Done(gpufeed::Result<()>),
}

struct TransferShared {
    stage: Mutex<Stage>,
    changed: Condvar,
    cancel: AtomicBool,
}

impl TransferShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stage> {
        self.stage.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A copy between ordinary memory and the device running on a thread of its
/// own (`to_device_async`, `to_host_async`): `wait()` (GIL released, Ctrl-C
/// interrupts the wait, not the copy) or `await t` (asyncio) returns the
/// `DeviceArray` (`to_device_async`) or the host array (`to_host_async`).
/// The host buffer stays exported, and the device array's memory in flight
/// (`BufferError` on any use), until then. Dropping it unfinished stops the
/// copy (GIL released until its thread lets go of the host memory), then
/// releases the export.
#[pyclass(module = "gpufeed", frozen)]
pub struct Transfer {
    shared: Arc<TransferShared>,
    /// The device array whose memory the thread holds.
    array: Py<DeviceArray>,
    /// What `wait()` returns.
    result: Py<PyAny>,
    /// The host buffer's export, released after the thread is done.
    host: Mutex<Option<HeldView>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    what: &'static str,
    /// The process the thread runs in (a `fork()` child has none).
    pid: u32,
}

impl Transfer {
    /// Starts `what` on a new thread: the copy between `host` and the memory
    /// of `array` (taken out of it: in flight until handed back).
    fn start(
        py: Python<'_>,
        what: &'static str,
        upload: bool,
        array: Bound<'_, DeviceArray>,
        host: HeldView,
        result: Py<PyAny>,
    ) -> PyResult<Transfer> {
        let staging = engine_for(py, &array.get().device)?;
        let mem = array.get().take_own(what, upload)?;
        let range = HostRange {
            ptr: host.view.ptr,
            len: host.view.len,
        };
        let shared = Arc::new(TransferShared {
            stage: Mutex::new(Stage::Running),
            changed: Condvar::new(),
            cancel: AtomicBool::new(false),
        });
        // Handed to the thread through a slot, so a failed spawn gives the
        // memory back.
        let slot = Arc::new(Mutex::new(Some(mem)));
        let (s2, slot2) = (shared.clone(), slot.clone());
        let spawned = std::thread::Builder::new()
            .name("gpufeed-transfer".into())
            .spawn(move || {
                let taken = slot2.lock().unwrap_or_else(|p| p.into_inner()).take();
                let Some(mut mem) = taken else { return };
                // A panic (none is expected) still ends the stage: a waiter
                // or the drop never waits for a thread that is gone. The
                // copy is dropped while unwinding (no thread touches the
                // host range after).
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_copy(&staging, upload, range, &mut mem, &s2.cancel)
                }))
                .unwrap_or_else(|_| {
                    Err(gpufeed::Error::Internal(
                        "a transfer's thread panicked".into(),
                    ))
                });
                *s2.lock() = Stage::Finished(r, mem);
                s2.changed.notify_all();
            });
        let thread = match spawned {
            Ok(t) => t,
            Err(e) => {
                let mem = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(mem) = mem {
                    array.get().put_back(mem);
                }
                return Err(to_py(gpufeed::Error::InvalidArgument(format!(
                    "{what}: could not start its thread: {e}"
                ))));
            }
        };
        Ok(Transfer {
            shared,
            array: array.unbind(),
            result,
            host: Mutex::new(Some(host)),
            thread: Mutex::new(Some(thread)),
            what,
            pid: std::process::id(),
        })
    }

    /// After the thread's end was seen: joins it (at once: it only returns)
    /// and releases the host export (GIL held).
    fn release_host(&self, py: Python<'_>) {
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t {
            py.detach(move || {
                let _ = t.join();
            });
        }
        let held = self.host.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(held);
    }

    /// Hands a finished stage's memory back to the array and the host
    /// export back to Python; the result, kept for later waiters.
    fn hand_back(&self, py: Python<'_>) -> Option<gpufeed::Result<()>> {
        let mut stage = self.shared.lock();
        let r = match std::mem::replace(&mut *stage, Stage::Running) {
            Stage::Finished(r, mem) => {
                self.array.bind(py).get().put_back(mem);
                *stage = Stage::Done(r.clone());
                r
            }
            Stage::Done(r) => {
                *stage = Stage::Done(r.clone());
                r
            }
            Stage::Running => return None,
        };
        drop(stage);
        self.release_host(py);
        Some(r)
    }

    fn forked(&self) -> bool {
        self.pid != std::process::id()
    }
}

/// The copy of a transfer's thread, driven until it ends or `cancel` is
/// set (then dropped: no thread touches the host range after).
fn run_copy(
    staging: &gpufeed::Staging,
    upload: bool,
    range: HostRange,
    mem: &mut DevMem,
    cancel: &AtomicBool,
) -> gpufeed::Result<()> {
    let DevMem::Own(buf) = mem else {
        return Err(gpufeed::Error::InvalidArgument(
            "a transfer works on arrays allocated by gpufeed".into(),
        ));
    };
    let stop = || {
        if cancel.load(Ordering::SeqCst) {
            return Err(gpufeed::Error::InvalidArgument(
                "the transfer was dropped before it finished".into(),
            ));
        }
        Ok(())
    };
    if range.len == 0 {
        return Ok(()); // nothing to copy (and no pointer to make a slice of)
    }
    if upload {
        // SAFETY: the range is a live export held by the `Transfer` until
        // this thread has finished (`Stage::Finished` is set after this
        // returns, every copy over or dropped).
        let src = unsafe { std::slice::from_raw_parts(range.ptr, range.len) };
        in_ranges(
            src.len(),
            first_range(staging),
            |r| {
                let at = r.start;
                gpufeed::block_on(staging.h2d_at(&src[r], buf, at))
            },
            stop,
        )
    } else {
        // SAFETY: as above, a writable export that only this copy uses.
        let dst = unsafe { std::slice::from_raw_parts_mut(range.ptr, range.len) };
        in_ranges(
            dst.len(),
            first_range(staging),
            |r| {
                let at = r.start;
                gpufeed::block_on(staging.d2h_at(buf, at, &mut dst[r]))
            },
            stop,
        )
    }
}

#[pymethods]
impl Transfer {
    /// Waits until the copy is done (GIL released; Ctrl-C interrupts the
    /// wait, not the copy) and returns the `DeviceArray` (`to_device_async`)
    /// or the host array (`to_host_async`); raises the copy's error. Waiting
    /// again returns (or raises) the same.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        loop {
            if let Some(r) = self.hand_back(py) {
                r.map_err(to_py)?;
                return Ok(self.result.clone_ref(py));
            }
            if self.forked() {
                return Err(to_py(gpufeed::Error::InvalidArgument(format!(
                    "{} of the parent process: its thread did not survive fork()",
                    self.what
                ))));
            }
            py.detach(|| {
                let s = self.shared.lock();
                if matches!(&*s, Stage::Running) {
                    let _ = self.shared.changed.wait_timeout(s, SIGNAL_CHECK);
                }
            });
            py.check_signals()?;
        }
    }

    /// Whether the copy has ended (`wait()` then returns at once).
    fn done(&self) -> bool {
        !matches!(&*self.shared.lock(), Stage::Running)
    }

    /// `await t` in asyncio: `wait()` on the loop's default executor (a
    /// thread that releases the GIL while it waits), as `Operation`.
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        crate::ops::await_wait(slf.as_any())
    }

    fn __repr__(&self) -> String {
        let s = match &*self.shared.lock() {
            Stage::Running => "running",
            Stage::Finished(..) => "done",
            Stage::Done(Ok(())) => "waited",
            Stage::Done(Err(_)) => "failed",
        };
        format!("<gpufeed.Transfer {} {s}>", self.what)
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.forked() {
            // No thread of ours in this process reads the memory.
            return;
        }
        Python::attach(|py| {
            if matches!(&*self.shared.lock(), Stage::Running) {
                self.shared.cancel.store(true, Ordering::SeqCst);
                // Until the thread has let go of the host memory, GIL
                // released: it stops between ranges (`in_ranges`: the first
                // up to 1 GiB, the later ones about SIGNAL_CHECK long at the
                // rate measured), so within one range's copy.
                py.detach(|| {
                    let mut s = self.shared.lock();
                    while matches!(&*s, Stage::Running) {
                        s = self
                            .shared
                            .changed
                            .wait(s)
                            .unwrap_or_else(|p| p.into_inner());
                    }
                });
            }
            let _ = self.hand_back(py);
        });
    }
}

/// `to_device_async(obj, device=None)`: `to_device` on a thread of its own;
/// returns a `Transfer` whose `await` (or `wait()`) gives the new
/// `DeviceArray`. `obj` stays exported until then (its owner can't resize
/// it; don't replace its memory with `__setstate__`).
#[pyfunction]
#[pyo3(signature = (obj, device=None))]
pub fn to_device_async(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: Option<&Device>,
) -> PyResult<Transfer> {
    let device = device_or_default(py, device)?;
    engine_for(py, &device)?;
    let host = contiguous(obj, false)?;
    let dtype = dtype_of(&host, "to_device_async")?;
    let Exported { view, keep, .. } = host;
    let array = Bound::new(
        py,
        DeviceArray::alloc(py, &device, view.shape.clone(), dtype)?,
    )?;
    let result = array.clone().into_any().unbind();
    let held = HeldView {
        view,
        _keep: keep.map(Bound::unbind),
    };
    Transfer::start(py, "to_device_async()", true, array, held, result)
}

/// `to_host_async(array, out=None)`: `to_host` on a thread of its own;
/// returns a `Transfer` whose `await` (or `wait()`) gives `out` (a new
/// NumPy array when omitted). `array` is in flight (`BufferError` on any
/// use) and `out` exported until then.
#[pyfunction]
#[pyo3(signature = (array, out=None))]
pub fn to_host_async<'py>(
    py: Python<'py>,
    array: &Bound<'py, DeviceArray>,
    out: Option<&Bound<'py, PyAny>>,
) -> PyResult<Transfer> {
    let (out, view, keep) = host_out(py, array.get(), out)?;
    let held = HeldView {
        view,
        _keep: keep.map(Bound::unbind),
    };
    Transfer::start(
        py,
        "to_host_async()",
        false,
        array.clone(),
        held,
        out.unbind(),
    )
}

/// Names the statistics of a device's staging engine (its pinned ring).
#[pyfunction]
#[pyo3(signature = (device=None))]
pub fn staging_stats(py: Python<'_>, device: Option<&Device>) -> PyResult<HashMap<String, u64>> {
    let device = device_or_default(py, device)?;
    let s = py.detach(|| engine(&device)).py()?;
    let (stats, c) = (s.pool_stats(), s.config());
    Ok(HashMap::from([
        ("in_use_bytes".into(), stats.in_use_bytes),
        ("peak_in_use_bytes".into(), stats.peak_in_use_bytes),
        ("bound_bytes".into(), c.total_bytes() as u64),
        ("block_bytes".into(), c.block_bytes as u64),
        ("blocks".into(), c.blocks as u64),
        ("threads".into(), c.threads as u64),
        ("direct_h2d_below".into(), c.direct_h2d_below as u64),
        ("direct_d2h_below".into(), c.direct_d2h_below as u64),
    ]))
}
