//! The overlap pipeline from Python, and the seed's `compare_sync_async`.

use crate::alloc::{PinnedBuffer, Typed};
use crate::convert::IntoPy;
use crate::device::{device_or_default, Device, DeviceArray};
use crate::dtype::DType;
use crate::ops::{distinct, take_all, Operation, Owner, Pending, Slot};
use gpufeed::{Kernel, Plan};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::time::Instant;

/// A kernel from its name and argument.
fn kernel(name: &str, arg: Option<f64>) -> PyResult<Kernel> {
    Ok(match name {
        "scale" => Kernel::Scale {
            s: arg.unwrap_or(2.0) as f32,
        },
        "intensity" => {
            let k = arg.unwrap_or(64.0);
            if !(0.0..=u32::MAX as f64).contains(&k) || k.fract() != 0.0 {
                return Err(PyValueError::new_err(format!(
                    "intensity takes a whole number of FMAs, not {k}"
                )));
            }
            Kernel::Intensity { k: k as u32 }
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown kernel {other:?}: \"scale\" (arg: the factor) or \"intensity\" (arg: FMAs per element)"
            )))
        }
    })
}

/// A plan: None or "auto" (`Plan::auto`), an int (that many chunks round-robin
/// over the pipeline's streams), `("uniform", chunks, streams)`,
/// `("engines", chunks, slots)`.
fn plan(p: Option<&Bound<'_, PyAny>>, n: usize, streams: usize) -> PyResult<Plan> {
    let Some(p) = p.filter(|p| !p.is_none()) else {
        return Ok(Plan::auto_for(n, streams));
    };
    if let Ok(s) = p.extract::<String>() {
        if s == "auto" {
            return Ok(Plan::auto_for(n, streams));
        }
        return Err(PyValueError::new_err(format!("unknown plan {s:?}")));
    }
    if let Ok(chunks) = p.extract::<usize>() {
        return Ok(Plan::uniform(chunks, streams));
    }
    if let Ok((layout, chunks, k)) = p.extract::<(String, usize, usize)>() {
        return match layout.as_str() {
            "uniform" | "round-robin" => Ok(Plan::uniform(chunks, k)),
            "engines" => Ok(Plan::engines(chunks, k)),
            other => Err(PyValueError::new_err(format!(
                "unknown layout {other:?}: uniform or engines"
            ))),
        };
    }
    Err(PyTypeError::new_err(
        "plan is None, \"auto\", an int (chunks), (\"uniform\", chunks, streams) or (\"engines\", chunks, slots)",
    ))
}

/// Chunked H2D → kernel → D2H over several streams, so the copy engines and
/// the SMs work at once. Reusable; runs may be started back to back.
#[pyclass(module = "gpufeed", frozen)]
pub struct Pipeline {
    /// Dropped with the GIL released (see `Drop`).
    inner: std::mem::ManuallyDrop<gpufeed::Pipeline>,
    device: gpufeed::Device,
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // SAFETY: taken once, here; `inner` is not used after.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        // Its streams' last handles may wait for queued work: not with the
        // GIL held.
        Python::attach(|py| py.detach(move || drop(inner)));
    }
}

#[pymethods]
impl Pipeline {
    /// `Pipeline(device=None, streams=4)`: 1 to 64 streams (`InvalidArgumentError`
    /// beyond).
    #[new]
    #[pyo3(
        signature = (device=None, streams=crate::convert::Count(4)),
        text_signature = "(device=None, streams=4)"
    )]
    fn new(
        py: Python<'_>,
        device: Option<&Device>,
        streams: crate::convert::Count,
    ) -> PyResult<Self> {
        let streams = streams.0 as usize;
        let device = device_or_default(py, device)?;
        let inner = py
            .detach(|| gpufeed::Pipeline::new(&device, streams))
            .py()?;
        Ok(Pipeline {
            inner: std::mem::ManuallyDrop::new(inner),
            device,
        })
    }

    /// Starts a run: `input` (a float32 PinnedBuffer) is pushed through
    /// H2D → `kernel` → D2H into `output` (a float32 PinnedBuffer of the same
    /// size, or a float32 DeviceArray — ours or a PyTorch/CuPy CUDA tensor
    /// wrapped by `as_device_array` — written in place on the device).
    /// Returns an Operation owning both until waited for.
    #[pyo3(signature = (input, output, kernel="scale", arg=None, plan=None))]
    fn run_async(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        kernel: &str,
        arg: Option<f64>,
        plan: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Operation> {
        let k = self::kernel(kernel, arg)?;
        distinct(input, output)?;
        let inp = crate::ops::pinned(input, "the input")?;
        let n = {
            let b = inp.get();
            if gpufeed::interop::device_id(&b.device) != gpufeed::interop::device_id(&self.device) {
                return Err(crate::convert::to_py(gpufeed::Error::InvalidArgument(
                    "the input array is on another device than the pipeline".into(),
                )));
            }
            if b.dtype != DType::F32 {
                return Err(PyTypeError::new_err(format!(
                    "the pipeline's kernels run on float32, the input is {}",
                    b.dtype.name()
                )));
            }
            b.len()
        };
        let plan = self::plan(plan, n, self.inner.streams().len())?;
        if let Ok(out) = output.cast::<DeviceArray>() {
            return self.run_to_device(py, &inp, out, k, plan, n);
        }
        let out = crate::ops::pinned(output, "the output")?;
        {
            let b = out.get();
            if gpufeed::interop::device_id(&b.device) != gpufeed::interop::device_id(&self.device) {
                return Err(crate::convert::to_py(gpufeed::Error::InvalidArgument(
                    "the output array is on another device than the pipeline".into(),
                )));
            }
            if b.dtype != DType::F32 {
                return Err(PyTypeError::new_err(format!(
                    "the output must be float32, not {}",
                    b.dtype.name()
                )));
            }
        }
        let owners = vec![Owner::Host(inp.unbind()), Owner::Host(out.unbind())];
        let mut slots = take_all(py, &owners)?.into_iter();
        let (Some(Slot::Host(i)), Some(Slot::Host(o))) = (slots.next(), slots.next()) else {
            return Err(crate::convert::InternalError::new_err("pipeline slots"));
        };
        let (i, o) = match (Typed::<f32>::new(i), Typed::<f32>::new(o)) {
            (Ok(i), Ok(o)) => (i, o),
            (i, o) => {
                let back = |r: Result<Typed<f32>, (gpufeed::Error, crate::alloc::HostMem)>| match r
                {
                    Ok(t) => (None, t.mem),
                    Err((e, m)) => (Some(e), m),
                };
                let ((e1, i), (e2, o)) = (back(i), back(o));
                owners[0].restore(py, Some(Slot::Host(i)), "");
                owners[1].restore(py, Some(Slot::Host(o)), "");
                let e = e1
                    .or(e2)
                    .unwrap_or_else(|| gpufeed::Error::Internal("cast".into()));
                return Err(crate::convert::to_py(e));
            }
        };
        let job = py.detach(|| self.inner.run(i, o, k, plan, gpufeed::Timeline::Off));
        Ok(Operation::new(
            Pending::Run(job),
            owners,
            self.inner.streams().to_vec(),
        ))
    }

    /// `run_async(...).wait()`: the run with the GIL released throughout;
    /// returns a dict describing the plan used.
    #[pyo3(signature = (input, output, kernel="scale", arg=None, plan=None))]
    fn run(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        output: &Bound<'_, PyAny>,
        kernel: &str,
        arg: Option<f64>,
        plan: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let op = self.run_async(py, input, output, kernel, arg, plan)?;
        let op = Bound::new(py, op)?;
        op.call_method0("wait").map(|r| r.unbind())
    }

    /// The number of streams.
    #[getter]
    fn streams(&self) -> usize {
        self.inner.streams().len()
    }

    /// The pipeline's device.
    #[getter]
    fn device(&self) -> Device {
        Device {
            inner: self.device.clone(),
        }
    }
}

impl Pipeline {
    fn run_to_device(
        &self,
        py: Python<'_>,
        inp: &Bound<'_, PinnedBuffer>,
        out: &Bound<'_, DeviceArray>,
        k: Kernel,
        plan: Plan,
        n: usize,
    ) -> PyResult<Operation> {
        {
            let b = out.get();
            if gpufeed::interop::device_id(&b.device) != gpufeed::interop::device_id(&self.device) {
                return Err(crate::convert::to_py(gpufeed::Error::InvalidArgument(
                    "the output device array is on another device than the pipeline".into(),
                )));
            }
            if b.dtype != DType::F32 {
                return Err(PyTypeError::new_err(format!(
                    "the output must be float32, not {}",
                    b.dtype.name()
                )));
            }
            let m: usize = b.shape.iter().product();
            if m != n {
                return Err(crate::convert::to_py(gpufeed::Error::LengthMismatch {
                    what: "pipeline (output vs input)",
                    expected: n,
                    got: m,
                }));
            }
        }
        let owners = vec![
            Owner::Host(inp.clone().unbind()),
            Owner::Dev(out.clone().unbind()),
        ];
        let mut slots = take_all(py, &owners)?.into_iter();
        let (Some(Slot::Host(i)), Some(Slot::Dev(o))) = (slots.next(), slots.next()) else {
            return Err(crate::convert::InternalError::new_err("pipeline slots"));
        };
        let i = match Typed::<f32>::new(i) {
            Ok(i) => i,
            Err((e, m)) => {
                owners[0].restore(py, Some(Slot::Host(m)), "");
                owners[1].restore(py, Some(Slot::Dev(o)), "");
                return Err(crate::convert::to_py(e));
            }
        };
        // The output is on the pipeline's device (checked above).
        let (addr, device) = (o.addr(), self.device.clone());
        let job = py.detach(move || {
            self.inner.run_stage(
                (i,),
                gpufeed::KeepAlive(o),
                plan,
                gpufeed::Timeline::Off,
                move |c, chunk| {
                    let r = chunk.range();
                    // SAFETY: `addr` is the output's memory, owned by this run's job
                    // (`DevOut`) until its last stream is done, written by nothing
                    // else meanwhile (the operation holds it); the chunk's range lies
                    // inside it (n elements, checked above); chunks are disjoint.
                    let dst = unsafe {
                        gpufeed::interop::device_slice_mut::<f32>(
                            &device,
                            addr + 4 * r.start as u64,
                            r.len(),
                        )
                    };
                    c.copy_d2d(chunk.input::<f32>(0)?, dst)?;
                    c.kernel(k, dst)
                },
            )
        });
        Ok(Operation::new(
            Pending::RunDev(job),
            owners,
            self.inner.streams().to_vec(),
        ))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The seed's experiment from Python: `size` float32 through copy in,
/// `scale`, copy out, synchronously (one stream, each step waited for) and
/// pipelined (`Plan::auto` over 4 streams); medians of `reps` runs on the
/// host clock, GIL released. Returns a dict: `n`, `sync_ms`, `async_ms`,
/// `speedup`, `plan`, `backend`, `correct` (both outputs equal the CPU
/// reference bit for bit).
#[pyfunction]
#[pyo3(
    signature = (size, device=None, reps=crate::convert::Count(3)),
    text_signature = "(size, device=None, reps=3)"
)]
pub fn compare_sync_async<'py>(
    py: Python<'py>,
    size: crate::convert::Count,
    device: Option<&Device>,
    reps: crate::convert::Count,
) -> PyResult<Bound<'py, PyDict>> {
    let (size, reps) = (size.0 as usize, reps.0 as usize);
    if size == 0 {
        return Err(crate::convert::to_py(gpufeed::Error::InvalidArgument(
            "compare_sync_async needs at least one element".into(),
        )));
    }
    let device = device_or_default(py, device)?;
    let k = Kernel::Scale { s: 2.0 };
    if reps == 0 {
        return Err(crate::convert::to_py(gpufeed::Error::InvalidArgument(
            "compare_sync_async needs reps >= 1 (the timings are medians of reps runs)".into(),
        )));
    }
    let r = py.detach(|| -> gpufeed::Result<_> {
        let pool = gpufeed::PinnedPool::new(&device);
        let mut input = pool.alloc::<f32>(size)?;
        for (i, v) in input.as_mut_slice().iter_mut().enumerate() {
            *v = (i % 1000) as f32 * 0.5 - 100.0;
        }
        // The kernel's arithmetic written out (`scale` by 2: one rounding),
        // not the kernel crate's code, which the CPU emulation runs.
        let expect: Vec<f32> = input.as_slice().iter().map(|&v| v * 2.0).collect();
        let stream = gpufeed::Stream::new(&device)?;
        let pipe = gpufeed::Pipeline::new(&device, 4)?;
        let plan = Plan::auto(size);
        let mut dev = gpufeed::DeviceBuffer::<f32>::new(&device, size)?;
        let mut out = pool.alloc::<f32>(size)?;
        let (mut sync_ms, mut async_ms) = (Vec::new(), Vec::new());
        let mut correct = true;
        for _ in 0..reps {
            out.as_mut_slice().fill(f32::NAN);
            let t = Instant::now();
            let ((i, d), ()) = stream.run_sync((input, dev), |c, (i, d)| {
                use gpufeed::PinnedHost;
                c.copy_h2d(i.host(), d.view_mut())
            })?;
            let (d, ()) = stream.run_sync(d, |c, d| c.kernel(k, d.view_mut()))?;
            let ((d, o), ()) = stream.run_sync((d, out), |c, (d, o)| {
                use gpufeed::PinnedHost;
                c.copy_d2h(d.view(), o.host_mut())
            })?;
            sync_ms.push(t.elapsed().as_secs_f64() * 1e3);
            correct &= bits_equal(o.as_slice(), &expect);
            (input, dev, out) = (i, d, o);
            out.as_mut_slice().fill(f32::NAN);
            let t = Instant::now();
            let ((i, o), _) =
                gpufeed::block_on(pipe.run(input, out, k, plan, gpufeed::Timeline::Off))?;
            async_ms.push(t.elapsed().as_secs_f64() * 1e3);
            correct &= bits_equal(o.as_slice(), &expect);
            (input, out) = (i, o);
        }
        Ok((median(sync_ms), median(async_ms), plan, correct))
    });
    let (sync_ms, async_ms, plan, correct) = r.py()?;
    let d = PyDict::new(py);
    d.set_item("n", size)?;
    d.set_item("bytes", size * 4)?;
    d.set_item("kernel", "scale")?;
    d.set_item("backend", device.kind().to_string())?;
    d.set_item("sync_ms", sync_ms)?;
    d.set_item("async_ms", async_ms)?;
    d.set_item("speedup", sync_ms / async_ms)?;
    d.set_item("plan", plan.to_string())?;
    d.set_item("reps", reps)?;
    d.set_item("correct", correct)?;
    Ok(d)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
