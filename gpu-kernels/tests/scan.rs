//! The single-pass inclusive scan on the CPU emulation, with the plan's
//! launch and zeroed scratch: `u32` and `i32` exact (wrapping) against a
//! plain loop, `f32` within the documented bound of an f64 plain loop and
//! bit-identical from run to run whatever the number of workers (the
//! look-back's order is fixed), on aligned and misaligned buffers.

mod common;

use common::{launch, uniform, Buf, SIZES, U};
use gpu_kernels::scan;
use kernel_abi::{Kernel, Slice, SliceMut};

/// Runs kernel `K` over `x` at byte `offset`, output poisoned first.
fn run<K, T>(x: &[T], offset: usize, poison: T, workers: usize) -> Vec<T>
where
    K: Kernel<Params = (Slice<T>, SliceMut<T>, SliceMut<u64>)>,
    T: Copy + Send + Sync,
{
    let n = x.len();
    let mut xb = Buf::new(x, offset);
    let mut y = Buf::new(&vec![poison; n], offset);
    let mut scratch = Buf::new(&vec![0u64; scan::scan_scratch_len(n)], 0);
    launch::<K>(
        scan::scan_launch(n),
        workers,
        (xb.slice(), y.slice_mut(), scratch.slice_mut()),
    );
    let s = scratch.contents();
    assert_eq!(s[0], scan::scan_tiles(n) as u64, "every tile taken once");
    y.contents()
}

#[test]
fn u32_and_i32_scans_are_exact_with_wrapping() {
    let mut rng = fastrand::Rng::with_seed(42);
    for n in SIZES {
        let x: Vec<u32> = (0..n).map(|_| rng.u32(..)).collect();
        for offset in [0, 4] {
            let y = run::<scan::scan_u32, u32>(&x, offset, 0xDEAD_BEEF, 2);
            let mut acc = 0u32;
            for (j, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
                acc = acc.wrapping_add(xv);
                assert_eq!(yv, acc, "u32 n={n} offset={offset} j={j}");
            }
        }
        let x: Vec<i32> = (0..n).map(|_| rng.i32(-1000..1000)).collect();
        let y = run::<scan::scan_i32, i32>(&x, 0, 0xDEAD_BEEFu32 as i32, 2);
        let mut acc = 0i32;
        for (j, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
            acc = acc.wrapping_add(xv);
            assert_eq!(yv, acc, "i32 n={n} j={j}");
        }
    }
}

#[test]
fn f32_scan_is_within_its_bound_and_bit_reproducible_across_workers() {
    let mut rng = fastrand::Rng::with_seed(43);
    for n in SIZES {
        let x = uniform(&mut rng, n);
        let y = run::<scan::scan_f32, f32>(&x, 0, f32::NAN, 2);
        let (mut exact, mut abs) = (0.0f64, 0.0f64);
        for (j, (&xv, &yv)) in x.iter().zip(&y).enumerate() {
            exact += xv as f64;
            abs += (xv as f64).abs();
            let bound = scan::scan_depth(j) as f64 * U * abs;
            assert!(
                (yv as f64 - exact).abs() <= bound,
                "n={n} j={j}: {yv} vs {exact} (bound {bound})"
            );
        }
        for (offset, workers) in [(4, 1), (0, 3)] {
            let again = run::<scan::scan_f32, f32>(&x, offset, f32::NAN, workers);
            let same = y
                .iter()
                .zip(&again)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "n={n}: a run with offset {offset} on {workers} workers differs"
            );
        }
    }
}

#[test]
fn the_plan_has_a_tile_per_4096_elements_and_a_status_word_each() {
    assert_eq!(scan::scan_launch(0).grid.x, 1);
    assert_eq!(scan::scan_launch(4096).grid.x, 1);
    assert_eq!(scan::scan_launch(4097).grid.x, 2);
    assert_eq!(scan::scan_scratch_len(1_000_007), 1 + 245);
    assert_eq!(scan::scan_launch(1 << 28).grid.x, 65536);
}
