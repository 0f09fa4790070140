//! Deterministic `sum` and `max` over `f32` and over bf16 (`u16` bits in,
//! `f32` accumulation; bf16 -> f32 is a 16-bit shift, exact), in two
//! passes whose order of accumulation is a function of `n` alone, so the
//! GPU and the CPU emulation give bit-identical results, run after run.
//!
//! # Launch plan ([`reduce_plan_f32`], [`reduce_plan_bf16`])
//! - **Pass 1** (`sum_f32`, `max_f32`, `sum_bf16`, `max_bf16`): a grid of
//!   `G` blocks of [`REDUCE_BLOCK`] threads, `G = clamp(ceil(chunks /
//!   (REDUCE_BLOCK * 16)), 1, REDUCE_MAX_GRID)`, where a *chunk* is 16 bytes
//!   of input (`E` = 4 `f32` or 8 bf16 elements) and `chunks = ceil(n / E)`.
//!   Block `b` writes `partials[b]`.
//! - **Pass 2** (`sum_finish_f32`, `max_finish_f32`): one block of
//!   [`FINISH_BLOCK`] threads reduces `partials[0..G]` into `out[0]`.
//!
//! # Order of accumulation (the same on both backends)
//! 1. Thread `g = block * REDUCE_BLOCK + t` of pass 1 (`T = G *
//!    REDUCE_BLOCK` threads) visits chunks `g, g + T, g + 2T, ...` in
//!    ascending order and keeps `E` accumulators, one per position in the
//!    chunk: `acc[j] = op(acc[j], x[c * E + j])`, starting from the
//!    identity (0 or -inf); elements past `n` in the last chunk are skipped.
//!    Whether a chunk is read with one 16-byte `ld.global.nc.v4` (when the
//!    input is 16-byte aligned) or element by element changes nothing in
//!    this order.
//! 2. The thread's value is the pairwise tree over its accumulators:
//!    `(a0 ⊕ a1) ⊕ (a2 ⊕ a3)` (and `(... ) ⊕ ((a4 ⊕ a5) ⊕ (a6 ⊕ a7))` for bf16).
//! 3. [`kernel_abi::block::reduce`] over the block's threads (its fixed
//!    warp and block trees) gives `partials[b]`.
//! 4. Pass 2's thread `t` folds `partials[t], partials[t + 256], ...` in
//!    ascending order from the identity, then [`kernel_abi::block::reduce`].
//!
//! # Error bounds
//! `max` is exact (the maximum of the inputs; NaNs are ignored, as IEEE
//! `maxNum`; `n = 0`, or every input NaN, gives -inf: the fold starts there). For `sum`,
//! every input passes through at most [`ReducePlan::depth`] roundings, so
//! `|sum - exact| <= depth * 2^-24 * sum(|x|)` (to first order; `sum(|x|)`
//! and every partial sum below `f32::MAX`). For 1 GiB of `f32` (2^28
//! elements, `G = 1024`): depth = 256 + 2 + 20 = 278, i.e. a relative
//! bound of 1.7e-5 of `sum(|x|)`, typically far below. `n = 0` gives 0.
//!
//! # Contract (every kernel)
//! The slices are valid device memory for their lengths; `partials` has
//! at least `G` elements; `out` at least one; the launch is the plan's.
//! The block size must be a multiple of 32 (the plan's is).

use kernel_abi::{block, kernels, thread, Slice, SliceMut};

/// Threads per block of pass 1.
pub const REDUCE_BLOCK: u32 = 256;
/// The most blocks pass 1 uses (and so the most partials).
pub const REDUCE_MAX_GRID: u32 = 1024;
/// Chunks (16 bytes each) per thread below which pass 1 uses fewer blocks.
pub const CHUNKS_PER_THREAD: usize = 16;
/// Threads of pass 2's single block.
pub const FINISH_BLOCK: u32 = 256;

/// The blocks of pass 1 for `chunks` 16-byte chunks.
pub const fn reduce_grid(chunks: usize) -> u32 {
    let per_block = REDUCE_BLOCK as usize * CHUNKS_PER_THREAD;
    let g = chunks.div_ceil(per_block);
    if g < 1 {
        1
    } else if g > REDUCE_MAX_GRID as usize {
        REDUCE_MAX_GRID
    } else {
        g as u32
    }
}

/// How the host launches a reduction of `n` elements: pass 1, then pass 2
/// on the same stream.
#[cfg(not(target_arch = "nvptx64"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReducePlan {
    /// Pass 1's launch (no dynamic shared memory).
    pub pass1: kernel_abi::thread::Launch,
    /// Pass 2's launch: one block.
    pub pass2: kernel_abi::thread::Launch,
    /// Length of the `partials` buffer (`f32`): pass 1's grid.
    pub partials: usize,
    /// The most roundings any input goes through in `sum` (see the module
    /// docs' error bound).
    pub depth: usize,
}

#[cfg(not(target_arch = "nvptx64"))]
fn plan(n: usize, e: usize) -> ReducePlan {
    use kernel_abi::thread::Launch;
    let chunks = n.div_ceil(e);
    let g = reduce_grid(chunks);
    let per_thread = chunks.div_ceil(g as usize * REDUCE_BLOCK as usize);
    let tree = e.trailing_zeros() as usize;
    let finish = (g as usize).div_ceil(FINISH_BLOCK as usize);
    ReducePlan {
        pass1: Launch::linear(g, REDUCE_BLOCK),
        pass2: Launch::linear(1, FINISH_BLOCK),
        partials: g as usize,
        // chain + pair tree + block tree (5 + 3) + pass 2 chain + tree (5 + 3).
        depth: per_thread + tree + 8 + finish + 8,
    }
}

/// The plan for `sum_f32` / `max_f32` over `n` elements.
#[cfg(not(target_arch = "nvptx64"))]
pub fn reduce_plan_f32(n: usize) -> ReducePlan {
    plan(n, 4)
}

/// The plan for `sum_bf16` / `max_bf16` over `n` elements.
#[cfg(not(target_arch = "nvptx64"))]
pub fn reduce_plan_bf16(n: usize) -> ReducePlan {
    plan(n, 8)
}

/// bf16 bits to `f32` (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Pass 1 over `n` elements in chunks of `E`: `full(c)` reads chunk `c`
/// (whole, with a vector load; only called when `vector`), `elem(i)` reads
/// element `i`. Writes the block's result to `partials[block]`.
#[inline(always)]
fn pass1<const E: usize>(
    n: usize,
    vector: bool,
    full: impl Fn(usize) -> [f32; E],
    elem: impl Fn(usize) -> f32,
    identity: f32,
    op: impl Fn(f32, f32) -> f32 + Copy,
    partials: SliceMut<f32>,
) {
    let (stride, full_chunks, chunks) = (thread::grid_stride(), n / E, n.div_ceil(E));
    let mut acc = [identity; E];
    let mut c = thread::global_id();
    if vector {
        // Four independent 16-byte loads in flight, consumed in chunk order.
        while c + 3 * stride < full_chunks {
            let v = [
                full(c),
                full(c + stride),
                full(c + 2 * stride),
                full(c + 3 * stride),
            ];
            for vk in v {
                for j in 0..E {
                    acc[j] = op(acc[j], vk[j]);
                }
            }
            c += 4 * stride;
        }
        while c < full_chunks {
            let v = full(c);
            for j in 0..E {
                acc[j] = op(acc[j], v[j]);
            }
            c += stride;
        }
    }
    while c < chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            let i = c * E + j;
            if i < n {
                *a = op(*a, elem(i));
            }
        }
        c += stride;
    }
    let mut w = E;
    while w > 1 {
        for j in 0..w / 2 {
            acc[j] = op(acc[2 * j], acc[2 * j + 1]);
        }
        w /= 2;
    }
    let r = block::reduce(acc[0], op);
    let b = thread::block_idx() as usize;
    if thread::thread_idx() == 0 {
        if b >= partials.len() {
            thread::trap();
        }
        // SAFETY: b < len; one thread per block writes its own element.
        unsafe { partials.write(b, r) };
    }
}

/// Pass 1 over `f32`.
#[inline(always)]
fn pass1_f32(
    x: Slice<f32>,
    partials: SliceMut<f32>,
    identity: f32,
    op: impl Fn(f32, f32) -> f32 + Copy,
) {
    pass1::<4>(
        x.len(),
        crate::vec16::aligned16(x.as_ptr()),
        // SAFETY: called for whole chunks (4c + 4 <= n) of an aligned input.
        |c| unsafe { x.load4_nc_unchecked(4 * c) },
        |i| x.load_nc(i),
        identity,
        op,
        partials,
    )
}

/// Pass 1 over bf16 bits.
#[inline(always)]
fn pass1_bf16(
    x: Slice<u16>,
    partials: SliceMut<f32>,
    identity: f32,
    op: impl Fn(f32, f32) -> f32 + Copy,
) {
    let n = x.len();
    let vector = crate::vec16::aligned16(x.as_ptr());
    // SAFETY: the words of the input's first `n / 2` pairs, used only when
    // the input is 16-byte aligned (so 4-byte aligned too).
    let words =
        unsafe { Slice::from_raw_parts(x.as_ptr().cast::<u32>(), if vector { n / 2 } else { 0 }) };
    pass1::<8>(
        n,
        vector,
        |c| {
            // SAFETY: whole chunks only: 8c + 8 <= n, so words 4c..4c + 4 exist, aligned.
            let w = unsafe { words.load4_nc_unchecked(4 * c) };
            [
                f32::from_bits(w[0] << 16),
                f32::from_bits(w[0] & 0xffff_0000),
                f32::from_bits(w[1] << 16),
                f32::from_bits(w[1] & 0xffff_0000),
                f32::from_bits(w[2] << 16),
                f32::from_bits(w[2] & 0xffff_0000),
                f32::from_bits(w[3] << 16),
                f32::from_bits(w[3] & 0xffff_0000),
            ]
        },
        // SAFETY: `pass1` passes i < n.
        |i| bf16_to_f32(unsafe { x.read(i) }),
        identity,
        op,
        partials,
    )
}

/// Pass 2: `out[0]` = the partials' combination (one block).
#[inline(always)]
fn finish(
    partials: Slice<f32>,
    out: SliceMut<f32>,
    identity: f32,
    op: impl Fn(f32, f32) -> f32 + Copy,
) {
    let (t, step) = (thread::thread_idx() as usize, thread::block_dim() as usize);
    let mut acc = identity;
    let mut i = t;
    while i < partials.len() {
        acc = op(acc, partials.load(i));
        i += step;
    }
    let r = block::reduce(acc, op);
    if t == 0 {
        if out.is_empty() {
            thread::trap();
        }
        // SAFETY: 0 < len; one thread writes.
        unsafe { out.write(0, r) };
    }
}

fn add(a: f32, b: f32) -> f32 {
    a + b
}

fn max(a: f32, b: f32) -> f32 {
    a.max(b)
}

kernels! {
    /// Pass 1 of the sum of `x` (`f32`): `partials[block]` (module docs).
    ///
    /// # Safety
    /// The module's contract; launched with [`reduce_plan_f32`]`(x.len())`'s `pass1`.
    pub unsafe fn sum_f32(x: Slice<f32>, partials: SliceMut<f32>) {
        pass1_f32(x, partials, 0.0, add)
    }

    /// Pass 1 of the maximum of `x` (`f32`): `partials[block]`.
    ///
    /// # Safety
    /// As `sum_f32`.
    pub unsafe fn max_f32(x: Slice<f32>, partials: SliceMut<f32>) {
        pass1_f32(x, partials, f32::NEG_INFINITY, max)
    }

    /// Pass 1 of the sum of `x` (bf16 bits), accumulated in `f32`.
    ///
    /// # Safety
    /// The module's contract; launched with [`reduce_plan_bf16`]`(x.len())`'s `pass1`.
    pub unsafe fn sum_bf16(x: Slice<u16>, partials: SliceMut<f32>) {
        pass1_bf16(x, partials, 0.0, add)
    }

    /// Pass 1 of the maximum of `x` (bf16 bits), as `f32`.
    ///
    /// # Safety
    /// As `sum_bf16`.
    pub unsafe fn max_bf16(x: Slice<u16>, partials: SliceMut<f32>) {
        pass1_bf16(x, partials, f32::NEG_INFINITY, max)
    }

    /// Pass 2 of a sum: `out[0]` = the sum of `partials` (one block, the plan's `pass2`).
    ///
    /// # Safety
    /// The module's contract; `partials` is pass 1's output (length `G`).
    pub unsafe fn sum_finish_f32(partials: Slice<f32>, out: SliceMut<f32>) {
        finish(partials, out, 0.0, add)
    }

    /// Pass 2 of a maximum: `out[0]` = the maximum of `partials`.
    ///
    /// # Safety
    /// As `sum_finish_f32`.
    pub unsafe fn max_finish_f32(partials: Slice<f32>, out: SliceMut<f32>) {
        finish(partials, out, f32::NEG_INFINITY, max)
    }
}
