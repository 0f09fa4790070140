//! `ldmatrix` and `mma.sync` (sm_80+), and their emulation on the host:
//! the warp's lanes exchange their fragments, then each computes its own.
//!
//! Fragment layouts (PTX ISA, `mma.m16n8k16` with `.bf16`, `row.col`),
//! with `g = lane / 4`, `t = lane % 4`, each `u32` two bf16 (low half the
//! lower column/row):
//! - A (16x16, row-major): `a[0]` row `g`, columns `2t, 2t+1`; `a[1]` row
//!   `g+8`, same columns; `a[2]` row `g`, columns `2t+8, 2t+9`; `a[3]` row
//!   `g+8`, columns `2t+8, 2t+9`.
//! - B (16x8, column-major): `b[0]` rows (k) `2t, 2t+1`, column `g`; `b[1]`
//!   rows `2t+8, 2t+9`, column `g`.
//! - C, D (16x8 f32): `c[0], c[1]` row `g`, columns `2t, 2t+1`; `c[2],
//!   c[3]` row `g+8`, same columns.

use crate::shared::SharedArray;

/// `D = A * B + C` for one warp: a 16x16 bf16 A, a 16x8 bf16 B, a 16x8 f32
/// C and D (`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`), the
/// fragments laid out across the lanes as the module docs say.
///
/// # Safety
/// Every lane of the warp executes this call together (converged, no lane
/// exited): the instruction is `.sync.aligned`. (Registers only: no memory
/// is touched.) On the emulation a lane missing is
/// [`FaultKind::IncompleteWarp`](crate::thread::FaultKind::IncompleteWarp).
#[inline(always)]
pub unsafe fn mma_m16n8k16_bf16_f32(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
    #[cfg(target_arch = "nvptx64")]
    {
        let (d0, d1, d2, d3): (f32, f32, f32, f32);
        // SAFETY: the caller's contract (converged warp); registers only.
        unsafe {
            core::arch::asm!(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                d0 = out(reg32) d0, d1 = out(reg32) d1, d2 = out(reg32) d2, d3 = out(reg32) d3,
                a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                b0 = in(reg32) b[0], b1 = in(reg32) b[1],
                c0 = in(reg32) c[0], c1 = in(reg32) c[1], c2 = in(reg32) c[2], c3 = in(reg32) c[3],
                options(pure, nomem, nostack),
            )
        };
        [d0, d1, d2, d3]
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        use crate::emu::{warp_allgather, WarpOp};
        let lane = crate::thread::lane_id();
        let mine = [a[0], a[1], a[2], a[3], b[0], b[1]].map(u64::from);
        warp_allgather(WarpOp::Mma, &mine, |get| {
            let bf = |x: u32, hi: bool| f32::from_bits(if hi { x & 0xffff_0000 } else { x << 16 });
            let mut am = [[0f32; 16]; 16];
            let mut bm = [[0f32; 8]; 16];
            for l in 0..32u32 {
                let Some(f) = get(l) else { continue };
                let (g, t) = ((l / 4) as usize, (l % 4) as usize);
                for (r, (row, col)) in [
                    (g, 2 * t),
                    (g + 8, 2 * t),
                    (g, 2 * t + 8),
                    (g + 8, 2 * t + 8),
                ]
                .into_iter()
                .enumerate()
                {
                    am[row][col] = bf(f[r] as u32, false);
                    am[row][col + 1] = bf(f[r] as u32, true);
                }
                for (r, k) in [(4, 2 * t), (5, 2 * t + 8)] {
                    bm[k][g] = bf(f[r] as u32, false);
                    bm[k + 1][g] = bf(f[r] as u32, true);
                }
            }
            let (g, t) = ((lane / 4) as usize, (lane % 4) as usize);
            let at = |row: usize, col: usize, acc: f32| {
                (0..16).fold(acc, |s, k| am[row][k].mul_add(bm[k][col], s))
            };
            [
                at(g, 2 * t, c[0]),
                at(g, 2 * t + 1, c[1]),
                at(g + 8, 2 * t, c[2]),
                at(g + 8, 2 * t + 1, c[3]),
            ]
        })
    }
}

/// Loads four 8x8 matrices of 16-bit elements from shared memory
/// (`ldmatrix.sync.aligned.m8n8.x4.shared.b16`): lane `l` passes the
/// address of one row (8 elements, 16 bytes: `tile` elements `i..i + 4`,
/// 16-byte aligned), lanes `8m..8m + 8` the rows of matrix `m`; lane `l`
/// gets, in word `m`, elements `(l / 4, 2 * (l % 4))` and the next of
/// matrix `m` (the A/B fragment layout of `mma`).
///
/// # Safety
/// Every lane of the warp executes this call together (converged), each
/// with `i + 4 <= tile.len()` and element `i` 16-byte aligned.
#[inline(always)]
pub unsafe fn ldmatrix_x4(tile: &SharedArray<u32>, i: usize) -> [u32; 4] {
    #[cfg(target_arch = "nvptx64")]
    {
        let (r0, r1, r2, r3): (u32, u32, u32, u32);
        // SAFETY: the caller's contract.
        unsafe {
            core::arch::asm!(
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
                r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
                a = in(reg32) tile.shared_addr(i), options(readonly, nostack),
            )
        };
        [r0, r1, r2, r3]
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let lane = crate::thread::lane_id();
        rows(tile, i, crate::emu::WarpOp::Ldmatrix, |row| {
            let (r, w) = (lane / 4, lane % 4);
            // SAFETY: the caller's contract: each lane's row lies in its array.
            core::array::from_fn(|m| unsafe { row(8 * m as u32 + r).get_unchecked(w as usize) })
        })
    }
}

/// [`ldmatrix_x4`] transposed (`ldmatrix ... .trans`): lane `l` gets, in
/// word `m`, elements `(2 * (l % 4), l / 4)` (low half) and
/// `(2 * (l % 4) + 1, l / 4)` (high half) of matrix `m`: the B fragment of
/// `mma` from a row-major (k-major) tile.
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(tile: &SharedArray<u32>, i: usize) -> [u32; 4] {
    #[cfg(target_arch = "nvptx64")]
    {
        let (r0, r1, r2, r3): (u32, u32, u32, u32);
        // SAFETY: the caller's contract.
        unsafe {
            core::arch::asm!(
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{r0}, {r1}, {r2}, {r3}}}, [{a}];",
                r0 = out(reg32) r0, r1 = out(reg32) r1, r2 = out(reg32) r2, r3 = out(reg32) r3,
                a = in(reg32) tile.shared_addr(i), options(readonly, nostack),
            )
        };
        [r0, r1, r2, r3]
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let lane = crate::thread::lane_id();
        rows(tile, i, crate::emu::WarpOp::Ldmatrix, |row| {
            let (k, col) = (2 * (lane % 4), lane / 4);
            let half = |m: u32, r: u32| {
                // SAFETY: the caller's contract: each lane's row lies in its array.
                let w = unsafe { row(8 * m + r).get_unchecked((col / 2) as usize) };
                (w >> (16 * (col % 2))) & 0xffff
            };
            core::array::from_fn(|m| half(m as u32, k) | (half(m as u32, k + 1) << 16))
        })
    }
}

/// The emulation of `ldmatrix`: every lane's row view (4 words), then `f`.
#[cfg(not(target_arch = "nvptx64"))]
fn rows<R>(
    tile: &SharedArray<u32>,
    i: usize,
    op: crate::emu::WarpOp,
    f: impl FnOnce(&dyn Fn(u32) -> SharedArray<u32>) -> R,
) -> R {
    let (words, first) = tile.raw_parts();
    let mine = [words as u64, (first + i) as u64];
    crate::emu::warp_allgather(op, &mine, |get| {
        f(&|l| match get(l) {
            // SAFETY: the lane's own view's words and position (both from
            // a live `SharedArray` of this block).
            Some(v) => unsafe { SharedArray::from_raw_parts(v[0] as *const _, v[1] as usize, 4) },
            None => crate::emu::raise(crate::thread::FaultKind::IncompleteWarp),
        })
    })
}
