//! `PinnedAllocator`: the seed's caching allocator of pinned host memory,
//! over the stream-aware pool.

use crate::alloc::buffer::PinnedBuffer;
use crate::alloc::host_mem::HostMem;
use crate::alloc::in_place::pin_on;
use crate::convert::IntoPy;
use crate::device::{device_or_default, nbytes, parse_dtype_or_f32, parse_shape, Device};
use gpufeed::PinnedPool;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The caching allocator of pinned host memory (the seed's API): `alloc`,
/// `free`, `get_array`, with the pool's statistics, cap and `empty_cache`.
/// Blocks freed while an operation still uses them return to the pool only
/// when the device is done.
#[pyclass(module = "gpufeed", frozen)]
pub struct PinnedAllocator {
    pool: PinnedPool,
    device: gpufeed::Device,
    cap: AtomicUsize,
}

#[pymethods]
impl PinnedAllocator {
    /// `PinnedAllocator(device=None, max_cached_bytes=None)`.
    #[new]
    #[pyo3(signature = (device=None, max_cached_bytes=None))]
    fn new(
        py: Python<'_>,
        device: Option<&Device>,
        max_cached_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let device = device_or_default(py, device)?;
        let pool = PinnedPool::new(&device);
        let cap = max_cached_bytes.unwrap_or(usize::MAX);
        pool.set_max_cached_bytes(cap);
        Ok(PinnedAllocator {
            pool,
            device,
            cap: AtomicUsize::new(cap),
        })
    }

    /// A pinned buffer of `shape` and `dtype`. Contents are unspecified (a
    /// reused block keeps old data) unless `zero=True`.
    #[pyo3(signature = (shape, dtype=None, zero=false))]
    fn alloc(
        &self,
        py: Python<'_>,
        shape: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        zero: bool,
    ) -> PyResult<PinnedBuffer> {
        let shape = parse_shape(shape)?;
        let dtype = parse_dtype_or_f32(dtype)?;
        let bytes = nbytes(&shape, dtype)?;
        let mut buf = py.detach(|| self.pool.alloc::<u8>(bytes)).py()?;
        if zero {
            buf.as_mut_slice().fill(0);
        }
        Ok(PinnedBuffer::new(
            HostMem::Pool(buf),
            dtype,
            &shape,
            &self.device,
            None,
        ))
    }

    /// Frees `buf` (back to the pool; refused while it has live views).
    fn free(&self, buf: &Bound<'_, PinnedBuffer>) -> PyResult<()> {
        buf.get().free_inner(buf.py(), "freed by free()")
    }

    /// A NumPy array over `buf`'s pinned memory, no copy (see `PinnedBuffer.get_array`).
    fn get_array<'py>(&self, buf: &Bound<'py, PinnedBuffer>) -> PyResult<Bound<'py, PyAny>> {
        PinnedBuffer::get_array(buf)
    }

    /// Pins `obj` in place on this allocator's device (see `gpufeed.pin`).
    fn pin(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PinnedBuffer> {
        pin_on(py, obj, &self.device)
    }

    /// The pool's statistics: bytes in use / cached / peak, blocks in use,
    /// hits, misses, driver allocations and frees with their times.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let d = PyDict::new(py);
        d.set_item("in_use_bytes", s.in_use_bytes)?;
        d.set_item("cached_bytes", s.cached_bytes)?;
        d.set_item("peak_in_use_bytes", s.peak_in_use_bytes)?;
        d.set_item("blocks_in_use", s.blocks_in_use)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("driver_allocs", s.driver_allocs)?;
        d.set_item("driver_frees", s.driver_frees)?;
        d.set_item("failed_frees", s.failed_frees)?;
        d.set_item("driver_alloc_ns", s.driver_alloc_ns)?;
        d.set_item("driver_free_ns", s.driver_free_ns)?;
        Ok(d)
    }

    /// The cap on bytes kept in free blocks (None: no cap).
    #[getter]
    fn get_max_cached_bytes(&self) -> Option<usize> {
        Some(self.cap.load(Ordering::Relaxed)).filter(|&c| c != usize::MAX)
    }

    /// Sets the cap (None: no cap); blocks beyond it are freed now.
    #[setter]
    fn set_max_cached_bytes(&self, py: Python<'_>, cap: Option<usize>) {
        let cap = cap.unwrap_or(usize::MAX);
        self.cap.store(cap, Ordering::Relaxed);
        py.detach(|| self.pool.set_max_cached_bytes(cap));
    }

    /// Frees every cached block (blocks in use are untouched).
    fn empty_cache(&self, py: Python<'_>) {
        py.detach(|| self.pool.empty_cache());
    }

    /// The allocator's device.
    #[getter]
    fn device(&self) -> Device {
        Device {
            inner: self.device.clone(),
        }
    }
}
