//! Choosing and opening a backend: the CUDA driver when a GPU is there, the
//! CPU emulation otherwise, behind one [`Device`] handle.

use crate::backend::{Backend, BackendKind, DeviceInfo, RawStream};
use crate::cpu::{CpuBackend, LockPolicy};
use crate::cuda::{CudaBackend, DeviceMemory, WaitMode};
use crate::error::{Error, Result};
use crate::kernel::Builtins;
use std::sync::{Arc, Mutex, Weak};

/// Which backend to open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when a driver and a device are present, else the CPU emulation.
    #[default]
    Auto,
    /// CUDA or an error.
    Cuda,
    /// The CPU emulation.
    Cpu,
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(BackendChoice::Auto),
            "cuda" | "gpu" => Ok(BackendChoice::Cuda),
            "cpu" | "emulation" => Ok(BackendChoice::Cpu),
            other => Err(Error::InvalidArgument(format!(
                "unknown backend {other:?}: use auto, cuda or cpu"
            ))),
        }
    }
}

/// The environment variable that forces a backend (`auto`, `cuda`, `cpu`).
pub const BACKEND_ENV: &str = "HOST_BACKEND";

/// How to open a device.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeviceOptions {
    /// Backend to use.
    pub backend: BackendChoice,
    /// Device ordinal (CUDA).
    pub ordinal: usize,
    /// How CUDA completion is waited for.
    pub wait_mode: WaitMode,
    /// How CUDA device memory is allocated and freed.
    pub device_memory: DeviceMemory,
    /// What the CPU backend does when locking memory is refused.
    pub lock_policy: LockPolicy,
}

impl DeviceOptions {
    /// Default options, with the backend taken from `HOST_BACKEND` if set.
    pub fn from_env() -> Result<Self> {
        let backend = match std::env::var(BACKEND_ENV) {
            Ok(v) => v.parse()?,
            Err(_) => BackendChoice::Auto,
        };
        Ok(DeviceOptions {
            backend,
            ..Default::default()
        })
    }
}

/// A handle to one device and its backend; cheap to clone.
#[derive(Clone)]
pub struct Device {
    pub(crate) backend: Arc<dyn Backend>,
    note: Arc<str>,
    /// Device buffers alive now (a leak and use-after-free check for tests).
    pub(crate) live_buffers: Arc<std::sync::atomic::AtomicUsize>,
    /// The streams opened on this device (for `synchronize`).
    streams: Arc<Mutex<Vec<Weak<dyn RawStream>>>>,
    /// The in-tree kernels, loaded at open (lazily for `Device::cpu`).
    builtins: Arc<std::sync::OnceLock<Builtins>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", self.info()).finish()
    }
}

impl Device {
    /// Opens a device as `opts` says.
    ///
    /// # Errors
    /// `BackendUnavailable` (CUDA forced without a driver), `NoSuchDevice`,
    /// or the driver's error (the in-tree kernels' PTX is loaded here).
    pub fn open(opts: DeviceOptions) -> Result<Device> {
        let device = Self::open_backend(opts)?;
        device.builtins()?;
        Ok(device)
    }

    fn open_backend(opts: DeviceOptions) -> Result<Device> {
        match opts.backend {
            BackendChoice::Cuda => {
                let b = CudaBackend::new(opts.ordinal, opts.wait_mode, opts.device_memory)?;
                Ok(Self::wrap(Arc::new(b), "forced".into()))
            }
            BackendChoice::Cpu => Ok(Self::wrap(
                Arc::new(CpuBackend::new(opts.lock_policy)),
                "forced".into(),
            )),
            BackendChoice::Auto => {
                match CudaBackend::new(opts.ordinal, opts.wait_mode, opts.device_memory) {
                    Ok(b) => Ok(Self::wrap(Arc::new(b), "auto: CUDA device found".into())),
                    Err(e @ Error::NoSuchDevice { count, .. }) if count > 0 => Err(e),
                    Err(e) => Ok(Self::wrap(
                        Arc::new(CpuBackend::new(opts.lock_policy)),
                        format!("auto: no usable GPU ({e})").into(),
                    )),
                }
            }
        }
    }

    /// Opens the device chosen by `HOST_BACKEND` (default: auto).
    pub fn from_env() -> Result<Device> {
        Self::open(DeviceOptions::from_env()?)
    }

    /// The CPU emulation backend.
    pub fn cpu() -> Device {
        Self::wrap(
            Arc::new(CpuBackend::new(LockPolicy::default())),
            "forced".into(),
        )
    }

    pub(crate) fn wrap(backend: Arc<dyn Backend>, note: Arc<str>) -> Device {
        Device {
            backend,
            note,
            live_buffers: Arc::default(),
            streams: Arc::default(),
            builtins: Arc::default(),
        }
    }

    /// Name, driver, size of the device.
    pub fn info(&self) -> &DeviceInfo {
        self.backend.info()
    }

    /// The backend's kind.
    pub fn kind(&self) -> BackendKind {
        self.info().backend
    }

    /// One line saying which backend runs and why.
    pub fn banner(&self) -> String {
        let i = self.info();
        let driver = i
            .driver
            .as_deref()
            .map(|d| format!(", driver {d}"))
            .unwrap_or_default();
        format!(
            "backend: {} — {} ({} compute units, {:.1} GiB{driver}) [{}]",
            i.backend,
            i.name,
            i.compute_units,
            i.total_memory as f64 / (1u64 << 30) as f64,
            self.note
        )
    }

    /// Device buffers of this handle alive now, including those a cancelled
    /// job keeps until the GPU is done with them (a test hook).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn live_device_buffers(&self) -> usize {
        self.live_buffers.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The first unrecoverable error, if the context is broken.
    pub fn broken(&self) -> Option<Error> {
        self.backend.broken()
    }

    /// Blocks the calling thread until all work queued so far on the
    /// device's streams has finished *and* its completions have been
    /// delivered: every job queued before the call is done, and the buffers
    /// of dropped (cancelled) jobs are back in their pools or freed when it
    /// returns. Synchronous code only (never on an executor thread).
    ///
    /// # Errors
    /// `Internal` on a completion thread (the `Drop` of a cancelled job's
    /// bundle), where it would wait for itself. The first fault of the work
    /// waited for ([`Error::ContextBroken`]
    /// after a trap), or a driver error.
    pub fn synchronize(&self) -> Result<()> {
        crate::completion::refuse_blocking_on_completion_thread("Device::synchronize")?;
        let streams: Vec<Arc<dyn RawStream>> = crate::completion::lock(&self.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut first_err = None;
        for s in &streams {
            // A point recorded now completes after everything queued before it
            // on that stream, and its completion source delivers completions
            // (and runs deferred releases) in order: once it is done, so are
            // they. Recorded even on a broken context (the CPU records
            // anyway; on CUDA the error comes back at once).
            let r = s.record(false).and_then(|ev| ev.completion.block());
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        drop(streams);
        let r = self.backend.synchronize();
        match first_err {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Remembers a stream for [`Device::synchronize`].
    pub(crate) fn register_stream(&self, raw: &Arc<dyn RawStream>) {
        let mut streams = crate::completion::lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(raw));
    }

    /// The in-tree kernels of `gpu-kernels` on this device.
    pub(crate) fn builtins(&self) -> Result<&Builtins> {
        if let Some(b) = self.builtins.get() {
            return Ok(b);
        }
        let loaded = Builtins::load(self)?;
        // Another thread may have won the race; either copy is the same.
        Ok(self.builtins.get_or_init(|| loaded))
    }

    /// Identity used to reject mixing buffers of different devices.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.backend) as *const () as usize
    }
}
