//! Asynchronous copies and tensor-core instructions through inline PTX:
//! `cp.async` (global to shared without registers, sm_80+), `ldmatrix`
//! and `mma.sync` (sm_80+). On the CPU emulation each is emulated
//! (`cp.async` copies at once; `ldmatrix` and `mma` exchange the warp's
//! fragments and compute with `f32` fused multiply-adds in `k` order: the
//! tensor cores' rounding is unspecified, so an `mma` result is close to,
//! not bit-identical with, the GPU's).
//!
//! `cp.async` falls back to a plain 16-byte load and store on a GPU target
//! below sm_80 (the default sm_70 build), so one kernel source serves all.
//! `ldmatrix_*` and `mma_*` exist only in builds for sm_80 or newer
//! (`-Ctarget-cpu=sm_80`: `cfg(target_feature = "sm_80")`) and on the host;
//! gate a kernel using them with
//! `#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]`.
//!
//! # Writing other inline PTX
//! `core::arch::asm!` with the crate feature `asm_experimental_arch` (the
//! nested kernel build enables it): operands are `reg32` (32-bit values,
//! also `f32`), `reg64` (64-bit values, pointers) and `reg16`; a shared
//! array's element address for `ld.shared`/`st.shared`/`ldmatrix` is
//! `SharedArray::shared_addr` (a 32-bit shared-window address, nvptx builds only);
//! a [`Slice`]'s pointer is generic: `cvta.to.global.u64` it for `.global`
//! instructions. Declare scratch registers inside `{ }` with a prefix of
//! your own (`.reg .pred %my_p;`), give `options(nomem)` only to
//! instructions that touch no memory, and keep a host form of each
//! instruction for the CPU emulation.

use crate::elem::Plain;
use crate::load::{misaligned, slice_oob};
use crate::shared::SharedArray;
use crate::Slice;

/// Starts an asynchronous copy of 16 bytes from `src` (elements `j..`) to
/// `dst` (elements `i..`): `cp.async.cg.shared.global` on sm_80+ (a plain
/// copy below sm_80 and on the emulation). The data is there after
/// [`cp_async_commit`] and [`cp_async_wait_all`] (or
/// [`cp_async_wait_group`]), and, for other threads, a barrier.
/// Both ends in bounds and 16-byte aligned; otherwise a trap / a fault.
#[inline(always)]
pub fn cp_async16<T: Plain>(dst: &SharedArray<T>, i: usize, src: &Slice<T>, j: usize) {
    let n = 16 / T::BYTES;
    if i >= dst.len() || dst.len() - i < n {
        crate::shared::out_of_bounds(i, dst.len())
    }
    if j >= src.len() || src.len() - j < n {
        slice_oob(j, src.len())
    }
    if !(src.as_ptr() as usize + j * T::BYTES).is_multiple_of(16) || !dst_aligned(dst, i) {
        misaligned()
    }
    // SAFETY: checked just above.
    unsafe { cp_async16_unchecked(dst, i, src, j) }
}

#[inline(always)]
fn dst_aligned<T: Plain>(dst: &SharedArray<T>, i: usize) -> bool {
    #[cfg(target_arch = "nvptx64")]
    {
        dst.shared_addr(i).is_multiple_of(16)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        dst.position(i).is_multiple_of(16 / T::BYTES)
    }
}

/// [`cp_async16`], unchecked.
///
/// # Safety
/// `i + 16 / size_of::<T>() <= dst.len()`, `j + 16 / size_of::<T>() <=
/// src.len()`, both ends 16-byte aligned.
#[inline(always)]
pub unsafe fn cp_async16_unchecked<T: Plain>(
    dst: &SharedArray<T>,
    i: usize,
    src: &Slice<T>,
    j: usize,
) {
    // SAFETY: the caller's contract.
    let p = unsafe { src.as_ptr().add(j) };
    #[cfg(all(target_arch = "nvptx64", target_feature = "sm_80"))]
    // SAFETY: 16 aligned bytes at both ends (the caller's contract).
    unsafe {
        core::arch::asm!(
            "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
            "cp.async.cg.shared.global [{d}], [%ka_g], 16;", "}}",
            d = in(reg32) dst.shared_addr(i), p = in(reg64) p, options(nostack))
    };
    #[cfg(all(target_arch = "nvptx64", not(target_feature = "sm_80")))]
    // SAFETY: as above; a 4-byte view of the same 16 bytes.
    unsafe {
        core::arch::asm!(
            "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
            "ld.global.nc.v4.b32 {{{x}, {y}, {z}, {w}}}, [%ka_g];",
            "st.shared.v4.b32 [{d}], {{{x}, {y}, {z}, {w}}};", "}}",
            x = out(reg32) _, y = out(reg32) _, z = out(reg32) _, w = out(reg32) _,
            d = in(reg32) dst.shared_addr(i), p = in(reg64) p, options(nostack))
    };
    #[cfg(not(target_arch = "nvptx64"))]
    for k in 0..16 / T::BYTES {
        // SAFETY: the caller's contract covers each element.
        unsafe { dst.set_unchecked(i + k, p.add(k).read()) };
    }
}

/// Closes the group of [`cp_async16`] copies this thread started
/// (`cp.async.commit_group`; nothing below sm_80 or on the emulation).
#[inline(always)]
pub fn cp_async_commit() {
    #[cfg(all(target_arch = "nvptx64", target_feature = "sm_80"))]
    // SAFETY: no operands; orders this thread's asynchronous copies.
    unsafe {
        core::arch::asm!("cp.async.commit_group;", options(nostack))
    };
}

/// Waits until all but the `N` most recent committed groups of this
/// thread's copies are done (`cp.async.wait_group N`).
#[inline(always)]
pub fn cp_async_wait_group<const N: u32>() {
    #[cfg(all(target_arch = "nvptx64", target_feature = "sm_80"))]
    // SAFETY: waits; no operands but the constant.
    unsafe {
        core::arch::asm!("cp.async.wait_group {n};", n = const N, options(nostack))
    };
}

/// Waits until all of this thread's copies are done (`cp.async.wait_all`).
#[inline(always)]
pub fn cp_async_wait_all() {
    #[cfg(all(target_arch = "nvptx64", target_feature = "sm_80"))]
    // SAFETY: waits; no operands.
    unsafe {
        core::arch::asm!("cp.async.wait_all;", options(nostack))
    };
}

#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]
mod tensor;
#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]
pub use tensor::{ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16_bf16_f32};
