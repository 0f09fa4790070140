//! Loaded PTX modules and their kernel entry points.

use super::shared::Shared;
use cudarc::driver::sys::{self};
use std::sync::Arc;

/// A loaded module, unloaded when the last function handle of it goes.
pub(crate) struct ModuleHandle {
    pub(super) module: sys::CUmodule,
    pub(super) shared: Arc<Shared>,
    /// Each entry's parameter sizes, read from the PTX text.
    pub(super) entries: std::collections::HashMap<String, Vec<usize>>,
}
// SAFETY: CUmodule is an opaque driver handle; the driver API is thread-safe.
unsafe impl Send for ModuleHandle {}
// SAFETY: as above; the handle is never mutated on our side.
unsafe impl Sync for ModuleHandle {}

impl Drop for ModuleHandle {
    fn drop(&mut self) {
        if self.shared.bind().is_ok() {
            // SAFETY: our module; every function handle of it holds this
            // handle's Arc, and a launch keeps its function until enqueued
            // (the driver keeps what queued work needs).
            unsafe {
                sys::cuModuleUnload(self.module);
            }
        }
    }
}

/// A kernel entry point; holds its module.
pub(crate) struct FunctionHandle {
    pub(super) func: sys::CUfunction,
    pub(super) _module: Arc<ModuleHandle>,
    /// The dynamic shared bytes the function has been opted in to
    /// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`; 48 KiB without).
    pub(super) dynamic_optin: std::sync::atomic::AtomicU32,
}

impl FunctionHandle {
    /// The 48 KiB every function may take without opting in.
    const DEFAULT_DYNAMIC: u32 = 48 * 1024;

    /// Checks that `dynamic` bytes of dynamic shared memory fit beside the
    /// function's static shared memory on this device, and opts the
    /// function in to more than 48 KiB where asked.
    ///
    /// # Errors
    /// `InvalidLaunch` when static + dynamic exceed the device's opt-in
    /// maximum; the driver's error from the attribute calls.
    pub(super) fn fit_shared(
        &self,
        name: &'static str,
        dynamic: u32,
        shared: &Shared,
    ) -> crate::base::error::Result<()> {
        use std::sync::atomic::Ordering;
        if dynamic <= Self::DEFAULT_DYNAMIC.max(self.dynamic_optin.load(Ordering::Acquire)) {
            return Ok(());
        }
        let mut stat = 0i32;
        // SAFETY: our function handle; writes one int.
        let r = unsafe {
            sys::cuFuncGetAttribute(
                &mut stat,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                self.func,
            )
        };
        shared.check("cuFuncGetAttribute", r)?;
        let mut max = 0i32;
        // SAFETY: writes one int for the context's device.
        let r = unsafe {
            sys::cuDeviceGetAttribute(
                &mut max,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                shared.ctx.cu_device(),
            )
        };
        shared.check("cuDeviceGetAttribute", r)?;
        let total = u64::from(dynamic) + stat.max(0) as u64;
        if total > max.max(0) as u64 {
            return Err(crate::base::error::Error::InvalidLaunch {
                kernel: name,
                reason: format!(
                    "{dynamic} bytes of dynamic shared memory beside the kernel's {stat} static \
                     bytes exceed the device's {max} per block"
                ),
            });
        }
        // SAFETY: our function handle; the value is within the device's
        // opt-in maximum (checked above).
        let r = unsafe {
            sys::cuFuncSetAttribute(
                self.func,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic as i32,
            )
        };
        shared.check("cuFuncSetAttribute", r)?;
        self.dynamic_optin.fetch_max(dynamic, Ordering::AcqRel);
        Ok(())
    }
}
// SAFETY: CUfunction is an opaque driver handle; launching from several threads is allowed.
unsafe impl Send for FunctionHandle {}
// SAFETY: as above.
unsafe impl Sync for FunctionHandle {}
