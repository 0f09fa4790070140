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
    /// How many devices the CPU emulation offers [`Device::all`] (0 counts
    /// as 1; [`DeviceOptions::from_env`] reads [`CPU_DEVICES_ENV`]), so
    /// multi-device code runs, and is tested, without GPUs.
    pub emulated_devices: usize,
}

/// The backend of every open device, by [`Device::id`]: commands that meet
/// memory of another device (peer copies) find its context here. Weak, so
/// a device closes as usual; a view of its memory keeps it open (its buffer
/// holds the device).
static OPEN: Mutex<Vec<(usize, Weak<dyn Backend>)>> = Mutex::new(Vec::new());

/// The backend of the open device `id`.
pub(crate) fn backend_by_id(id: usize) -> Option<Arc<dyn Backend>> {
    crate::completion::lock(&OPEN)
        .iter()
        .find(|(i, w)| *i == id && w.strong_count() > 0)
        .and_then(|(_, w)| w.upgrade())
}

/// The environment variable giving the CPU emulation's device count.
pub const CPU_DEVICES_ENV: &str = "HOST_CPU_DEVICES";

impl DeviceOptions {
    /// Default options, with the backend taken from `HOST_BACKEND` if set.
    pub fn from_env() -> Result<Self> {
        let backend = match std::env::var(BACKEND_ENV) {
            Ok(v) => v.parse()?,
            Err(_) => BackendChoice::Auto,
        };
        let emulated_devices = match std::env::var(CPU_DEVICES_ENV) {
            Ok(v) => v.trim().parse().map_err(|_| {
                Error::InvalidArgument(format!("{CPU_DEVICES_ENV}={v:?}: expected a count"))
            })?,
            Err(_) => 1,
        };
        Ok(DeviceOptions {
            backend,
            emulated_devices,
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
            BackendChoice::Cpu => Self::open_cpu(opts, "forced".into()),
            BackendChoice::Auto => {
                match CudaBackend::new(opts.ordinal, opts.wait_mode, opts.device_memory) {
                    Ok(b) => Ok(Self::wrap(Arc::new(b), "auto: CUDA device found".into())),
                    Err(e @ Error::NoSuchDevice { count, .. }) if count > 0 => Err(e),
                    Err(e) => Self::open_cpu(opts, format!("auto: no usable GPU ({e})").into()),
                }
            }
        }
    }

    /// The emulated device `opts.ordinal` of `opts.emulated_devices`.
    fn open_cpu(opts: DeviceOptions, note: Arc<str>) -> Result<Device> {
        let count = opts.emulated_devices.max(1);
        if opts.ordinal >= count {
            return Err(Error::NoSuchDevice {
                index: opts.ordinal,
                count,
            });
        }
        Ok(Self::wrap(
            Arc::new(CpuBackend::with_ordinal(opts.lock_policy, opts.ordinal)),
            note,
        ))
    }

    /// Every device of the backend `opts` chooses (its `ordinal` aside),
    /// in ordinal order, with direct peer copies enabled between each pair
    /// where the topology allows ([`Device::enable_peer_access`]). On the
    /// CPU emulation, `opts.emulated_devices` devices.
    ///
    /// # Errors
    /// As [`Device::open`], for any of them.
    pub fn all(opts: DeviceOptions) -> Result<Vec<Device>> {
        let first = Device::open(DeviceOptions { ordinal: 0, ..opts })?;
        let count = match first.kind() {
            BackendKind::Cuda => crate::cuda::device_count()?,
            BackendKind::Cpu => opts.emulated_devices.max(1),
        };
        let choice = match first.kind() {
            BackendKind::Cuda => BackendChoice::Cuda,
            BackendKind::Cpu => BackendChoice::Cpu,
        };
        let mut all = vec![first];
        for ordinal in 1..count {
            all.push(Device::open(DeviceOptions {
                backend: choice,
                ordinal,
                ..opts
            })?);
        }
        for a in &all {
            for b in &all {
                if a.id() != b.id() {
                    a.enable_peer_access(b)?;
                }
            }
        }
        Ok(all)
    }

    /// The device's ordinal among those of its backend.
    pub fn ordinal(&self) -> usize {
        self.info().ordinal
    }

    /// Whether copies between this device and `peer`
    /// ([`Commands::copy_peer`](crate::Commands::copy_peer)) go directly
    /// (peer access, over NVLink or PCIe), enabling it where the topology
    /// allows; `false` when the driver must stage them through host memory
    /// (they still work). Two emulated devices: `true`.
    ///
    /// # Errors
    /// `InvalidArgument` for devices of different backends; a driver error.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<bool> {
        if self.kind() != peer.kind() {
            return Err(Error::InvalidArgument(
                "peer access between devices of different backends".into(),
            ));
        }
        self.backend.enable_peer_access(&*peer.backend)
    }

    /// The device's PCI address (`0000:17:00.0`), for a GPU.
    pub fn pci_bus_id(&self) -> Option<String> {
        self.backend.pci_bus_id()
    }

    /// The host's NUMA node closest to the device, as the platform reports
    /// it (sysfs, the same source as `nvidia-smi topo -m`): `None` for the
    /// CPU emulation, or when the platform does not say (`-1`, as in most
    /// VMs). [`PinnedPool::near`](crate::PinnedPool::near) places memory there.
    pub fn numa_node(&self) -> Option<u32> {
        let id = self.pci_bus_id()?;
        crate::numa::node_of_pci_in(std::path::Path::new(crate::numa::SYSFS), &id)
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
        {
            let mut open = crate::completion::lock(&OPEN);
            open.retain(|(_, w)| w.strong_count() > 0);
            open.push((
                Arc::as_ptr(&backend) as *const () as usize,
                Arc::downgrade(&backend),
            ));
        }
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
    /// Whether `other` is a handle of this same device (buffers of one
    /// can be used with the other).
    pub fn same_as(&self, other: &Device) -> bool {
        self.id() == other.id()
    }

    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.backend) as *const () as usize
    }

    /// Identity of the host memory this device's pinned buffers are: one
    /// per backend kind, since every device of a backend can copy from any
    /// of them (portable pinned memory on CUDA; plain memory on the CPU).
    pub(crate) fn host_domain(&self) -> usize {
        match self.kind() {
            BackendKind::Cuda => 1,
            BackendKind::Cpu => 2,
        }
    }
}
