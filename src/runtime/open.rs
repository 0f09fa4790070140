//! Choosing and opening a device: the CUDA driver when a GPU is there, the
//! CPU emulation otherwise, as the options or the environment say.

use crate::backend::cpu::{CpuBackend, LockPolicy};
use crate::backend::cuda::{CudaBackend, DeviceMemory, WaitMode};
use crate::backend::BackendKind;
use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::kernel::Builtins;
use std::sync::Arc;

/// Which backend to open.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendChoice, BackendKind, Device, DeviceOptions};
/// let choice: BackendChoice = "cpu".parse()?; // what `HOST_BACKEND=cpu` says
/// assert_eq!(choice, BackendChoice::Cpu);
/// let device = Device::open(DeviceOptions { backend: choice, ..Default::default() })?;
/// assert_eq!(device.kind(), BackendKind::Cpu);
/// let err = "tpu".parse::<BackendChoice>().unwrap_err();
/// assert!(matches!(err, gpufeed::Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
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
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendChoice, Device, DeviceOptions};
/// // Two emulated devices, as `HOST_CPU_DEVICES=2` gives `DeviceOptions::from_env`.
/// let opts = DeviceOptions {
///     backend: BackendChoice::Cpu,
///     emulated_devices: 2,
///     ..Default::default()
/// };
/// let devices = Device::all(opts)?;
/// assert_eq!(devices.len(), 2);
/// assert_eq!(devices[1].ordinal(), 1);
/// let err = Device::open(DeviceOptions { ordinal: 5, ..opts }).unwrap_err();
/// assert!(matches!(err, gpufeed::Error::NoSuchDevice { index: 5, count: 2 }));
/// # Ok(()) }
/// ```
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

impl Device {
    /// Opens a device as `opts` says.
    ///
    /// # Errors
    /// `BackendUnavailable` (CUDA forced without a driver), `NoSuchDevice`,
    /// or the driver's error (the in-tree kernels' PTX is loaded here).
    pub fn open(opts: DeviceOptions) -> Result<Device> {
        let device = Self::open_backend(opts)?;
        Builtins::of(&device)?;
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
            BackendKind::Cuda => crate::backend::cuda::device_count()?,
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
}
