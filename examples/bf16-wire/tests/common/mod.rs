//! What the tests share: the CPU references (computed from values, not
//! from the kernels' bit tricks) and a one-kernel round trip on a device.
#![allow(dead_code)]

use bf16_wire::bf16;
use gpufeed::{
    Commands, Device, DeviceBuffer, DeviceSlice, DeviceSliceMut, PinnedBuffer, PinnedHost, Stream,
};

/// A bf16's exact value, from its fields: `(-1)^s * 2^(e-127) * 1.m` (or
/// `2^-126 * 0.m` for subnormals), as f64. `None` for NaN; infinities as
/// f64 infinities.
pub fn bf16_value(b: u16) -> Option<f64> {
    let sign = if b & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 7) & 0xff) as i32;
    let man = (b & 0x7f) as f64;
    match exp {
        0xff if man == 0.0 => Some(sign * f64::INFINITY),
        0xff => None,
        0 => Some(sign * man / 128.0 * 2f64.powi(-126)),
        e => Some(sign * (1.0 + man / 128.0) * 2f64.powi(e - 127)),
    }
}

/// Whether bf16 bits are a NaN.
pub fn bf16_is_nan(b: u16) -> bool {
    b & 0x7fff > 0x7f80
}

/// The bf16 nearest to `x`, ties to the even mantissa, found by comparing
/// `x` with its two bf16 neighbours as values (f64 holds every difference
/// exactly). Overflow follows IEEE: the neighbour past the largest finite
/// bf16 counts as 2^128 (even), and rounds to infinity. `None` for NaN.
pub fn rne_reference(x: f32) -> Option<u16> {
    if x.is_nan() {
        return None;
    }
    if x.is_infinite() {
        return Some(if x > 0.0 { 0x7f80 } else { 0xff80 });
    }
    let toward_zero = (x.to_bits() >> 16) as u16;
    let away = toward_zero + 1;
    let value = |b: u16| {
        if b & 0x7fff == 0x7f80 {
            // Infinity stands for 2^128 in the rounding decision.
            let v = 2f64.powi(128);
            if b & 0x8000 != 0 {
                -v
            } else {
                v
            }
        } else {
            bf16_value(b).expect("finite")
        }
    };
    let x = x as f64;
    let (d0, d1) = ((x - value(toward_zero)).abs(), (value(away) - x).abs());
    Some(if d0 < d1 || (d0 == d1 && toward_zero & 1 == 0) {
        toward_zero
    } else {
        away
    })
}

/// Checks bf16 bits `got` against the reference narrowing of `x`: equal
/// bits, or for a NaN input a NaN of the same sign, quiet.
pub fn check_narrowed(x: f32, got: u16) -> Result<(), String> {
    match rne_reference(x) {
        Some(want) if want == got => Ok(()),
        Some(want) => Err(format!(
            "{:#010x} ({x:e}): got {got:#06x}, want {want:#06x}",
            x.to_bits()
        )),
        None => {
            let sign_kept = (got >> 15) as u32 == x.to_bits() >> 31;
            if bf16_is_nan(got) && sign_kept && got & 0x0040 != 0 {
                Ok(())
            } else {
                Err(format!(
                    "{:#010x} (NaN): got {got:#06x}, not a quiet NaN of the same sign",
                    x.to_bits()
                ))
            }
        }
    }
}

/// f32 bits equal, or both NaN.
pub fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Narrowing's edge inputs: ties (to even, up and down), just beside ties,
/// carries into the exponent, subnormals, the largest finite values and
/// overflow, infinities, zeros and NaNs of every kind.
pub fn edge_inputs() -> Vec<f32> {
    let bits: &[u32] = &[
        0x0000_0000,
        0x8000_0000, // zeros
        0x3f80_0000,
        0x3f80_7fff,
        0x3f80_8000,
        0x3f80_8001, // 1.0 and around its tie (even)
        0x3f81_7fff,
        0x3f81_8000,
        0x3f81_8001, // an odd tie
        0xbf81_8000,
        0xbf80_8000, // negative ties
        0x3fff_8000,
        0x3fff_ffff,
        0x407f_8000, // carries into the exponent
        0x0000_0001,
        0x0000_7fff,
        0x0000_8000,
        0x0000_8001,
        0x0001_8000, // subnormals
        0x007f_7fff,
        0x007f_8000,
        0x007f_ffff,
        0x0080_0000, // the subnormal/normal border
        0x8000_8000,
        0x8001_8000,
        0x807f_ffff,
        0x7f7f_0000,
        0x7f7f_7fff,
        0x7f7f_8000,
        0x7f7f_ffff, // near max: max, tie to inf, f32::MAX
        0xff7f_7fff,
        0xff7f_8000,
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000, // infinities
        0x7fc0_0000,
        0xffc0_0000,
        0x7f80_0001,
        0xff80_0001, // NaNs: quiet, payload only low
        0x7fa0_0000,
        0x7fbf_ffff,
        0x7fff_ffff,
        0xffff_ffff,
        0x7f81_0000, // signalling, all ones
    ];
    let mut v: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
    v.extend([
        f32::MIN_POSITIVE,
        f32::EPSILON,
        f32::MAX,
        f32::MIN,
        0.1,
        -0.1,
        1.0 / 3.0,
        65504.0,
    ]);
    v
}

/// Random f32 bit patterns (every class) and random values in [-1, 1).
pub fn random_inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v: Vec<f32> = (0..n / 2).map(|_| f32::from_bits(rng.u32(..))).collect();
    let mut floats = vec![0f32; n - n / 2];
    gpufeed::testing::random_floats(&mut floats, seed);
    v.extend(floats);
    v
}

/// Copies `input` to the device, runs `launch` on it into a fresh output
/// of the same length, and copies that back: one batch on one stream.
pub fn round_trip<TI, TO, F>(device: &Device, input: &[TI], launch: F) -> Vec<TO>
where
    TI: bytemuck::Pod + Send,
    TO: bytemuck::Pod + Send,
    F: for<'a> FnOnce(
        &mut Commands<'a>,
        DeviceSlice<'a, TI>,
        DeviceSliceMut<'a, TO>,
    ) -> gpufeed::Result<()>,
{
    let n = input.len();
    let stream = Stream::new(device).unwrap();
    let bundle = (
        PinnedBuffer::from_slice(device, input).unwrap(),
        DeviceBuffer::<TI>::new(device, n).unwrap(),
        DeviceBuffer::<TO>::new(device, n).unwrap(),
        PinnedBuffer::<TO>::new(device, n).unwrap(),
    );
    let result = stream.run_sync(bundle, |c, (hi, di, dout, ho)| {
        let di = di.view_mut();
        c.copy_h2d(hi.host(), di)?;
        let dout = dout.view_mut();
        launch(c, di.into(), dout)?;
        c.copy_d2h(dout, ho.host_mut())
    });
    match result {
        Ok(((_, _, _, out), ())) => out.as_slice().to_vec(),
        Err(e) => panic!("{}: {e}", device.kind()),
    }
}

/// bf16s from bits.
pub fn from_bits(bits: impl IntoIterator<Item = u16>) -> Vec<bf16> {
    bits.into_iter().map(bf16::from_bits).collect()
}
