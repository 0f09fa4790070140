//! Where `load_model` writes: new device arrays, or tensors that exist
//! (gpufeed device arrays, PyTorch/CuPy CUDA tensors wrapped in place, and
//! on the CPU emulation host arrays: its device memory is host memory),
//! each checked against the checkpoint before any byte is written; and the
//! read itself (one staging stream for every tensor kept in its dtype, a
//! host-side conversion for the others).

use super::convert;
use crate::buffer::ContiguousView;
use crate::device::{DevMem, DeviceArray};
use crate::dtype::DType;
use gpufeed::weights::{Checkpoint, LoadPlan, LoadStats, PlannedTensor, ReadTarget};
use gpufeed::{BackendKind, DeviceBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A tensor's destination.
pub(crate) struct Target {
    /// The object given in `into=` (returned as it is).
    pub given: Option<Py<PyAny>>,
    mem: Mem,
    shape: Vec<usize>,
    dtype: DType,
}

enum Mem {
    /// A device array: ours, or foreign memory wrapped in place.
    Array(Py<DeviceArray>),
    /// Host memory on the CPU emulation (a NumPy array, a CPU tensor),
    /// exported writable for the read.
    Host {
        view: ContiguousView,
        _keep: Option<Py<PyAny>>,
    },
}

impl Target {
    /// A new device array.
    pub fn fresh(
        py: Python<'_>,
        device: &gpufeed::Device,
        shape: Vec<usize>,
        dtype: DType,
    ) -> PyResult<Target> {
        let a = DeviceArray::alloc(py, device, shape.clone(), dtype)?;
        Ok(Target {
            given: None,
            mem: Mem::Array(Py::new(py, a)?),
            shape,
            dtype,
        })
    }

    /// `obj` from `into=[name]`: a gpufeed `DeviceArray` of `device`; on a
    /// GPU a CUDA tensor (wrapped in place: `as_device_array`); on the CPU
    /// emulation any writable C-contiguous host array.
    pub fn existing(
        py: Python<'_>,
        device: &gpufeed::Device,
        name: &str,
        obj: &Bound<'_, PyAny>,
    ) -> PyResult<Target> {
        let given = Some(obj.clone().unbind());
        if let Ok(a) = obj.cast::<DeviceArray>() {
            let d = a.get();
            if !d.device.same_as(device) {
                return Err(PyValueError::new_err(format!(
                    "load_model: into[{name:?}] lives on another device"
                )));
            }
            return Ok(Target {
                given,
                shape: d.shape.clone(),
                dtype: d.dtype,
                mem: Mem::Array(a.clone().unbind()),
            });
        }
        if device.kind() == BackendKind::Cuda {
            let dev = crate::device::Device {
                inner: device.clone(),
            };
            let a = crate::device::as_device_array(py, obj, Some(&dev)).map_err(|e| {
                PyTypeError::new_err(format!(
                    "load_model: into[{name:?}] is not C-contiguous device memory of this GPU \
                     ({e})"
                ))
            })?;
            return Ok(Target {
                given,
                shape: a.shape.clone(),
                dtype: a.dtype,
                mem: Mem::Array(Py::new(py, a)?),
            });
        }
        let host = crate::staging::contiguous(obj, true)?;
        let dtype = crate::staging::dtype_of(&host, "load_model: into=")?;
        let crate::staging::Exported { view, keep, .. } = host;
        Ok(Target {
            given,
            shape: view.shape.clone(),
            dtype,
            mem: Mem::Host {
                view,
                _keep: keep.map(Bound::unbind),
            },
        })
    }

    /// The device array (of a fresh target).
    pub fn array(self) -> PyResult<Py<DeviceArray>> {
        match self.mem {
            Mem::Array(a) => Ok(a),
            Mem::Host { .. } => Err(crate::convert::InternalError::new_err(
                "a host target handed out as a device array",
            )),
        }
    }
}

/// `ValueError` naming the tensor unless `target` has its part's shape and
/// `dtype`.
pub(crate) fn check(
    target: Option<&Target>,
    t: &PlannedTensor,
    dtype: DType,
    plan: &LoadPlan,
) -> PyResult<()> {
    let Some(target) = target else { return Ok(()) };
    if target.shape != t.shape || target.dtype != dtype {
        let part = if plan.world_size > 1 && t.shape != t.full_shape {
            format!(
                " (rank {} of {}'s part of {:?})",
                plan.rank, plan.world_size, t.full_shape
            )
        } else {
            String::new()
        };
        return Err(PyValueError::new_err(format!(
            "load_model: into[{:?}] has shape {:?} and dtype {}; the checkpoint gives shape {:?}{part} \
             and dtype {}: nothing was written",
            t.name,
            target.shape,
            target.dtype.name(),
            t.shape,
            dtype.name()
        )));
    }
    Ok(())
}

/// A target's memory, held for the read.
enum Taken {
    /// A device array's, taken out of it (in flight) until the read ends.
    Mem(DevMem),
    /// Host memory of an export (the CPU emulation).
    Raw { addr: u64, len: usize },
}

impl Taken {
    /// A read target over it.
    fn target<'a>(&'a mut self, device: &gpufeed::Device) -> ReadTarget<'a> {
        match self {
            Taken::Mem(DevMem::Own(b)) => ReadTarget::buffer(b),
            Taken::Mem(DevMem::Foreign { addr, bytes, .. }) => {
                // SAFETY: the wrapper's owner keeps the allocation alive and
                // the array is taken out (in flight) for the read, so nothing
                // of ours uses it meanwhile; the driver knew the range as this
                // device's memory when it was wrapped. Other code using it
                // meanwhile is the caller's to avoid (as for every operation
                // on a foreign tensor).
                ReadTarget::slice(unsafe {
                    gpufeed::interop::device_slice_mut::<u8>(device, *addr, *bytes)
                })
            }
            Taken::Raw { addr, len } => {
                // SAFETY: on the CPU emulation device memory is host memory:
                // this is a writable buffer export held (with the GIL-side
                // view) until the read has ended, written by nothing of ours
                // but this read.
                ReadTarget::slice(unsafe {
                    gpufeed::interop::device_slice_mut::<u8>(device, *addr, *len)
                })
            }
        }
    }
}

/// Reads every planned tensor into its target: those kept in their dtype
/// in one stream through `staging`, those converted (`dtypes[i]` differs
/// from the file's) on the host, then uploaded. The GIL is released for
/// the reads.
pub(crate) fn read_all(
    py: Python<'_>,
    staging: &gpufeed::Staging,
    ck: &Checkpoint,
    plan: &LoadPlan,
    targets: &[Target],
    dtypes: &[DType],
    io: gpufeed::FileIo,
) -> PyResult<LoadStats> {
    let device = staging.device().clone();
    // Every target's memory, taken out (in flight) until the end.
    let mut taken: Vec<Taken> = Vec::with_capacity(targets.len());
    let mut took = Ok(());
    for t in targets {
        match &t.mem {
            Mem::Array(a) => match a.bind(py).get().take_for_operation() {
                Ok(m) => taken.push(Taken::Mem(m)),
                Err(e) => {
                    took = Err(e);
                    break;
                }
            },
            Mem::Host { view, .. } => taken.push(Taken::Raw {
                addr: view.ptr as u64,
                len: view.len,
            }),
        }
    }
    let result = took.and_then(|()| {
        py.detach(|| read_taken(staging, &device, ck, plan, &mut taken, dtypes, io))
            .map_err(super::convert::weights_error)
    });
    for (t, m) in targets.iter().zip(taken) {
        if let (Mem::Array(a), Taken::Mem(m)) = (&t.mem, m) {
            a.bind(py).get().put_back(m);
        }
    }
    result
}

fn read_taken(
    staging: &gpufeed::Staging,
    device: &gpufeed::Device,
    ck: &Checkpoint,
    plan: &LoadPlan,
    taken: &mut [Taken],
    dtypes: &[DType],
    io: gpufeed::FileIo,
) -> gpufeed::Result<LoadStats> {
    let kept: Vec<bool> = plan
        .tensors
        .iter()
        .zip(dtypes)
        .map(|(t, &d)| super::convert::device_dtype(t.dtype) == Some(d))
        .collect();
    let same = LoadPlan {
        tensors: plan
            .tensors
            .iter()
            .zip(&kept)
            .filter(|(_, &k)| k)
            .map(|(t, _)| t.clone())
            .collect(),
        rank: plan.rank,
        world_size: plan.world_size,
    };
    let mut stats = {
        let targets: Vec<ReadTarget<'_>> = taken
            .iter_mut()
            .zip(&kept)
            .filter(|(_, &k)| k)
            .map(|(m, _)| m.target(device))
            .collect();
        gpufeed::weights::load(staging, ck, &same, targets, io)?
    };
    for ((t, m), &d) in plan.tensors.iter().zip(taken.iter_mut()).zip(dtypes) {
        if super::convert::device_dtype(t.dtype) == Some(d) {
            continue;
        }
        let from = super::convert::device_dtype(t.dtype)
            .ok_or_else(|| gpufeed::Error::Internal("a conversion from no dtype".into()))?;
        let raw = convert::read_pieces(&ck.shards[t.shard].path, t)?;
        let bytes = convert::convert(&raw, from, d)?;
        upload(staging, device, m, &bytes)?;
        stats.bytes_read += raw.len() as u64;
        stats.tensors += 1;
    }
    Ok(stats)
}

/// `bytes` into a target: straight through the ring into a buffer of ours;
/// into other memory through a scratch buffer and a device copy.
fn upload(
    staging: &gpufeed::Staging,
    device: &gpufeed::Device,
    m: &mut Taken,
    bytes: &[u8],
) -> gpufeed::Result<()> {
    if let Taken::Mem(DevMem::Own(b)) = m {
        return staging.h2d_blocking(bytes, b);
    }
    let (addr, len) = match m {
        Taken::Mem(DevMem::Foreign { addr, bytes, .. }) => (*addr, *bytes),
        Taken::Raw { addr, len } => (*addr, *len),
        Taken::Mem(DevMem::Own(_)) => return Err(gpufeed::Error::Internal("unreachable".into())),
    };
    if len != bytes.len() {
        return Err(gpufeed::Error::LengthMismatch {
            what: "load_model conversion (target vs converted bytes)",
            expected: len,
            got: bytes.len(),
        });
    }
    if len == 0 {
        return Ok(());
    }
    let mut scratch = DeviceBuffer::<u8>::new(device, len)?;
    staging.h2d_blocking(bytes, &mut scratch)?;
    let stream = gpufeed::Stream::new(device)?;
    stream
        .run_sync(scratch, |c, s| {
            // SAFETY: as `Taken::target`: the target's memory is held for
            // this call, written by nothing else of ours.
            let dst = unsafe { gpufeed::interop::device_slice_mut::<u8>(device, addr, len) };
            c.copy_d2d(s.view(), dst)
        })
        .map(|_| ())
        .map_err(|e| e.error)
}
