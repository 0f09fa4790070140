//! The element types of shared memory, warp exchanges and atomics: plain
//! data of 4 or 8 bytes ([`Plain`]), and those with arithmetic for the
//! reductions and scans ([`Arith`]). Both traits are sealed: the
//! implementations below are the whole list.

mod sealed {
    pub trait Sealed {}
}

/// Plain data of 4 or 8 bytes that moves as its bits: `u32`, `i32`, `f32`,
/// `u64`, `i64`, `f64`. Shared memory holds these, warp shuffles exchange
/// them (8-byte types as two 32-bit shuffles) and the CPU emulation stores
/// them in atomic words.
pub trait Plain: Copy + sealed::Sealed + 'static {
    /// Size in bytes: 4 or 8.
    const BYTES: usize;
    /// The value's bits, zero-extended to 64.
    fn to_bits(self) -> u64;
    /// The value of these bits (the low `8 * BYTES` of them).
    fn from_bits(bits: u64) -> Self;
}

macro_rules! plain {
    ($($t:ty, $bytes:expr, |$v:ident| $to:expr, |$b:ident| $from:expr;)*) => { $(
        impl sealed::Sealed for $t {}
        impl Plain for $t {
            const BYTES: usize = $bytes;
            #[inline(always)]
            fn to_bits(self) -> u64 {
                let $v = self;
                $to
            }
            #[inline(always)]
            fn from_bits($b: u64) -> Self {
                $from
            }
        }
    )* };
}

plain! {
    u32, 4, |v| v as u64, |b| b as u32;
    i32, 4, |v| v as u32 as u64, |b| b as u32 as i32;
    f32, 4, |v| v.to_bits() as u64, |b| f32::from_bits(b as u32);
    u64, 8, |v| v, |b| b;
    i64, 8, |v| v as u64, |b| b as i64;
    f64, 8, |v| v.to_bits(), |b| f64::from_bits(b);
}

/// A [`Plain`] type with the arithmetic of the reductions and scans: a sum
/// (wrapping for integers, IEEE for floats, so results never trap), a
/// maximum and a minimum (for floats, IEEE `maxNum`/`minNum`: a NaN operand
/// is ignored unless both are NaN; the GPU's `max.f32`/`min.f32` agree).
pub trait Arith: Plain {
    /// The identity of the sum: `0`.
    const ZERO: Self;
    /// The identity of the maximum: the lowest value (`-inf` for floats).
    const LOWEST: Self;
    /// The identity of the minimum: the highest value (`+inf` for floats).
    const HIGHEST: Self;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// The larger of `a` and `b`.
    fn max(a: Self, b: Self) -> Self;
    /// The smaller of `a` and `b`.
    fn min(a: Self, b: Self) -> Self;
}

macro_rules! arith_int {
    ($($t:ty),*) => { $(
        impl Arith for $t {
            const ZERO: Self = 0;
            const LOWEST: Self = <$t>::MIN;
            const HIGHEST: Self = <$t>::MAX;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { if a > b { a } else { b } }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { if a < b { a } else { b } }
        }
    )* };
}
arith_int!(u32, i32, u64, i64);

macro_rules! arith_float {
    ($($t:ty),*) => { $(
        impl Arith for $t {
            const ZERO: Self = 0.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a + b }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self { a.max(b) }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self { a.min(b) }
        }
    )* };
}
arith_float!(f32, f64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip() {
        assert_eq!(<f32 as Plain>::from_bits(Plain::to_bits(-1.5f32)), -1.5);
        assert_eq!(<i32 as Plain>::from_bits(Plain::to_bits(-7i32)), -7);
        assert_eq!(Plain::to_bits(-1i32), 0xffff_ffff);
        assert_eq!(<f64 as Plain>::from_bits(Plain::to_bits(2.25f64)), 2.25);
    }
}
