//! The contract between a kernel crate written in Rust and the host library
//! that launches it: one declaration ([`kernels!`]) gives both the PTX entry
//! point (when the crate is built for `nvptx64-nvidia-cuda`) and, when the
//! same crate is built for the host, a type naming the kernel and its
//! parameter list, whose per-thread body the CPU emulation runs over a
//! simulated grid. The two can't drift: they are one function.
//!
//! ```
//! use kernel_abi::{kernels, thread, SliceMut};
//!
//! kernels! {
//!     /// `x[i] *= s` for every element.
//!     pub unsafe fn scale(x: SliceMut<f32>, s: f32) {
//!         let mut i = thread::global_id();
//!         while i < x.len() {
//!             // SAFETY: i < len, and each index has one thread (grid stride).
//!             unsafe { x.write(i, x.read(i) * s) };
//!             i += thread::grid_stride();
//!         }
//!     }
//! }
//! ```
//!
//! Kernel parameters are [`Param`] types: scalars, [`Slice`] / [`SliceMut`]
//! (a device pointer *with its length*, so a kernel never gets a pointer
//! without the bound the host checked), and `#[repr(C)]` plain-data structs
//! their author declares with `unsafe impl Param`.
//!
//! # Block-level programming
//! A kernel is more than a per-thread map:
//! - [`thread`]: 1-D and 3-D indices ([`thread::thread_idx3`] ...), lane and
//!   warp ids, the block barrier [`thread::sync_threads`], memory fences,
//!   [`thread::trap`];
//! - [`shared`]: shared memory, static arrays ([`shared_array!`]) and the
//!   dynamic area sized at launch ([`shared::dynamic`]), with checked
//!   (safe) and unchecked access, and the tile pattern
//!   ([`shared::SharedArray::fill_and_sync`]);
//! - [`warp`]: shuffles, votes, warp reductions and scans;
//! - [`block`]: block reductions and scans (fixed order, bit-identical on
//!   the GPU and the CPU emulation);
//! - [`atomic`]: atomics on global memory ([`SliceMut::atomic_add`] ...) and
//!   on shared memory, with orderings;
//! - [`load`]: read-only (`ld.global.nc`), streaming and 16-byte vector
//!   loads on [`Slice`];
//! - [`ptx`]: `cp.async`, `ldmatrix` and `mma.sync` (sm_80+), and how to
//!   write other inline PTX.
//!
//! A block sum with the safe building blocks, run on the CPU emulation:
//!
//! ```
//! use core::sync::atomic::Ordering::Relaxed;
//! use kernel_abi::{block, thread, Slice, SliceMut};
//!
//! /// `out[0] += sum(x)`, one atomic per block.
//! fn block_sum(x: Slice<f32>, out: SliceMut<f32>) {
//!     let mut acc = 0.0f32;
//!     let mut i = thread::global_id();
//!     while i < x.len() {
//!         acc += x.load(i);
//!         i += thread::grid_stride();
//!     }
//!     let total = block::reduce_sum(acc);
//!     if thread::thread_idx() == 0 {
//!         out.atomic_add(0, total, Relaxed);
//!     }
//! }
//!
//! let v = vec![1.0f32; 1000];
//! let mut out = [0.0f32];
//! // SAFETY: both outlive the launch.
//! let (x, o) = unsafe { (Slice::from_raw_parts(v.as_ptr(), 1000), SliceMut::from_raw_parts(out.as_mut_ptr(), 1)) };
//! thread::emulate_launch("block_sum", &thread::Launch::linear(4, 128), 2, &|| block_sum(x, o)).unwrap();
//! assert_eq!(out[0], 1000.0);
//! ```
//!
//! # The CPU emulation
//! Built for the host, [`thread::emulate_launch`] runs a launch's threads:
//! the threads of a block meet at barriers for real, warp operations
//! exchange among the warp's 32 lanes, each block has its own shared
//! memory (poisoned at its start), atomics are atomic. A barrier not every
//! thread of the block reaches, a warp operation not every lane reaches,
//! an out-of-bounds shared or slice access, a trap or a panic is a typed
//! [`thread::EmulationError`] naming the kernel, block and thread (never a
//! hang). Elementwise kernels that never wait run their blocks' threads one
//! after another, as fast as before; see the `emu` design notes in
//! [`thread::emulate_launch`]'s module.
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics)
)]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![deny(missing_docs)]

pub mod atomic;
pub mod block;
mod elem;
#[cfg(not(target_arch = "nvptx64"))]
mod emu;
pub mod load;
mod param;
pub mod ptx;
pub mod shared;
pub mod thread;
pub mod warp;

pub use atomic::Atomic;
pub use elem::{Arith, Plain};
pub use param::{Param, Params, Slice, SliceMut};
pub use shared::SharedArray;

/// Fused multiply-add: `a * b + c` computed exactly and rounded once (to
/// nearest, ties to even), on every target, with no unstable feature in the
/// kernel crate: `fma.rn.f32` on the GPU (inline PTX), `f32::mul_add` on the
/// host (the CPU emulation). Both are the IEEE 754 fusedMultiplyAdd, so a
/// kernel's results on the GPU and on the emulation are bit-identical.
///
/// Not the same as `a * b + c` written out, which rounds twice (after the
/// product and after the sum) and differs from the fused result in the last
/// bit for many inputs; the in-tree `saxpy` kernel uses this function.
///
/// ```
/// let (a, b, c) = (0.1f32, 10.0f32, -1.0f32);
/// assert_eq!(kernel_abi::fma(a, b, c).to_bits(), a.mul_add(b, c).to_bits());
/// assert_ne!(kernel_abi::fma(a, b, c).to_bits(), (a * b + c).to_bits());
/// ```
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let d: f32;
        // SAFETY: one arithmetic instruction on registers: it reads no
        // memory, writes only `d`, and has no other effect.
        unsafe {
            core::arch::asm!(
                "fma.rn.f32 {d}, {a}, {b}, {c};",
                d = out(reg32) d,
                a = in(reg32) a,
                b = in(reg32) b,
                c = in(reg32) c,
                options(pure, nomem, nostack),
            );
        }
        d
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        a.mul_add(b, c)
    }
}

/// Copies 16 bytes from `src` to `dst`: one vector load and one vector
/// store on the GPU (`ld.v4.u32` / `st.v4.u32`, generic addresses, so
/// `src` may be host memory the device reads through a mapping), a plain
/// copy on the host (the CPU emulation).
///
/// # Safety
/// `src` is readable and `dst` writable for 16 bytes, both 16-byte
/// aligned, the two not overlapping.
#[inline(always)]
pub unsafe fn copy16(dst: *mut u8, src: *const u8) {
    #[cfg(target_arch = "nvptx64")]
    {
        // SAFETY: the caller's contract: both addresses valid and aligned
        // for a 16-byte access; the registers are scratch.
        unsafe {
            core::arch::asm!(
                "ld.v4.u32 {{{a}, {b}, {c}, {d}}}, [{s}];",
                "st.v4.u32 [{t}], {{{a}, {b}, {c}, {d}}};",
                s = in(reg64) src,
                t = in(reg64) dst,
                a = out(reg32) _,
                b = out(reg32) _,
                c = out(reg32) _,
                d = out(reg32) _,
                options(nostack),
            );
        }
    }
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: the caller's contract.
    unsafe {
        core::ptr::copy_nonoverlapping(src, dst, 16)
    }
}

/// A kernel declared with [`kernels!`], as the host sees it.
///
/// # Safety
/// Implemented by [`kernels!`] only. [`Kernel::NAME`] is the name of a PTX
/// entry point whose parameters are [`Kernel::Params`] in order, and
/// [`Kernel::thread`] is the same body: the host launches one or the other.
pub unsafe trait Kernel: 'static {
    /// The entry point's name in the PTX (`.entry`).
    const NAME: &'static str;
    /// The parameter list, as a tuple.
    type Params: Params;
    /// One thread's body, run by the CPU emulation with the emulated thread
    /// indices set (see [`thread::emulate`]).
    ///
    /// # Safety
    /// The kernel's own contract (the declaration's `# Safety`): the slices
    /// are valid for their lengths, and the grid is one the kernel supports.
    unsafe fn thread(params: Self::Params);
}

/// Declares kernels. Each item is written once, as an `unsafe fn` of
/// [`Param`] arguments:
/// - built for `nvptx64`, it becomes `#[no_mangle] extern "ptx-kernel" fn`
///   (the crate needs `#![feature(abi_ptx)]` there);
/// - built for the host, it becomes a unit type of the same name that
///   implements [`Kernel`], for the host library's typed launches and for
///   the CPU emulation.
///
/// Also defines `KERNEL_NAMES`, the entry points in declaration order.
#[macro_export]
macro_rules! kernels {
    ($(
        $(#[$meta:meta])*
        pub unsafe fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block
    )*) => {
        $(
            $(#[$meta])*
            #[cfg(target_arch = "nvptx64")]
            #[no_mangle]
            pub unsafe extern "ptx-kernel" fn $name($($arg: $ty),*) $body

            $(#[$meta])*
            #[cfg(not(target_arch = "nvptx64"))]
            #[allow(non_camel_case_types)]
            #[derive(Clone, Copy, Debug)]
            pub struct $name;

            // SAFETY: the entry point above and this body are one declaration.
            #[cfg(not(target_arch = "nvptx64"))]
            unsafe impl $crate::Kernel for $name {
                const NAME: &'static str = stringify!($name);
                type Params = ($($ty,)*);
                #[allow(unused_variables, unused_unsafe, clippy::unused_unit)]
                unsafe fn thread(params: Self::Params) {
                    let ($($arg,)*) = params;
                    $body
                }
            }
        )*

        /// The kernels' entry points, in declaration order.
        pub const KERNEL_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}
