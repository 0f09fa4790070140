//! The driver itself: whether it is there, how many devices it has, what its
//! error codes mean, and its raw stream handle.

use crate::base::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};

/// A raw driver stream.
pub(super) struct StreamHandle(pub(super) sys::CUstream);
// SAFETY: CUstream is an opaque driver handle; enqueueing from several threads is allowed.
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no other precondition.
    unsafe { sys::is_culib_present() }
}

/// How many CUDA devices the driver reports (0 without a driver).
///
/// # Errors
/// The driver's error from `cuInit` or `cuDeviceGetCount`.
pub(crate) fn device_count() -> Result<usize> {
    if !driver_present() {
        return Ok(0);
    }
    let drv = |call: &'static str| {
        move |e: cudarc::driver::DriverError| Error::Driver {
            call,
            code: code_name(e.0),
        }
    };
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Errors after which the context cannot be used again.
pub(super) fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

pub(super) fn code_name(code: CUresult) -> String {
    let err = cudarc::driver::DriverError(code);
    match err.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{code:?}"),
    }
}
