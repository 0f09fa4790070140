//! The GEMMs of the kernel set: SGEMM (`f32`) and the bf16 GEMM on the
//! tensor cores (`mma.sync`, sm_80 and newer), as batch commands.

use super::set::{bf16_gemm_supported, dim32, KernelSet};
use crate::base::error::{Error, Result};
use crate::runtime::memory::{check_len, DeviceSlice, DeviceSliceMut};
use crate::runtime::stream::Commands;

/// The shape and scalars of `C = alpha * A * B + beta * C`: `A` is
/// `m x k`, `B` is `k x n`, `C` is `m x n`, all row-major and dense (the
/// leading dimensions `k`, `n` and `n`).
///
/// ```
/// use gpufeed::kernels::Gemm;
/// let g = Gemm::new(129, 257, 65); // C = A * B
/// assert_eq!((g.alpha, g.beta), (1.0, 0.0));
/// let g = g.scaled(2.0, 0.5); // C = 2 A B + 0.5 C
/// assert_eq!((g.m, g.n, g.k, g.alpha, g.beta), (129, 257, 65, 2.0, 0.5));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    /// Rows of `A` and `C`.
    pub m: usize,
    /// Columns of `B` and `C`.
    pub n: usize,
    /// Columns of `A`, rows of `B`.
    pub k: usize,
    /// The product's factor.
    pub alpha: f32,
    /// `C`'s factor; `0.0` means `C` is not read (NaN in it does not
    /// propagate).
    pub beta: f32,
}

impl Gemm {
    /// `C = A * B` for an `m x k` by `k x n` product (`alpha = 1`,
    /// `beta = 0`).
    pub const fn new(m: usize, n: usize, k: usize) -> Gemm {
        Gemm {
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// The same product as `C = alpha * A * B + beta * C`.
    pub const fn scaled(self, alpha: f32, beta: f32) -> Gemm {
        Gemm {
            alpha,
            beta,
            ..self
        }
    }

    /// The sizes as the kernels take them, and the operands' lengths
    /// checked against them.
    fn check(&self, what: &'static str, a: usize, b: usize, c: usize) -> Result<(u32, u32, u32)> {
        let dims = (
            dim32("gemm: m", self.m)?,
            dim32("gemm: n", self.n)?,
            dim32("gemm: k", self.k)?,
        );
        let area = |x: usize, y: usize| {
            x.checked_mul(y).ok_or_else(|| {
                Error::InvalidArgument(format!("{what}: a {x} x {y} matrix overflows"))
            })
        };
        let lens: [(&'static str, usize, usize); 3] = match what {
            "sgemm" => [
                ("sgemm (a vs m * k)", area(self.m, self.k)?, a),
                ("sgemm (b vs k * n)", area(self.k, self.n)?, b),
                ("sgemm (c vs m * n)", area(self.m, self.n)?, c),
            ],
            _ => [
                ("gemm_bf16 (a vs m * k)", area(self.m, self.k)?, a),
                ("gemm_bf16 (b vs k * n)", area(self.k, self.n)?, b),
                ("gemm_bf16 (c vs m * n)", area(self.m, self.n)?, c),
            ],
        };
        for (name, expected, got) in lens {
            check_len(name, expected, got)?;
        }
        Ok(dims)
    }
}

impl<'a> Commands<'a> {
    /// SGEMM: `C = alpha * A * B + beta * C` in `f32` ([`Gemm`](crate::kernels::Gemm): shapes
    /// row-major and dense, any sizes, zeros included). `C` is disjoint
    /// from `A` and `B`.
    ///
    /// Each element of `C` takes one fused multiply-add per `k`, in
    /// ascending `k`, from `+0.0`; then `alpha * acc` (when `beta == 0`: C
    /// is not read) or `fma(beta, c_old, alpha * acc)`. A fixed order: the
    /// GPU and the CPU emulation give bit-identical results, equal to that
    /// sequential loop. Against the exact product: `|c - exact| <=
    /// gamma_(k+2) * (|alpha| * sum_p |a*b| + |beta * c_old|)`, `gamma_j =
    /// j u / (1 - j u)`, `u = 2^-24`.
    ///
    /// # Errors
    /// `LengthMismatch` when `a`, `b` or `c` is not `m * k`, `k * n` or
    /// `m * n` elements; `InvalidArgument` for a size past `u32` or memory
    /// of another device; [`Error::Overlap`] when `c` overlaps `a` or `b`;
    /// `InvalidLaunch` for a product of more than 2^31 - 1 tiles of 128 x 128.
    pub fn sgemm(
        &mut self,
        g: Gemm,
        a: impl Into<DeviceSlice<'a, f32>>,
        b: impl Into<DeviceSlice<'a, f32>>,
        c: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let (a, b) = (a.into(), b.into());
        let (m, n, k) = g.check("sgemm", a.len(), b.len(), c.len())?;
        let set = KernelSet::of(self.batch_device())?;
        let cfg = gpu_kernels::gemm::sgemm_launch(m, n, k).into();
        self.launch(&set.sgemm, cfg, (m, n, k, g.alpha, a, b, g.beta, c))
    }

    /// The bf16 GEMM on the tensor cores: `C = alpha * A * B + beta * C`,
    /// `A` and `B` bf16 (their bits, as `u16`), `C` and the accumulation
    /// `f32` ([`Gemm`](crate::kernels::Gemm): row-major and dense, any sizes). 128 x 128 tiles,
    /// `mma.sync.m16n8k16` with `ldmatrix` and a `cp.async` pipeline, 48 KiB
    /// of dynamic shared memory a block; sm_80 and newer.
    ///
    /// `k` goes in steps of 16 in ascending order, each an `mma` adding 16
    /// exact products to the `f32` accumulator; the order of the additions
    /// inside one `mma` is the hardware's, so the GPU's result is not
    /// bit-reproducible by a loop (the CPU emulation adds them one `fma` at
    /// a time). On both: `|c - exact| <= gamma * (|alpha| * sum_p |a*b| +
    /// |beta * c_old|)`, `gamma = 2(k + 2)u / (1 - 2(k + 2)u)`, `u = 2^-24`,
    /// `exact` the product of the bf16 values.
    ///
    /// # Errors
    /// `InvalidLaunch` on a GPU of compute capability below 8.0
    /// ([`bf16_gemm_supported`](crate::kernels::bf16_gemm_supported)); otherwise as [`Commands::sgemm`].
    pub fn gemm_bf16(
        &mut self,
        g: Gemm,
        a: impl Into<DeviceSlice<'a, u16>>,
        b: impl Into<DeviceSlice<'a, u16>>,
        c: DeviceSliceMut<'a, f32>,
    ) -> Result<()> {
        let (a, b) = (a.into(), b.into());
        let (m, n, k) = g.check("gemm_bf16", a.len(), b.len(), c.len())?;
        let device = self.batch_device();
        let cc = device.info().compute_capability;
        let set = KernelSet::of(device)?;
        let f = match (&set.gemm_bf16, bf16_gemm_supported(cc)) {
            (Some(f), true) => f,
            _ => {
                let (major, minor) = cc.unwrap_or_default();
                return Err(Error::InvalidLaunch {
                    kernel: "gemm_bf16",
                    reason: format!(
                        "the tensor-core GEMM needs compute capability 8.0 or newer; \
                         this device is {major}.{minor}"
                    ),
                });
            }
        };
        let cfg = gpu_kernels::gemm_mma::gemm_bf16_launch(m, n, k).into();
        self.launch(f, cfg, (m, n, k, g.alpha, a, b, g.beta, c))
    }
}
