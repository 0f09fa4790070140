//! Choosing and opening a backend: the CUDA driver when a GPU is there, the
//! CPU emulation otherwise, behind one [`Device`] handle.

use crate::backend::{Backend, BackendKind, DeviceInfo};
use crate::cpu::{CpuBackend, LockPolicy};
use crate::cuda::{CudaBackend, WaitMode};
use crate::error::{Error, Result};
use std::sync::Arc;

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
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", self.info()).finish()
    }
}

impl Device {
    /// Opens a device as `opts` says.
    pub fn open(opts: DeviceOptions) -> Result<Device> {
        match opts.backend {
            BackendChoice::Cuda => {
                let b = CudaBackend::new(opts.ordinal, opts.wait_mode)?;
                Ok(Self::wrap(Arc::new(b), "forced".into()))
            }
            BackendChoice::Cpu => Ok(Self::wrap(
                Arc::new(CpuBackend::new(opts.lock_policy)),
                "forced".into(),
            )),
            BackendChoice::Auto => match CudaBackend::new(opts.ordinal, opts.wait_mode) {
                Ok(b) => Ok(Self::wrap(Arc::new(b), "auto: CUDA device found".into())),
                Err(e @ Error::NoSuchDevice { count, .. }) if count > 0 => Err(e),
                Err(e) => Ok(Self::wrap(
                    Arc::new(CpuBackend::new(opts.lock_policy)),
                    format!("auto: no usable GPU ({e})").into(),
                )),
            },
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

    fn wrap(backend: Arc<dyn Backend>, note: Arc<str>) -> Device {
        Device {
            backend,
            note,
            live_buffers: Arc::default(),
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
    /// job keeps until the GPU is done with them.
    pub fn live_device_buffers(&self) -> usize {
        self.live_buffers.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The first unrecoverable error, if the context is broken.
    pub fn broken(&self) -> Option<Error> {
        self.backend.broken()
    }

    /// Blocks until all queued work on the device has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize()
    }

    /// Identity used to reject mixing buffers of different devices.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.backend) as *const () as usize
    }
}

/// Test support: the devices every test body runs against.
pub mod testing {
    use super::*;

    /// Whether `REQUIRE_GPU=1` is set: GPU tests must then run, not skip.
    pub fn gpu_required() -> bool {
        std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
    }

    /// The CUDA device, or `None` with a printed notice (a panic when
    /// `REQUIRE_GPU=1`).
    pub fn cuda(test: &str) -> Option<Device> {
        match CudaBackend::new(0, WaitMode::default()) {
            Ok(b) => Some(Device::wrap(Arc::new(b), "test".into())),
            Err(e) => {
                assert!(
                    !gpu_required(),
                    "{test}: REQUIRE_GPU=1 but no CUDA device: {e}"
                );
                // Written to the stderr handle directly: the test harness
                // captures eprintln!, and a skip must be visible.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {test}: {e}");
                None
            }
        }
    }

    /// Test bodies that use the GPU run one at a time in a process: a test
    /// holding a GPU-side gate closed must not share the device with another
    /// test's `cuMemFree`, which waits for the whole device to go idle (and so
    /// for the gate) while holding driver locks the first test may need.
    pub fn serial() -> std::sync::MutexGuard<'static, ()> {
        static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens `gate` after 20 s if the test has not, so a failing test fails
    /// instead of hanging the suite. Dropping the guard disarms it.
    ///
    /// The thread holds the gate weakly: holding it (and so its device) would
    /// make this thread the device's last owner once the test ends, tearing
    /// the CUDA context down on its own schedule, even while the process
    /// exits (heap corruption at exit under compute-sanitizer).
    pub fn watchdog(gate: &Arc<crate::MappedFlag>) -> Watchdog {
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (a, g) = (armed.clone(), Arc::downgrade(gate));
        std::thread::spawn(move || {
            for _ in 0..200 {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if !a.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
            }
            if let Some(g) = g.upgrade() {
                eprintln!("watchdog: opening a gate the test left closed");
                g.set(1);
            }
        });
        Watchdog(armed)
    }

    /// Disarms its watchdog on drop.
    pub struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

    impl Drop for Watchdog {
        fn drop(&mut self) {
            self.0.store(false, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Every backend present: the CPU emulation, and CUDA when available.
    pub fn backends(test: &str) -> Vec<Device> {
        let mut v = vec![Device::cpu()];
        v.extend(cuda(test));
        v
    }
}
