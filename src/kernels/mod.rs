//! The block-level kernel set of `gpu-kernels` as typed commands of a batch:
//! [`sum`](crate::Commands::sum) and [`max`](crate::Commands::max) (f32; bf16 in, f32
//! out), an [inclusive scan](crate::Commands::inclusive_scan) (u32, i32, f32), a
//! [row softmax](crate::Commands::softmax_rows), a
//! [256-bin histogram](crate::Commands::histogram_u8), [SGEMM](crate::Commands::sgemm)
//! and the tensor-core [bf16 GEMM](crate::Commands::gemm_bf16).
//!
//! Each is a method of [`Commands`](crate::Commands) (a job's batch), so it works on views
//! borrowed from the job's bundle, like every command: the job owns the
//! buffers until the device is done, and an error (a length, a scratch too
//! small, overlapping operands) hands them back with the job's
//! [`JobError`](crate::JobError). Every check runs before anything is
//! queued. The kernels are loaded once per device, at first use (on a GPU
//! of compute capability 8.0 or more from [`crate::ptx::PTX_SM80`], else
//! from [`crate::ptx::PTX`]).
//!
//! Every launch is exactly the configuration of the kernel's plan function
//! in `gpu-kernels` (`reduce_plan_f32`, `scan_launch`, `softmax_launch`,
//! `histogram_launch`, `sgemm_launch`, `gemm_bf16_launch`): the order of
//! accumulation is a function of the sizes alone, so the GPU and the CPU
//! emulation give bit-identical results wherever the algorithm fixes the
//! order (every kernel here but the bf16 GEMM, whose `mma` adds in an order
//! the hardware does not specify).
//!
//! ```rust
//! # fn main() -> gpufeed::Result<()> {
//! use gpufeed::{block_on, kernels, Device, DeviceBuffer, Stream};
//! let device = Device::cpu();
//! let n = 1000;
//! let mut x = DeviceBuffer::<f32>::new(&device, n)?;
//! x.copy_from_host_sync(&vec![0.5; n])?;
//! let scratch = DeviceBuffer::<f32>::new(&device, kernels::reduce_scratch_len(n))?;
//! let out = DeviceBuffer::<f32>::new(&device, 1)?;
//! let ((_, _, mut out), ()) = block_on(Stream::new(&device)?.run(
//!     (x, scratch, out),
//!     |c, (x, s, o)| c.sum(x.view(), s.view_mut(), o.view_mut()),
//! ))?;
//! let mut total = [0f32];
//! out.copy_to_host_sync(&mut total)?;
//! assert_eq!(total[0], 500.0);
//! # Ok(()) }
//! ```

mod gemm;
mod ops;
mod set;

pub use gemm::Gemm;
pub use ops::ScanElement;
pub use set::{
    bf16_gemm_supported, reduce_bf16_scratch_len, reduce_scratch_len, scan_depth, scan_scratch_len,
    softmax_sum_depth, sum_bf16_depth, sum_depth,
};
