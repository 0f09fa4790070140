//! GPUDirect Storage: file reads straight into device memory by cuFile
//! (`libcufile`, through cudarc's `cufile` bindings, loaded at run time),
//! where the driver and the file system support it; the staging ring
//! otherwise ([`Staging::file_route`](crate::Staging::file_route)).
//!
//! The probe, once per process: is the `nvidia-fs` kernel module loaded
//! (`/proc/driver/nvidia-fs`; without it cuFile can only run in
//! compatibility mode, unless the platform offers NVMe P2P DMA: set
//! `HOST_GDS=probe` to open the driver anyway); is `libcufile` loadable; does
//! `cuFileDriverOpen` succeed; do the driver's properties show a storage
//! type it reaches natively (the `nvidia-fs` kernel driver or NVMe P2P DMA:
//! `dstatusflags` non-zero)? A driver with none runs in compatibility mode,
//! where cuFile itself reads with POSIX calls through bounce buffers, as the
//! ring does, in one thread: the ring is used then. Per file,
//! `cuFileHandleRegister` of a descriptor opened with `O_DIRECT` says
//! whether its file system is supported.

use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use std::fs::File;
use std::sync::OnceLock;

/// What the GPUDirect Storage probe found ([`crate::gds_status`]).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{gds_status, Device, GdsStatus, Staging};
/// let device = Device::from_env()?; // CUDA when present, else the CPU emulation
/// let status = gds_status(&device);
/// println!("{status}"); // what was found, and what is missing
/// let route = if status.is_available() { "cuFile" } else { "the staging ring" };
/// println!("file reads of this device go through {route}");
/// assert_eq!(gds_status(&Device::cpu()), GdsStatus::NotCuda);
/// assert_eq!(Staging::new(&Device::cpu())?.file_route(), GdsStatus::NotCuda);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GdsStatus {
    /// cuFile reads into device memory natively (the driver's `nvfs`
    /// version and storage flags): file reads of a CUDA device use it
    /// where the file's system is supported.
    Available {
        /// The `nvidia-fs` driver's version (major, minor).
        nvfs_version: (u32, u32),
        /// cuFile's `dstatusflags`: the storage kinds the driver supports.
        dstatusflags: u32,
    },
    /// The device is the CPU emulation.
    NotCuda,
    /// The `nvidia-fs` kernel module is not loaded, and `HOST_GDS=probe`
    /// doesn't ask for the cuFile driver to be opened anyway (opening it
    /// costs time, and `libcufile` leaves an allocation and a failed free
    /// behind that compute-sanitizer reports).
    NoKernelModule,
    /// `libcufile` is not found by the dynamic loader.
    NoLibrary,
    /// `cuFileDriverOpen` failed (its error).
    DriverOpenFailed(String),
    /// The driver opened in compatibility mode only (no `nvidia-fs`, no
    /// P2P DMA): its reads would be POSIX reads through bounce buffers.
    CompatibilityModeOnly {
        /// The `nvidia-fs` driver's version (major, minor).
        nvfs_version: (u32, u32),
    },
}

impl GdsStatus {
    /// Whether file reads may go through cuFile.
    pub fn is_available(&self) -> bool {
        matches!(self, GdsStatus::Available { .. })
    }
}

impl std::fmt::Display for GdsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GdsStatus::Available {
                nvfs_version: (a, b),
                dstatusflags,
            } => write!(
                f,
                "GPUDirect Storage available (nvidia-fs {a}.{b}, storage flags {dstatusflags:#x})"
            ),
            GdsStatus::NotCuda => write!(f, "no GPUDirect Storage: the CPU emulation"),
            GdsStatus::NoKernelModule => write!(
                f,
                "no GPUDirect Storage: the nvidia-fs kernel module is not loaded \
                 (HOST_GDS=probe opens the cuFile driver anyway)"
            ),
            GdsStatus::NoLibrary => write!(
                f,
                "no GPUDirect Storage: libcufile not found by the dynamic loader"
            ),
            GdsStatus::DriverOpenFailed(e) => {
                write!(f, "no GPUDirect Storage: cuFileDriverOpen failed ({e})")
            }
            GdsStatus::CompatibilityModeOnly {
                nvfs_version: (a, b),
            } => write!(
                f,
                "no GPUDirect Storage: cuFile opens in compatibility mode only (nvidia-fs \
                 {a}.{b}, no storage type supported natively)"
            ),
        }
    }
}

/// The driver-level probe, once per process (the driver is process-wide).
fn driver_probe() -> GdsStatus {
    static PROBE: OnceLock<GdsStatus> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            use cudarc::cufile::{result, sys};
            let asked = std::env::var("HOST_GDS").is_ok_and(|v| v == "probe");
            if !asked && !std::path::Path::new("/proc/driver/nvidia-fs").exists() {
                return GdsStatus::NoKernelModule;
            }
            // SAFETY: only tries the loader; loads nothing else.
            if !unsafe { sys::is_culib_present() } {
                return GdsStatus::NoLibrary;
            }
            if let Err(e) = result::driver_open() {
                return GdsStatus::DriverOpenFailed(format!("{e:?}"));
            }
            match result::driver_get_properties() {
                Ok(p) => {
                    let nvfs_version = (p.nvfs.major_version, p.nvfs.minor_version);
                    if p.nvfs.dstatusflags != 0 {
                        GdsStatus::Available {
                            nvfs_version,
                            dstatusflags: p.nvfs.dstatusflags,
                        }
                    } else {
                        GdsStatus::CompatibilityModeOnly { nvfs_version }
                    }
                }
                Err(e) => GdsStatus::DriverOpenFailed(format!("cuFileDriverGetProperties: {e:?}")),
            }
        })
        .clone()
}

/// What the GPUDirect Storage probe finds for `device` (the driver probed
/// once per process).
pub fn gds_status(device: &Device) -> GdsStatus {
    if device.kind() != crate::backend::BackendKind::Cuda {
        return GdsStatus::NotCuda;
    }
    driver_probe()
}

/// A file registered with cuFile (deregistered on drop).
pub(crate) struct Registered {
    handle: cudarc::cufile::sys::CUfileHandle_t,
}

// SAFETY: a cuFile handle is usable from any thread (cuFile's API is
// thread-safe); it is only used through `&self`.
unsafe impl Send for Registered {}

impl Registered {
    /// `direct` (a descriptor opened with `O_DIRECT`) registered; `Err`
    /// with cuFile's reason when its file system is not supported.
    pub(crate) fn new(direct: &File) -> std::result::Result<Registered, String> {
        use cudarc::cufile::{result, sys};
        use std::os::unix::io::AsRawFd;
        let descr = sys::CUfileDescr_t {
            type_: sys::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: sys::CUfileDescr_t__bindgen_ty_1 {
                fd: direct.as_raw_fd(),
            },
            fs_ops: std::ptr::null(),
        };
        result::handle_register(&descr)
            .map(|handle| Registered { handle })
            .map_err(|e| format!("cuFileHandleRegister: {e:?}"))
    }

    /// Reads `len` bytes of the file from `at` into device memory at
    /// `dev`, synchronously (cuFile's own threads and DMA).
    ///
    /// # Safety
    /// `dev..dev + len` is device memory of the current context that
    /// nothing else uses until this returns.
    pub(crate) unsafe fn read(&self, at: u64, dev: u64, len: usize) -> Result<()> {
        let mut done = 0usize;
        while done < len {
            let file_at = i64::try_from(at + done as u64)
                .map_err(|_| Error::InvalidArgument("file offset past i64".into()))?;
            // SAFETY: the caller's range; `done < len` bytes already read.
            // (cudarc's `result::read` would transmute a POSIX errno into
            // cuFile's error enum: the raw call instead.)
            let n = unsafe {
                cudarc::cufile::sys::cuFileRead(
                    self.handle,
                    dev as *mut std::ffi::c_void,
                    len - done,
                    file_at as _,
                    done as _,
                )
            };
            if n < 0 {
                let text = if n == -1 {
                    std::io::Error::last_os_error().to_string()
                } else if -n < 5000 {
                    std::io::Error::from_raw_os_error((-n) as i32).to_string()
                } else {
                    format!("cuFile error {}", -n)
                };
                return Err(Error::Io(std::sync::Arc::new(std::io::Error::other(
                    format!("cuFileRead: {text}"),
                ))));
            }
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the file ends before offset {} (truncated, or it shrank during the read)",
                        at + len as u64
                    ),
                )
                .into());
            }
            done += n as usize;
        }
        Ok(())
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once.
        let _ = unsafe { cudarc::cufile::result::handle_deregister(self.handle) };
    }
}
