//! 16-byte vector stores for the kernels of this crate (the loads are
//! [`kernel_abi::Slice::load4_nc`]): one `st.global.v4.b32` (`STG.E.128`)
//! through inline PTX on the GPU (a 16-byte aligned struct written through
//! a pointer is not enough: LLVM split it into `st.v2` + `st` pieces in
//! the softmax), a plain write on the CPU emulation.

use kernel_abi::SliceMut;

/// Four 4-byte words, 16-byte aligned: one vector access (host side).
#[cfg(not(target_arch = "nvptx64"))]
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct V4([u32; 4]);

/// Whether `p` is 16-byte aligned.
#[inline(always)]
pub(crate) fn aligned16<T>(p: *const T) -> bool {
    (p as usize).is_multiple_of(16)
}

/// Stores `v` (bits of 4-byte values) at elements `i..i + 4` of `y` in one
/// 16-byte store.
///
/// # Safety
/// `i + 4 <= y.len()`, element `i` is 16-byte aligned, `y`'s element type
/// is 4 bytes, and no other thread reads or writes these elements meanwhile.
#[inline(always)]
pub(crate) unsafe fn store4_bits<T>(y: &SliceMut<T>, i: usize, v: [u32; 4]) {
    // SAFETY: the caller's contract: in bounds.
    let p = unsafe { y.as_mut_ptr().add(i) };
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: 16 aligned, writable bytes of global memory, no other
    // thread's (the caller's contract); the registers are inputs only.
    unsafe {
        core::arch::asm!(
            "{{", ".reg .u64 %kv_g;", "cvta.to.global.u64 %kv_g, {p};",
            "st.global.v4.b32 [%kv_g], {{{a}, {b}, {c}, {d}}};", "}}",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack),
        )
    };
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: the caller's contract: in bounds, aligned for `V4`, exclusive.
    unsafe {
        p.cast::<V4>().write(V4(v))
    }
}

/// Repeats `$body` once for each listed literal, with `$k` a `const usize`
/// of that value: a loop unrolled by hand, so arrays indexed by `$k` stay
/// in registers (LLVM leaves long loop bodies rolled, and a rolled loop
/// over a register array puts the array in local memory).
macro_rules! unroll {
    ($k:ident in [$($n:literal)*] $body:block) => {
        $({
            #[allow(non_upper_case_globals)]
            const $k: usize = $n;
            $body
        })*
    };
}
pub(crate) use unroll;
