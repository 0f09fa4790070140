//! Row softmax on the CPU emulation with the plan's launch: against an
//! independent f64 plain loop (within the documented relative bound), a
//! sequential model of the documented order (bit-exact), outputs poisoned
//! before and guard elements after the matrix untouched; and the `exp`
//! against f64 (the documented 2 ulp).

mod common;

use common::{block_tree, launch, warp_tree, Buf, U};
use gpu_kernels::softmax::{self, exp_f32};

fn add(a: f32, b: f32) -> f32 {
    a + b
}

/// The documented order, sequentially, for one row.
fn model_row(x: &[f32]) -> Vec<f32> {
    let cols = x.len();
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let warp = cols <= softmax::SOFTMAX_WARP_COLS;
    let width = if warp {
        32
    } else {
        softmax::softmax_block_threads(cols) as usize
    };
    let chunks = cols.div_ceil(4);
    let sums: Vec<f32> = (0..width)
        .map(|g| {
            let mut s = 0.0f32;
            for q in (g..chunks).step_by(width) {
                for &v in &x[4 * q..(4 * q + 4).min(cols)] {
                    s += exp_f32(v - m);
                }
            }
            s
        })
        .collect();
    let total = if warp {
        warp_tree(&sums, add)
    } else {
        block_tree(&sums, add)
    };
    let inv = 1.0 / total;
    x.iter().map(|&v| exp_f32(v - m) * inv).collect()
}

#[test]
fn softmax_rows_meet_the_f64_reference_and_the_fixed_order_bit_for_bit() {
    const GUARD: usize = 8;
    let mut rng = fastrand::Rng::with_seed(44);
    let shapes = [
        (0, 5),
        (3, 0),
        (1, 1),
        (5, 31),
        (9, 33),
        (17, 512),
        (3, 1000),
        (2, 4096),
        (3, 4099),
        (2, 5000),
        (1, 20_000),
        (1, 1_000_007),
    ];
    for (rows, cols) in shapes {
        let n = rows * cols;
        let x: Vec<f32> = (0..n).map(|_| rng.f32() * 16.0 - 8.0).collect();
        let mut xb = Buf::new(&x, 0);
        let mut y = Buf::new(&vec![f32::NAN; n + GUARD], 0);
        let mut ys = y.slice_mut();
        // SAFETY: the first n elements of y's buffer; the guard stays outside the kernel's view.
        ys = unsafe { kernel_abi::SliceMut::from_raw_parts(ys.as_mut_ptr(), n) };
        let plan = softmax::softmax_launch(rows, cols);
        launch::<softmax::softmax_f32>(plan, 2, (xb.slice(), ys, rows as u32, cols as u32));
        let y = y.contents();
        assert!(
            y[n..].iter().all(|v| v.is_nan()),
            "{rows}x{cols}: a guard element written"
        );
        let depth = softmax::softmax_sum_depth(cols) as f64;
        for r in 0..rows {
            let (xr, yr) = (&x[r * cols..(r + 1) * cols], &y[r * cols..(r + 1) * cols]);
            let m = xr.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
            let sum: f64 = xr.iter().map(|&v| (v as f64 - m).exp()).sum();
            for (c, (&xv, &yv)) in xr.iter().zip(yr).enumerate() {
                let d = xv as f64 - m;
                let want = d.exp() / sum;
                let bound = (d.abs() + depth + 7.0) * U * want;
                assert!(
                    (yv as f64 - want).abs() <= bound,
                    "{rows}x{cols} [{r}][{c}]: {yv} vs {want}"
                );
            }
            let model = model_row(xr);
            let same = yr
                .iter()
                .zip(&model)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{rows}x{cols} row {r}: not the documented order");
        }
    }
}

#[test]
fn softmax_of_misaligned_rows_gives_the_same_bits_as_aligned_ones() {
    let mut rng = fastrand::Rng::with_seed(45);
    let (rows, cols) = (3, 4096);
    let x: Vec<f32> = (0..rows * cols).map(|_| rng.f32() * 4.0 - 2.0).collect();
    let mut out = Vec::new();
    for offset in [0, 4] {
        let mut xb = Buf::new(&x, offset);
        let mut y = Buf::new(&vec![f32::NAN; rows * cols], offset);
        let plan = softmax::softmax_launch(rows, cols);
        launch::<softmax::softmax_f32>(
            plan,
            2,
            (xb.slice(), y.slice_mut(), rows as u32, cols as u32),
        );
        out.push(y.contents());
    }
    assert!(out[0]
        .iter()
        .zip(&out[1])
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// Distance in units in the last place of `want` (an f64 rounded to f32's grid).
fn ulps(got: f32, want: f64) -> f64 {
    let w = want as f32;
    let ulp = (f32::from_bits(w.to_bits() + 1) - w) as f64;
    (got as f64 - want).abs() / ulp.max(f32::MIN_POSITIVE as f64 * f32::EPSILON as f64)
}

#[test]
fn exp_is_within_two_ulp_of_f64_and_handles_the_edges() {
    let mut rng = fastrand::Rng::with_seed(46);
    let mut worst = 0.0f64;
    for k in 0..2_000_000 {
        let x = if k % 2 == 0 {
            rng.f32() * -87.0
        } else {
            rng.f32() * 175.0 - 87.0
        };
        let u = ulps(exp_f32(x), (x as f64).exp());
        worst = worst.max(u);
        assert!(
            u <= 2.0,
            "exp({x}) = {} vs {}: {u} ulp",
            exp_f32(x),
            (x as f64).exp()
        );
    }
    eprintln!("exp_f32: worst error {worst:.3} ulp");
    assert_eq!(exp_f32(0.0), 1.0);
    assert_eq!(exp_f32(-200.0), 0.0);
    assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp_f32(100.0), f32::INFINITY);
    assert!(exp_f32(f32::NAN).is_nan());
    let sub = exp_f32(-100.0) as f64;
    assert!((sub - (-100.0f64).exp()).abs() <= 2.0 * f32::from_bits(1) as f64);
}

#[test]
fn the_plan_uses_warps_for_short_rows_and_blocks_for_long_ones() {
    assert_eq!(softmax::softmax_launch(17, 512).grid.x, 3);
    assert_eq!(softmax::softmax_launch(17, 513).grid.x, 17);
    assert_eq!(softmax::softmax_launch(0, 513).grid.x, 1);
    assert_eq!(softmax::softmax_launch(4, 4096).block.x, 256);
    assert_eq!(softmax::softmax_launch(4, 8192).block.x, 512);
    assert_eq!(softmax::softmax_launch(4, 8193).block.x, 512);
    assert_eq!(softmax::softmax_launch(4, 1 << 20).block.x, 512);
}
