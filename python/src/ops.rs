//! Streams and operations: copies and kernel launches from Python, each an
//! `Operation` that owns its buffers until the device is done.

use crate::alloc::{HostMem, PinnedBuffer, Typed};
use crate::device::{device_or_default, DevMem, Device, DeviceArray, State};
use crate::dtype::DType;
use crate::{convert::buffer_error, convert::to_py, convert::IntoPy};
use gpufeed::interop::{cast_device, cast_device_mut};
use gpufeed::{
    DeviceSliceMut, Error, HostSlice, HostSliceMut, Job, JobError, Kernel, PinnedHost, RunInfo,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// One buffer an operation owns.
pub enum Slot {
    Host(HostMem),
    Dev(DevMem),
}

/// The Python object a slot came from (and goes back to).
pub enum Owner {
    Host(Py<PinnedBuffer>),
    Dev(Py<DeviceArray>),
}

impl Owner {
    /// Puts `slot` back into the object (or marks it gone, with `why`).
    pub fn restore(&self, py: Python<'_>, slot: Option<Slot>, why: &str) {
        // The classes are frozen: no borrow flag to trip over, wherever this
        // runs (an operation dropped by the garbage collector inside another
        // method of the same buffer).
        match (self, slot) {
            (Owner::Host(o), Some(Slot::Host(m))) => o.bind(py).get().state.set(State::Ready(m)),
            (Owner::Dev(o), Some(Slot::Dev(m))) => o.bind(py).get().state.set(State::Ready(m)),
            (Owner::Host(o), _) => o.bind(py).get().state.set(State::Freed(why.into())),
            (Owner::Dev(o), _) => o.bind(py).get().state.set(State::Freed(why.into())),
        }
    }
}

/// Takes the memory of every owner for an operation; on failure, puts back
/// what was taken and returns the error.
pub fn take_all(py: Python<'_>, owners: &[Owner]) -> PyResult<Vec<Slot>> {
    let mut slots = Vec::with_capacity(owners.len());
    for o in owners {
        let taken = match o {
            Owner::Host(b) => b.bind(py).get().take_for_operation(py).map(Slot::Host),
            Owner::Dev(d) => d.bind(py).get().take_for_operation().map(Slot::Dev),
        };
        match taken {
            Ok(s) => slots.push(s),
            Err(e) => {
                for (o, s) in owners.iter().zip(slots) {
                    o.restore(py, Some(s), "");
                }
                return Err(e);
            }
        }
    }
    Ok(slots)
}

/// A device-array output of a pipeline run: owned by the run's job, written
/// by the stage through raw views (it has no host side to copy out).
pub type DevOut = gpufeed::KeepAlive<DevMem>;

/// The job behind an operation.
pub enum Pending {
    Batch(Job<Vec<Slot>, ()>),
    Run(Job<(Typed<f32>, Typed<f32>), RunInfo>),
    RunDev(Job<((Typed<f32>,), DevOut), RunInfo>),
}

/// What a finished operation reports besides its buffers.
pub type Info = Option<(String, usize, usize, &'static str)>;

fn info(r: &RunInfo) -> Info {
    Some((
        r.plan.to_string(),
        r.chunks,
        r.plan.streams_used(),
        r.plan.layout.name(),
    ))
}

impl Pending {
    pub fn is_done(&self) -> bool {
        match self {
            Pending::Batch(j) => j.is_done(),
            Pending::Run(j) => j.is_done(),
            Pending::RunDev(j) => j.is_done(),
        }
    }

    /// Waits up to `timeout` (the caller has released the GIL): the
    /// outcome split into the result and the slots handed back, or `None`
    /// when it isn't done yet (then it can be waited for again).
    pub fn block_for(&mut self, timeout: Duration) -> Option<Outcome> {
        fn split<B, R>(
            r: Result<(B, R), JobError<B>>,
            slots: impl Fn(B) -> Vec<Slot>,
            info: impl Fn(&R) -> Info,
        ) -> Outcome {
            match r {
                Ok((b, v)) => (Ok(info(&v)), Some(slots(b))),
                Err(JobError { error, bundle }) => (Err(error), bundle.map(slots)),
            }
        }
        use gpufeed::block_on_for;
        match self {
            Pending::Batch(j) => block_on_for(j, timeout).map(|r| split(r, |b| b, |_| None)),
            Pending::Run(j) => block_on_for(j, timeout)
                .map(|r| split(r, |(i, o)| vec![Slot::Host(i.mem), Slot::Host(o.mem)], info)),
            Pending::RunDev(j) => block_on_for(j, timeout)
                .map(|r| split(r, |((i,), o)| vec![Slot::Host(i.mem), Slot::Dev(o.0)], info)),
        }
    }
}

/// A finished operation: its result, and the slots handed back (`None`
/// when its end could not be observed).
pub type Outcome = (Result<Info, Error>, Option<Vec<Slot>>);

/// A wait a signal handler's exception stopped: the operation, still in
/// flight, and the exception.
type Interrupted = Box<(Box<Pending>, PyErr)>;

/// How long a blocking wait runs between looks at Python's signal
/// handlers: Ctrl-C interrupts a wait within about this.
pub(crate) const SIGNAL_CHECK: Duration = Duration::from_millis(50);

enum OpState {
    Pending(Box<Pending>),
    Waiting,
    Done(Result<Info, Error>),
}

/// Work in flight on the device. Owns the buffers given to it: they are
/// handed back into their Python objects by `wait()` (GIL released while
/// waiting) or `await op` (asyncio); until then every access to them raises
/// `BufferError`. Dropping an operation without waiting never frees memory
/// the device uses: its buffers are released when the device is done (pool
/// blocks return to the pool then), and their Python objects read as freed.
#[pyclass(module = "gpufeed")]
pub struct Operation {
    state: Mutex<OpState>,
    /// Signalled when a waiter has finished (state `Done`), for the other
    /// waiters.
    finished: Condvar,
    owners: Vec<Owner>,
    /// The streams the work runs on, kept while the operation lives: the
    /// drop of their Python object (a `Stream`, a `Pipeline`) is then never
    /// the last and never waits for this work.
    keep: Vec<gpufeed::Stream>,
}

/// Drops `streams` with the GIL released: dropping the last handle of a
/// stream waits for the work queued on it.
pub fn drop_streams_detached(streams: Vec<gpufeed::Stream>) {
    if !streams.is_empty() {
        Python::attach(|py| py.detach(move || drop(streams)));
    }
}

impl Operation {
    pub fn new(pending: Pending, owners: Vec<Owner>, keep: Vec<gpufeed::Stream>) -> Self {
        Operation {
            state: Mutex::new(OpState::Pending(Box::new(pending))),
            finished: Condvar::new(),
            owners,
            keep,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for `pending` (GIL released, Python's signal handlers run
    /// every [`SIGNAL_CHECK`]) and hands the buffers back. `Err(Ok(_))`:
    /// a handler raised (Ctrl-C): the operation is still in flight, handed
    /// back with the exception.
    fn finish(
        &self,
        py: Python<'_>,
        mut pending: Box<Pending>,
    ) -> Result<Result<Info, Error>, Interrupted> {
        let (result, slots) = loop {
            match py.detach(|| pending.block_for(SIGNAL_CHECK)) {
                Some(outcome) => break outcome,
                None => {
                    if let Err(e) = py.check_signals() {
                        return Err(Box::new((pending, e)));
                    }
                }
            }
        };
        let why = "leaked: the end of the device work could not be observed, so the memory was \
                   kept rather than freed under the device";
        match slots {
            Some(slots) => {
                for (o, s) in self.owners.iter().zip(slots) {
                    o.restore(py, Some(s), why);
                }
            }
            None => {
                for o in &self.owners {
                    o.restore(py, None, why);
                }
            }
        }
        Ok(result)
    }
}

fn info_to_py(py: Python<'_>, info: Info) -> PyResult<Py<PyAny>> {
    match info {
        None => Ok(py.None()),
        Some((plan, chunks, streams, layout)) => {
            let d = PyDict::new(py);
            d.set_item("plan", plan)?;
            d.set_item("chunks", chunks)?;
            d.set_item("streams", streams)?;
            d.set_item("layout", layout)?;
            Ok(d.into_any().unbind())
        }
    }
}

#[pymethods]
impl Operation {
    /// Waits until the device is done (GIL released) and hands the buffers
    /// back; returns None for a batch, a dict describing the plan for a
    /// pipeline run. Raises the operation's error (its buffers are handed
    /// back all the same whenever the device is known to be done with them).
    /// Waiting again returns (or raises) the same. A pipeline run's dict:
    /// `plan` (as asked), `chunks` (the chunks that ran: fewer than the plan's
    /// for short arrays), `streams`, `layout`.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let taken = std::mem::replace(&mut *self.lock(), OpState::Waiting);
        let result = match taken {
            OpState::Pending(p) => match self.finish(py, p) {
                Ok(r) => {
                    *self.lock() = OpState::Done(r.clone());
                    self.finished.notify_all();
                    r
                }
                // Interrupted (Ctrl-C): still pending, safe to wait for
                // again or to drop; another waiter takes over.
                Err(interrupted) => {
                    let (p, e) = *interrupted;
                    *self.lock() = OpState::Pending(p);
                    self.finished.notify_all();
                    return Err(e);
                }
            },
            OpState::Done(r) => {
                *self.lock() = OpState::Done(r.clone());
                r
            }
            // Another thread (an asyncio executor whose `await` was
            // cancelled, say) is waiting: wait for it to finish, GIL released.
            OpState::Waiting => {
                let done = loop {
                    let look = py.detach(|| {
                        let s = self.lock();
                        let s = match &*s {
                            OpState::Waiting => {
                                self.finished
                                    .wait_timeout(s, SIGNAL_CHECK)
                                    .unwrap_or_else(|p| p.into_inner())
                                    .0
                            }
                            _ => s,
                        };
                        match &*s {
                            OpState::Done(r) => Some(Some(r.clone())),
                            // The other waiter was interrupted: wait ourselves.
                            OpState::Pending(_) => Some(None),
                            OpState::Waiting => None,
                        }
                    });
                    match look {
                        Some(done) => break done,
                        None => py.check_signals()?,
                    }
                };
                match done {
                    Some(r) => r,
                    None => return self.wait(py),
                }
            }
        };
        info_to_py(py, result.map_err(to_py)?)
    }

    /// Whether the device work has finished (`wait()` then returns at once).
    fn done(&self) -> bool {
        match &*self.lock() {
            OpState::Pending(p) => p.is_done(),
            OpState::Waiting => false,
            OpState::Done(_) => true,
        }
    }

    /// `await op` in asyncio: `wait()` on the loop's default executor (a
    /// thread that releases the GIL while it waits).
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        await_wait(slf.as_any())
    }

    fn __repr__(&self) -> String {
        let s = match &*self.lock() {
            OpState::Pending(p) if p.is_done() => "done",
            OpState::Pending(_) | OpState::Waiting => "pending",
            OpState::Done(Ok(_)) => "waited",
            OpState::Done(Err(_)) => "failed",
        };
        format!("<gpufeed.Operation {s} ({} buffers)>", self.owners.len())
    }
}

impl Drop for Operation {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|p| p.into_inner()),
            OpState::Waiting,
        );
        if let OpState::Pending(p) = state {
            Python::attach(|py| {
                if p.is_done() {
                    // Nothing to wait for: hand the buffers back (a
                    // signal handler's exception can't be raised here: the
                    // operation then goes as an unfinished one does).
                    if let Err(interrupted) = self.finish(py, p) {
                        drop(interrupted);
                        for o in &self.owners {
                            o.restore(py, None, "released with its Operation");
                        }
                    }
                } else {
                    // The job's own drop defers the release to the completion.
                    drop(p);
                    for o in &self.owners {
                        o.restore(
                            py,
                            None,
                            "released when the device finished: its Operation was dropped \
                             before wait()",
                        );
                    }
                }
            });
        }
        drop_streams_detached(std::mem::take(&mut self.keep));
    }
}

/// One command of a batch, over slot indices.
#[derive(Clone, Copy, Debug)]
enum Cmd {
    H2D {
        src: usize,
        dst: usize,
    },
    D2H {
        src: usize,
        dst: usize,
    },
    D2D {
        src: usize,
        dst: usize,
    },
    Scale {
        x: usize,
        s: f32,
    },
    Intensity {
        x: usize,
        k: u32,
    },
    Saxpy {
        a: f32,
        x: usize,
        y: usize,
    },
    /// The example user kernel crate's `scale_bf16` (bf16 both ways).
    ScaleBf16 {
        x: usize,
        y: usize,
        s: f32,
    },
    /// Its `scale_bf16_f32` (bf16 in, f32 out).
    ScaleBf16F32 {
        x: usize,
        y: usize,
        s: f32,
    },
}

/// The kernels of a user's kernel crate (`examples/bf16-kernels`, built to
/// PTX by this crate's build.rs with kernel-builder), loaded once per stream:
/// how an extension launches a kernel crate of its own, typed.
#[derive(Clone)]
pub struct UserKernels {
    scale_bf16: gpufeed::Function<bf16_kernels::scale_bf16>,
    scale_bf16_f32: gpufeed::Function<bf16_kernels::scale_bf16_f32>,
}

/// The example kernel crate's PTX.
const USER_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/bf16_kernels.ptx"));

impl UserKernels {
    fn load(device: &gpufeed::Device) -> gpufeed::Result<UserKernels> {
        // SAFETY: USER_PTX is bf16-kernels' PTX, built by this crate's
        // build.rs (kernel-builder) from the crate that declares the kernels
        // taken below.
        let m = unsafe { gpufeed::Module::from_ptx(device, USER_PTX)? };
        Ok(UserKernels {
            scale_bf16: m.function()?,
            scale_bf16_f32: m.function()?,
        })
    }
}

/// The buffers of a batch being parsed: one slot per distinct object.
#[derive(Default)]
struct Batch {
    owners: Vec<Owner>,
    ids: Vec<usize>,
    /// Per slot: (dtype, bytes, is device, written).
    meta: Vec<(DType, usize, bool, bool)>,
    /// Per slot: read by a command (a copy's source).
    read: Vec<bool>,
}

impl Batch {
    fn slot(&mut self, obj: &Bound<'_, PyAny>, want_device: bool, writes: bool) -> PyResult<usize> {
        let id = obj.as_ptr() as usize;
        if let Some(i) = self.ids.iter().position(|&x| x == id) {
            if self.meta[i].2 != want_device {
                return Err(PyTypeError::new_err(
                    "a buffer used as host and device memory",
                ));
            }
            if !want_device && writes && self.meta[i].3 {
                return Err(PyValueError::new_err(
                    "a pinned buffer can be the destination of one copy per batch",
                ));
            }
            // Checked here, before anything is submitted: a batch's host
            // memory is either read by its commands or written by one.
            if !want_device && (writes && self.read[i] || !writes && self.meta[i].3) {
                return Err(PyValueError::new_err(
                    "a pinned buffer can't be both a copy's source and a copy's destination in \
                     one batch: submit the two as separate operations",
                ));
            }
            self.meta[i].3 |= writes;
            self.read[i] |= !writes;
            return Ok(i);
        }
        let (owner, meta) = if want_device {
            let d = obj.cast::<DeviceArray>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "expected a gpufeed.DeviceArray, got {}",
                    type_name(obj)
                ))
            })?;
            let b = d.get();
            (
                Owner::Dev(d.clone().unbind()),
                (b.dtype, b.nbytes, true, writes),
            )
        } else {
            let h = obj.cast::<PinnedBuffer>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "expected a gpufeed.PinnedBuffer (pinned host memory: PinnedAllocator.alloc \
                     or gpufeed.pin), got {}",
                    type_name(obj)
                ))
            })?;
            let b = h.get();
            (
                Owner::Host(h.clone().unbind()),
                (b.dtype, b.nbytes, false, writes),
            )
        };
        self.owners.push(owner);
        self.ids.push(id);
        self.meta.push(meta);
        self.read.push(!writes);
        Ok(self.ids.len() - 1)
    }

    fn same_type(&self, a: usize, b: usize, what: &str) -> PyResult<()> {
        let (da, ba, ..) = self.meta[a];
        let (db, bb, ..) = self.meta[b];
        if da != db {
            return Err(PyTypeError::new_err(format!(
                "{what}: {} and {} differ",
                da.name(),
                db.name()
            )));
        }
        if ba != bb {
            // Same dtype (checked above): the byte counts are whole elements.
            let size = da.size().max(1);
            return Err(to_py(Error::LengthMismatch {
                what: "copy (destination vs source)",
                expected: ba / size,
                got: bb / size,
            }));
        }
        Ok(())
    }

    fn float32(&self, i: usize, what: &str) -> PyResult<()> {
        if self.meta[i].0 != DType::F32 {
            return Err(PyTypeError::new_err(format!(
                "{what} runs on float32 device arrays, not {}",
                self.meta[i].0.name()
            )));
        }
        Ok(())
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn parse_command(b: &mut Batch, cmd: &Bound<'_, PyAny>) -> PyResult<Cmd> {
    let t = cmd.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(
            "a command is a tuple: (\"h2d\", src, dst), (\"d2h\", src, dst), (\"d2d\", src, dst), \
             (\"scale\", x, s), (\"intensity\", x, k), (\"saxpy\", a, x, y)",
        )
    })?;
    let name: String = t.get_item(0)?.extract()?;
    let arity = |n: usize| -> PyResult<()> {
        if t.len() != n + 1 {
            return Err(PyTypeError::new_err(format!(
                "command {name:?} takes {n} arguments, got {}",
                t.len() - 1
            )));
        }
        Ok(())
    };
    Ok(match name.as_str() {
        "h2d" | "copy_h2d" => {
            arity(2)?;
            let src = b.slot(&t.get_item(1)?, false, false)?;
            let dst = b.slot(&t.get_item(2)?, true, true)?;
            b.same_type(src, dst, "copy_h2d")?;
            Cmd::H2D { src, dst }
        }
        "d2h" | "copy_d2h" => {
            arity(2)?;
            let src = b.slot(&t.get_item(1)?, true, false)?;
            let dst = b.slot(&t.get_item(2)?, false, true)?;
            b.same_type(src, dst, "copy_d2h")?;
            Cmd::D2H { src, dst }
        }
        "d2d" | "copy_d2d" => {
            arity(2)?;
            let src = b.slot(&t.get_item(1)?, true, false)?;
            let dst = b.slot(&t.get_item(2)?, true, true)?;
            if src == dst {
                return Err(to_py(Error::Overlap {
                    what: "copy_d2d (source and destination)",
                }));
            }
            b.same_type(src, dst, "copy_d2d")?;
            Cmd::D2D { src, dst }
        }
        "scale" => {
            arity(2)?;
            let x = b.slot(&t.get_item(1)?, true, true)?;
            b.float32(x, "scale")?;
            Cmd::Scale {
                x,
                s: t.get_item(2)?.extract()?,
            }
        }
        "intensity" => {
            arity(2)?;
            let x = b.slot(&t.get_item(1)?, true, true)?;
            b.float32(x, "intensity")?;
            Cmd::Intensity {
                x,
                k: t.get_item(2)?
                    .extract::<crate::convert::Count>()?
                    .u32("intensity: k")?,
            }
        }
        "saxpy" => {
            arity(3)?;
            let a: f32 = t.get_item(1)?.extract()?;
            let x = b.slot(&t.get_item(2)?, true, false)?;
            let y = b.slot(&t.get_item(3)?, true, true)?;
            b.float32(x, "saxpy")?;
            b.float32(y, "saxpy")?;
            Cmd::Saxpy { a, x, y }
        }
        "scale_bf16" | "scale_bf16_f32" => {
            arity(3)?;
            let x = b.slot(&t.get_item(1)?, true, false)?;
            let y = b.slot(&t.get_item(2)?, true, true)?;
            let s: f32 = t.get_item(3)?.extract()?;
            let out = if name == "scale_bf16" {
                DType::BF16
            } else {
                DType::F32
            };
            let ((dx, bx, ..), (dy, by, ..)) = (b.meta[x], b.meta[y]);
            if dx != DType::BF16 || dy != out {
                return Err(PyTypeError::new_err(format!(
                    "{name} takes a bfloat16 device array and a {} one, not {} and {}",
                    out.name(),
                    dx.name(),
                    dy.name()
                )));
            }
            if bx / 2 != by / out.size() {
                return Err(to_py(Error::LengthMismatch {
                    what: "user kernel (y vs x, elements)",
                    expected: bx / 2,
                    got: by / out.size(),
                }));
            }
            if name == "scale_bf16" {
                Cmd::ScaleBf16 { x, y, s }
            } else {
                Cmd::ScaleBf16F32 { x, y, s }
            }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown command {other:?}: h2d, d2h, d2d, scale, intensity, saxpy, \
                 scale_bf16, scale_bf16_f32"
            )))
        }
    })
}

/// Per slot, the views a batch takes (each borrowed from the bundle for the
/// whole batch).
enum Views<'a> {
    HostRead(HostSlice<'a, u8>),
    HostWrite(Option<HostSliceMut<'a, u8>>),
    Dev(DeviceSliceMut<'a, u8>),
}

/// Each slot's views for a batch: read-only host, writable host (taken by
/// the one command that writes it) or device.
fn views_of<'a>(bundle: &'a mut [Slot], writes: &[bool]) -> Vec<Views<'a>> {
    bundle
        .iter_mut()
        .zip(writes)
        .map(|(s, &w)| match s {
            Slot::Host(h) => {
                if w {
                    Views::HostWrite(Some(h.host_mut()))
                } else {
                    let h: &'a HostMem = h;
                    Views::HostRead(h.host())
                }
            }
            Slot::Dev(d) => Views::Dev(d.view_mut()),
        })
        .collect()
}

fn inconsistent() -> Error {
    Error::Internal("a batch's buffer roles are inconsistent".into())
}

fn dev_view<'a>(views: &[Views<'a>], i: usize) -> gpufeed::Result<DeviceSliceMut<'a, u8>> {
    match views.get(i) {
        Some(Views::Dev(d)) => Ok(*d),
        _ => Err(inconsistent()),
    }
}

fn host_read<'a>(views: &[Views<'a>], i: usize) -> gpufeed::Result<HostSlice<'a, u8>> {
    match views.get(i) {
        Some(Views::HostRead(s)) => Ok(*s),
        _ => Err(inconsistent()),
    }
}

fn host_write<'a>(views: &mut [Views<'a>], i: usize) -> gpufeed::Result<HostSliceMut<'a, u8>> {
    match views.get_mut(i) {
        Some(Views::HostWrite(h)) => h.take().ok_or_else(inconsistent),
        _ => Err(inconsistent()),
    }
}

fn enqueue<'a>(
    c: &mut gpufeed::Commands<'a>,
    bundle: &'a mut [Slot],
    writes: &[bool],
    cmds: &[Cmd],
    user: Option<&UserKernels>,
) -> gpufeed::Result<()> {
    let mut views = views_of(bundle, writes);
    for cmd in cmds {
        match *cmd {
            Cmd::H2D { src, dst } => c.copy_h2d(host_read(&views, src)?, dev_view(&views, dst)?)?,
            Cmd::D2H { src, dst } => {
                let d = dev_view(&views, src)?;
                c.copy_d2h(d, host_write(&mut views, dst)?)?;
            }
            Cmd::D2D { src, dst } => c.copy_d2d(dev_view(&views, src)?, dev_view(&views, dst)?)?,
            Cmd::Scale { x, s } => {
                c.kernel(Kernel::Scale { s }, cast_device_mut(dev_view(&views, x)?)?)?
            }
            Cmd::Intensity { x, k } => c.kernel(
                Kernel::Intensity { k },
                cast_device_mut(dev_view(&views, x)?)?,
            )?,
            Cmd::Saxpy { a, x, y } => {
                let xv = cast_device::<f32>(dev_view(&views, x)?.as_view())?;
                c.saxpy(a, xv, cast_device_mut(dev_view(&views, y)?)?)?
            }
            Cmd::ScaleBf16 { x, y, s } => {
                let k = user.ok_or_else(inconsistent)?;
                let xv = cast_device::<half::bf16>(dev_view(&views, x)?.as_view())?;
                let yv = cast_device_mut::<half::bf16>(dev_view(&views, y)?)?;
                let cfg = gpufeed::LaunchConfig::grid_stride(c.device(), xv.len());
                c.launch(&k.scale_bf16, cfg, (s, xv, yv))?
            }
            Cmd::ScaleBf16F32 { x, y, s } => {
                let k = user.ok_or_else(inconsistent)?;
                let xv = cast_device::<half::bf16>(dev_view(&views, x)?.as_view())?;
                let yv = cast_device_mut::<f32>(dev_view(&views, y)?)?;
                let cfg = gpufeed::LaunchConfig::grid_stride(c.device(), xv.len());
                c.launch(&k.scale_bf16_f32, cfg, (s, xv, yv))?
            }
        }
    }
    Ok(())
}

/// The copies of a batch as one `copy_batch` (a buffer is one slot: one
/// destination at most, which is then no copy's source).
fn enqueue_batch<'a>(
    c: &mut gpufeed::Commands<'a>,
    bundle: &'a mut [Slot],
    writes: &[bool],
    cmds: &[Cmd],
) -> gpufeed::Result<()> {
    let overlap = || Error::Overlap {
        what: "copy_batch (a buffer written by one copy and used by another)",
    };
    let mut uses = vec![0usize; bundle.len()];
    for cmd in cmds {
        if let Cmd::H2D { src, dst } | Cmd::D2H { src, dst } | Cmd::D2D { src, dst } = *cmd {
            uses[src] += 1;
            uses[dst] += 1;
        }
    }
    if writes.iter().zip(&uses).any(|(&w, &n)| w && n > 1) {
        return Err(overlap());
    }
    let mut views = views_of(bundle, writes);
    let mut transfers = Vec::with_capacity(cmds.len());
    for cmd in cmds {
        transfers.push(match *cmd {
            Cmd::H2D { src, dst } => {
                gpufeed::Transfer::h2d(host_read(&views, src)?, dev_view(&views, dst)?)
            }
            Cmd::D2H { src, dst } => {
                let d = dev_view(&views, src)?;
                gpufeed::Transfer::d2h(d, host_write(&mut views, dst)?)
            }
            Cmd::D2D { src, dst } => {
                gpufeed::Transfer::d2d(dev_view(&views, src)?, dev_view(&views, dst)?)
            }
            _ => return Err(inconsistent()),
        });
    }
    c.copy_batch(transfers)
}

/// An in-order queue of device work (a CUDA stream, or a CPU worker).
#[pyclass(module = "gpufeed", frozen)]
pub struct Stream {
    /// Dropped with the GIL released (see `Drop`).
    pub(crate) inner: std::mem::ManuallyDrop<gpufeed::Stream>,
    /// The user kernel crate's kernels, loaded at first use.
    user: std::sync::OnceLock<UserKernels>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `inner` is not used after.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        drop_streams_detached(vec![inner]);
    }
}

impl Stream {
    fn user_kernels(&self) -> PyResult<UserKernels> {
        if let Some(k) = self.user.get() {
            return Ok(k.clone());
        }
        let k = UserKernels::load(self.inner.device()).py()?;
        Ok(self.user.get_or_init(|| k).clone())
    }

    /// One command as its own operation.
    fn submit_one<'py>(
        &self,
        py: Python<'py>,
        cmd: impl IntoPyObject<'py, Target = PyTuple, Output = Bound<'py, PyTuple>>,
    ) -> PyResult<Operation> {
        let cmd = cmd.into_pyobject(py).map_err(Into::into)?;
        self.submit_cmds(py, &PyTuple::new(py, [cmd])?, false)
    }

    /// `batched`: the commands are copies, enqueued as one
    /// [`gpufeed::Commands::copy_batch`].
    fn submit_cmds(
        &self,
        py: Python<'_>,
        commands: &Bound<'_, PyTuple>,
        batched: bool,
    ) -> PyResult<Operation> {
        let mut b = Batch::default();
        let cmds = commands
            .iter()
            .map(|c| parse_command(&mut b, &c))
            .collect::<PyResult<Vec<_>>>()?;
        let writes: Vec<bool> = b.meta.iter().map(|m| m.3).collect();
        let user = if cmds
            .iter()
            .any(|c| matches!(c, Cmd::ScaleBf16 { .. } | Cmd::ScaleBf16F32 { .. }))
        {
            Some(self.user_kernels()?)
        } else {
            None
        };
        let mut bundle = take_all(py, &b.owners)?;
        // Host buffers read only: a pinned-in-place memory can be both; the
        // slots were typed when parsed.
        let _ = &mut bundle;
        let stream = (*self.inner).clone();
        let job = py.detach(move || {
            stream.run(bundle, move |c, bundle| {
                if batched {
                    enqueue_batch(c, bundle, &writes, &cmds)
                } else {
                    enqueue(c, bundle, &writes, &cmds, user.as_ref())
                }
            })
        });
        Ok(Operation::new(
            Pending::Batch(job),
            b.owners,
            vec![(*self.inner).clone()],
        ))
    }
}

#[pymethods]
impl Stream {
    /// `Stream(device=None)`: a new non-blocking stream.
    #[new]
    #[pyo3(signature = (device=None))]
    fn new(py: Python<'_>, device: Option<&Device>) -> PyResult<Self> {
        let device = device_or_default(py, device)?;
        Ok(Stream {
            inner: std::mem::ManuallyDrop::new(gpufeed::Stream::new(&device).py()?),
            user: std::sync::OnceLock::new(),
        })
    }

    /// Enqueues a batch of commands, in order, as one operation owning every
    /// buffer they name: `("h2d", pinned, dev)`, `("d2h", dev, pinned)`,
    /// `("d2d", src, dst)`, `("scale", dev, s)`, `("intensity", dev, k)`,
    /// `("saxpy", a, x, y)` (kernels: float32 device arrays; `saxpy` is a
    /// fused multiply-add, see `Stream.saxpy`).
    #[pyo3(signature = (*commands))]
    fn submit(&self, py: Python<'_>, commands: &Bound<'_, PyTuple>) -> PyResult<Operation> {
        self.submit_cmds(py, commands, false)
    }

    /// Many copies as one operation and one driver call
    /// (`cuMemcpyBatchAsync`): `pairs` is a sequence of `(src, dst)`, each
    /// pinned -> device, device -> pinned or device -> device (same dtype
    /// and size). The copies run in no particular order among themselves,
    /// so a buffer may be the destination of one copy only, and not also a
    /// source (`OverlapError`). For many small tensors this is several
    /// times faster than one copy each (the copy engines' cost per
    /// operation is paid once).
    fn copy_batch(&self, py: Python<'_>, pairs: &Bound<'_, PyAny>) -> PyResult<Operation> {
        let mut cmds = Vec::new();
        for pair in pairs.try_iter()? {
            let pair = pair?;
            let t = pair.cast::<PyTuple>().map_err(|_| {
                PyTypeError::new_err("copy_batch takes a sequence of (src, dst) tuples")
            })?;
            if t.len() != 2 {
                return Err(PyTypeError::new_err(
                    "copy_batch takes a sequence of (src, dst) tuples",
                ));
            }
            let (src, dst) = (t.get_item(0)?, t.get_item(1)?);
            let kind = match (device_array(&src).is_some(), device_array(&dst).is_some()) {
                (false, true) => "h2d",
                (true, false) => "d2h",
                (true, true) => "d2d",
                (false, false) => return Err(PyTypeError::new_err(
                    "copy_batch: a copy between two host buffers (one side must be a device array)",
                )),
            };
            cmds.push(PyTuple::new(
                py,
                [kind.into_pyobject(py)?.into_any(), src, dst],
            )?);
        }
        self.submit_cmds(py, &PyTuple::new(py, cmds)?, true)
    }

    /// Async copy of a pinned buffer to a device array (same dtype and size).
    fn copy_h2d(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("h2d", src, dst))
    }

    /// Async copy of a device array into a pinned buffer.
    fn copy_d2h(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("d2h", src, dst))
    }

    /// Async copy between two device arrays.
    fn copy_d2d(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("d2d", src, dst))
    }

    /// `x *= s` on a float32 device array (the in-tree `scale` kernel).
    fn scale(&self, py: Python<'_>, x: &Bound<'_, PyAny>, s: f32) -> PyResult<Operation> {
        self.submit_one(py, ("scale", x, s))
    }

    /// `y = bfloat16(float32(x) * s)`, rounded to nearest even: a kernel of
    /// a user's kernel crate (`examples/bf16-kernels`), bfloat16 device
    /// arrays of one length (`y` may not be `x`).
    fn scale_bf16(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        y: &Bound<'_, PyAny>,
        s: f32,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("scale_bf16", x, y, s))
    }

    /// `y = float32(x) * s`: bfloat16 in, float32 out (the same user kernel
    /// crate).
    fn scale_bf16_f32(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        y: &Bound<'_, PyAny>,
        s: f32,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("scale_bf16_f32", x, y, s))
    }

    /// `k` dependent FMAs per element of a float32 device array (`intensity`).
    fn intensity(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        k: crate::convert::Count,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("intensity", x, k.u32("intensity: k")?))
    }

    /// `y = a * x + y` on float32 device arrays (`saxpy`; `x` may be `y`), as
    /// a fused multiply-add: `a * x + y` computed exactly and rounded once
    /// (`fma.rn.f32` on the GPU, bit-identical on the CPU emulation). NumPy's
    /// `a * x + y` rounds twice and differs in the last bit for many
    /// elements. Kernels of your own: `kernel_abi::fma`.
    fn saxpy(
        &self,
        py: Python<'_>,
        a: f32,
        x: &Bound<'_, PyAny>,
        y: &Bound<'_, PyAny>,
    ) -> PyResult<Operation> {
        self.submit_one(py, ("saxpy", a, x, y))
    }

    /// Waits (GIL released) for all work queued on the stream. Ctrl-C
    /// (any exception a signal handler raises) interrupts the wait, not the
    /// work.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let end = self.inner.record().py()?;
        let mut done = end.wait();
        loop {
            match py.detach(|| gpufeed::block_on_for(&mut done, SIGNAL_CHECK)) {
                Some(r) => return r.py(),
                None => py.check_signals()?,
            }
        }
    }

    /// The stream's device.
    #[getter]
    fn device(&self) -> Device {
        Device {
            inner: self.inner.device().clone(),
        }
    }
}

/// Makes a foreign CUDA stream wait, on the GPU, for everything queued so
/// far on `stream` (an event recorded on ours, waited for on theirs; the
/// host does not wait). CUDA only.
///
/// `foreign` is a stream object or a raw handle:
/// - an object with `__cuda_stream__` (the CUDA stream protocol: returns
///   `(version, handle)`), as CuPy's and recent PyTorch's streams have;
/// - an object with a `cuda_stream` attribute (`torch.cuda.Stream`, e.g.
///   `torch.cuda.current_stream()`);
/// - an int handle (`torch.cuda.current_stream().cuda_stream`,
///   `cupy.cuda.get_current_stream().ptr`).
///
/// Handle 0 is the legacy default stream (what PyTorch and CuPy report for
/// their default stream), 1 the legacy default stream by name
/// (`CU_STREAM_LEGACY`), 2 the per-thread default stream.
#[pyfunction]
pub fn foreign_stream_wait(stream: &Stream, foreign: &Bound<'_, PyAny>) -> PyResult<()> {
    let handle = foreign_stream_handle(foreign)?;
    // SAFETY: the handle is documented to be a live stream of the device's
    // primary context (what PyTorch and CuPy hand out) or a default-stream
    // handle; a dead one is the caller's bug, as in those libraries' own
    // stream APIs.
    unsafe { gpufeed::interop::foreign_stream_wait(&stream.inner, handle) }.py()
}

/// The raw `CUstream` handle of a stream object or int (see
/// [`foreign_stream_wait`]).
pub fn foreign_stream_handle(foreign: &Bound<'_, PyAny>) -> PyResult<u64> {
    let handle = if foreign.hasattr("__cuda_stream__")? {
        let pair = foreign.call_method0("__cuda_stream__")?;
        let (_version, handle): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
            pair.extract().map_err(|_| {
                PyTypeError::new_err("__cuda_stream__() must return a (version, handle) pair")
            })?;
        handle
    } else if foreign.hasattr("cuda_stream")? {
        foreign.getattr("cuda_stream")?
    } else if foreign.is_instance_of::<pyo3::types::PyInt>() {
        foreign.clone()
    } else {
        return Err(PyTypeError::new_err(format!(
            "a foreign stream is an object with __cuda_stream__ or .cuda_stream (a torch or CuPy \
             stream) or an int handle, not {}",
            type_name(foreign)
        )));
    };
    let handle: i128 = handle
        .extract()
        .map_err(|_| PyTypeError::new_err("a stream handle must be an int"))?;
    u64::try_from(handle)
        .map_err(|_| PyValueError::new_err(format!("{handle} is not a stream handle")))
}

/// Device-check helper for the pipeline: `Err` if `b` isn't a `PinnedBuffer`.
pub fn pinned<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PinnedBuffer>> {
    obj.cast::<PinnedBuffer>().cloned().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a gpufeed.PinnedBuffer, got {}",
            type_name(obj)
        ))
    })
}

/// The device arrays of a pipeline output, or `None` for a pinned buffer.
pub fn device_array<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, DeviceArray>> {
    obj.cast::<DeviceArray>().ok().cloned()
}

/// `BufferError` for a buffer given twice.
pub fn distinct(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<()> {
    if a.is(b) {
        return Err(buffer_error("input and output must be different buffers"));
    }
    Ok(())
}

/// Default device, re-exported for the pipeline.
pub fn default_dev(py: Python<'_>, device: Option<&Device>) -> PyResult<gpufeed::Device> {
    device_or_default(py, device)
}

/// `obj.__await__()` for an object with a blocking `wait()` that releases
/// the GIL (`Operation`, `Transfer`): `wait()` run on the asyncio loop's
/// default executor.
pub(crate) fn await_wait<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let fut = event_loop.call_method1("run_in_executor", (py.None(), obj.getattr("wait")?))?;
    fut.call_method0("__await__")
}
