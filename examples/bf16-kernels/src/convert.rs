//! bf16 ⇄ f32 as bit operations, the same on the GPU and the CPU.
//!
//! bf16 is the top half of an f32: 1 sign bit, the same 8 exponent bits,
//! 7 of the 23 mantissa bits. Widening is exact (append 16 zero bits);
//! narrowing drops 16 bits, rounding to nearest with ties to even, as IEEE
//! 754's default rounding does.

use half::bf16;

/// The f32 equal to `x`, exactly: `x`'s bits shifted into the top half.
/// Every bf16 (subnormals, infinities, NaNs with their payload) maps to the
/// f32 of the same value and class.
#[inline(always)]
pub const fn widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// The bits of the bf16 nearest to `x`, ties to even.
///
/// - Finite values round to nearest; a tie (the dropped 16 bits exactly
///   `0x8000`) goes to the neighbour with an even last bit. A carry out of
///   the mantissa moves to the next binade, and past the largest finite
///   bf16 to infinity, as IEEE rounding does.
/// - Subnormals round the same way (integer arithmetic, no flush to zero).
/// - Infinities stay infinities.
/// - A NaN stays a NaN of the same sign: the top of its payload is kept and
///   the quiet bit set (so a NaN whose payload lies only in the dropped
///   bits does not become an infinity).
#[inline(always)]
pub const fn narrow_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) as u16) | 0x0040;
    }
    // Half an ulp of the result, less one, plus the kept part's last bit:
    // above half rounds up, below down, exactly half up only from odd.
    let lsb = (bits >> 16) & 1;
    // No overflow: the largest non-NaN pattern is 0xff80_0000 (-inf).
    (bits.wrapping_add(0x7fff + lsb) >> 16) as u16
}

/// The bf16 nearest to `x`, ties to even (see [`narrow_bits`]).
#[inline(always)]
pub const fn narrow(x: f32) -> bf16 {
    bf16::from_bits(narrow_bits(x))
}

/// One element of the bf16-in / f32-out kernel: widen, multiply in f32.
#[inline(always)]
pub fn scale_widen(x: bf16, s: f32) -> f32 {
    widen(x) * s
}

/// One element of the bf16-both-ways kernel: widen, multiply in f32, narrow.
#[inline(always)]
pub fn scale_narrow(x: bf16, s: f32) -> bf16 {
    narrow(widen(x) * s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_the_top_half() {
        for b in [0u16, 0x3f80, 0xbf80, 0x7f80, 0xff80, 0x0001, 0x7fc1, 0x7f81] {
            assert_eq!(widen(bf16::from_bits(b)).to_bits(), (b as u32) << 16);
        }
        assert_eq!(widen(bf16::from_bits(0x3f80)), 1.0);
    }

    #[test]
    fn narrowing_rounds_to_nearest_even() {
        let n = |bits: u32| narrow_bits(f32::from_bits(bits));
        assert_eq!(n(0x3f80_0000), 0x3f80); // 1.0
        assert_eq!(n(0x3f80_7fff), 0x3f80); // below half: down
        assert_eq!(n(0x3f80_8000), 0x3f80); // tie, even stays
        assert_eq!(n(0x3f81_8000), 0x3f82); // tie, odd goes up
        assert_eq!(n(0x3f80_8001), 0x3f81); // above half: up
        assert_eq!(n(0x3fff_8000), 0x4000); // carry into the exponent
        assert_eq!(n(0x7f7f_7fff), 0x7f7f); // below max + half: max
        assert_eq!(n(0x7f7f_8000), 0x7f80); // tie at max: to even, infinity
        assert_eq!(n(0x7f7f_ffff), 0x7f80); // f32::MAX: infinity
        assert_eq!(n(0xff7f_ffff), 0xff80);
        assert_eq!(n(0x7f80_0000), 0x7f80); // inf
        assert_eq!(n(0x0000_8000), 0x0000); // subnormal tie, even
        assert_eq!(n(0x0001_8000), 0x0002); // subnormal tie, odd up
        assert_eq!(n(0x8000_0001), 0x8000); // -tiny: -0
        assert_eq!(n(0x7f80_0001), 0x7fc0); // NaN with a low payload stays NaN
        assert_eq!(n(0xffc0_0000), 0xffc0);
        assert_eq!(n(0x7fa0_0000), 0x7fe0); // signalling: quieted
    }

    #[test]
    fn narrowing_agrees_with_half_on_a_sweep() {
        // half's own (software) conversion rounds the same way.
        let mut bits = 0u32;
        loop {
            let x = f32::from_bits(bits);
            assert_eq!(
                narrow(x).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{bits:#010x}"
            );
            match bits.checked_add(0x0001_3579) {
                Some(b) => bits = b,
                None => break,
            }
        }
    }
}
