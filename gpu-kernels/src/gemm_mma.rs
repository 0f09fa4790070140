//! bf16 GEMM on the tensor cores: `C = alpha * A * B + beta * C`, `A` and
//! `B` in bf16 (as `u16` bits), `C` and the accumulation in `f32`, with
//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, `ldmatrix` and a
//! `cp.async` pipeline (sm_80 or newer).
//!
//! # Contract
//! - `A` is `m x k`, `B` is `k x n`, `C` is `m x n`, all row-major and
//!   dense (leading dimensions `k`, `n`, `n`); each slice holds at least
//!   its matrix (else the kernel traps before touching memory), `C` is
//!   disjoint from both. Any `m`, `n`, `k`, zeros included.
//! - Fast path (`cp.async`, 16 bytes = 8 elements a copy): `A`'s rows when
//!   `k % 8 == 0` and `A` starts 16-byte aligned; `B`'s when `n % 8 == 0`
//!   and `B` starts 16-byte aligned. Otherwise the same kernel gathers the
//!   tiles element by element (same results, slower). Pieces of a tile
//!   past an edge are zero-filled.
//! - Launch with exactly [`gemm_bf16_launch`]`(m, n, k)` (host builds): a
//!   1-D grid of `ceil(m / 128) * ceil(n / 128)` blocks (at least 1) of 128
//!   threads and [`DYNAMIC_SHARED_BYTES`] (48 KiB) of dynamic shared memory;
//!   less dynamic shared memory is a trap.
//! - Built only for sm_80 and newer: on nvptx this module exists when
//!   `cfg(target_feature = "sm_80")` (`-Ctarget-cpu=sm_80` or later and
//!   `-Ctarget-feature=+ptx70` or later); on the host always (the CPU
//!   emulation).
//!
//! # Accumulation order and error bound
//! Each output has one `f32` accumulator; the products of two bf16 values
//! are exact in `f32`. `k` goes in steps of 16 in ascending order, each an
//! `mma` that adds 16 products to the accumulator. Inside one `mma` the
//! hardware's order and rounding of the additions are unspecified, so the
//! GPU's result is *not* bit-reproducible by a sequential loop. The CPU
//! emulation's `mma` adds the 16 products one fused multiply-add at a time,
//! `k` ascending, so on the emulation the result is bit-identical to a
//! sequential `fma` loop over all of `k` (`acc = fma(a, b, acc)`), which
//! the tests check. The epilogue is [`crate::gemm`]'s: `alpha * acc` when
//! `beta == 0` (C not read), else `fma(beta, c_old, alpha * acc)`.
//!
//! The bound, on both backends (allowing each addition to round toward
//! zero, error `2u`, `u = 2^-24`): `|c - exact| <= gamma * (|alpha| *
//! sum_p |a*b| + |beta * c_old|)` with `gamma = 2(k + 2)u / (1 - 2(k +
//! 2)u)`, where `exact` is the product of the bf16 values in exact
//! arithmetic.
//!
//! # Design
//! A block computes a 128x128 tile of `C` with 4 warps (2 x 2), each a
//! 64x64 tile: 4 x 8 `mma` tiles of 16x8, 128 `f32` accumulators per
//! thread. `k` goes in steps of 32 through a 3-stage `cp.async` ring in
//! dynamic shared memory (16 KiB a stage: `A` 128x32, `B` 32x128), one
//! barrier a step. Each 16-step a warp loads its `A` fragments with 4
//! `ldmatrix.x4` and its `B` fragments with 4 `ldmatrix.x4.trans` (from the
//! row-major, `k`-major `B` tile), then issues 32 `mma`. Shared tiles are
//! XOR-swizzled by 16-byte chunk so that both the copies and the
//! `ldmatrix` reads are free of bank conflicts. Blocks are ordered in
//! groups of 8 block-rows, as in [`crate::gemm`].
//!
//! ptxas 12.9 (`-arch=sm_90 -v`, the sm_90 PTX): 240 registers, no stack,
//! no spills (two blocks of 128 threads an SM by registers, 96 KiB of
//! shared memory); per `k` step of 32: 16 `cp.async.cg.shared.global`, 8
//! `ldmatrix.x4`, 8 `ldmatrix.x4.trans`, 64 `mma.sync` per warp.

use kernel_abi::ptx::{
    cp_async16_unchecked, cp_async_commit, cp_async_wait_all, cp_async_wait_group, ldmatrix_x4,
    ldmatrix_x4_trans, mma_m16n8k16_bf16_f32,
};
use kernel_abi::shared::{dynamic, dynamic_bytes};
use kernel_abi::thread::{block_idx, sync_threads, thread_idx, trap};
use kernel_abi::{fma, kernels, SharedArray, Slice, SliceMut};

/// Rows of `C` a block computes.
pub const BM: usize = 128;
/// Columns of `C` a block computes.
pub const BN: usize = 128;
/// The `k` step of the pipeline.
pub const BK: usize = 32;
/// Threads per block (4 warps).
pub const THREADS: u32 = 128;
/// Pipeline stages.
pub const STAGES: usize = 3;
/// Words (`u32`, two bf16) of one stage of `A`'s tile.
const A_WORDS: usize = BM * BK / 2;
/// Words of one stage (`A`, then `B`).
const STAGE_WORDS: usize = A_WORDS + BK * BN / 2;
/// Dynamic shared memory a block needs: 48 KiB.
pub const DYNAMIC_SHARED_BYTES: u32 = (STAGES * STAGE_WORDS * 4) as u32;
/// Block-rows per group in the block order.
const GROUP_M: usize = 8;

kernels! {
    /// `C = alpha * A * B + beta * C`, `A` (`m x k`) and `B` (`k x n`) bf16
    /// bits, `C` (`m x n`) f32, row-major and dense, on the tensor cores:
    /// see the [module docs](self) for the contract, the accumulation
    /// order and the error bound.
    ///
    /// # Safety
    /// `a`, `b` and `c` are valid device memory for their lengths, `c`
    /// disjoint from both others; launched with
    /// [`gemm_bf16_launch`]`(m, n, k)`.
    pub unsafe fn gemm_bf16(
        m: u32,
        n: u32,
        k: u32,
        alpha: f32,
        a: Slice<u16>,
        b: Slice<u16>,
        beta: f32,
        c: SliceMut<f32>,
    ) {
        // SAFETY: the contract above.
        unsafe { gemm_block(m as usize, n as usize, k as usize, alpha, a, b, beta, c) }
    }
}

/// `$body` once for each literal, `$i` bound to it: arrays indexed with
/// it have constant indices, so they stay in registers.
macro_rules! unroll {
    ($i:ident in [$($n:literal)*] $body:block) => {$({
        let $i: usize = $n;
        $body
    })*};
}

/// The launch plan of [`gemm_bf16`](struct@gemm_bf16): a 1-D grid of
/// `ceil(m/128) * ceil(n/128)` blocks (at least one), 128 threads a block,
/// [`DYNAMIC_SHARED_BYTES`] of dynamic shared memory.
#[cfg(not(target_arch = "nvptx64"))]
pub fn gemm_bf16_launch(m: u32, n: u32, k: u32) -> kernel_abi::thread::Launch {
    let _ = k;
    let blocks = (m as u64).div_ceil(BM as u64) * (n as u64).div_ceil(BN as u64);
    kernel_abi::thread::Launch {
        dynamic_shared_bytes: DYNAMIC_SHARED_BYTES,
        ..kernel_abi::thread::Launch::linear(blocks.clamp(1, u32::MAX as u64) as u32, THREADS)
    }
}

/// The f32 value of bf16 bits.
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// The word index of 16-byte chunk `c` (0..4) of row `r` of an `A` tile
/// (16 words a row), swizzled: 8 consecutive rows' chunk `c` fall in 8
/// different bank groups.
#[inline(always)]
fn a_word(r: usize, c: usize) -> usize {
    r * 16 + ((c ^ ((r >> 1) & 3)) << 2)
}

/// The word index of chunk `c` (0..16) of row `r` of a `B` tile (64 words a
/// row), swizzled likewise.
#[inline(always)]
fn b_word(r: usize, c: usize) -> usize {
    r * 64 + ((c ^ (r & 7)) << 2)
}

/// The whole block's work (every thread calls it).
///
/// # Safety
/// As [`gemm_bf16`](struct@gemm_bf16).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn gemm_block(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Slice<u16>,
    b: Slice<u16>,
    beta: f32,
    c: SliceMut<f32>,
) {
    if a.len() < m * k || b.len() < k * n || c.len() < m * n {
        trap()
    }
    if dynamic_bytes() < DYNAMIC_SHARED_BYTES as usize {
        trap()
    }
    let (tiles_m, tiles_n) = (m.div_ceil(BM), n.div_ceil(BN));
    let pid = block_idx() as usize;
    if pid >= tiles_m * tiles_n {
        return; // the whole block: no barrier is reached by anyone
    }
    let (bm, bn) = crate::gemm::tile_of(pid, tiles_m, tiles_n, GROUP_M);
    let (row0, col0) = (bm * BM, bn * BN);
    let t = thread_idx() as usize;
    let (warp, lane) = (t / 32, t % 32);
    let (wm, wn) = (warp / 2, warp % 2);
    let smem = dynamic::<u32>();
    let loader = Loader {
        m,
        n,
        k,
        a,
        b,
        // SAFETY: the same memory as `a`, as words (read only where the
        // fast path holds: k even, so every row starts on a word).
        a32: unsafe { Slice::from_raw_parts(a.as_ptr().cast::<u32>(), a.len() / 2) },
        // SAFETY: as above.
        b32: unsafe { Slice::from_raw_parts(b.as_ptr().cast::<u32>(), b.len() / 2) },
        vec_a: k.is_multiple_of(8) && (a.as_ptr() as usize).is_multiple_of(16),
        vec_b: n.is_multiple_of(8) && (b.as_ptr() as usize).is_multiple_of(16),
        row0,
        col0,
        t,
    };

    let k_tiles = k.div_ceil(BK);
    for s in 0..STAGES - 1 {
        if s < k_tiles {
            // SAFETY: the slices hold their matrices; stage s in bounds.
            unsafe { loader.load(&smem, s * STAGE_WORDS, s) };
        }
        cp_async_commit();
    }
    let mut acc = [[[0.0f32; 4]; 8]; 4];
    for kt in 0..k_tiles {
        // Tile kt's copies are done (all but the STAGES - 2 newest groups),
        // and, after the barrier, everyone's; the stage refilled below was
        // last read in step kt - 1, before the barrier.
        cp_async_wait_group::<{ STAGES as u32 - 2 }>();
        sync_threads();
        let pf = kt + STAGES - 1;
        if pf < k_tiles {
            // SAFETY: as above.
            unsafe { loader.load(&smem, (pf % STAGES) * STAGE_WORDS, pf) };
        }
        cp_async_commit();
        let st = (kt % STAGES) * STAGE_WORDS;
        unroll!(ks in [0 1] {
            // SAFETY: the whole warp runs this (no divergence: everything
            // above is uniform per block); rows in bounds, 16-byte chunks.
            let (af, bf) = unsafe { fragments(&smem, st, ks, wm, wn, lane) };
            unroll!(mi in [0 1 2 3] {
                unroll!(ni in [0 1 2 3 4 5 6 7] {
                    let bw = [bf[ni / 2][2 * (ni % 2)], bf[ni / 2][2 * (ni % 2) + 1]];
                    // SAFETY: the whole warp, converged (as above).
                    acc[mi][ni] = unsafe { mma_m16n8k16_bf16_f32(af[mi], bw, acc[mi][ni]) };
                });
            });
        });
    }
    cp_async_wait_all();

    let (g, tq) = (lane / 4, lane % 4);
    let vec_c = n.is_multiple_of(2) && (c.as_mut_ptr() as usize).is_multiple_of(8);
    unroll!(mi in [0 1 2 3] {
        unroll!(ni in [0 1 2 3 4 5 6 7] {
            let (r, col) = (row0 + wm * 64 + mi * 16 + g, col0 + wn * 64 + ni * 8 + 2 * tq);
            let d = acc[mi][ni];
            for (h, r) in [(0, r), (1, r + 8)] {
                if r < m {
                    let v = [d[2 * h], d[2 * h + 1]];
                    // SAFETY: this thread alone owns these outputs; in bounds.
                    unsafe { store_pair(&c, r * n + col, n - col.min(n), vec_c, alpha, beta, v) };
                }
            }
        });
    });
}

/// A warp's `A` fragments (4 m16 tiles) and `B` fragments (4 pairs of n8
/// tiles) for 16-step `ks` of the stage at word `st`.
///
/// # Safety
/// The whole warp calls it, converged; `st` is a stage's first word.
#[inline(always)]
unsafe fn fragments(
    smem: &SharedArray<u32>,
    st: usize,
    ks: usize,
    wm: usize,
    wn: usize,
    lane: usize,
) -> ([[u32; 4]; 4], [[u32; 4]; 4]) {
    let (r16, half) = (lane % 16, lane / 16);
    // SAFETY: the caller's contract; every address is a swizzled 16-byte
    // chunk inside the stage.
    unsafe {
        let (mut af, mut bf) = ([[0u32; 4]; 4], [[0u32; 4]; 4]);
        unroll!(i in [0 1 2 3] {
            af[i] = ldmatrix_x4(smem, st + a_word(wm * 64 + i * 16 + r16, 2 * ks + half));
            let chunk = (wn * 64 + i * 16) / 8 + half;
            bf[i] = ldmatrix_x4_trans(smem, st + A_WORDS + b_word(16 * ks + r16, chunk));
        });
        (af, bf)
    }
}

/// Writes two adjacent outputs at `at`, `at + 1` (only the first `left` of
/// them exist in the row).
///
/// # Safety
/// `at + min(left, 2) <= c.len()`; no other thread writes these.
#[inline(always)]
unsafe fn store_pair(
    c: &SliceMut<f32>,
    at: usize,
    left: usize,
    vec: bool,
    alpha: f32,
    beta: f32,
    v: [f32; 2],
) {
    let ep = |x: f32, old: f32| {
        if beta == 0.0 {
            alpha * x
        } else {
            fma(beta, old, alpha * x)
        }
    };
    if vec && left >= 2 {
        // SAFETY: 8-byte aligned (n even, at even), in bounds (the caller).
        unsafe {
            let old = if beta == 0.0 { [0.0; 2] } else { load2(c, at) };
            store2(c, at, [ep(v[0], old[0]), ep(v[1], old[1])]);
        }
    } else {
        for (j, &x) in v.iter().enumerate().take(left) {
            // SAFETY: in bounds (the caller's contract).
            unsafe {
                let old = if beta == 0.0 { 0.0 } else { c.read(at + j) };
                c.write(at + j, ep(x, old));
            }
        }
    }
}

/// One thread's share of a stage's copies: 4 chunks of 8 elements of `A`'s
/// tile and 4 of `B`'s.
struct Loader {
    m: usize,
    n: usize,
    k: usize,
    a: Slice<u16>,
    b: Slice<u16>,
    a32: Slice<u32>,
    b32: Slice<u32>,
    vec_a: bool,
    vec_b: bool,
    row0: usize,
    col0: usize,
    t: usize,
}

impl Loader {
    /// Starts the copies of tile `kt` into the stage at word `st`: 16-byte
    /// `cp.async` where a chunk is inside its matrix and the fast path
    /// holds, zeros past the edges, an element-wise gather otherwise.
    ///
    /// # Safety
    /// The slices hold their matrices; `st + STAGE_WORDS <= smem.len()`.
    #[inline(always)]
    unsafe fn load(&self, smem: &SharedArray<u32>, st: usize, kt: usize) {
        for i in 0..4 {
            let q = self.t + THREADS as usize * i;
            let (r, ch) = (q / 4, q % 4);
            let (row, col) = (self.row0 + r, kt * BK + ch * 8);
            let dst = st + a_word(r, ch);
            // SAFETY: the caller's contract; row < m and col + 8 <= k.
            unsafe {
                if self.vec_a && row < self.m && col < self.k {
                    copy16(smem, dst, &self.a32, (row * self.k + col) / 2);
                } else {
                    let ok = |j: usize| row < self.m && col + j < self.k;
                    gather(smem, dst, &self.a, row * self.k + col, ok);
                }
            }
        }
        for i in 0..4 {
            let q = self.t + THREADS as usize * i;
            let (r, ch) = (q / 16, q % 16);
            let (row, col) = (kt * BK + r, self.col0 + ch * 8);
            let dst = st + A_WORDS + b_word(r, ch);
            // SAFETY: as above, for B.
            unsafe {
                if self.vec_b && row < self.k && col < self.n {
                    copy16(smem, dst, &self.b32, (row * self.n + col) / 2);
                } else {
                    let ok = |j: usize| row < self.k && col + j < self.n;
                    gather(smem, dst, &self.b, row * self.n + col, ok);
                }
            }
        }
    }
}

/// `cp.async` of 16 bytes: unchecked on the GPU, checked on the emulation
/// (a bounds or alignment bug is a typed fault there).
///
/// # Safety
/// `dst..dst + 4` in `smem`, `src..src + 4` in `s`, both 16-byte aligned.
#[inline(always)]
unsafe fn copy16(smem: &SharedArray<u32>, dst: usize, s: &Slice<u32>, src: usize) {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    unsafe {
        cp_async16_unchecked(smem, dst, s, src)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let _ = cp_async16_unchecked::<u32>;
        kernel_abi::ptx::cp_async16(smem, dst, s, src)
    }
}

/// Eight elements from `s[at..]` (those with `ok(j)`; zeros elsewhere)
/// into the chunk at word `dst`.
///
/// # Safety
/// `ok(j)` implies `at + j < s.len()`; `dst..dst + 4` in `smem`, aligned.
#[inline(always)]
unsafe fn gather(
    smem: &SharedArray<u32>,
    dst: usize,
    s: &Slice<u16>,
    at: usize,
    ok: impl Fn(usize) -> bool,
) {
    let e = |j: usize| {
        if ok(j) {
            // SAFETY: ok(j), so in bounds (the caller's contract).
            u32::from(unsafe { s.read(at + j) })
        } else {
            0
        }
    };
    let w = core::array::from_fn(|i| e(2 * i) | (e(2 * i + 1) << 16));
    // SAFETY: the caller's contract.
    unsafe { smem.set4_unchecked(dst, w) };
}

/// Elements `i`, `i + 1` of `c` (`ld.global.v2.f32`).
///
/// # Safety
/// `i + 2 <= c.len()`, element `i` 8-byte aligned, nobody else writes them.
#[inline(always)]
unsafe fn load2(c: &SliceMut<f32>, i: usize) -> [f32; 2] {
    #[cfg(target_arch = "nvptx64")]
    {
        // SAFETY: the caller's contract.
        let p = unsafe { c.as_mut_ptr().add(i) };
        let (x, y): (f32, f32);
        // SAFETY: 8 aligned bytes of global memory (the caller's contract).
        unsafe {
            core::arch::asm!(
                "{{", ".reg .u64 %gm_g;", "cvta.to.global.u64 %gm_g, {p};",
                "ld.global.v2.f32 {{{x}, {y}}}, [%gm_g];", "}}",
                x = out(reg32) x, y = out(reg32) y, p = in(reg64) p, options(readonly, nostack))
        };
        [x, y]
    }
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: as above.
    core::array::from_fn(|j| unsafe { c.read(i + j) })
}

/// Stores elements `i`, `i + 1` of `c` (`st.global.v2.f32`).
///
/// # Safety
/// As [`load2`].
#[inline(always)]
unsafe fn store2(c: &SliceMut<f32>, i: usize, v: [f32; 2]) {
    #[cfg(target_arch = "nvptx64")]
    {
        // SAFETY: the caller's contract.
        let p = unsafe { c.as_mut_ptr().add(i) };
        // SAFETY: 8 aligned bytes of global memory (the caller's contract).
        unsafe {
            core::arch::asm!(
                "{{", ".reg .u64 %gm_g;", "cvta.to.global.u64 %gm_g, {p};",
                "st.global.v2.f32 [%gm_g], {{{x}, {y}}};", "}}",
                x = in(reg32) v[0], y = in(reg32) v[1], p = in(reg64) p, options(nostack))
        };
    }
    #[cfg(not(target_arch = "nvptx64"))]
    for (j, x) in v.into_iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe { c.write(i + j, x) };
    }
}
