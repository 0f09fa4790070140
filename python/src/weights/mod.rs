//! Model weights from Python: `load_model` (a checkpoint directory, index
//! or shard list into new device arrays or into tensors that exist, sliced
//! per tensor-parallel rank) and `save_async` (a checkpoint written in the
//! background from a snapshot: [`save_async`]), over `gpufeed::weights`.
//!
//! Errors about a file are raised as Python's own: `FileNotFoundError` (and
//! the other `OSError` subclasses, `errno` and `filename` set) for a shard
//! that can't be opened, `OSError` with `filename` for one shorter than its
//! header says, `ValueError` naming the file for one that is not
//! safetensors.

mod convert;
mod save;
mod targets;

pub use save::{save_async, SaveHandle};

use convert::{device_dtype, weights_error};

use crate::device::device_or_default;
use gpufeed::weights::{Checkpoint, LoadPlan, Source, Split};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use targets::Target;

/// The checkpoint source: a path (str or os.PathLike) or a list/tuple of
/// shard paths.
fn source_of(obj: &Bound<'_, PyAny>) -> PyResult<Source> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut paths = Vec::new();
        for item in obj.try_iter()? {
            paths.push(path_of(&item?)?);
        }
        if paths.is_empty() {
            return Err(PyValueError::new_err("load_model: an empty list of shards"));
        }
        return Ok(Source::Shards(paths));
    }
    Ok(Source::Path(path_of(obj)?))
}

fn path_of(obj: &Bound<'_, PyAny>) -> PyResult<PathBuf> {
    if obj.is_instance_of::<pyo3::types::PyBytes>() {
        return Err(PyTypeError::new_err(
            "load_model: paths are str or os.PathLike, not bytes",
        ));
    }
    obj.extract::<PathBuf>().map_err(|_| {
        PyTypeError::new_err(format!(
            "load_model: a checkpoint is a path (str or os.PathLike) or a list of shard paths, \
             not {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })
}

/// Which names to load: all, a collection, or a predicate.
enum Names<'py> {
    All,
    Set(HashSet<String>),
    Call(Bound<'py, PyAny>),
}

impl Names<'_> {
    fn wants(&self, name: &str) -> PyResult<bool> {
        match self {
            Names::All => Ok(true),
            Names::Set(s) => Ok(s.contains(name)),
            Names::Call(f) => f.call1((name,))?.is_truthy(),
        }
    }
}

fn names_of<'py>(names: Option<Bound<'py, PyAny>>) -> PyResult<Names<'py>> {
    let Some(n) = names else {
        return Ok(Names::All);
    };
    if n.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(
            "load_model: names is a list of names or a callable name -> bool, not a string",
        ));
    }
    if n.is_callable() {
        return Ok(Names::Call(n));
    }
    let mut set = HashSet::new();
    for item in n.try_iter()? {
        set.insert(item?.extract::<String>()?);
    }
    Ok(Names::Set(set))
}

/// The split of each tensor `rules` gives: an exact name first, else the
/// first pattern (a glob: `*`, `?`) that matches, in the dict's order; a
/// dimension (negative counts from the end) or None (replicated).
fn splits(
    ck: &Checkpoint,
    rules: Option<&Bound<'_, PyDict>>,
    wanted: &HashSet<String>,
) -> PyResult<HashMap<String, Split>> {
    let mut out = HashMap::new();
    let Some(rules) = rules else { return Ok(out) };
    let mut list: Vec<(String, Option<i64>)> = Vec::with_capacity(rules.len());
    for (k, v) in rules.iter() {
        let k: String = k
            .extract()
            .map_err(|_| PyTypeError::new_err("load_model: rules' keys are names or patterns"))?;
        let v: Option<i64> = v.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "load_model: rules[{k:?}] is a dimension (0 rows, 1 columns) or None (replicated)"
            ))
        })?;
        list.push((k, v));
    }
    for (_, t) in ck.tensors() {
        if !wanted.contains(&t.name) {
            continue;
        }
        let rule = list.iter().find(|(k, _)| *k == t.name).or_else(|| {
            list.iter()
                .find(|(k, _)| gpufeed::weights::glob_match(k, &t.name))
        });
        let split = match rule {
            None | Some((_, None)) => Split::Replicated,
            Some((k, Some(d))) => {
                let nd = t.shape.len() as i64;
                let dim = if *d < 0 { nd + d } else { *d };
                if dim < 0 || dim >= nd {
                    return Err(PyValueError::new_err(format!(
                        "load_model: tensor {:?} of shape {:?}: rule {k:?} splits dimension {d}, \
                         which it does not have",
                        t.name, t.shape
                    )));
                }
                Split::Dim(dim as usize)
            }
        };
        out.insert(t.name.clone(), split);
    }
    Ok(out)
}

/// `load_model(checkpoint, device=None, framework="gpufeed", names=None,
/// into=None, dtype=None, rank=None, world_size=None, rules=None,
/// strict=True, direct=None, stats=None)`: see the README's "Model
/// weights".
#[pyfunction]
#[pyo3(signature = (checkpoint, device=None, framework="gpufeed", names=None, into=None, dtype=None, rank=None, world_size=None, rules=None, strict=true, direct=None, stats=None))]
#[allow(clippy::too_many_arguments)]
pub fn load_model<'py>(
    py: Python<'py>,
    checkpoint: &Bound<'py, PyAny>,
    device: Option<&crate::device::Device>,
    framework: &str,
    names: Option<Bound<'py, PyAny>>,
    into: Option<Bound<'py, PyAny>>,
    dtype: Option<&Bound<'py, PyAny>>,
    rank: Option<crate::convert::Count>,
    world_size: Option<crate::convert::Count>,
    rules: Option<&Bound<'py, PyDict>>,
    strict: bool,
    direct: Option<bool>,
    stats: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let started = std::time::Instant::now();
    let framework = convert::Framework::parse(framework)?;
    let source = source_of(checkpoint)?;
    let device = device_or_default(py, device)?;
    let to_dtype = dtype.map(crate::device::parse_dtype).transpose()?;
    if let Some(d) = to_dtype {
        if !convert::is_float(d) {
            return Err(PyValueError::new_err(format!(
                "load_model: dtype={} is not one of float32, float16, bfloat16",
                d.name()
            )));
        }
    }
    let ck = py
        .detach(|| Checkpoint::open(&source))
        .map_err(weights_error)?;
    let names = names_of(names)?;
    // into=: a dict of tensors (a state_dict()), or a module (its state_dict()).
    let into = match into {
        None => None,
        Some(m) if !m.is_instance_of::<PyDict>() && m.hasattr("state_dict")? => {
            Some(m.call_method0("state_dict")?.cast_into::<PyDict>()?)
        }
        Some(d) => Some(d.cast_into::<PyDict>().map_err(|_| {
            PyTypeError::new_err(
                "load_model: into= is a dict of tensors (a state_dict()) or a module",
            )
        })?),
    };
    let into_keys: Option<Vec<(String, Bound<'py, PyAny>)>> = match &into {
        None => None,
        Some(d) => {
            let mut v = Vec::with_capacity(d.len());
            for (k, t) in d.iter() {
                let k: String = k.extract().map_err(|_| {
                    PyTypeError::new_err("load_model: into='s keys are tensor names")
                })?;
                v.push((k, t));
            }
            Some(v)
        }
    };
    // The names wanted, checked against the checkpoint.
    let mut wanted = HashSet::new();
    match &into_keys {
        Some(keys) => {
            let mut missing = Vec::new();
            for (k, _) in keys {
                if !names.wants(k)? {
                    continue;
                }
                if ck.get(k).is_some() {
                    wanted.insert(k.clone());
                } else if strict {
                    missing.push(k.clone());
                }
            }
            if !missing.is_empty() {
                return Err(PyKeyError::new_err(format!(
                    "load_model: into= has tensors the checkpoint lacks (strict=False skips \
                     them): {missing:?}"
                )));
            }
        }
        None => {
            for (_, t) in ck.tensors() {
                if names.wants(&t.name)? {
                    wanted.insert(t.name.clone());
                }
            }
            if let Names::Set(s) = &names {
                let mut missing: Vec<&String> = s.iter().filter(|n| ck.get(n).is_none()).collect();
                if !missing.is_empty() {
                    missing.sort();
                    return Err(PyKeyError::new_err(format!(
                        "load_model: names= lists tensors the checkpoint lacks: {missing:?}"
                    )));
                }
            }
        }
    }
    let (rank, world) = match (rank, world_size, rules) {
        (None, None, None) => (0, 1),
        (Some(_), None, _) | (None, Some(_), _) => {
            return Err(PyValueError::new_err(
                "load_model: give both rank= and world_size=, or neither",
            ))
        }
        (r, w, _) => {
            let (r, w, _) =
                crate::loader::distributed(py, r.map(|r| r.0 as usize), w.map(|w| w.0 as usize))?;
            (r, w)
        }
    };
    let split_of = splits(&ck, rules, &wanted)?;
    let plan = ck
        .plan(
            |n| wanted.contains(n),
            |t| split_of.get(&t.name).copied().unwrap_or_default(),
            rank,
            world,
        )
        .map_err(|e| match e {
            gpufeed::Error::InvalidArgument(m) => PyValueError::new_err(format!("load_model: {m}")),
            e => crate::convert::to_py(e),
        })?;
    // Each tensor's dtype on the device.
    let mut out_dtypes = Vec::with_capacity(plan.tensors.len());
    for t in &plan.tensors {
        let Some(d) = device_dtype(t.dtype) else {
            return Err(PyValueError::new_err(format!(
                "load_model: {}: tensor {:?} has dtype {}, which has no device dtype (leave it \
                 out with names=)",
                ck.shards[t.shard].path.display(),
                t.name,
                t.dtype.name()
            )));
        };
        out_dtypes.push(match to_dtype {
            Some(to) if convert::is_float(d) => to,
            _ => d,
        });
    }
    // The targets: every one resolved and checked before any byte is written.
    let targets: Vec<Target> = match &into_keys {
        Some(keys) => {
            let by_name: HashMap<&str, &Bound<'py, PyAny>> =
                keys.iter().map(|(k, t)| (k.as_str(), t)).collect();
            let mut v = Vec::with_capacity(plan.tensors.len());
            for (t, &d) in plan.tensors.iter().zip(&out_dtypes) {
                let obj = by_name.get(t.name.as_str()).copied().ok_or_else(|| {
                    crate::convert::InternalError::new_err("a planned tensor not in into=")
                })?;
                v.push(Target::existing(py, &device, &t.name, obj)?);
                targets::check(v.last(), t, d, &plan)?;
            }
            v
        }
        None => {
            let mut v = Vec::with_capacity(plan.tensors.len());
            for (t, &d) in plan.tensors.iter().zip(&out_dtypes) {
                v.push(Target::fresh(py, &device, t.shape.clone(), d)?);
            }
            v
        }
    };
    let staging = crate::staging::engine_for(py, &device)?;
    let io = match direct {
        None => gpufeed::FileIo::Auto,
        Some(true) => gpufeed::FileIo::Direct,
        Some(false) => gpufeed::FileIo::Buffered,
    };
    let converted = plan
        .tensors
        .iter()
        .zip(&out_dtypes)
        .filter(|(t, &d)| device_dtype(t.dtype) != Some(d))
        .count();
    let read = targets::read_all(py, &staging, &ck, &plan, &targets, &out_dtypes, io)?;
    // The result: into='s own objects, or new arrays as `framework` says.
    let out = PyDict::new(py);
    for (t, target) in plan.tensors.iter().zip(targets) {
        let value = match target.given {
            Some(obj) => obj.into_bound(py),
            None => framework.hand_out(py, target.array()?)?,
        };
        out.set_item(&t.name, value)?;
    }
    if let Some(s) = stats {
        fill_stats(s, &plan, &read, converted, started.elapsed().as_secs_f64())?;
    }
    Ok(out)
}

fn fill_stats(
    s: &Bound<'_, PyDict>,
    plan: &LoadPlan,
    read: &gpufeed::weights::LoadStats,
    converted: usize,
    seconds: f64,
) -> PyResult<()> {
    s.set_item("bytes_read", read.bytes_read)?;
    s.set_item("bytes_whole", plan.bytes_whole())?;
    s.set_item("tensors", plan.tensors.len())?;
    s.set_item("files", read.files)?;
    s.set_item("converted", converted)?;
    s.set_item("rank", plan.rank)?;
    s.set_item("world_size", plan.world_size)?;
    s.set_item(
        "file_io",
        match read.file_io {
            Some(gpufeed::FileIo::Direct) => Some("direct"),
            Some(_) => Some("buffered"),
            None => None,
        },
    )?;
    s.set_item("read_seconds", read.seconds)?;
    s.set_item("seconds", seconds)?;
    s.set_item(
        "gb_per_s",
        if seconds > 0.0 {
            read.bytes_read as f64 / seconds / 1e9
        } else {
            0.0
        },
    )?;
    Ok(())
}

/// Registers the weights functions and classes.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(load_model, m)?)?;
    m.add_function(wrap_pyfunction!(save_async, m)?)?;
    m.add_class::<SaveHandle>()?;
    Ok(())
}
