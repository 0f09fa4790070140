//! The emulation of `ldmatrix` and `mma.sync` (m16n8k16, bf16 in, f32
//! accumulate): one warp computes a 16x8 product from shared-memory tiles
//! and matches a plain loop.

use kernel_abi::ptx::{ldmatrix_x4, ldmatrix_x4_trans, mma_m16n8k16_bf16_f32};
use kernel_abi::thread::{emulate_launch, Launch};
use kernel_abi::{shared_array, thread, SliceMut};

fn bf16(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16 // exact for the small integers used here
}

#[test]
fn ldmatrix_and_mma_compute_a_16x8_product_like_a_plain_loop() {
    // A 16x16 (row-major), B 16x8 stored k-major (row k: 8 columns).
    let a: Vec<f32> = (0..256).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let b: Vec<f32> = (0..128).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
    let mut d = vec![0f32; 128];
    let out = {
        // SAFETY: `d` outlives the launch.
        unsafe { SliceMut::from_raw_parts(d.as_mut_ptr(), d.len()) }
    };
    let (a2, b2) = (a.clone(), b.clone());
    emulate_launch("mma", &Launch::linear(1, 32), 1, &|| {
        let l = thread::thread_idx() as usize;
        // Tiles as u32 pairs of bf16: A 16 rows x 8 words, B 16 rows x 4 words.
        let ta = shared_array!(u32, 128);
        let tb = shared_array!(u32, 64);
        ta.fill_and_sync(|w| {
            let (r, c) = (w / 8, 2 * (w % 8));
            u32::from(bf16(a2[r * 16 + c])) | (u32::from(bf16(a2[r * 16 + c + 1])) << 16)
        });
        tb.fill_and_sync(|w| {
            let (k, c) = (w / 4, 2 * (w % 4));
            u32::from(bf16(b2[k * 8 + c])) | (u32::from(bf16(b2[k * 8 + c + 1])) << 16)
        });
        // A: matrices (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
        // (rows 0-7, cols 8-15), (rows 8-15, cols 8-15): lane l gives row
        // l % 16 at column block l / 16.
        let (row, cb) = (l % 16, l / 16);
        // SAFETY: the whole warp calls it; rows in bounds and 16-byte aligned.
        let fa = unsafe { ldmatrix_x4(&ta, row * 8 + cb * 4) };
        // B (k-major) transposed: matrices k 0-7 and k 8-15 (n 0-7); lanes
        // 0-15 give rows k = l, lanes 16-31 repeat them.
        // SAFETY: as above.
        let fb = unsafe { ldmatrix_x4_trans(&tb, (l % 16) * 4) };
        // SAFETY: the whole warp calls it.
        let c = unsafe { mma_m16n8k16_bf16_f32(fa, [fb[0], fb[1]], [1.0; 4]) };
        let (g, t) = (l / 4, l % 4);
        for (k, (r, col)) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ]
        .into_iter()
        .enumerate()
        {
            // SAFETY: each (r, col) belongs to one lane.
            unsafe { out.write(r * 8 + col, c[k]) };
        }
    })
    .unwrap();
    for r in 0..16 {
        for c in 0..8 {
            let want: f32 = 1.0 + (0..16).map(|k| a[r * 16 + k] * b[k * 8 + c]).sum::<f32>();
            assert_eq!(d[r * 8 + c], want, "({r}, {c})");
        }
    }
}
