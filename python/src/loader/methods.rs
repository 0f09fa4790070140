//! The Python methods of the [`Loader`]: its making (the arguments checked,
//! the source read, the library's loader started on the producer thread),
//! the epoch and its iterator, and the state of a run (`state_dict`,
//! `load_state_dict`).

use crate::convert::Count;
use crate::convert::IntoPy;
use crate::loader::fields::{row_sources, source_fields, Keep};
use crate::loader::handle::{Loader, LoaderIterator};
use crate::loader::producer::Producer;
use crate::loader::setup::{distributed, loader_device, pick_framework, Framework};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

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
        let device = loader_device(py, device, world_size, local_rank)?;
        let framework = pick_framework(py, framework, &device)?;
        let mut keep = Keep { views: Vec::new() };
        let (fields, as_dict) = source_fields(py, source, &mut keep)?;
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
