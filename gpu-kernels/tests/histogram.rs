//! The byte histogram on the CPU emulation with the plan's launch: exact
//! counts against a plain loop, at every size and every start offset
//! modulo 16 (head, aligned body and tail), added to bins that already
//! hold counts.

mod common;

use common::{launch, Buf, SIZES};
use gpu_kernels::histogram;

fn run(x: &[u8], offset: usize, start: &[u32]) -> Vec<u32> {
    let mut xb = Buf::new(x, offset);
    let mut bins = Buf::new(start, 0);
    launch::<histogram::histogram_u8>(
        histogram::histogram_launch(x.len()),
        2,
        (xb.slice(), bins.slice_mut()),
    );
    bins.contents()
}

#[test]
fn histogram_counts_every_byte_exactly_at_every_offset() {
    let mut rng = fastrand::Rng::with_seed(47);
    for n in SIZES {
        let x: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
        let mut want = [0u32; 256];
        for &b in &x {
            want[b as usize] += 1;
        }
        let offsets: &[usize] = if n > 10_000 {
            &[0, 7]
        } else {
            &[0, 1, 3, 8, 15]
        };
        for &offset in offsets {
            let got = run(&x, offset, &[0; 256]);
            assert_eq!(got, want, "n={n} offset={offset}");
        }
    }
}

#[test]
fn histogram_adds_to_the_bins_it_is_given() {
    let mut rng = fastrand::Rng::with_seed(48);
    let x: Vec<u8> = (0..5000).map(|_| rng.u8(..)).collect();
    let start: Vec<u32> = (0..256).map(|_| rng.u32(..1000)).collect();
    let got = run(&x, 0, &start);
    let mut want = start.clone();
    for &b in &x {
        want[b as usize] += 1;
    }
    assert_eq!(got, want);
}

#[test]
fn histogram_of_one_repeated_value_counts_under_full_contention() {
    let x = vec![0xa5u8; 100_003];
    let got = run(&x, 5, &[0; 256]);
    assert_eq!(got[0xa5], 100_003);
    assert_eq!(got.iter().sum::<u32>(), 100_003);
}

#[test]
fn the_plan_caps_the_grid() {
    assert_eq!(histogram::histogram_launch(0).grid.x, 1);
    assert_eq!(histogram::histogram_launch(1 << 30).grid.x, 1024);
    assert_eq!(histogram::histogram_launch(1_000_007).grid.x, 62);
}
