//! SGEMM: `C = alpha * A * B + beta * C` in `f32`, row-major, any shape.
//!
//! # Contract
//! - `A` is `m x k`, `B` is `k x n`, `C` is `m x n`, all row-major and
//!   dense: the leading dimensions are `k`, `n` and `n` (element `(i, j)` of
//!   `A` is `a[i * k + j]`). Each slice holds at least that many elements
//!   (otherwise the kernel traps before touching memory); `C` is disjoint
//!   from `A` and `B`.
//! - Any `m`, `n`, `k`, zeros included. Rows and columns past the edges of
//!   a tile are bounds-checked (loads zero-filled, stores skipped). The
//!   16-byte vector paths are taken where they are valid: `A`'s rows when
//!   `k % 4 == 0` and `A` starts 16-byte aligned, `B`'s and `C`'s rows when
//!   `n % 4 == 0` and the slice starts 16-byte aligned; otherwise the same
//!   kernel loads and stores element by element (same results, slower).
//! - Launch with exactly [`sgemm_launch`]`(m, n, k)` (host builds): a 1-D
//!   grid of `ceil(m / 128) * ceil(n / 128)` blocks (at least 1) of 256
//!   threads, no dynamic shared memory (the kernel's static shared memory
//!   is 16.5 KiB).
//!
//! # Accumulation order and results
//! Each element of `C` has one `f32` accumulator, starting at `+0.0`, that
//! takes one fused multiply-add ([`kernel_abi::fma`]: `fma.rn.f32` on the
//! GPU, `f32::mul_add` on the host) per `k`, in ascending `k`:
//! `acc = fma(a[i][p], b[p][j], acc)` for `p = 0, 1, ..., k - 1`. Then
//! `c = alpha * acc` when `beta == 0` (C is *not read*: NaN or garbage in
//! `C` does not propagate), else `c = fma(beta, c_old, alpha * acc)`.
//! The result is therefore bit-identical between the GPU, the CPU
//! emulation and [`sgemm_reference`], a sequential loop with that order.
//!
//! Against the exact product: with `u = 2^-24`, each accumulation has a
//! relative-to-magnitude error of at most `gamma_k = k*u / (1 - k*u)`, so
//! `|acc - sum_p a*b| <= gamma_k * sum_p |a*b|` (the standard bound for a
//! recursive sum with fused steps), and the epilogue adds at most two more
//! roundings: `|c - exact| <= gamma_(k+2) * (|alpha| * sum_p |a*b| +
//! |beta * c_old|)`. The tests check every element against an `f64`
//! reference with that bound.
//!
//! # Design
//! A block computes a 128x128 tile of `C` with 256 threads, each an 8x8
//! sub-tile in 64 registers: rows `4ty..4ty+4` and `64+4ty..64+4ty+4`,
//! columns `4tx..4tx+4` and `64+4tx..64+4tx+4` (`ty, tx` in `0..16`, a
//! warp being 4 `ty` by 8 `tx`, so each shared read of a warp is at most
//! one 128-byte wavefront). `k` goes in steps of 8: each thread loads one
//! `float4` of `A` (`ld.global.nc.v4`) and one of `B` for the next step
//! into registers while it computes the current one from shared memory
//! (two buffers, one barrier a step), `A` stored transposed (`k`-major,
//! rows padded to 132 floats: the transposing stores are conflict-free) so
//! both operands are read with `ld.shared.v4`. Blocks are ordered in
//! groups of 8 block-rows (consecutive blocks share `B`'s columns and
//! `A`'s rows in L2).
//!
//! ptxas 12.9 (`-arch=sm_90 -v`, the sm_70 or sm_90 PTX): 159 registers,
//! 16640 bytes of shared memory, no stack, no spills (one block of 256
//! threads an SM by registers). The PTX's hot loop is 32
//! `ld.shared.v4.b32` and 512 `fma.rn.f32` per `k` step of 8, with
//! `ld.global.nc.v4.b32` loads and `st.global.v4.f32` stores.

use kernel_abi::thread::{block_idx, thread_idx, trap};
use kernel_abi::{fma, kernels, shared_array, SharedArray, Slice, SliceMut};

/// Rows of `C` a block computes.
pub const BM: usize = 128;
/// Columns of `C` a block computes.
pub const BN: usize = 128;
/// The `k` step: columns of `A` (rows of `B`) per shared-memory stage.
pub const BK: usize = 8;
/// Threads per block.
pub const THREADS: u32 = 256;
/// Block-rows per group in the block order (L2 reuse).
const GROUP_M: usize = 8;
/// A's transposed tile: row stride in floats (padded against bank conflicts).
const AS_STRIDE: usize = BM + 4;
/// Floats of one stage of A's tile.
const AS_STAGE: usize = BK * AS_STRIDE;
/// Floats of one stage of B's tile.
const BS_STAGE: usize = BK * BN;
const AS_LEN: usize = 2 * AS_STAGE;
const BS_LEN: usize = 2 * BS_STAGE;

kernels! {
    /// `C = alpha * A * B + beta * C` (f32, row-major, `A` `m x k`, `B`
    /// `k x n`, `C` `m x n`, dense): see the [module docs](self) for the
    /// contract, the accumulation order and the error bound.
    ///
    /// # Safety
    /// `a`, `b` and `c` are valid device memory for their lengths, `c`
    /// disjoint from both others; launched with [`sgemm_launch`]`(m, n, k)`.
    pub unsafe fn sgemm(
        m: u32,
        n: u32,
        k: u32,
        alpha: f32,
        a: Slice<f32>,
        b: Slice<f32>,
        beta: f32,
        c: SliceMut<f32>,
    ) {
        // SAFETY: the contract above.
        unsafe { sgemm_block(m as usize, n as usize, k as usize, alpha, a, b, beta, c) }
    }
}

/// The launch plan of [`sgemm`](struct@sgemm) for an `m x k` by `k x n`
/// product: a 1-D grid of `ceil(m/128) * ceil(n/128)` blocks (at least one:
/// a zero-sized product is a launch whose block does nothing), 256 threads a
/// block, no dynamic shared memory.
#[cfg(not(target_arch = "nvptx64"))]
pub fn sgemm_launch(m: u32, n: u32, k: u32) -> kernel_abi::thread::Launch {
    let _ = k;
    let blocks = (m as u64).div_ceil(BM as u64) * (n as u64).div_ceil(BN as u64);
    kernel_abi::thread::Launch::linear(blocks.clamp(1, u32::MAX as u64) as u32, THREADS)
}

/// The sequential reference with the kernel's order (see the module
/// docs): `c` becomes bit-identical to what [`sgemm`](struct@sgemm) writes.
///
/// Panics when a slice is shorter than its matrix.
#[cfg(not(target_arch = "nvptx64"))]
#[allow(clippy::too_many_arguments)]
pub fn sgemm_reference(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    let (a, b, c) = (&a[..m * k], &b[..k * n], &mut c[..m * n]);
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for p in 0..k {
                acc = fma(a[i * k + p], b[p * n + j], acc);
            }
            c[i * n + j] = epilogue(alpha, beta, acc, c[i * n + j]);
        }
    }
}

/// `alpha * acc` when `beta == 0` (`old` unused), else
/// `fma(beta, old, alpha * acc)`.
#[inline(always)]
fn epilogue(alpha: f32, beta: f32, acc: f32, old: f32) -> f32 {
    if beta == 0.0 {
        alpha * acc
    } else {
        fma(beta, old, alpha * acc)
    }
}

/// Which tile of `C` block `pid` computes: `(block row, block column)`,
/// in groups of `group_m` block-rows, column-major in a group.
#[inline(always)]
pub(crate) fn tile_of(
    pid: usize,
    tiles_m: usize,
    tiles_n: usize,
    group_m: usize,
) -> (usize, usize) {
    let per_group = group_m * tiles_n;
    let first = pid / per_group * group_m;
    let rows = if tiles_m - first < group_m {
        tiles_m - first
    } else {
        group_m
    };
    let in_group = pid % per_group;
    (first + in_group % rows, in_group / rows)
}

/// The whole block's work (every thread calls it).
///
/// # Safety
/// As [`sgemm`](struct@sgemm).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn sgemm_block(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Slice<f32>,
    b: Slice<f32>,
    beta: f32,
    c: SliceMut<f32>,
) {
    if a.len() < m * k || b.len() < k * n || c.len() < m * n {
        trap()
    }
    let (tiles_m, tiles_n) = (m.div_ceil(BM), n.div_ceil(BN));
    let pid = block_idx() as usize;
    if pid >= tiles_m * tiles_n {
        return; // the whole block: no barrier is reached by anyone
    }
    let (bm, bn) = tile_of(pid, tiles_m, tiles_n, GROUP_M);
    let (row0, col0) = (bm * BM, bn * BN);
    let t = thread_idx() as usize;
    let (warp, lane) = (t / 32, t % 32);
    let ty = (warp / 2) * 4 + lane / 8;
    let tx = (warp % 2) * 8 + lane % 8;

    let a_s = shared_array!(f32, AS_LEN);
    let b_s = shared_array!(f32, BS_LEN);
    let (a_row, b_col) = (row0 + t / 2, col0 + (t % 32) * 4);
    let loader = Loader {
        a,
        b,
        a_at: a_row * k + (t % 2) * 4,
        a_in: a_row < m,
        a_col: (t % 2) as u32 * 4,
        b_at: (t / 32) * n + b_col,
        b_step: BK * n,
        b_row: (t / 32) as u32,
        b_col: b_col as u32,
        k: k as u32,
        n: n as u32,
        vec_a: k.is_multiple_of(4) && (a.as_ptr() as usize).is_multiple_of(16),
        vec_b: n.is_multiple_of(4) && (b.as_ptr() as usize).is_multiple_of(16),
    };

    let mut acc = [[0.0f32; 8]; 8];
    let k_tiles = (k as u32).div_ceil(BK as u32);
    if k_tiles > 0 {
        // SAFETY: the slices hold their matrices (checked above).
        let (ra, rb) = unsafe { (loader.a(0), loader.b(0)) };
        // SAFETY: in bounds of the tiles by construction of the indices.
        unsafe { loader.store(&a_s, &b_s, 0, t, ra, rb) };
        kernel_abi::thread::sync_threads();
    }
    for kt in 0..k_tiles {
        let cur = (kt % 2) as usize;
        let next = kt + 1 < k_tiles;
        let (mut ra, mut rb) = ([0.0f32; 4], [0.0f32; 4]);
        if next {
            // SAFETY: as above.
            (ra, rb) = unsafe { (loader.a(kt + 1), loader.b(kt + 1)) };
        }
        let (a_base, b_base) = (cur * AS_STAGE + 4 * ty, cur * BS_STAGE + 4 * tx);
        // The 8 k-steps written out (each a constant offset from the bases).
        macro_rules! steps {
            ($($kk:literal)*) => {$(
                // SAFETY: 16-byte aligned (every offset a multiple of 4
                // floats) and in bounds: at most
                // AS_STAGE + 7 * AS_STRIDE + 64 + 60 + 4 <= AS_LEN, and
                // BS_STAGE + 7 * BN + 64 + 28 + 4 <= BS_LEN.
                unsafe { step(&mut acc, &a_s, a_base + $kk * AS_STRIDE, &b_s, b_base + $kk * BN) };
            )*};
        }
        steps!(0 1 2 3 4 5 6 7);
        if next {
            // SAFETY: as above; the other stage was last read before the
            // previous step's barrier.
            unsafe { loader.store(&a_s, &b_s, 1 - cur, t, ra, rb) };
        }
        kernel_abi::thread::sync_threads();
    }

    let out = Out {
        m,
        n,
        alpha,
        beta,
        c,
        vec_c: n.is_multiple_of(4) && (c.as_mut_ptr() as usize).is_multiple_of(16),
    };
    // One call per row with a constant index: `acc` stays in registers.
    macro_rules! rows {
        ($($i:literal)*) => {$(
            // SAFETY: this thread alone owns its 8x8 outputs.
            unsafe { out.row(row0 + 4 * ty + if $i < 4 { $i } else { 60 + $i }, col0 + 4 * tx, &acc[$i]) };
        )*};
    }
    rows!(0 1 2 3 4 5 6 7);
}

/// One k-step of a thread's 8x8 outer product: 8 values of `A`'s
/// transposed tile (`a_s[ai..ai + 4]`, `a_s[ai + 64..ai + 68]`), 8 of
/// `B`'s (`b_s[bi..]`, `b_s[bi + 64..]`), 64 fused multiply-adds.
///
/// # Safety
/// `ai + 68 <= a_s.len()`, `bi + 68 <= b_s.len()`, both multiples of 4.
#[inline(always)]
unsafe fn step(
    acc: &mut [[f32; 8]; 8],
    a_s: &SharedArray<f32>,
    ai: usize,
    b_s: &SharedArray<f32>,
    bi: usize,
) {
    // SAFETY: the caller's contract.
    let (a0, a1, b0, b1) = unsafe {
        (
            a_s.get4_unchecked(ai),
            a_s.get4_unchecked(ai + 64),
            b_s.get4_unchecked(bi),
            b_s.get4_unchecked(bi + 64),
        )
    };
    let av = [a0[0], a0[1], a0[2], a0[3], a1[0], a1[1], a1[2], a1[3]];
    let bv = [b0[0], b0[1], b0[2], b0[3], b1[0], b1[1], b1[2], b1[3]];
    for (row, &x) in acc.iter_mut().zip(&av) {
        for (o, &y) in row.iter_mut().zip(&bv) {
            *o = fma(x, y, *o);
        }
    }
}

/// The epilogue's parameters.
struct Out {
    m: usize,
    n: usize,
    alpha: f32,
    beta: f32,
    c: SliceMut<f32>,
    vec_c: bool,
}

impl Out {
    /// Writes this thread's outputs of row `r` (if inside `C`): columns
    /// `col..col + 4` from `v[..4]` and `col + 64..col + 68` from `v[4..]`.
    ///
    /// # Safety
    /// `c` holds `m * n` elements; no other thread writes these.
    #[inline(always)]
    unsafe fn row(&self, r: usize, col: usize, v: &[f32; 8]) {
        if r >= self.m {
            return;
        }
        let (alpha, beta, c) = (self.alpha, self.beta, &self.c);
        for half in 0..2 {
            let col = col + 64 * half;
            let v = [
                v[4 * half],
                v[4 * half + 1],
                v[4 * half + 2],
                v[4 * half + 3],
            ];
            let at = r * self.n + col;
            if self.vec_c && col < self.n {
                // SAFETY: col + 4 <= n (n % 4 == 0, col % 4 == 0), the row
                // in bounds, 16-byte aligned; the caller's contract.
                unsafe {
                    let old = if beta == 0.0 { [0.0; 4] } else { load4(c, at) };
                    let out = core::array::from_fn(|j| epilogue(alpha, beta, v[j], old[j]));
                    store4(c, at, out);
                }
            } else {
                for (j, &x) in v.iter().enumerate() {
                    if col + j < self.n {
                        // SAFETY: in bounds; the caller's contract.
                        unsafe {
                            let old = if beta == 0.0 { 0.0 } else { c.read(at + j) };
                            c.write(at + j, epilogue(alpha, beta, x, old));
                        }
                    }
                }
            }
        }
    }
}

/// One thread's share of the global-to-shared copies: four elements of
/// `A`'s tile (a row, four columns) and four of `B`'s (a row, four columns).
struct Loader {
    a: Slice<f32>,
    b: Slice<f32>,
    /// Index in `a` of this thread's first element of tile 0; whether its
    /// row is inside `A`; its column in a tile.
    a_at: usize,
    a_in: bool,
    a_col: u32,
    /// Index in `b` of this thread's first element of tile 0, the step
    /// from one tile to the next (`BK * n`), its row in a tile, its column.
    b_at: usize,
    b_step: usize,
    b_row: u32,
    b_col: u32,
    k: u32,
    n: u32,
    vec_a: bool,
    vec_b: bool,
}

impl Loader {
    /// This thread's four elements of `A`'s tile `kt` (zero past the edges).
    ///
    /// # Safety
    /// `a` holds `m * k` elements.
    #[inline(always)]
    unsafe fn a(&self, kt: u32) -> [f32; 4] {
        let col = kt * BK as u32 + self.a_col;
        let mut v = [0.0f32; 4];
        if self.a_in {
            let at = self.a_at + kt as usize * BK;
            if self.vec_a {
                if col < self.k {
                    // SAFETY: col + 4 <= k (both multiples of 4), aligned.
                    v = unsafe { ld4(&self.a, at) };
                }
            } else {
                for (j, x) in v.iter_mut().enumerate() {
                    if col + (j as u32) < self.k {
                        // SAFETY: in bounds.
                        *x = unsafe { ld(&self.a, at + j) };
                    }
                }
            }
        }
        v
    }

    /// This thread's four elements of `B`'s tile `kt` (zero past the edges).
    ///
    /// # Safety
    /// `b` holds `k * n` elements.
    #[inline(always)]
    unsafe fn b(&self, kt: u32) -> [f32; 4] {
        let row = kt * BK as u32 + self.b_row;
        let mut v = [0.0f32; 4];
        if row < self.k {
            let at = self.b_at + kt as usize * self.b_step;
            if self.vec_b {
                if self.b_col < self.n {
                    // SAFETY: b_col + 4 <= n (both multiples of 4), aligned.
                    v = unsafe { ld4(&self.b, at) };
                }
            } else {
                for (j, x) in v.iter_mut().enumerate() {
                    if self.b_col + (j as u32) < self.n {
                        // SAFETY: in bounds.
                        *x = unsafe { ld(&self.b, at + j) };
                    }
                }
            }
        }
        v
    }

    /// Stores this thread's share into stage `stage`: `A` transposed.
    ///
    /// # Safety
    /// `stage < 2`, `t < 256`.
    #[inline(always)]
    unsafe fn store(
        &self,
        a_s: &SharedArray<f32>,
        b_s: &SharedArray<f32>,
        stage: usize,
        t: usize,
        ra: [f32; 4],
        rb: [f32; 4],
    ) {
        let a_at = stage * AS_STAGE + self.a_col as usize * AS_STRIDE + t / 2;
        for (j, &x) in ra.iter().enumerate() {
            // SAFETY: at most AS_STAGE + 7 * AS_STRIDE + 127 < AS_LEN.
            unsafe { a_s.set_unchecked(a_at + j * AS_STRIDE, x) };
        }
        // SAFETY: at most BS_STAGE + 7 * BN + 124 + 4 <= BS_LEN, aligned.
        unsafe {
            b_s.set4_unchecked(
                stage * BS_STAGE + self.b_row as usize * BN + (t % 32) * 4,
                rb,
            )
        };
    }
}

/// Elements `i..i + 4` of `s` (`ld.global.nc.v4`), unchecked on the GPU,
/// checked on the emulation (an edge-mask bug there is a typed fault,
/// [`kernel_abi::thread::FaultKind::SliceOutOfBounds`], even where the
/// values read would never reach `C`).
///
/// # Safety
/// `i + 4 <= s.len()`, element `i` 16-byte aligned.
#[inline(always)]
unsafe fn ld4(s: &Slice<f32>, i: usize) -> [f32; 4] {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    unsafe {
        s.load4_nc_unchecked(i)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    s.load4_nc(i)
}

/// Element `i` of `s` (`ld.global.nc`), as [`ld4`].
///
/// # Safety
/// `i < s.len()`.
#[inline(always)]
unsafe fn ld(s: &Slice<f32>, i: usize) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    unsafe {
        s.load_nc_unchecked(i)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    s.load_nc(i)
}

/// Elements `i..i + 4` of `c` (`ld.global.v4.f32`).
///
/// # Safety
/// `i + 4 <= c.len()`, element `i` 16-byte aligned, nobody else writes them.
#[inline(always)]
unsafe fn load4(c: &SliceMut<f32>, i: usize) -> [f32; 4] {
    #[cfg(target_arch = "nvptx64")]
    {
        // SAFETY: the caller's contract.
        let p = unsafe { c.as_mut_ptr().add(i) };
        let (x, y, z, w): (f32, f32, f32, f32);
        // SAFETY: 16 aligned bytes of global memory (the caller's contract).
        unsafe {
            core::arch::asm!(
                "{{", ".reg .u64 %gm_g;", "cvta.to.global.u64 %gm_g, {p};",
                "ld.global.v4.f32 {{{x}, {y}, {z}, {w}}}, [%gm_g];", "}}",
                x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                p = in(reg64) p, options(readonly, nostack))
        };
        [x, y, z, w]
    }
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: as above.
    core::array::from_fn(|j| unsafe { c.read(i + j) })
}

/// Stores elements `i..i + 4` of `c` (`st.global.v4.f32`).
///
/// # Safety
/// As [`load4`].
#[inline(always)]
unsafe fn store4(c: &SliceMut<f32>, i: usize, v: [f32; 4]) {
    #[cfg(target_arch = "nvptx64")]
    {
        // SAFETY: the caller's contract.
        let p = unsafe { c.as_mut_ptr().add(i) };
        // SAFETY: 16 aligned bytes of global memory (the caller's contract).
        unsafe {
            core::arch::asm!(
                "{{", ".reg .u64 %gm_g;", "cvta.to.global.u64 %gm_g, {p};",
                "st.global.v4.f32 [%gm_g], {{{x}, {y}, {z}, {w}}};", "}}",
                x = in(reg32) v[0], y = in(reg32) v[1], z = in(reg32) v[2], w = in(reg32) v[3],
                p = in(reg64) p, options(nostack))
        };
    }
    #[cfg(not(target_arch = "nvptx64"))]
    for (j, x) in v.into_iter().enumerate() {
        // SAFETY: the caller's contract.
        unsafe { c.write(i + j, x) };
    }
}
