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
#![cfg_attr(target_arch = "nvptx64", no_std)]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch)
)]

pub mod elementwise;
pub mod histogram;
pub mod reduce;
pub mod scan;
pub mod softmax;
pub mod thread;
mod vec16;

mod kernels;
pub use kernels::*;

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

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    kernel_abi::thread::trap()
}
