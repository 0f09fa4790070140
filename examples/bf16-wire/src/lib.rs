//! bf16 on the wire: a user's own kernels (the `bf16-kernels` crate, built
//! to PTX by this package's `build.rs` with `kernel-builder`) launched
//! through the host library's futures API.
//!
//! Data that lives in bf16 on the host crosses PCIe as bf16, half the bytes
//! of f32; the kernel widens it to f32, computes in f32, and writes either
//! f32 (bf16 in, f32 out) or bf16 again, rounded to nearest even (bf16 both
//! ways), so the copy back is halved too. On a full-duplex link the slower
//! direction decides the time: bf16-in/f32-out saves on the way in only.
//!
//! - [`load`]: the module and its typed kernels on a device;
//!   [`Kernels`]' methods launch them in a batch, lengths checked.
//! - [`narrow_into`] / [`narrow_to_pinned`]: the host-side f32 → bf16
//!   conversion for data that starts as f32, on all CPU threads, with the
//!   kernels' rounding (the same bits).
//! - [`run_f32`], [`run_bf16_f32`], [`run_bf16`]: the three variants through
//!   [`Pipeline::run_stage`], chunked and overlapped.
//!
//! ```no_run
//! # async fn f() -> gpufeed::Result<()> {
//! use bf16_wire::{bf16, load, narrow_to_pinned, run_bf16};
//! use gpufeed::{Device, PinnedPool, Pipeline, Plan};
//! let device = Device::from_env()?;
//! let (pool, pipe, kernels) = (PinnedPool::new(&device), Pipeline::new(&device, 4)?, load(&device)?);
//! let data: Vec<f32> = (0..1_000_000).map(|i| i as f32 * 0.5).collect();
//! let input = narrow_to_pinned(&pool, &data)?; // half the bytes to copy
//! let output = pool.alloc::<bf16>(data.len())?;
//! let (((input,), (output,)), _info) =
//!     run_bf16(&pipe, &kernels, input, output, 2.0, Plan::auto(data.len()), gpufeed::Timeline::Off).await?;
//! assert_eq!(output.as_slice()[3].to_f32(), 3.0);
//! # drop(input); Ok(()) }
//! ```

pub use bf16_kernels::{convert, narrow_f32, scale_bf16, scale_bf16_f32, widen_bf16, KERNEL_NAMES};
pub use half::bf16;

use gpufeed::{
    Chunk, Commands, Device, DeviceSlice, DeviceSliceMut, Error, Function, Job, Kernel,
    LaunchConfig, Module, PinnedArray, PinnedPool, Pipeline, Plan, PooledBuffer, Result, RunInfo,
    Timeline,
};

/// The kernels' PTX, as `build.rs` had `kernel-builder` compile it.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/bf16_kernels.ptx"));

/// The architecture the PTX targets (`KERNEL_ARCH` at build time; `none`
/// for a `HOST_PTX_STUB=1` build).
pub const ARCH: &str = env!("BF16_KERNELS_ARCH");

/// The bf16 kernels, loaded on one device.
#[derive(Clone, Debug)]
pub struct Kernels {
    /// bf16 → f32, exact.
    pub widen_bf16: Function<widen_bf16>,
    /// f32 → bf16, round to nearest even.
    pub narrow_f32: Function<narrow_f32>,
    /// bf16 in, f32 out: `y = f32(x) * s`.
    pub scale_bf16_f32: Function<scale_bf16_f32>,
    /// bf16 both ways: `y = bf16(f32(x) * s)`.
    pub scale_bf16: Function<scale_bf16>,
}

/// Loads [`PTX`] on `device` and takes a handle of each kernel (on the CPU
/// emulation nothing is loaded: the kernels run from their host build).
///
/// # Errors
/// The driver's error when the PTX does not load or lacks a kernel.
pub fn load(device: &Device) -> Result<Kernels> {
    // SAFETY: PTX is bf16-kernels' PTX, built by this package's build.rs
    // (kernel-builder) from the crate that declares the kernels taken below.
    let module = unsafe { Module::from_ptx(device, PTX)? };
    Ok(Kernels {
        widen_bf16: module.function()?,
        narrow_f32: module.function()?,
        scale_bf16_f32: module.function()?,
        scale_bf16: module.function()?,
    })
}

fn same_len(what: &'static str, x: usize, y: usize) -> Result<()> {
    if x != y {
        return Err(Error::LengthMismatch {
            what,
            expected: x,
            got: y,
        });
    }
    Ok(())
}

/// Launches `f` over `n.0` elements, grid-stride, once the output's length
/// `n.1` is checked against it.
fn elementwise<'a, K, A>(
    c: &mut Commands<'a>,
    f: &Function<K>,
    what: &'static str,
    n: (usize, usize),
    args: A,
) -> Result<()>
where
    K: gpufeed::kernel_abi::Kernel,
    A: gpufeed::Args<'a, Params = K::Params>,
{
    same_len(what, n.0, n.1)?;
    let config = LaunchConfig::grid_stride(c.device(), n.0);
    c.launch(f, config, args)
}

impl Kernels {
    /// Enqueues `y = f32(x)` (exact) in the batch `c`.
    ///
    /// # Errors
    /// `LengthMismatch` for views of different lengths; the launch's errors
    /// ([`Commands::launch`]).
    pub fn widen<'a>(
        &self,
        c: &mut Commands<'a>,
        x: impl Into<DeviceSlice<'a, bf16>>,
        y: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let x = x.into();
        elementwise(
            c,
            &self.widen_bf16,
            "widen_bf16 (y vs x)",
            (x.len(), y.len()),
            (x, y),
        )
    }

    /// Enqueues `y = bf16(x)` (round to nearest even) in the batch `c`.
    ///
    /// # Errors
    /// As [`Kernels::widen`].
    pub fn narrow<'a>(
        &self,
        c: &mut Commands<'a>,
        x: impl Into<DeviceSlice<'a, f32>>,
        y: DeviceSliceMut<'a, bf16>,
    ) -> Result<()> {
        let x = x.into();
        elementwise(
            c,
            &self.narrow_f32,
            "narrow_f32 (y vs x)",
            (x.len(), y.len()),
            (x, y),
        )
    }

    /// Enqueues `y = f32(x) * s` (bf16 in, f32 out) in the batch `c`.
    ///
    /// # Errors
    /// As [`Kernels::widen`].
    pub fn scale_to_f32<'a>(
        &self,
        c: &mut Commands<'a>,
        s: f32,
        x: impl Into<DeviceSlice<'a, bf16>>,
        y: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let x = x.into();
        elementwise(
            c,
            &self.scale_bf16_f32,
            "scale_bf16_f32 (y vs x)",
            (x.len(), y.len()),
            (s, x, y),
        )
    }

    /// Enqueues `y = bf16(f32(x) * s)` (bf16 both ways) in the batch `c`.
    ///
    /// # Errors
    /// As [`Kernels::widen`].
    pub fn scale<'a>(
        &self,
        c: &mut Commands<'a>,
        s: f32,
        x: impl Into<DeviceSlice<'a, bf16>>,
        y: DeviceSliceMut<'a, bf16>,
    ) -> Result<()> {
        let x = x.into();
        elementwise(
            c,
            &self.scale_bf16,
            "scale_bf16 (y vs x)",
            (x.len(), y.len()),
            (s, x, y),
        )
    }
}

/// Below this many elements the conversion runs on the calling thread
/// (starting threads would cost more than it saves).
pub const PARALLEL_MIN: usize = 1 << 16;

/// Converts `src` to bf16 into `dst` (round to nearest even, NaN stays NaN:
/// the same bits as the kernels' narrowing, [`convert::narrow`]), on all
/// CPU threads. `dst` is typically a pinned buffer's
/// `as_mut_slice()`, ready to be copied: see [`narrow_to_pinned`].
///
/// # Errors
/// `LengthMismatch` when the lengths differ.
pub fn narrow_into(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    narrow_into_with(src, dst, threads)
}

/// [`narrow_into`] on at most `threads` threads (at least one; one when
/// `src` is shorter than [`PARALLEL_MIN`]).
///
/// # Errors
/// `LengthMismatch` when the lengths differ.
pub fn narrow_into_with(src: &[f32], dst: &mut [bf16], threads: usize) -> Result<()> {
    same_len("narrow_into (dst vs src)", src.len(), dst.len())?;
    let serial = |src: &[f32], dst: &mut [bf16]| {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = convert::narrow(*s);
        }
    };
    let threads = threads.clamp(1, src.len().div_ceil(PARALLEL_MIN).max(1));
    if threads == 1 {
        serial(src, dst);
        return Ok(());
    }
    // Chunks of whole cache lines (64 bytes of bf16), one per thread.
    let chunk = src.len().div_ceil(threads).div_ceil(32) * 32;
    std::thread::scope(|scope| {
        for (s, d) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
            scope.spawn(move || serial(s, d));
        }
    });
    Ok(())
}

/// Converts `src` to bf16 into a pinned buffer from `pool` ([`narrow_into`]),
/// ready for an asynchronous copy of half the bytes.
///
/// # Errors
/// The pool's allocation errors.
pub fn narrow_to_pinned(pool: &PinnedPool, src: &[f32]) -> Result<PooledBuffer<bf16>> {
    let mut out = pool.alloc::<bf16>(src.len())?;
    narrow_into(src, out.as_mut_slice())?;
    Ok(out)
}

/// One of the three ways to scale data through a pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// f32 in, f32 out ([`run_f32`]; the in-tree `scale` kernel).
    F32,
    /// bf16 in, f32 out ([`run_bf16_f32`]).
    Bf16InF32Out,
    /// bf16 in, bf16 out ([`run_bf16`]).
    Bf16BothWays,
}

impl Variant {
    /// The three, in order of bytes moved.
    pub const ALL: [Variant; 3] = [Variant::F32, Variant::Bf16InF32Out, Variant::Bf16BothWays];

    /// A short label: `f32`, `bf16-in/f32-out`, `bf16-both-ways`.
    pub fn label(self) -> &'static str {
        match self {
            Variant::F32 => "f32",
            Variant::Bf16InF32Out => "bf16-in/f32-out",
            Variant::Bf16BothWays => "bf16-both-ways",
        }
    }

    /// Bytes per element copied host to device.
    pub fn h2d_bytes(self) -> usize {
        match self {
            Variant::F32 => 4,
            Variant::Bf16InF32Out | Variant::Bf16BothWays => 2,
        }
    }

    /// Bytes per element copied device to host.
    pub fn d2h_bytes(self) -> usize {
        match self {
            Variant::F32 | Variant::Bf16InF32Out => 4,
            Variant::Bf16BothWays => 2,
        }
    }
}

/// The f32 reference variant: `output = input * s` through `pipe`, f32 both
/// ways, with the in-tree kernel ([`Kernel::Scale`]). Each chunk is copied
/// in, copied device-to-device into the output's chunk (device memory
/// bandwidth, far above the link's) and scaled there in place.
pub fn run_f32<I, O>(
    pipe: &Pipeline,
    input: I,
    output: O,
    s: f32,
    plan: Plan,
    timeline: Timeline,
) -> Job<((I,), (O,)), RunInfo>
where
    I: PinnedArray<Elem = f32>,
    O: PinnedArray<Elem = f32>,
{
    pipe.run_stage((input,), (output,), plan, timeline, move |c, chunk| {
        let y = chunk.output::<f32>(0)?;
        c.copy_d2d(chunk.input::<f32>(0)?, y)?;
        c.kernel(Kernel::Scale { s }, y)
    })
}

/// bf16 in, f32 out: `output = f32(input) * s` through `pipe` (half the
/// bytes in).
pub fn run_bf16_f32<I, O>(
    pipe: &Pipeline,
    kernels: &Kernels,
    input: I,
    output: O,
    s: f32,
    plan: Plan,
    timeline: Timeline,
) -> Job<((I,), (O,)), RunInfo>
where
    I: PinnedArray<Elem = bf16>,
    O: PinnedArray<Elem = f32>,
{
    pipe.run_stage(
        (input,),
        (output,),
        plan,
        timeline,
        |c: &mut Commands<'_>, chunk: &Chunk<'_>| {
            kernels.scale_to_f32(c, s, chunk.input::<bf16>(0)?, chunk.output::<f32>(0)?)
        },
    )
}

/// bf16 both ways: `output = bf16(f32(input) * s)` through `pipe` (half the
/// bytes in and out).
pub fn run_bf16<I, O>(
    pipe: &Pipeline,
    kernels: &Kernels,
    input: I,
    output: O,
    s: f32,
    plan: Plan,
    timeline: Timeline,
) -> Job<((I,), (O,)), RunInfo>
where
    I: PinnedArray<Elem = bf16>,
    O: PinnedArray<Elem = bf16>,
{
    pipe.run_stage(
        (input,),
        (output,),
        plan,
        timeline,
        |c: &mut Commands<'_>, chunk: &Chunk<'_>| {
            kernels.scale(c, s, chunk.input::<bf16>(0)?, chunk.output::<bf16>(0)?)
        },
    )
}
