//! GPU kernels written in Rust.
//!
//! Built two ways from the same source:
//! - for `nvptx64-nvidia-cuda` (driven by the `gpufeed` crate's `build.rs`), where the crate is
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
pub mod histogram;
pub mod reduce;
pub mod scan;
pub mod softmax;
pub mod thread;
mod vec16;

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

/// The PTX entry points of every module's [`kernel_abi::kernels!`] block,
/// in order. `kernels!` may be invoked once per module: each invocation
/// defines that module's own `KERNEL_NAMES`; this item (which shadows the
/// one `kernels::*` brings in) joins them. A module with a `kernels!` block
/// adds its list to `PARTS`.
pub const KERNEL_NAMES: &[&str] = &{
    const PARTS: &[&[&str]] = &[
        kernels::KERNEL_NAMES,
        reduce::KERNEL_NAMES,
        scan::KERNEL_NAMES,
        softmax::KERNEL_NAMES,
        histogram::KERNEL_NAMES,
        gemm::KERNEL_NAMES,
    ];
    const LEN: usize = {
        let (mut n, mut p) = (0, 0);
        while p < PARTS.len() {
            n += PARTS[p].len();
            p += 1;
        }
        n
    };
    let mut all = [""; LEN];
    let (mut k, mut p) = (0, 0);
    while p < PARTS.len() {
        let mut i = 0;
        while i < PARTS[p].len() {
            all[k] = PARTS[p][i];
            k += 1;
            i += 1;
        }
        p += 1;
    }
    all
};

/// The entry points only the sm_80 build has (beside [`KERNEL_NAMES`]):
/// the kernels that need Ampere's instructions.
#[cfg(any(not(target_arch = "nvptx64"), target_feature = "sm_80"))]
pub const SM80_KERNEL_NAMES: &[&str] = gemm_mma::KERNEL_NAMES;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    kernel_abi::thread::trap()
}
