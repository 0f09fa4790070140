//! Narrowing f32 → bf16 on every backend against a CPU reference that
//! rounds to nearest even from values (not the kernel's bit trick): ties,
//! subnormals, overflow, infinities, NaNs, and random bit patterns.

mod common;

use bf16_wire::bf16;
use common::{check_narrowed, edge_inputs, random_inputs, rne_reference, round_trip};
use gpufeed::testing::serial;

#[test]
fn the_reference_rounds_as_ieee_says() {
    let r = |b: u32| rne_reference(f32::from_bits(b));
    assert_eq!(rne_reference(1.0), Some(0x3f80));
    assert_eq!(r(0x3f80_8000), Some(0x3f80));
    assert_eq!(r(0x3f81_8000), Some(0x3f82));
    assert_eq!(r(0x7f7f_8000), Some(0x7f80));
    assert_eq!(r(0x7f7f_7fff), Some(0x7f7f));
    assert_eq!(r(0x0000_8000), Some(0x0000));
    assert_eq!(r(0x8001_8000), Some(0x8002));
    assert_eq!(rne_reference(f32::NAN), None);
    assert_eq!(common::bf16_value(0x3f80), Some(1.0));
    assert_eq!(common::bf16_value(0x0001), Some(2f64.powi(-133)));
    assert_eq!(common::bf16_value(0xff80), Some(f64::NEG_INFINITY));
    assert_eq!(common::bf16_value(0x7fc0), None);
}

gpufeed::backend_tests!(kernel_narrowing_matches_the_reference_on_edges_and_random_inputs);
fn kernel_narrowing_matches_the_reference_on_edges_and_random_inputs(device: gpufeed::Device) {
    let _serial = serial();
    let kernels = bf16_wire::load(&device).unwrap();
    let mut input = edge_inputs();
    input.extend(random_inputs(1 << 20, 7));
    let out: Vec<bf16> = round_trip(&device, &input, |c, x, y| kernels.narrow(c, x, y));
    let bad: Vec<String> = input
        .iter()
        .zip(&out)
        .filter_map(|(x, y)| check_narrowed(*x, y.to_bits()).err())
        .take(10)
        .collect();
    assert!(bad.is_empty(), "{}: {bad:#?}", device.kind());
    // NaN payloads too: bit for bit the CPU's function (and half's).
    for (x, y) in input.iter().zip(&out) {
        assert_eq!(
            y.to_bits(),
            bf16_wire::convert::narrow_bits(*x),
            "{}",
            device.kind()
        );
        assert_eq!(
            y.to_bits(),
            bf16::from_f32(*x).to_bits(),
            "{}",
            device.kind()
        );
    }
}

#[test]
fn every_f32_exponent_and_rounding_case_on_the_cpu_function() {
    // The kernel body on the host, over every bf16 neighbourhood: each
    // upper half (every exponent and kept mantissa, both signs) with low
    // halves that hit each rounding case (exact, below, tie, above).
    let mut bits = 0u32;
    let mut checked = 0usize;
    loop {
        for low in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
            let x = f32::from_bits((bits & 0xffff_0000) | low);
            if let Err(e) = check_narrowed(x, bf16_wire::convert::narrow_bits(x)) {
                panic!("{e}");
            }
            checked += 1;
        }
        match bits.checked_add(0x0001_0000) {
            Some(b) => bits = b,
            None => break,
        }
    }
    assert_eq!(checked, 6 << 16);
}
