//! The host-side f32 → bf16 conversion (parallel, into pinned memory)
//! against the reference: the same bits as the kernels' narrowing.

mod common;

use bf16_wire::{bf16, narrow_into, narrow_into_with, narrow_to_pinned, PARALLEL_MIN};
use common::{check_narrowed, edge_inputs, random_inputs};
use gpufeed::{Device, Error, PinnedPool};

fn check(input: &[f32], out: &[bf16]) {
    assert_eq!(input.len(), out.len());
    for (i, (x, y)) in input.iter().zip(out).enumerate() {
        if let Err(e) = check_narrowed(*x, y.to_bits()) {
            panic!("element {i} of {}: {e}", input.len());
        }
        assert_eq!(
            y.to_bits(),
            bf16_wire::convert::narrow_bits(*x),
            "element {i}"
        );
    }
}

#[test]
fn parallel_conversion_matches_the_reference_at_every_split() {
    let mut edges = edge_inputs();
    edges.extend(random_inputs(1 << 12, 3));
    for n in [
        0usize,
        1,
        5,
        63,
        PARALLEL_MIN - 1,
        PARALLEL_MIN,
        PARALLEL_MIN + 1,
        1_000_003,
    ] {
        let mut input = random_inputs(n, n as u64);
        // Edge values at the start, the end and across chunk borders.
        for (k, e) in edges.iter().enumerate().take(n) {
            let at = (k * 7919) % n;
            input[at] = *e;
        }
        for threads in [1usize, 2, 3, 8, 64] {
            let mut out = vec![bf16::ZERO; n];
            narrow_into_with(&input, &mut out, threads).unwrap();
            check(&input, &out);
        }
        let mut out = vec![bf16::ZERO; n];
        narrow_into(&input, &mut out).unwrap();
        check(&input, &out);
    }
}

#[test]
fn conversion_into_a_pinned_buffer() {
    let device = Device::cpu();
    let pool = PinnedPool::new(&device);
    let input = random_inputs(1_234_567, 11);
    let pinned = narrow_to_pinned(&pool, &input).unwrap();
    check(&input, pinned.as_slice());
    let mut pinned = pool.alloc::<bf16>(input.len()).unwrap();
    narrow_into(&input, pinned.as_mut_slice()).unwrap();
    check(&input, pinned.as_slice());
}

#[test]
fn unequal_lengths_are_refused() {
    let mut out = vec![bf16::ZERO; 9];
    let e = narrow_into(&[1.0; 10], &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                expected: 10,
                got: 9,
                ..
            }
        ),
        "{e}"
    );
}
