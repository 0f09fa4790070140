//! `gpufeed.kernels`: the library's block-level kernel set (`sum`, `max`,
//! `cumsum`, `softmax`, `histogram`, `matmul`) on device arrays: gpufeed's
//! own `DeviceArray`s, and PyTorch / CuPy CUDA arrays used in place (through
//! `__dlpack__` or `__cuda_array_interface__`, as `as_device_array` wraps
//! them: no copy).
//!
//! Each call is synchronous, as `to_device` and `to_host` are: it queues
//! the kernels on a stream (a new one, or `stream=`), waits for them with
//! the GIL released, and returns the result: a new `DeviceArray`, or `out`
//! written in place. While it runs, its arrays are in flight (any other use
//! raises `BufferError`); an error hands them back. Since the call has
//! finished on the device when it returns, any stream of any library may
//! use the result at once.

use crate::convert::{buffer_error, to_py, IntoPy};
use crate::device::{device_or_default, Device, DeviceArray};
use crate::dtype::DType;
use crate::ops::{take_all, Owner, Slot, Stream};
use gpufeed::interop::{cast_device, cast_device_mut};
use gpufeed::kernels::{self, Gemm};
use gpufeed::{Commands, DeviceBuffer, DeviceSlice, DeviceSliceMut, Error, JobError};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// What a call computes (its operands, in order: the inputs, then the output).
#[derive(Clone, Copy)]
enum Op {
    Sum { bf16: bool },
    Max { bf16: bool },
    Scan(DType),
    Softmax { rows: usize, cols: usize },
    Histogram,
    Matmul { g: Gemm, bf16: bool },
}

impl Op {
    /// Bytes of scratch for `n` input elements.
    fn scratch_bytes(self, n: usize) -> usize {
        match self {
            Op::Sum { bf16: false } | Op::Max { bf16: false } => 4 * kernels::reduce_scratch_len(n),
            Op::Sum { bf16: true } | Op::Max { bf16: true } => {
                4 * kernels::reduce_bf16_scratch_len(n)
            }
            Op::Scan(_) => 8 * kernels::scan_scratch_len(n),
            _ => 0,
        }
    }

    /// Queues the operation on `views` (inputs, then the output).
    fn enqueue<'a>(
        self,
        c: &mut Commands<'a>,
        views: &[DeviceSliceMut<'a, u8>],
        scratch: DeviceSliceMut<'a, u8>,
    ) -> gpufeed::Result<()> {
        let view = |i: usize| -> gpufeed::Result<DeviceSlice<'a, u8>> {
            views
                .get(i)
                .map(|v| v.as_view())
                .ok_or_else(|| Error::Internal("an operand is missing".into()))
        };
        let out = |i: usize| -> gpufeed::Result<DeviceSliceMut<'a, u8>> {
            views
                .get(i)
                .copied()
                .ok_or_else(|| Error::Internal("an operand is missing".into()))
        };
        let f32s = || cast_device_mut::<f32>(scratch);
        let words = || cast_device_mut::<u64>(scratch);
        match self {
            Op::Sum { bf16: false } => {
                c.sum(cast_device(view(0)?)?, f32s()?, cast_device_mut(out(1)?)?)
            }
            Op::Max { bf16: false } => {
                c.max(cast_device(view(0)?)?, f32s()?, cast_device_mut(out(1)?)?)
            }
            Op::Sum { bf16: true } => {
                c.sum_bf16(cast_device(view(0)?)?, f32s()?, cast_device_mut(out(1)?)?)
            }
            Op::Max { bf16: true } => {
                c.max_bf16(cast_device(view(0)?)?, f32s()?, cast_device_mut(out(1)?)?)
            }
            Op::Scan(DType::F32) => {
                c.inclusive_scan::<f32>(cast_device(view(0)?)?, cast_device_mut(out(1)?)?, words()?)
            }
            Op::Scan(DType::I32) => {
                c.inclusive_scan::<i32>(cast_device(view(0)?)?, cast_device_mut(out(1)?)?, words()?)
            }
            Op::Scan(_) => {
                c.inclusive_scan::<u32>(cast_device(view(0)?)?, cast_device_mut(out(1)?)?, words()?)
            }
            Op::Softmax { rows, cols } => c.softmax_rows(
                cast_device(view(0)?)?,
                cast_device_mut(out(1)?)?,
                rows,
                cols,
            ),
            Op::Histogram => c.histogram_u8(view(0)?, cast_device_mut(out(1)?)?),
            Op::Matmul { g, bf16: false } => c.sgemm(
                g,
                cast_device::<f32>(view(0)?)?,
                cast_device::<f32>(view(1)?)?,
                cast_device_mut(out(2)?)?,
            ),
            Op::Matmul { g, bf16: true } => c.gemm_bf16(
                g,
                cast_device::<u16>(view(0)?)?,
                cast_device::<u16>(view(1)?)?,
                cast_device_mut(out(2)?)?,
            ),
        }
    }
}

/// An operand resolved to a `DeviceArray` (ours, or a foreign CUDA array
/// wrapped in place), with the Python object to hand back as the result.
struct Operand<'py> {
    array: Bound<'py, DeviceArray>,
    obj: Bound<'py, PyAny>,
}

impl Operand<'_> {
    fn dtype(&self) -> DType {
        self.array.get().dtype
    }

    fn shape(&self) -> &[usize] {
        &self.array.get().shape
    }

    fn len(&self) -> usize {
        self.shape().iter().product()
    }
}

/// `obj` as a device array: a gpufeed `DeviceArray` as it is; an object with
/// `__dlpack__` or `__cuda_array_interface__` on a CUDA device wrapped in
/// place (`as_device_array`: C-contiguous only, else `BufferError`). Host
/// memory (NumPy, a CPU tensor) is a `TypeError` pointing at `to_device`.
fn operand<'py>(
    py: Python<'py>,
    what: &str,
    obj: &Bound<'py, PyAny>,
    device: &gpufeed::Device,
) -> PyResult<Operand<'py>> {
    if let Ok(a) = obj.cast::<DeviceArray>() {
        return Ok(Operand {
            array: a.clone(),
            obj: obj.clone(),
        });
    }
    let dlpack = obj.hasattr("__dlpack__")?;
    if !dlpack && !obj.hasattr("__cuda_array_interface__")? {
        return Err(PyTypeError::new_err(format!(
            "{what} takes a device array (gpufeed's DeviceArray, a CUDA torch tensor, a CuPy \
             array), not {}",
            obj.get_type().name()?
        )));
    }
    if dlpack && !obj.hasattr("__cuda_array_interface__")? && obj.hasattr("__dlpack_device__")? {
        // kDLCPU (1) and kDLCUDAHost (3): memory the host owns.
        let (kind, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        if kind == 1 || kind == 3 {
            return Err(PyTypeError::new_err(format!(
                "{what} takes device arrays; this {} is in host memory: \
                 gpufeed.to_device() it first",
                obj.get_type().name()?
            )));
        }
    }
    let on = Device {
        inner: device.clone(),
    };
    let wrapped = crate::device::as_device_array(py, obj, Some(&on))?;
    Ok(Operand {
        array: Bound::new(py, wrapped)?,
        obj: obj.clone(),
    })
}

/// The device of the call: the first gpufeed `DeviceArray`'s, else the default.
fn device_of(py: Python<'_>, objs: &[&Bound<'_, PyAny>]) -> PyResult<gpufeed::Device> {
    for o in objs {
        if let Ok(a) = o.cast::<DeviceArray>() {
            return Ok(a.get().device.clone());
        }
    }
    device_or_default(py, None)
}

/// `TypeError` unless `a`'s dtype is one of `ok`.
fn want(what: &str, name: &str, a: &Operand<'_>, ok: &[DType]) -> PyResult<()> {
    if ok.contains(&a.dtype()) {
        return Ok(());
    }
    let names: Vec<&str> = ok.iter().map(|d| d.name()).collect();
    Err(PyTypeError::new_err(format!(
        "{what}: {name} of dtype {} (takes {})",
        a.dtype().name(),
        names.join(", ")
    )))
}

/// The output: `out` checked (dtype `dtype`, `len` elements, else
/// `TypeError` / `ValueError`), or a new array of `shape`.
fn output<'py>(
    py: Python<'py>,
    what: &str,
    out: Option<&Bound<'py, PyAny>>,
    device: &gpufeed::Device,
    dtype: DType,
    shape: Vec<usize>,
) -> PyResult<Operand<'py>> {
    let Some(out) = out else {
        let a = Bound::new(py, DeviceArray::alloc(py, device, shape, dtype)?)?;
        return Ok(Operand {
            obj: a.clone().into_any(),
            array: a,
        });
    };
    let o = operand(py, what, out, device)?;
    want(what, "out", &o, &[dtype])?;
    let len: usize = shape.iter().product();
    if o.len() != len {
        return Err(PyValueError::new_err(format!(
            "{what}: out has shape {:?}, {len} elements needed (shape {shape:?})",
            o.shape()
        )));
    }
    Ok(o)
}

/// Runs `op` on `operands` (inputs, then the output) on `stream` (or a new
/// stream of the operands' device), waits with the GIL released, hands the
/// arrays back and returns the output's Python object.
fn run<'py>(
    py: Python<'py>,
    op: Op,
    operands: Vec<Operand<'py>>,
    n: usize,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    let result = operands
        .last()
        .map(|o| o.obj.clone())
        .ok_or_else(|| PyValueError::new_err("no output"))?;
    let device = operands[0].array.get().device.clone();
    let stream = match stream {
        Some(s) => (*s.get().inner).clone(),
        None => gpufeed::Stream::new(&device).py()?,
    };
    // One array given twice as an input (`matmul(a, a)`) is taken once and
    // read twice; as the output and an input, it is refused.
    let (out_index, mut index, mut distinct) = (operands.len() - 1, Vec::new(), Vec::new());
    for (i, o) in operands.iter().enumerate() {
        match distinct
            .iter()
            .position(|d: &&Operand<'_>| d.array.is(&o.array))
        {
            Some(_) if i == out_index => {
                return Err(buffer_error(
                    "out is one of the inputs: the kernels don't work in place, pass another \
                     array (or none)",
                ))
            }
            Some(j) => index.push(j),
            None => {
                index.push(distinct.len());
                distinct.push(o);
            }
        }
    }
    let scratch = DeviceBuffer::<u8>::new(&device, op.scratch_bytes(n)).py()?;
    let owners: Vec<Owner> = distinct
        .iter()
        .map(|o| Owner::Dev(o.array.clone().unbind()))
        .collect();
    let slots = take_all(py, &owners)?;
    let outcome = py.detach(move || {
        let job = stream.run((slots, scratch), move |c, (slots, scratch)| {
            let views = slots
                .iter_mut()
                .map(|s| match s {
                    Slot::Dev(m) => Ok(m.view_mut()),
                    Slot::Host(_) => Err(Error::Internal("a host buffer as an operand".into())),
                })
                .collect::<gpufeed::Result<Vec<_>>>()?;
            let views = index
                .iter()
                .map(|&j| views.get(j).copied())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::Internal("an operand's slot is missing".into()))?;
            op.enqueue(c, &views, scratch.view_mut())
        });
        gpufeed::block_on(job).map_err(Box::new)
    });
    let (error, slots) = match outcome {
        Ok(((slots, _), ())) => (None, Some(slots)),
        Err(e) => {
            let JobError { error, bundle } = *e;
            (Some(error), bundle.map(|(s, _)| s))
        }
    };
    match slots {
        Some(slots) => {
            for (o, s) in owners.iter().zip(slots) {
                o.restore(py, Some(s), "");
            }
        }
        None => {
            for o in &owners {
                o.restore(py, None, "its operation's end could not be observed");
            }
        }
    }
    match error {
        Some(e) => Err(to_py(e)),
        None => Ok(result),
    }
}

/// `sum(x, out=None, stream=None)`: the sum of every element of `x`
/// (float32, or bfloat16 accumulated in float32) as a float32 device array
/// of shape `()` (or written into `out`, one float32). Deterministic: the
/// same bits run after run, on the GPU and the CPU emulation.
#[pyfunction]
#[pyo3(signature = (x, out=None, stream=None))]
fn sum<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    reduce(py, "sum", x, out, stream, |bf16| Op::Sum { bf16 })
}

/// `max(x, out=None, stream=None)`: the largest element of `x` (float32 or
/// bfloat16), exact, as a float32 device array of shape `()`; NaNs are
/// ignored (`-inf` when there is no number).
#[pyfunction]
#[pyo3(name = "max", signature = (x, out=None, stream=None))]
fn max_<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    reduce(py, "max", x, out, stream, |bf16| Op::Max { bf16 })
}

fn reduce<'py>(
    py: Python<'py>,
    what: &str,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
    op: fn(bool) -> Op,
) -> PyResult<Bound<'py, PyAny>> {
    let device = device_of(py, &[x])?;
    let x = operand(py, what, x, &device)?;
    want(what, "x", &x, &[DType::F32, DType::BF16])?;
    let op = op(x.dtype() == DType::BF16);
    let out = output(py, what, out, &device, DType::F32, vec![])?;
    let n = x.len();
    run(py, op, vec![x, out], n, stream)
}

/// `cumsum(x, out=None, stream=None)`: the inclusive prefix sum of `x`'s
/// elements in memory order (float32, int32 or uint32; the integers wrap),
/// as a 1-D array of the same dtype (or into `out`, any shape of that many
/// elements). float32 is deterministic (a fixed order).
#[pyfunction]
#[pyo3(signature = (x, out=None, stream=None))]
fn cumsum<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    let device = device_of(py, &[x])?;
    let x = operand(py, "cumsum", x, &device)?;
    want("cumsum", "x", &x, &[DType::F32, DType::I32, DType::U32])?;
    let (n, dtype) = (x.len(), x.dtype());
    let out = output(py, "cumsum", out, &device, dtype, vec![n])?;
    run(py, Op::Scan(dtype), vec![x, out], n, stream)
}

/// `softmax(x, out=None, stream=None)`: softmax over each row of the 2-D
/// float32 array `x`, into a new array of its shape (or `out`).
#[pyfunction]
#[pyo3(signature = (x, out=None, stream=None))]
fn softmax<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    let device = device_of(py, &[x])?;
    let x = operand(py, "softmax", x, &device)?;
    want("softmax", "x", &x, &[DType::F32])?;
    let &[rows, cols] = x.shape() else {
        return Err(PyValueError::new_err(format!(
            "softmax takes a 2-D array (rows, columns), not shape {:?}",
            x.shape()
        )));
    };
    let out = output(py, "softmax", out, &device, DType::F32, vec![rows, cols])?;
    run(
        py,
        Op::Softmax { rows, cols },
        vec![x, out],
        rows * cols,
        stream,
    )
}

/// `histogram(x, out=None, stream=None)`: how many bytes of the uint8 array
/// `x` take each value, as 256 uint32 (or into `out`, 256 uint32, zeroed
/// first). Exact.
#[pyfunction]
#[pyo3(signature = (x, out=None, stream=None))]
fn histogram<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    let device = device_of(py, &[x])?;
    let x = operand(py, "histogram", x, &device)?;
    want("histogram", "x", &x, &[DType::U8])?;
    let out = output(py, "histogram", out, &device, DType::U32, vec![256])?;
    let n = x.len();
    run(py, Op::Histogram, vec![x, out], n, stream)
}

/// `matmul(a, b, out=None, alpha=1.0, beta=0.0, stream=None)`: `alpha * a @
/// b + beta * out` for 2-D `a` (m x k) and `b` (k x n): float32 (SGEMM,
/// bit-identical on the GPU and the CPU emulation) or bfloat16 (the tensor
/// cores, sm_80 and newer; float32 accumulation) into a float32 (m, n)
/// array. `beta` needs `out` (its values are read).
#[pyfunction]
#[pyo3(signature = (a, b, out=None, alpha=1.0, beta=0.0, stream=None))]
#[allow(clippy::too_many_arguments)]
fn matmul<'py>(
    py: Python<'py>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
    out: Option<&Bound<'py, PyAny>>,
    alpha: f32,
    beta: f32,
    stream: Option<&Bound<'py, Stream>>,
) -> PyResult<Bound<'py, PyAny>> {
    let device = device_of(py, &[a, b])?;
    let a = operand(py, "matmul", a, &device)?;
    let b = operand(py, "matmul", b, &device)?;
    want("matmul", "a", &a, &[DType::F32, DType::BF16])?;
    want("matmul", "b", &b, &[a.dtype()])?;
    let (&[m, k], &[k2, n]) = (a.shape(), b.shape()) else {
        return Err(PyValueError::new_err(format!(
            "matmul takes 2-D arrays, not shapes {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    };
    if k != k2 {
        return Err(PyValueError::new_err(format!(
            "matmul: shapes {:?} and {:?} don't chain (a's columns must be b's rows)",
            a.shape(),
            b.shape()
        )));
    }
    if beta != 0.0 && out.is_none() {
        return Err(PyValueError::new_err(
            "matmul: beta != 0 adds to out's values: pass out=",
        ));
    }
    let out = output(py, "matmul", out, &device, DType::F32, vec![m, n])?;
    let g = Gemm::new(m, n, k).scaled(alpha, beta);
    let bf16 = a.dtype() == DType::BF16;
    run(py, Op::Matmul { g, bf16 }, vec![a, b, out], 0, stream)
}

/// The `gpufeed.kernels` submodule (also importable as `import gpufeed.kernels`).
pub fn submodule<'py>(parent: &Bound<'py, PyModule>) -> PyResult<Bound<'py, PyModule>> {
    let py = parent.py();
    let m = PyModule::new(py, "kernels")?;
    m.add(
        "__doc__",
        "The block-level kernel set on device arrays (gpufeed's, CUDA torch tensors, CuPy \
         arrays; zero copy): sum, max, cumsum, softmax, histogram, matmul.",
    )?;
    m.add_function(wrap_pyfunction!(sum, &m)?)?;
    m.add_function(wrap_pyfunction!(max_, &m)?)?;
    m.add_function(wrap_pyfunction!(cumsum, &m)?)?;
    m.add_function(wrap_pyfunction!(softmax, &m)?)?;
    m.add_function(wrap_pyfunction!(histogram, &m)?)?;
    m.add_function(wrap_pyfunction!(matmul, &m)?)?;
    parent.add_submodule(&m)?;
    py.import("sys")?
        .getattr("modules")?
        .set_item("gpufeed.kernels", &m)?;
    Ok(m)
}
