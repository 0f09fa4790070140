//! GPU kernels written in Rust.
//!
//! Built two ways from the same source:
//! - for `nvptx64-nvidia-cuda` (driven by `host/build.rs`), where the crate is
//!   `no_std` and its `kernels` module (built only there) exports
//!   `extern "ptx-kernel"` entry points;
//! - for the host, as an ordinary crate, where the per-element bodies in
//!   [`elementwise`] and the per-thread bodies in [`thread`] are what the CPU
//!   backend runs and what the tests check.
//!
//! Entry points are a few lines: read the thread's global index and the grid
//! stride, then call the per-thread body from [`thread`], which is plain Rust
//! over raw pointers and is tested on the host by simulating a grid.
#![deny(missing_docs)]
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch)
)]

pub mod elementwise;
pub mod gemm;
// The tensor-core GEMM: sm_80 and newer only (and the host).
#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]
pub mod gemm_mma;
pub mod thread;

mod kernels;
pub use kernels::*;
// The GEMM entry points (their own `gemm::KERNEL_NAMES`).
pub use gemm::sgemm;
#[cfg(not(target_arch = "nvptx64"))]
pub use gemm::sgemm_launch;
#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]
pub use gemm_mma::gemm_bf16;
#[cfg(not(target_arch = "nvptx64"))]
pub use gemm_mma::gemm_bf16_launch;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    kernel_abi::thread::trap()
}
