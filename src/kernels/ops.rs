//! The reductions, the scan, the softmax and the histogram as batch
//! commands.

use super::set::{check_operands, checked_scratch, dim32, read, write, KernelSet};
use crate::base::error::{Error, Result};
use crate::runtime::kernel::LaunchConfig;
use crate::runtime::memory::{check_len, DeviceSlice, DeviceSliceMut};
use crate::runtime::stream::Commands;
use gpu_kernels::{histogram, reduce, scan, softmax};

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
    /// [`reduce_scratch_len`](crate::kernels::reduce_scratch_len)`(n)` `f32`s (at most 1024), disjoint from `x`
    /// and `out`. `out` is one element.
    ///
    /// Error bound: `|out - exact| <= `[`sum_depth`](crate::kernels::sum_depth)`(n) * 2^-24 *
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
    /// as [`Commands::sum`]; bound `|out - exact| <= `[`sum_bf16_depth`](crate::kernels::sum_bf16_depth)`(n)
    /// * 2^-24 * sum(|x|)`. `scratch`: at least
    /// [`reduce_bf16_scratch_len`](crate::kernels::reduce_bf16_scratch_len)`(n)` `f32`s.
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
    /// `|y_j - exact_j| <= `[`scan_depth`](crate::kernels::scan_depth)`(j) * 2^-24 * sum(|x_0..=j|)`.
    ///
    /// `y` has `x`'s length, disjoint from it (not in place). `scratch`:
    /// at least [`scan_scratch_len`](crate::kernels::scan_scratch_len)`(n)` `u64`s; the batch zeroes it first
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
    /// [`softmax_sum_depth`](crate::kernels::softmax_sum_depth)`(cols)`.
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
