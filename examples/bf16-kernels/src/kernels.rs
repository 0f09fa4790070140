//! The kernels, each declared once: PTX entry points on nvptx64, typed
//! kernels for the host library elsewhere. Each is a grid-stride loop over
//! the shorter of its input and output: every thread takes elements
//! `global_id, global_id + grid_stride, ...`, so any grid covers any length
//! and no two threads touch one element.

use crate::convert;
use half::bf16;
use kernel_abi::thread::{global_id, grid_stride};
use kernel_abi::{kernels, Slice, SliceMut};

/// The shorter of two lengths (`usize::min` is not inlined on every
/// target as reliably as this).
#[inline(always)]
fn shorter(a: usize, b: usize) -> usize {
    if a < b {
        a
    } else {
        b
    }
}

kernels! {
    /// `y[i] = x[i]` as f32, exactly (bf16 → f32 widening).
    ///
    /// # Safety
    /// `x` and `y` are valid device memory for their lengths (the host
    /// library builds them from checked views) and do not overlap.
    pub unsafe fn widen_bf16(x: Slice<bf16>, y: SliceMut<f32>) {
        let n = shorter(x.len(), y.len());
        let mut i = global_id();
        while i < n {
            // SAFETY: i < n, inside both; each index is this thread's alone.
            unsafe { y.write(i, convert::widen(x.read(i))) };
            i += grid_stride();
        }
    }

    /// `y[i] = x[i]` as bf16, rounded to nearest even (f32 → bf16
    /// narrowing; NaN stays NaN).
    ///
    /// # Safety
    /// As for `widen_bf16`.
    pub unsafe fn narrow_f32(x: Slice<f32>, y: SliceMut<bf16>) {
        let n = shorter(x.len(), y.len());
        let mut i = global_id();
        while i < n {
            // SAFETY: i < n, inside both; each index is this thread's alone.
            unsafe { y.write(i, convert::narrow(x.read(i))) };
            i += grid_stride();
        }
    }

    /// bf16 in, f32 out: `y[i] = f32(x[i]) * s`.
    ///
    /// # Safety
    /// As for `widen_bf16`.
    pub unsafe fn scale_bf16_f32(s: f32, x: Slice<bf16>, y: SliceMut<f32>) {
        let n = shorter(x.len(), y.len());
        let mut i = global_id();
        while i < n {
            // SAFETY: i < n, inside both; each index is this thread's alone.
            unsafe { y.write(i, convert::scale_widen(x.read(i), s)) };
            i += grid_stride();
        }
    }

    /// bf16 both ways: `y[i] = bf16(f32(x[i]) * s)`, the product rounded to
    /// nearest even.
    ///
    /// # Safety
    /// As for `widen_bf16`.
    pub unsafe fn scale_bf16(s: f32, x: Slice<bf16>, y: SliceMut<bf16>) {
        let n = shorter(x.len(), y.len());
        let mut i = global_id();
        while i < n {
            // SAFETY: i < n, inside both; each index is this thread's alone.
            unsafe { y.write(i, convert::scale_narrow(x.read(i), s)) };
            i += grid_stride();
        }
    }
}
