//! What a loader is made for: its shard (rank and world size, from
//! torch.distributed, torchrun or the arguments), its device, and the
//! framework its batches come out as.

use crate::device::Device;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// What batches come out as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Framework {
    Torch,
    Cupy,
    Gpufeed,
    Numpy,
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

/// The device a loader's batches go to: `device` (a `gpufeed.Device` or an
/// ordinal), else GPU `LOCAL_RANK` of a shard of several ranks, else GPU 0.
pub(super) fn loader_device(
    py: Python<'_>,
    device: Option<&Bound<'_, PyAny>>,
    world_size: usize,
    local_rank: Option<usize>,
) -> PyResult<gpufeed::Device> {
    Ok(match device {
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
    })
}

/// The framework batches come out as: `framework` by name, or for `"auto"`
/// torch if it sees `device`, else CuPy (on a GPU), else `DeviceArray`s.
pub(super) fn pick_framework(
    py: Python<'_>,
    framework: &str,
    device: &gpufeed::Device,
) -> PyResult<Framework> {
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
    Ok(framework)
}
