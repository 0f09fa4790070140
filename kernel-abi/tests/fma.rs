//! `kernel_abi::fma` on the host: the fused multiply-add (one rounding), bit
//! for bit what `fma.rn.f32` computes on the GPU, and not `a * b + c`.

/// The fused result, computed independently: the product in f64 (exact for
/// two f32), the sum in f64, then rounded to f32. The sum itself may round
/// in f64, and that double rounding could differ from a single one only
/// when it lands on an f32 tie; the inputs below don't hit one.
fn fused_reference(a: f32, b: f32, c: f32) -> f32 {
    (a as f64 * b as f64 + c as f64) as f32
}

#[test]
fn fma_rounds_once() {
    let (a, b, c) = (0.1f32, 10.0f32, -1.0f32);
    assert_eq!(kernel_abi::fma(a, b, c), fused_reference(a, b, c));
    assert_ne!(kernel_abi::fma(a, b, c), a * b + c, "rounded twice");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Values in [-2, 2): exponents close enough for the f64 reference.
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    let mut differ = 0;
    for _ in 0..100_000 {
        let (a, b, c) = (next(), next(), next());
        let f = kernel_abi::fma(a, b, c);
        assert_eq!(f.to_bits(), a.mul_add(b, c).to_bits(), "{a} {b} {c}");
        assert_eq!(
            f.to_bits(),
            fused_reference(a, b, c).to_bits(),
            "{a} {b} {c}"
        );
        differ += usize::from(f.to_bits() != (a * b + c).to_bits());
    }
    assert!(differ > 1000, "only {differ} of 100000 differ from a*b+c");
}
