//! Kernel entry points (nvptx64 only). Each is a few lines: indices in, body out.
//!
//! Launch with a 1-D grid. Pointers are device addresses of `f32` buffers;
//! the host side (`host::kernel`) checks lengths before launching.

use crate::device::{global_thread_id, grid_stride, trap as device_trap};
use crate::thread;

/// `x[i] *= s` for `i < n`.
///
/// # Safety
/// `x` is a device pointer valid for `n` floats, 4-byte aligned.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn scale(x: *mut f32, n: usize, s: f32) {
    // SAFETY: the caller's contract; every thread uses the same x, n, stride.
    unsafe { thread::scale(x, n, s, global_thread_id(), grid_stride()) }
}

/// `y[i] = a * x[i] + y[i]` for `i < n`, fused.
///
/// # Safety
/// `x` and `y` are device pointers valid for `n` floats, 4-byte aligned.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn saxpy(a: f32, x: *const f32, y: *mut f32, n: usize) {
    // SAFETY: the caller's contract; every thread uses the same arguments.
    unsafe { thread::saxpy(a, x, y, n, global_thread_id(), grid_stride()) }
}

/// `k` dependent FMAs on each `x[i]`: arithmetic intensity `2k / 8` flop per byte.
///
/// # Safety
/// `x` is a device pointer valid for `n` floats, 4-byte aligned.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn intensity(x: *mut f32, n: usize, k: u32) {
    // SAFETY: the caller's contract; every thread uses the same arguments.
    unsafe { thread::intensity(x, n, k, global_thread_id(), grid_stride()) }
}

/// A GPU-side gate: thread 0 spins until the host writes a non-zero value to
/// `flag` (device-mapped pinned host memory). Work queued behind it on the
/// stream is held until then; tests use it instead of timers.
///
/// # Safety
/// `flag` is a device-visible pointer to a `u32` that the host will set.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn gate_wait(flag: *const u32) {
    if global_thread_id() == 0 {
        // SAFETY: the caller's contract; volatile loads re-read system memory.
        while unsafe { flag.read_volatile() } == 0 {}
    }
}

/// Traps: used by the fault tests to break a context on purpose.
///
/// # Safety
/// Always faults; the context is unusable afterwards.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn trap() {
    device_trap()
}
