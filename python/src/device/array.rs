//! `DeviceArray`: device memory of a shape and dtype, and what it checks
//! before an operation takes it or a consumer exports it.

use crate::device::parse::nbytes;
use crate::device::state::{DevMem, State, StateCell};
use crate::dtype::DType;
use crate::{convert::buffer_error, convert::IntoPy};
use gpufeed::{BackendKind, DeviceBuffer};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Device memory of a shape and dtype: allocated here (`Device.empty`), or
/// a PyTorch/CuPy CUDA array wrapped in place (`as_device_array`).
///
/// Exported without a copy through `__dlpack__` (counted: while a consumer
/// holds it, the array can't be freed or given to an operation) and
/// `__cuda_array_interface__` (not counted: once asked for, the array can't be
/// freed or given to an operation any more; it is freed when the last
/// reference goes, after a device-wide synchronize, since the interface
/// never says which stream its consumers used). A DLPack export's release
/// waits for the consumer's stream given to `__dlpack__(stream=...)`: the
/// memory is freed, and the array used again, only once that stream is
/// past the release. On the CPU emulation both raise `BufferError`: there
/// device memory is host memory that no GPU library can use; use
/// `download()` or a copy into a `PinnedBuffer`.
#[pyclass(module = "gpufeed", frozen)]
pub struct DeviceArray {
    pub(crate) state: StateCell<DevMem>,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) nbytes: usize,
    pub(crate) device: gpufeed::Device,
    /// Live DLPack exports.
    pub(crate) exports: Arc<AtomicUsize>,
    /// Handed out through `__cuda_array_interface__` (uncounted).
    pub(crate) shared: AtomicBool,
    /// Released DLPack exports whose consumers may still be at work.
    pub(crate) releases: Arc<crate::dlpack::Releases>,
}

impl Drop for DeviceArray {
    /// An array handed out through `__cuda_array_interface__` is freed only
    /// after a device-wide synchronize (on the release thread; this thread
    /// does not wait): its consumers' streams are unknown. Otherwise the
    /// memory goes at once (the usual stream-ordered free).
    fn drop(&mut self) {
        if !self.shared.load(Ordering::SeqCst) || self.device.kind() != BackendKind::Cuda {
            return;
        }
        let state = std::mem::replace(&mut *self.state.lock(), State::Freed("dropped".into()));
        if let State::Ready(mem) = state {
            gpufeed::interop::release_after_device_idle(&self.device).defer(move || drop(mem));
        }
    }
}

impl DeviceArray {
    /// A new array (the allocation runs with the GIL released: the CPU
    /// emulation zeroes it, some 0.2 s for 256 MiB).
    pub(crate) fn alloc(
        py: Python<'_>,
        device: &gpufeed::Device,
        shape: Vec<usize>,
        dtype: DType,
    ) -> PyResult<Self> {
        let nbytes = nbytes(&shape, dtype)?;
        let buf = py.detach(|| DeviceBuffer::<u8>::new(device, nbytes)).py()?;
        Ok(DeviceArray {
            state: StateCell::ready(DevMem::Own(buf)),
            dtype,
            shape,
            nbytes,
            device: device.clone(),
            exports: Arc::default(),
            shared: AtomicBool::new(false),
            releases: Arc::default(),
        })
    }

    /// Moves the memory out (state: in-flight) once every released DLPack
    /// export's consumer is past its release (waited for, GIL released),
    /// and `check` passes.
    pub(super) fn take_settled(&self, check: impl Fn(&DevMem) -> PyResult<()>) -> PyResult<DevMem> {
        loop {
            self.releases.settle();
            let mut again = false;
            let r = self.state.take("the device array", |m| {
                // A release since the wait: wait for it too.
                if !self.releases.pending().is_empty() {
                    again = true;
                    return Err(buffer_error("a DLPack export was just released"));
                }
                check(m)
            });
            if !again {
                return r;
            }
        }
    }

    /// Moves the memory out for an operation (state: in-flight).
    pub(crate) fn take_for_operation(&self) -> PyResult<DevMem> {
        self.take_settled(|_| {
            let n = self.exports.load(Ordering::SeqCst);
            if n > 0 {
                return Err(buffer_error(format!(
                    "the device array has {n} live DLPack export(s): drop the consumers' tensors \
                     first"
                )));
            }
            if self.shared.load(Ordering::SeqCst) {
                return Err(buffer_error(
                    "the device array was exported through __cuda_array_interface__, which can't \
                     tell when its consumers are done: it can't be given to an operation any more \
                     (export with __dlpack__, which is counted)",
                ));
            }
            Ok(())
        })
    }

    /// Runs `f` on the memory of an array allocated here, moved out for the
    /// call (state: in-flight, so any other use meanwhile gets a
    /// `BufferError` instead of waiting), and puts it back after. `f` may
    /// write: released DLPack exports' consumers are waited for first (GIL
    /// released).
    pub(crate) fn with_own<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        self.with_own_inner(what, true, f)
    }

    /// As [`DeviceArray::with_own`], for an `f` that only reads: a released
    /// export's consumer still reading is no conflict, so nothing is waited
    /// for and the GIL is never released here (a caller may hold a view of
    /// NumPy memory that only the GIL keeps in place).
    pub(crate) fn with_own_read<R>(
        &self,
        what: &str,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        self.with_own_inner(what, false, f)
    }

    fn with_own_inner<R>(
        &self,
        what: &str,
        writes: bool,
        f: impl FnOnce(&mut DeviceBuffer<u8>) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut mem = self.take_own(what, writes)?;
        let result = match &mut mem {
            DevMem::Own(buf) => f(buf),
            DevMem::Foreign { .. } => Err(buffer_error("not an array allocated by gpufeed")),
        };
        self.state.set(State::Ready(mem));
        result
    }

    /// Moves the memory of an array allocated here out (state: in-flight)
    /// for work that outlives the call; [`DeviceArray::put_back`] returns it.
    /// `writes`: as [`DeviceArray::with_own`] (released DLPack exports'
    /// consumers waited for first, GIL released), else as
    /// [`DeviceArray::with_own_read`].
    pub(crate) fn take_own(&self, what: &str, writes: bool) -> PyResult<DevMem> {
        let check = |m: &DevMem| match m {
            DevMem::Own(_) => Ok(()),
            DevMem::Foreign { .. } => Err(buffer_error(format!(
                "{what} works on arrays allocated by gpufeed"
            ))),
        };
        if writes {
            self.take_settled(check)
        } else {
            self.state.take("the device array", check)
        }
    }

    /// Returns memory taken by [`DeviceArray::take_own`] (state: ready).
    pub(crate) fn put_back(&self, mem: DevMem) {
        self.state.set(State::Ready(mem));
    }

    pub(super) fn cuda_only(&self, what: &str) -> PyResult<()> {
        if self.device.kind() != BackendKind::Cuda {
            return Err(buffer_error(format!(
                "{what}: this device array lives on the CPU emulation, where device memory is \
                 host memory no GPU library can use; download() it or copy it into a PinnedBuffer"
            )));
        }
        Ok(())
    }
}
