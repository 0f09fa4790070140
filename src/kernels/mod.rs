//! The block-level kernel set of `gpu-kernels` as typed commands of a batch:
//! [`sum`](Commands::sum) and [`max`](Commands::max) (f32; bf16 in, f32
//! out), an [inclusive scan](Commands::inclusive_scan) (u32, i32, f32), a
//! [row softmax](Commands::softmax_rows), a
//! [256-bin histogram](Commands::histogram_u8), [SGEMM](Commands::sgemm)
//! and the tensor-core [bf16 GEMM](Commands::gemm_bf16).
//!
//! Each is a method of [`Commands`] (a job's batch), so it works on views
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

pub use gemm::{bf16_gemm_supported, Gemm};

use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::kernel::{check_overlaps, Function, LaunchConfig, Module, Touch, TouchOpaque};
use crate::runtime::memory::{check_len, DeviceSlice, DeviceSliceMut};
use crate::runtime::stream::Commands;
use gpu_kernels::{histogram, reduce, scan, softmax};

/// The kernel set on one device (the device holds it once loaded).
pub(crate) struct KernelSet {
    sum_f32: Function<reduce::sum_f32>,
    max_f32: Function<reduce::max_f32>,
    sum_bf16: Function<reduce::sum_bf16>,
    max_bf16: Function<reduce::max_bf16>,
    sum_finish: Function<reduce::sum_finish_f32>,
    max_finish: Function<reduce::max_finish_f32>,
    scan_u32: Function<scan::scan_u32>,
    scan_i32: Function<scan::scan_i32>,
    scan_f32: Function<scan::scan_f32>,
    softmax: Function<softmax::softmax_f32>,
    histogram: Function<histogram::histogram_u8>,
    sgemm: Function<gpu_kernels::gemm::sgemm>,
    /// `None` on a GPU below compute capability 8.0 (the kernel is not in
    /// the sm_70 PTX).
    gemm_bf16: Option<Function<gpu_kernels::gemm_mma::gemm_bf16>>,
}

impl KernelSet {
    /// The set on `device`, loaded the first time.
    pub(crate) fn of(device: &Device) -> Result<&KernelSet> {
        device.kernel_set(KernelSet::load)
    }

    fn load(device: &Device) -> Result<KernelSet> {
        let sm80 = bf16_gemm_supported(device.info().compute_capability);
        let ptx = if sm80 {
            crate::ptx::PTX_SM80
        } else {
            crate::ptx::PTX
        };
        // SAFETY: both texts are gpu-kernels' PTX, built by this crate's
        // build script from the crate that declares every kernel taken
        // below (the sm_80 one has all of them; the other all but
        // gemm_bf16, taken only from the sm_80 one).
        let m = unsafe { Module::from_ptx(device, ptx)? };
        Ok(KernelSet {
            sum_f32: m.function()?,
            max_f32: m.function()?,
            sum_bf16: m.function()?,
            max_bf16: m.function()?,
            sum_finish: m.function()?,
            max_finish: m.function()?,
            scan_u32: m.function()?,
            scan_i32: m.function()?,
            scan_f32: m.function()?,
            softmax: m.function()?,
            histogram: m.function()?,
            sgemm: m.function()?,
            gemm_bf16: if sm80 { Some(m.function()?) } else { None },
        })
    }
}

/// The `f32` scratch [`Commands::sum`] and [`Commands::max`] need for `n`
/// elements: one partial result per block of the first pass (at most 1024).
pub fn reduce_scratch_len(n: usize) -> usize {
    reduce::reduce_plan_f32(n).partials
}

/// The `f32` scratch [`Commands::sum_bf16`] and [`Commands::max_bf16`] need
/// for `n` elements (at most [`reduce_scratch_len`]`(n)`).
pub fn reduce_bf16_scratch_len(n: usize) -> usize {
    reduce::reduce_plan_bf16(n).partials
}

/// The `u64` scratch [`Commands::inclusive_scan`] needs for `n` elements:
/// a tile counter and one status word per tile of 4096 elements.
pub fn scan_scratch_len(n: usize) -> usize {
    scan::scan_scratch_len(n)
}

/// The bound on the roundings of [`Commands::sum`] over `n` elements:
/// `|sum - exact| <= sum_depth(n) * 2^-24 * sum(|x|)` (to first order).
/// 278 for 2^28 elements; the same for the bf16 sum of `2 n` elements.
pub fn sum_depth(n: usize) -> usize {
    reduce::reduce_plan_f32(n).depth
}

/// The bound on the roundings of [`Commands::sum_bf16`] over `n` elements.
pub fn sum_bf16_depth(n: usize) -> usize {
    reduce::reduce_plan_bf16(n).depth
}

/// The bound on the roundings that reach an `f32` scan's output `j`:
/// `|y_j - exact_j| <= scan_depth(j) * 2^-24 * sum(|x_0..=j|)`.
pub fn scan_depth(j: usize) -> usize {
    scan::scan_depth(j)
}

/// The bound on the roundings of a softmax row's sum for rows of `cols`
/// elements (`D`): each output is within `(|x - max| + D + 7) * 2^-24`
/// relative error of the exact softmax.
pub fn softmax_sum_depth(cols: usize) -> usize {
    softmax::softmax_sum_depth(cols)
}

/// `InvalidArgument` unless `scratch` holds `need` elements; the range of
/// exactly `need` the kernel is given.
fn checked_scratch<'a, T>(
    what: &str,
    s: DeviceSliceMut<'a, T>,
    need: usize,
    helper: &str,
) -> Result<DeviceSliceMut<'a, T>> {
    if s.len() < need {
        return Err(Error::InvalidArgument(format!(
            "{what}: a scratch of {} elements, at least {need} needed (kernels::{helper})",
            s.len()
        )));
    }
    s.range(..need)
}

/// A size the kernels take as `u32`.
fn dim32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::InvalidArgument(format!("{what} = {v} is more than u32::MAX")))
}

/// The scan's element types: `u32` and `i32` (wrapping, exact) and `f32`
/// (deterministic; see [`Commands::inclusive_scan`]). Sealed.
pub trait ScanElement: bytemuck::Pod + sealed::Sealed {
    /// Enqueues the scan (the checks done).
    #[doc(hidden)]
    fn enqueue<'a>(
        c: &mut Commands<'a>,
        x: DeviceSlice<'a, Self>,
        y: DeviceSliceMut<'a, Self>,
        scratch: DeviceSliceMut<'a, u64>,
    ) -> Result<()>;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! scan_elements {
    ($($t:ty => $f:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl ScanElement for $t {
            fn enqueue<'a>(
                c: &mut Commands<'a>,
                x: DeviceSlice<'a, $t>,
                y: DeviceSliceMut<'a, $t>,
                scratch: DeviceSliceMut<'a, u64>,
            ) -> Result<()> {
                let set = KernelSet::of(c.batch_device())?;
                let cfg = LaunchConfig::from(scan::scan_launch(x.len()));
                c.memset_zero(scratch)?;
                c.launch(&set.$f, cfg, (x, y, scratch))
            }
        }
    )*};
}
scan_elements!(u32 => scan_u32, i32 => scan_i32, f32 => scan_f32);

/// Which reduction.
#[derive(Clone, Copy)]
enum Op {
    Sum,
    Max,
}

impl<'a> Commands<'a> {
    /// `out[0] = x[0] + x[1] + ... + x[n - 1]` (`f32`), deterministic: two
    /// launches in a fixed order of accumulation that depends on `n` alone,
    /// so the result is the same run after run and bit-identical on the GPU
    /// and the CPU emulation. `n = 0` gives 0.
    ///
    /// `scratch` holds the first pass's partial results: at least
    /// [`reduce_scratch_len`]`(n)` `f32`s (at most 1024), disjoint from `x`
    /// and `out`. `out` is one element.
    ///
    /// Error bound: `|out - exact| <= `[`sum_depth`]`(n) * 2^-24 *
    /// sum(|x|)` (to first order; 1.7e-5 of `sum(|x|)` at 2^28 elements).
    ///
    /// # Errors
    /// `LengthMismatch` when `out` is not one element; `InvalidArgument`
    /// for a scratch too small or memory of another device;
    /// [`Error::Overlap`] when `scratch` or `out` overlaps another operand.
    pub fn sum(
        &mut self,
        x: impl Into<DeviceSlice<'a, f32>>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        self.reduce_f32(Op::Sum, x.into(), scratch, out)
    }

    /// `out[0]` = the maximum of `x` (`f32`): exact (the largest input).
    /// NaNs are ignored (IEEE `maxNum`): `-inf` when there is no number (`n
    /// = 0`, or every input NaN). Deterministic, as [`Commands::sum`];
    /// scratch and errors as there.
    ///
    /// # Errors
    /// As [`Commands::sum`].
    pub fn max(
        &mut self,
        x: impl Into<DeviceSlice<'a, f32>>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        self.reduce_f32(Op::Max, x.into(), scratch, out)
    }

    /// The sum of bf16 values (`x` their bits, as `u16`), accumulated in
    /// `f32` (bf16 to f32 is exact), into `out[0]` (`f32`): deterministic,
    /// as [`Commands::sum`]; bound `|out - exact| <= `[`sum_bf16_depth`]`(n)
    /// * 2^-24 * sum(|x|)`. `scratch`: at least
    /// [`reduce_bf16_scratch_len`]`(n)` `f32`s.
    ///
    /// # Errors
    /// As [`Commands::sum`].
    pub fn sum_bf16(
        &mut self,
        x: impl Into<DeviceSlice<'a, u16>>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        self.reduce_bf16(Op::Sum, x.into(), scratch, out)
    }

    /// The maximum of bf16 values (`x` their bits), as `f32`: exact, as
    /// [`Commands::max`]. Scratch as [`Commands::sum_bf16`].
    ///
    /// # Errors
    /// As [`Commands::sum`].
    pub fn max_bf16(
        &mut self,
        x: impl Into<DeviceSlice<'a, u16>>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        self.reduce_bf16(Op::Max, x.into(), scratch, out)
    }

    fn reduce_f32(
        &mut self,
        op: Op,
        x: DeviceSlice<'a, f32>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let plan = reduce::reduce_plan_f32(x.len());
        let (partials, out) = reduce_operands(plan.partials, scratch, out, "reduce_scratch_len")?;
        check_operands(self, "sum/max", &[read(x), write(partials), write(out)])?;
        let set = KernelSet::of(self.batch_device())?;
        let (p1, p2) = (plan.pass1.into(), plan.pass2.into());
        match op {
            Op::Sum => {
                self.launch(&set.sum_f32, p1, (x, partials))?;
                self.launch(&set.sum_finish, p2, (partials.as_view(), out))
            }
            Op::Max => {
                self.launch(&set.max_f32, p1, (x, partials))?;
                self.launch(&set.max_finish, p2, (partials.as_view(), out))
            }
        }
    }

    fn reduce_bf16(
        &mut self,
        op: Op,
        x: DeviceSlice<'a, u16>,
        scratch: DeviceSliceMut<'a, f32>,
        out: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let plan = reduce::reduce_plan_bf16(x.len());
        let (partials, out) =
            reduce_operands(plan.partials, scratch, out, "reduce_bf16_scratch_len")?;
        check_operands(
            self,
            "sum_bf16/max_bf16",
            &[read(x), write(partials), write(out)],
        )?;
        let set = KernelSet::of(self.batch_device())?;
        let (p1, p2) = (plan.pass1.into(), plan.pass2.into());
        match op {
            Op::Sum => {
                self.launch(&set.sum_bf16, p1, (x, partials))?;
                self.launch(&set.sum_finish, p2, (partials.as_view(), out))
            }
            Op::Max => {
                self.launch(&set.max_bf16, p1, (x, partials))?;
                self.launch(&set.max_finish, p2, (partials.as_view(), out))
            }
        }
    }

    /// The inclusive scan (prefix sum) `y[j] = x[0] + ... + x[j]`, in one
    /// pass (a deterministic decoupled look-back over tiles of 4096
    /// elements). `u32` and `i32` wrap and are exact; `f32` is
    /// deterministic (a fixed order of accumulation: the same run after run,
    /// bit-identical on the GPU and the CPU emulation), within
    /// `|y_j - exact_j| <= `[`scan_depth`]`(j) * 2^-24 * sum(|x_0..=j|)`.
    ///
    /// `y` has `x`'s length, disjoint from it (not in place). `scratch`:
    /// at least [`scan_scratch_len`]`(n)` `u64`s; the batch zeroes it first
    /// ([`Commands::memset_zero`]), so it needs no preparation.
    ///
    /// # Errors
    /// `LengthMismatch` when `y` and `x` differ in length;
    /// `InvalidArgument` for a scratch too small or memory of another
    /// device; [`Error::Overlap`] for operands that share memory.
    pub fn inclusive_scan<T: ScanElement>(
        &mut self,
        x: impl Into<DeviceSlice<'a, T>>,
        y: DeviceSliceMut<'a, T>,
        scratch: DeviceSliceMut<'a, u64>,
    ) -> Result<()> {
        let x = x.into();
        check_len("inclusive_scan (y vs x)", x.len(), y.len())?;
        let s = checked_scratch(
            "inclusive_scan",
            scratch,
            scan::scan_scratch_len(x.len()),
            "scan_scratch_len",
        )?;
        // The launch checks these after the memset: checked first, so a
        // refused scan queues nothing.
        check_operands(self, "inclusive_scan", &[read(x), write(y), write(s)])?;
        T::enqueue(self, x, y, s)
    }

    /// Softmax over each row of the row-major `rows x cols` matrix `x`,
    /// into `y`: `y[r][c] = exp(x[r][c] - max_r) / sum_c' exp(x[r][c'] -
    /// max_r)`. A warp a row for rows of up to 512 elements, a block a row
    /// beyond. The exponential is written from `fma`, `mul` and `add` (no
    /// `ex2.approx`) and the row's sum has a fixed order: bit-identical on
    /// the GPU and the CPU emulation. Each output is within `(|x - max| +
    /// D + 7) * 2^-24` relative error of the exact softmax, `D` =
    /// [`softmax_sum_depth`]`(cols)`.
    ///
    /// # Errors
    /// `LengthMismatch` when `x` or `y` is not `rows * cols` elements;
    /// `InvalidArgument` for `rows` or `cols` past `u32`, or memory of
    /// another device; [`Error::Overlap`] when `y` overlaps `x`;
    /// `InvalidLaunch` for more rows than a grid may have blocks
    /// (2^31 - 1, for rows longer than 512).
    pub fn softmax_rows(
        &mut self,
        x: impl Into<DeviceSlice<'a, f32>>,
        y: DeviceSliceMut<'a, f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let x = x.into();
        let (r, c) = (
            dim32("softmax_rows: rows", rows)?,
            dim32("softmax_rows: cols", cols)?,
        );
        let n = rows.checked_mul(cols).ok_or_else(|| {
            Error::InvalidArgument(format!("softmax_rows: {rows} x {cols} overflows"))
        })?;
        check_len("softmax_rows (x vs rows * cols)", n, x.len())?;
        check_len("softmax_rows (y vs rows * cols)", n, y.len())?;
        let set = KernelSet::of(self.batch_device())?;
        let cfg = softmax::softmax_launch(rows, cols).into();
        self.launch(&set.softmax, cfg, (x, y, r, c))
    }

    /// A 256-bin histogram of the bytes of `x`: `bins[v]` = how many
    /// elements equal `v`. The batch zeroes `bins` first, then counts with
    /// shared-memory atomics: integer counts, exact and independent of the
    /// order (the same on every backend).
    ///
    /// # Errors
    /// `LengthMismatch` unless `bins` has 256 elements; `InvalidArgument`
    /// for more than `u32::MAX` bytes (a count could wrap) or memory of
    /// another device; [`Error::Overlap`] when `bins` overlaps `x`.
    pub fn histogram_u8(
        &mut self,
        x: impl Into<DeviceSlice<'a, u8>>,
        bins: DeviceSliceMut<'a, u32>,
    ) -> Result<()> {
        let x = x.into();
        check_len("histogram_u8 (bins)", histogram::BINS, bins.len())?;
        dim32("histogram_u8: the input's length", x.len())?;
        check_operands(self, "histogram_u8", &[read(x), write(bins)])?;
        let set = KernelSet::of(self.batch_device())?;
        let cfg = histogram::histogram_launch(x.len()).into();
        self.memset_zero(bins)?;
        self.launch(&set.histogram, cfg, (x, bins))
    }
}

/// A device range an operation reads or writes.
#[derive(Clone, Copy)]
struct Operand {
    addr: u64,
    bytes: u64,
    device_id: usize,
    writes: bool,
}

/// `x` as an operand that is read.
fn read<'v, T: 'v>(x: impl Into<DeviceSlice<'v, T>>) -> Operand {
    let x = x.into();
    Operand {
        addr: x.addr,
        bytes: (x.len * std::mem::size_of::<T>()) as u64,
        device_id: x.device_id,
        writes: false,
    }
}

/// `x` as an operand that is written.
fn write<T>(x: DeviceSliceMut<'_, T>) -> Operand {
    Operand {
        writes: true,
        ..read(x)
    }
}

/// The checks the launches would make, made before an operation of
/// several commands queues its first: every operand of the batch's
/// device, no written range overlapping another.
fn check_operands(c: &Commands<'_>, name: &'static str, ops: &[Operand]) -> Result<()> {
    let id = c.batch_device().id();
    if ops.iter().any(|o| o.device_id != id) {
        return Err(Error::InvalidArgument(format!(
            "{name}: a buffer of another device (or backend) was given to this stream"
        )));
    }
    let touches: Vec<TouchOpaque> = ops
        .iter()
        .map(|o| {
            TouchOpaque(Touch {
                addr: o.addr,
                bytes: o.bytes,
                writes: o.writes,
            })
        })
        .collect();
    check_overlaps(name, &touches, false)
}

/// The partials (exactly the plan's) and the one-element output of a
/// reduction, checked.
fn reduce_operands<'a>(
    partials: usize,
    scratch: DeviceSliceMut<'a, f32>,
    out: DeviceSliceMut<'a, f32>,
    helper: &str,
) -> Result<(DeviceSliceMut<'a, f32>, DeviceSliceMut<'a, f32>)> {
    check_len("reduce (out)", 1, out.len())?;
    Ok((checked_scratch("reduce", scratch, partials, helper)?, out))
}
