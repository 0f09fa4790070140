//! Softmax over the rows of a row-major `rows x cols` `f32` matrix:
//! `y[r][c] = exp(x[r][c] - max_r) / sum_c' exp(x[r][c'] - max_r)`, with an
//! exponential written from `fma`/`mul`/`add` and bit operations
//! ([`exp_f32`]: the same instructions on the GPU and the CPU emulation, no
//! `ex2.approx`), so the two backends give bit-identical results.
//!
//! # Launch plan ([`softmax_launch`])
//! - `cols <= 512` (*warp rows*): blocks of 256 threads, a warp per row,
//!   8 rows per block, `ceil(rows / 8)` blocks.
//! - `cols > 512` (*block rows*): a block per row, `rows` blocks of 256
//!   threads (`cols <= 4096`) or 512 (longer rows). Not 1024: at the
//!   kernel's 74-83 registers a thread, a block of 1024 threads needs more
//!   registers than a multiprocessor has (65536), and the launch fails
//!   (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`, seen on the H100).
//!
//! The row's group (the warp, or the block) reads the row once, in 16-byte
//! chunks (`chunk q` = elements `4q .. 4q + 4`, the last one possibly
//! partial): the group's thread `g` holds chunks `g, g + W, g + 2W, ...`
//! (`W` the group's threads). The first [`SOFTMAX_CACHE`] = 4 of them stay
//! in registers, from the load to the store (the row is read once and
//! written once while `cols <= 16 W`: up to 512, 4096 and 8192
//! columns in the three shapes); later
//! chunks, in rows longer than that, are read again for the sum and the
//! output.
//!
//! # Order of accumulation
//! The row's maximum is exact (order-free). The sum: each thread folds
//! `exp(x - max)` over its elements in ascending order (chunk, then
//! position) from `0.0`; then the group's fixed tree
//! ([`kernel_abi::warp::reduce`] or [`kernel_abi::block::reduce`]). The
//! output is `e * (1 / sum)` (two roundings: a reciprocal, a product).
//!
//! # Error bound
//! [`exp_f32`] is within 2 ulp of `exp` (tested); with `d = x - max`
//! rounded once (relative error `2^-24 |d|` in the exponential), the
//! sum's `D` roundings (`D <= 8 + 2^k` with `2^k` chunks per thread times
//! 4, plus the tree's 5 or 8 levels: see [`softmax_sum_depth`]), the
//! relative error of each output is at most `(|d| + D + 7) * 2^-24`
//! against an `f64` reference (to first order).
//!
//! # Contract
//! `x` and `y` have at least `rows * cols` elements each, `y` disjoint
//! from `x`; the launch is [`softmax_launch`]`(rows, cols)`.

use crate::vec16::{aligned16, store4_bits, unroll};
use kernel_abi::{block, fma, kernels, thread, warp, Slice, SliceMut};

/// The longest rows done by one warp each (8 rows per block).
pub const SOFTMAX_WARP_COLS: usize = 512;
/// Chunks (of 4 elements) a thread keeps in registers.
pub const SOFTMAX_CACHE: usize = 4;
/// Threads per block in warp-row mode (8 rows each).
pub const SOFTMAX_BLOCK: u32 = 256;

/// Threads per block for rows of `cols` elements.
pub const fn softmax_block_threads(cols: usize) -> u32 {
    if cols <= 4096 {
        SOFTMAX_BLOCK
    } else {
        512
    }
}

/// Rows one block does: 8 for rows of up to 512 elements, else 1.
pub const fn softmax_rows_per_block(cols: usize) -> usize {
    if cols <= SOFTMAX_WARP_COLS {
        SOFTMAX_BLOCK as usize / 32
    } else {
        1
    }
}

/// The most roundings an element goes through in its row's sum.
pub const fn softmax_sum_depth(cols: usize) -> usize {
    let (width, tree) = if cols <= SOFTMAX_WARP_COLS {
        (32, 5)
    } else {
        let b = softmax_block_threads(cols) as usize;
        (b, 5 + (b / 32).trailing_zeros() as usize)
    };
    4 * cols.div_ceil(4).div_ceil(width) + tree
}

/// The launch for a `rows x cols` softmax.
#[cfg(not(target_arch = "nvptx64"))]
pub fn softmax_launch(rows: usize, cols: usize) -> kernel_abi::thread::Launch {
    let blocks = rows.div_ceil(softmax_rows_per_block(cols)).max(1);
    kernel_abi::thread::Launch::linear(blocks as u32, softmax_block_threads(cols))
}

/// `e^x` in `f32`, within 2 ulp (normal results; subnormal results to
/// within 2 ulp of the smallest normal), from `fma`, `mul`, `add` and bit
/// operations only: bit-identical on the GPU and the CPU emulation. `x >
/// 88.73` gives `inf`, `x < -103.98` gives `0`, NaN gives NaN.
///
/// Cody-Waite reduction `x = n ln2 + r` (`n` = `x log2 e` rounded, `|r| <=
/// ln2 / 2`, `ln2` split in two so `n * hi` is exact), a degree-7
/// polynomial for `e^r` (Cephes' `expf`), and `2^n` applied as two exact
/// power-of-two factors (so results down in the subnormals round once).
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let xc = x.clamp(-104.0, 89.0);
    let t = fma(xc, core::f32::consts::LOG2_E, SHIFT);
    let nf = t - SHIFT;
    let r = fma(nf, -0.693_359_4, xc);
    let r = fma(nf, 2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4;
    p = fma(p, r, 1.398_199_9e-3);
    p = fma(p, r, 8.333_452e-3);
    p = fma(p, r, 4.166_579_6e-2);
    p = fma(p, r, 0.166_666_65);
    p = fma(p, r, 0.5);
    let e = fma(p, r * r, r) + 1.0;
    let n = t.to_bits() as i32 - SHIFT.to_bits() as i32;
    let n1 = n / 2;
    let n2 = n - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    e * s1 * s2
}

/// The row's group: a warp (`BLOCK = false`) or the block.
#[inline(always)]
fn group_reduce<const BLOCK: bool>(v: f32, op: fn(f32, f32) -> f32) -> f32 {
    if BLOCK {
        block::reduce(v, op)
    } else {
        warp::reduce(v, op)
    }
}

fn add(a: f32, b: f32) -> f32 {
    a + b
}

fn max(a: f32, b: f32) -> f32 {
    a.max(b)
}

/// Softmax of row `row` (`cols` elements) by a group of `width` threads in
/// which this one is `g`.
#[inline(always)]
fn row_softmax<const BLOCK: bool>(
    x: Slice<f32>,
    y: SliceMut<f32>,
    row: usize,
    cols: usize,
    g: usize,
    width: usize,
) {
    let start = row * cols;
    // SAFETY: start <= x.len() (the caller checked rows * cols <= len).
    let vector = aligned16(unsafe { x.as_ptr().add(start) })
        && aligned16(unsafe { y.as_mut_ptr().add(start) });
    let chunks = cols.div_ceil(4);
    let load = |q: usize| -> [f32; 4] {
        let i = start + 4 * q;
        if vector && 4 * q + 4 <= cols {
            // SAFETY: a whole chunk of the row, 16-byte aligned (row start aligned, i - start a multiple of 4).
            unsafe { x.load4_nc_unchecked(i) }
        } else {
            core::array::from_fn(|j| {
                if 4 * q + j < cols {
                    x.load_nc(i + j)
                } else {
                    f32::NEG_INFINITY
                }
            })
        }
    };
    let mut cache = [[f32::NEG_INFINITY; 4]; SOFTMAX_CACHE];
    unroll!(k in [0 1 2 3] {
        let q = g + width * k;
        if q < chunks {
            cache[k] = load(q);
        }
    });
    let mut m = f32::NEG_INFINITY;
    unroll!(k in [0 1 2 3] {
        unroll!(j in [0 1 2 3] {
            m = m.max(cache[k][j]);
        });
    });
    let mut q = g + width * SOFTMAX_CACHE;
    while q < chunks {
        for e in load(q) {
            m = m.max(e);
        }
        q += width;
    }
    let m = group_reduce::<BLOCK>(m, max);
    let mut s = 0.0f32;
    unroll!(k in [0 1 2 3] {
        let q = g + width * k;
        unroll!(j in [0 1 2 3] {
            if q < chunks && 4 * q + j < cols {
                cache[k][j] = exp_f32(cache[k][j] - m);
                s += cache[k][j];
            }
        });
    });
    let mut q = g + width * SOFTMAX_CACHE;
    while q < chunks {
        let v = load(q);
        for (j, e) in v.into_iter().enumerate() {
            if 4 * q + j < cols {
                s += exp_f32(e - m);
            }
        }
        q += width;
    }
    let inv = 1.0 / group_reduce::<BLOCK>(s, add);
    let store = |q: usize, v: [f32; 4]| {
        let i = start + 4 * q;
        if vector && 4 * q + 4 <= cols {
            // SAFETY: a whole aligned chunk of the row, in bounds; one writer.
            unsafe { store4_bits(&y, i, v.map(f32::to_bits)) };
        } else {
            for (j, e) in v.into_iter().enumerate() {
                if 4 * q + j < cols {
                    // SAFETY: in the row, in bounds (checked by the caller); one writer.
                    unsafe { y.write(i + j, e) };
                }
            }
        }
    };
    unroll!(k in [0 1 2 3] {
        let q = g + width * k;
        if q < chunks {
            store(q, cache[k].map(|e| e * inv));
        }
    });
    let mut q = g + width * SOFTMAX_CACHE;
    while q < chunks {
        store(q, load(q).map(|e| exp_f32(e - m) * inv));
        q += width;
    }
}

kernels! {
    /// Softmax over each row of the row-major `rows x cols` matrix `x`
    /// into `y` (module docs: plan, order, bound).
    ///
    /// # Safety
    /// The module's contract.
    pub unsafe fn softmax_f32(x: Slice<f32>, y: SliceMut<f32>, rows: u32, cols: u32) {
        let (rows, cols) = (rows as usize, cols as usize);
        if rows * cols > x.len() || rows * cols > y.len() {
            thread::trap();
        }
        let b = thread::block_idx() as usize;
        if cols <= SOFTMAX_WARP_COLS {
            let row = b * (thread::block_dim() as usize / 32) + thread::warp_id() as usize;
            if row < rows {
                row_softmax::<false>(x, y, row, cols, warp::lane_id() as usize, 32);
            }
        } else if b < rows {
            row_softmax::<true>(x, y, b, cols, thread::thread_idx() as usize, thread::block_dim() as usize);
        }
    }
}
