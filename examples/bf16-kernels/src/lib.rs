//! bf16 on the wire: a user's kernel crate, outside the host library.
//!
//! Data that lives in bf16 crosses PCIe as bf16 (half the bytes of f32);
//! the kernels widen it to f32, compute in f32, and either write f32 or
//! narrow back to bf16 (round to nearest, ties to even) for the copy back.
//!
//! Built two ways from this one source:
//! - for `nvptx64-nvidia-cuda` (by `kernel-builder`, from the host package's
//!   `build.rs`), `no_std`: the [`kernels!`](kernel_abi::kernels) items are
//!   PTX entry points;
//! - for the host: the same items are types implementing
//!   [`kernel_abi::Kernel`], which the host library launches on a GPU and
//!   runs on its CPU emulation.
//!
//! The conversions in [`convert`] are integer bit operations, so the GPU and
//! the CPU give the same bits (no dependence on a conversion instruction or
//! on a library's f32 path on the device).
#![cfg_attr(target_arch = "nvptx64", no_std, feature(abi_ptx, stdarch_nvptx))]

pub mod convert;
mod kernels;

pub use half::bf16;
pub use kernels::*;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    kernel_abi::thread::trap()
}
