//! The scale kernels on every backend with edge values (NaN stays NaN,
//! overflow to infinity, subnormal products), the launch helpers' length
//! checks, and the embedded PTX.

mod common;

use bf16_wire::bf16;
use common::{from_bits, rne_reference, round_trip, same_f32};
use gpufeed::testing::serial;
use gpufeed::{DeviceBuffer, Error, Stream};
use kernel_builder::ptx;

/// Every bf16 bit pattern, and factors that round, overflow, underflow.
const FACTORS: [f32; 5] = [3.3, -0.7, 1.0e30, 1.0e-30, 0.0];

gpufeed::backend_tests!(scale_kernels_on_every_bf16_match_the_cpu);
fn scale_kernels_on_every_bf16_match_the_cpu(device: gpufeed::Device) {
    let _serial = serial();
    let kernels = bf16_wire::load(&device).unwrap();
    let input = from_bits(0..=u16::MAX);
    for s in FACTORS {
        let wide: Vec<f32> =
            round_trip(&device, &input, |c, x, y| kernels.scale_to_f32(c, s, x, y));
        let narrow: Vec<bf16> = round_trip(&device, &input, |c, x, y| kernels.scale(c, s, x, y));
        for ((x, w), n) in input.iter().zip(&wide).zip(&narrow) {
            let product = x.to_f32() * s;
            // A GPU makes canonical NaNs, a CPU passes the payload on:
            // NaNs compare by class.
            assert!(
                same_f32(*w, product),
                "{} s={s}: {:#06x} -> {:#010x}, want {:#010x}",
                device.kind(),
                x.to_bits(),
                w.to_bits(),
                product.to_bits()
            );
            match rne_reference(product) {
                Some(want) => assert_eq!(
                    n.to_bits(),
                    want,
                    "{} s={s}: {:#06x}",
                    device.kind(),
                    x.to_bits()
                ),
                None => assert!(
                    n.is_nan(),
                    "{} s={s}: {:#06x}: NaN stays NaN",
                    device.kind(),
                    x.to_bits()
                ),
            }
        }
    }
}

gpufeed::backend_tests!(launch_helpers_check_lengths);
fn launch_helpers_check_lengths(device: gpufeed::Device) {
    let _serial = serial();
    let kernels = bf16_wire::load(&device).unwrap();
    let stream = Stream::new(&device).unwrap();
    let bundle = (
        DeviceBuffer::<bf16>::new(&device, 100).unwrap(),
        DeviceBuffer::<f32>::new(&device, 99).unwrap(),
        DeviceBuffer::<bf16>::new(&device, 101).unwrap(),
    );
    let err = stream
        .run_sync(bundle, |c, (x, y, z)| {
            let (x, y, z) = (x.view(), y.view_mut(), z.view_mut());
            let e = kernels.widen(c, x, y).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::LengthMismatch {
                        expected: 100,
                        got: 99,
                        ..
                    }
                ),
                "{e}"
            );
            let e = kernels.scale(c, 2.0, x, z).unwrap_err();
            assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
            kernels.narrow(c, y, z)
        })
        .unwrap_err();
    assert!(matches!(err.error, Error::LengthMismatch { .. }), "{err}");
    assert!(err.bundle.is_some());
}

#[test]
fn embedded_ptx_has_every_kernel_for_the_requested_arch() {
    let ptx = bf16_wire::PTX;
    if bf16_wire::ARCH == "none" {
        return; // HOST_PTX_STUB=1
    }
    let mut entries = ptx::entry_points(ptx);
    entries.sort_unstable();
    let mut names = bf16_wire::KERNEL_NAMES.to_vec();
    names.sort_unstable();
    assert_eq!(entries, names);
    assert_eq!(ptx::target(ptx), Some(bf16_wire::ARCH));
    assert!(ptx::unresolved_externs(ptx).is_empty(), "{ptx}");
    // f32 arithmetic without flush-to-zero: subnormals as on the CPU.
    assert!(ptx.contains("mul.rn.f32"), "no f32 multiply");
    assert!(!ptx.contains(".ftz"), "flush-to-zero arithmetic in the PTX");
}
