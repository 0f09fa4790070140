//! Device-side helpers over `core::arch::nvptx`: thread indices and grid stride.

use core::arch::nvptx;

/// Global index of this thread in a 1-D launch.
#[inline(always)]
pub fn global_thread_id() -> usize {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        nvptx::_block_idx_x() as usize * nvptx::_block_dim_x() as usize
            + nvptx::_thread_idx_x() as usize
    }
}

/// Total threads in a 1-D launch: the step of a grid-stride loop.
#[inline(always)]
pub fn grid_stride() -> usize {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe { nvptx::_grid_dim_x() as usize * nvptx::_block_dim_x() as usize }
}

/// Aborts the kernel; the context reports a launch failure to the host.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` has no preconditions; it ends the kernel.
    unsafe { nvptx::trap() }
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    trap()
}
