//! The kernel set loaded on a device, the scratch sizes and error bounds of
//! its plans, and the checks its commands share.

use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::kernel::{check_overlaps, Function, Module, Touch, TouchOpaque};
use crate::runtime::memory::{DeviceSlice, DeviceSliceMut};
use crate::runtime::stream::Commands;
use gpu_kernels::{histogram, reduce, scan, softmax};

/// The kernel set on one device (the device holds it once loaded).
pub(crate) struct KernelSet {
    pub(crate) sum_f32: Function<reduce::sum_f32>,
    pub(crate) max_f32: Function<reduce::max_f32>,
    pub(crate) sum_bf16: Function<reduce::sum_bf16>,
    pub(crate) max_bf16: Function<reduce::max_bf16>,
    pub(crate) sum_finish: Function<reduce::sum_finish_f32>,
    pub(crate) max_finish: Function<reduce::max_finish_f32>,
    pub(crate) scan_u32: Function<scan::scan_u32>,
    pub(crate) scan_i32: Function<scan::scan_i32>,
    pub(crate) scan_f32: Function<scan::scan_f32>,
    pub(crate) softmax: Function<softmax::softmax_f32>,
    pub(crate) histogram: Function<histogram::histogram_u8>,
    pub(crate) sgemm: Function<gpu_kernels::gemm::sgemm>,
    /// `None` on a GPU below compute capability 8.0 (the kernel is not in
    /// the sm_70 PTX).
    pub(crate) gemm_bf16: Option<Function<gpu_kernels::gemm_mma::gemm_bf16>>,
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
/// for `n` elements (at most [`reduce_scratch_len`](crate::kernels::reduce_scratch_len)`(n)`).
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
pub(crate) fn checked_scratch<'a, T>(
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
pub(crate) fn dim32(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::InvalidArgument(format!("{what} = {v} is more than u32::MAX")))
}

/// A device range an operation reads or writes.
#[derive(Clone, Copy)]
pub(crate) struct Operand {
    addr: u64,
    bytes: u64,
    device_id: usize,
    writes: bool,
}

/// `x` as an operand that is read.
pub(crate) fn read<'v, T: 'v>(x: impl Into<DeviceSlice<'v, T>>) -> Operand {
    let x = x.into();
    Operand {
        addr: x.addr,
        bytes: (x.len * std::mem::size_of::<T>()) as u64,
        device_id: x.device_id,
        writes: false,
    }
}

/// `x` as an operand that is written.
pub(crate) fn write<T>(x: DeviceSliceMut<'_, T>) -> Operand {
    Operand {
        writes: true,
        ..read(x)
    }
}

/// The checks the launches would make, made before an operation of
/// several commands queues its first: every operand of the batch's
/// device, no written range overlapping another.
pub(crate) fn check_operands(c: &Commands<'_>, name: &'static str, ops: &[Operand]) -> Result<()> {
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

/// Whether a device of compute capability `cc` runs the bf16 GEMM: 8.0 or
/// newer (`mma.sync` on bf16, `ldmatrix`, `cp.async`), or `None`, the CPU
/// emulation, which runs every kernel.
///
/// ```
/// use gpufeed::kernels::bf16_gemm_supported;
/// assert!(bf16_gemm_supported(Some((9, 0)))); // H100
/// assert!(!bf16_gemm_supported(Some((7, 5)))); // T4
/// assert!(bf16_gemm_supported(gpufeed::Device::cpu().info().compute_capability));
/// ```
pub fn bf16_gemm_supported(cc: Option<(u32, u32)>) -> bool {
    cc.is_none_or(|(major, _)| major >= 8)
}
