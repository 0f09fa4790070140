//! Widening bf16 → f32 on every backend, for all 65536 bf16 bit patterns:
//! bit for bit the f32 of the same value (from the bf16's fields), NaNs
//! by class (NaN, sign, quiet bit).

mod common;

use common::{bf16_value, from_bits, round_trip};
use gpufeed::testing::serial;

gpufeed::backend_tests!(every_bf16_widens_exactly);
fn every_bf16_widens_exactly(device: gpufeed::Device) {
    let _serial = serial();
    let kernels = bf16_wire::load(&device).unwrap();
    let input = from_bits(0..=u16::MAX);
    let out: Vec<f32> = round_trip(&device, &input, |c, x, y| kernels.widen(c, x, y));
    let mut nans = 0;
    for (b, y) in (0..=u16::MAX).zip(&out) {
        let y = *y;
        match bf16_value(b) {
            Some(v) => {
                assert_eq!(y as f64, v, "{}: {b:#06x}", device.kind());
                assert_eq!(y.to_bits(), (b as u32) << 16, "{}: {b:#06x}", device.kind());
            }
            None => {
                nans += 1;
                let yb = y.to_bits();
                assert!(y.is_nan(), "{}: {b:#06x} -> {yb:#010x}", device.kind());
                assert_eq!(
                    yb >> 31,
                    (b >> 15) as u32,
                    "{}: sign of {b:#06x}",
                    device.kind()
                );
                assert_eq!(
                    yb & 0x0040_0000 != 0,
                    b & 0x0040 != 0,
                    "{}: quiet bit of {b:#06x} -> {yb:#010x}",
                    device.kind()
                );
            }
        }
    }
    // 2 signs x (2^7 - 1) non-zero mantissas with an all-ones exponent.
    assert_eq!(nans, 254);
}

#[test]
fn the_cpu_function_is_the_kernel_body() {
    // What the host code (references, demos) calls is the same function.
    for b in 0..=u16::MAX {
        let x = bf16_wire::bf16::from_bits(b);
        assert_eq!(bf16_wire::convert::widen(x).to_bits(), (b as u32) << 16);
        if !x.is_nan() {
            assert_eq!(bf16_wire::convert::widen(x), x.to_f32());
        }
    }
}
