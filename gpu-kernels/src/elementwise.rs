//! Pure per-element functions, identical on the GPU and the CPU.
//!
//! SAXPY and the intensity kernel use a fused multiply-add (one rounding:
//! `a * x + y` computed exactly, then rounded), [`kernel_abi::fma`]:
//! `fma.rn.f32` on the GPU and `f32::mul_add` on the host, so GPU and CPU
//! results are bit-identical. A fused result differs in the last bit, for
//! many inputs, from `a * x + y` written out in NumPy or in a kernel (two
//! roundings); a kernel of your own gets the same operation from
//! `kernel_abi::fma`.

/// Fused multiply-add `a * b + c` with a single rounding, on every target
/// ([`kernel_abi::fma`]).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    kernel_abi::fma(a, b, c)
}

/// `x * s`.
#[inline(always)]
pub fn scale(x: f32, s: f32) -> f32 {
    x * s
}

/// `a * x + y`, fused: one rounding ([`fma`]), not the two of `a * x + y`
/// written out.
#[inline(always)]
pub fn saxpy(a: f32, x: f32, y: f32) -> f32 {
    fma(a, x, y)
}

/// Multiplier of the intensity recurrence: contracting, so values stay bounded.
pub const INTENSITY_MUL: f32 = 0.999_9;
/// Addend of the intensity recurrence.
pub const INTENSITY_ADD: f32 = 1.0e-4;

/// `k` dependent FMAs: `x = x * M + A`, `k` times. Two flops per step, and the
/// dependency chain keeps the compiler from folding or reordering the loop.
#[inline(always)]
pub fn intensity(mut x: f32, k: u32) -> f32 {
    let mut i = 0;
    while i < k {
        x = fma(x, INTENSITY_MUL, INTENSITY_ADD);
        i += 1;
    }
    x
}

/// Four floats aligned to 16 bytes: one `ld.global.v4.f32` / `st.global.v4.f32`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(16))]
pub struct F32x4(pub [f32; 4]);

impl F32x4 {
    /// Applies `f` to each lane.
    #[inline(always)]
    pub fn map(self, mut f: impl FnMut(f32) -> f32) -> Self {
        let [a, b, c, d] = self.0;
        F32x4([f(a), f(b), f(c), f(d)])
    }

    /// Applies `f` lane-wise to two vectors.
    #[inline(always)]
    pub fn zip(self, other: Self, mut f: impl FnMut(f32, f32) -> f32) -> Self {
        let ([a, b, c, d], [e, g, h, i]) = (self.0, other.0);
        F32x4([f(a, e), f(b, g), f(c, h), f(d, i)])
    }
}

/// How a slice of `n` floats starting at byte address `addr` splits into a
/// scalar head (up to the first 16-byte boundary), a body of aligned
/// [`F32x4`] vectors, and a scalar tail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Scalar elements before the first 16-byte boundary.
    pub head: usize,
    /// Number of 4-float vectors after the head.
    pub vectors: usize,
    /// Scalar elements after the vectors.
    pub tail: usize,
}

impl Split {
    /// Splits `n` floats at address `addr` (which must be 4-byte aligned, as
    /// every `f32` is).
    #[inline(always)]
    pub fn new(addr: usize, n: usize) -> Self {
        let misalign = (addr / 4) % 4;
        let head = if misalign == 0 { 0 } else { 4 - misalign };
        let head = if head < n { head } else { n };
        let rest = n - head;
        Split {
            head,
            vectors: rest / 4,
            tail: rest % 4,
        }
    }

    /// Index of the first tail element.
    #[inline(always)]
    pub fn tail_start(&self) -> usize {
        self.head + self.vectors * 4
    }
}

/// CPU version of the `scale` kernel over a slice: same split, same bodies.
pub fn scale_slice(x: &mut [f32], s: f32) {
    for v in x.iter_mut() {
        *v = scale(*v, s);
    }
}

/// CPU version of the `saxpy` kernel over slices (`y = a * x + y`, fused:
/// one rounding, [`fma`]).
///
/// # Panics
/// If the slices have different lengths (callers check this and return a typed error).
pub fn saxpy_slice(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "saxpy_slice: length mismatch");
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = saxpy(a, *xv, *yv);
    }
}

/// CPU version of the `intensity` kernel over a slice.
pub fn intensity_slice(x: &mut [f32], k: u32) {
    for v in x.iter_mut() {
        *v = intensity(*v, k);
    }
}
