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
}
// SAFETY: CUfunction is an opaque driver handle; launching from several threads is allowed.
unsafe impl Send for FunctionHandle {}
// SAFETY: as above.
unsafe impl Sync for FunctionHandle {}
