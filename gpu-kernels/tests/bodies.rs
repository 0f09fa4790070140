//! The per-thread kernel bodies, run on the host over a simulated grid,
//! against scalar references on fresh random inputs: every size class of the
//! head/vector/tail split, every start offset inside a buffer, several grid
//! strides, and guard elements that must stay untouched.

use gpu_kernels::{elementwise, thread};

const SIZES: [usize; 7] = [0, 1, 3, 4, 5, 1023, (1 << 20) + 3];
const GUARD: usize = 8;

fn random(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.f32() * 2.0 - 1.0)
        .filter(|v| *v != 0.0)
        .chain(std::iter::repeat(0.5))
        .take(n)
        .collect()
}

fn strides(n: usize) -> &'static [usize] {
    if n > 10_000 {
        &[1280]
    } else {
        &[1, 3, 64]
    }
}

/// A 16-byte aligned buffer of `len` floats (so offsets 0..3 cover every alignment).
fn aligned(rng: &mut fastrand::Rng, len: usize) -> Vec<elementwise::F32x4> {
    let v = random(rng, len.div_ceil(4) * 4);
    v.chunks(4)
        .map(|c| elementwise::F32x4([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn floats(v: &mut [elementwise::F32x4]) -> &mut [f32] {
    // SAFETY: F32x4 is repr(C) of four f32s: same layout as 4*len floats.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<f32>(), v.len() * 4) }
}

fn check_map(
    name: &str,
    run: impl Fn(*mut f32, usize, usize, usize),
    reference: impl Fn(f32) -> f32,
) {
    let mut rng = fastrand::Rng::with_seed(0x5eed ^ name.len() as u64);
    for n in SIZES {
        for offset in 0..4 {
            for &stride in strides(n) {
                let mut storage = aligned(&mut rng, n + offset + GUARD);
                let buf = floats(&mut storage);
                let before = buf.to_vec();
                let x = buf[offset..].as_mut_ptr();
                for gid in 0..stride {
                    run(x, n, gid, stride);
                }
                for (i, (&got, &was)) in buf.iter().zip(&before).enumerate() {
                    let want = if (offset..offset + n).contains(&i) {
                        reference(was)
                    } else {
                        was
                    };
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{name}: n={n} offset={offset} stride={stride} i={i}"
                    );
                }
            }
        }
    }
}

#[test]
fn scale_matches_reference_for_every_size_and_offset() {
    let s = 1.7f32;
    // SAFETY: x points at n floats of a live buffer; the simulated threads run one at a time.
    check_map(
        "scale",
        |x, n, g, st| unsafe { thread::scale(x, n, s, g, st) },
        |v| v * s,
    );
}

#[test]
fn intensity_matches_reference_for_every_size_and_offset() {
    for k in [0u32, 1, 17] {
        let reference = move |mut v: f32| {
            for _ in 0..k {
                v = v.mul_add(elementwise::INTENSITY_MUL, elementwise::INTENSITY_ADD);
            }
            v
        };
        // SAFETY: as for scale.
        check_map(
            "intensity",
            move |x, n, g, st| unsafe { thread::intensity(x, n, k, g, st) },
            reference,
        );
    }
}

#[test]
fn saxpy_matches_reference_for_every_size_and_pair_of_offsets() {
    let mut rng = fastrand::Rng::with_seed(42);
    let a = -0.37f32;
    for n in SIZES {
        for ox in 0..4 {
            for oy in 0..4 {
                for &stride in strides(n) {
                    let mut xs = aligned(&mut rng, n + ox + GUARD);
                    let mut ys = aligned(&mut rng, n + oy + GUARD);
                    let (xb, yb) = (floats(&mut xs), floats(&mut ys));
                    let y_before = yb.to_vec();
                    let (xp, yp) = (xb[ox..].as_ptr(), yb[oy..].as_mut_ptr());
                    for gid in 0..stride {
                        // SAFETY: x and y point at n floats of distinct live buffers.
                        unsafe { thread::saxpy(a, xp, yp, n, gid, stride) };
                    }
                    for (i, (&got, &was)) in yb.iter().zip(&y_before).enumerate() {
                        let want = if (oy..oy + n).contains(&i) {
                            a.mul_add(xb[i - oy + ox], was)
                        } else {
                            was
                        };
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "saxpy n={n} ox={ox} oy={oy} stride={stride} i={i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn split_covers_every_element_once() {
    for addr in (0..64).step_by(4) {
        for n in 0..40 {
            let s = elementwise::Split::new(addr, n);
            assert_eq!(s.head + 4 * s.vectors + s.tail, n);
            assert!(s.head < 4 && s.tail < 4);
            if s.vectors > 0 {
                assert_eq!(
                    (addr + 4 * s.head) % 16,
                    0,
                    "body must start 16-byte aligned"
                );
            }
        }
    }
}

#[test]
fn slice_functions_match_elementwise_bodies() {
    let mut rng = fastrand::Rng::with_seed(7);
    let x = random(&mut rng, 1023);
    let mut y = random(&mut rng, 1023);
    let y0 = y.clone();
    elementwise::saxpy_slice(2.5, &x, &mut y);
    for i in 0..x.len() {
        assert_eq!(y[i].to_bits(), 2.5f32.mul_add(x[i], y0[i]).to_bits());
    }
    let mut z = x.clone();
    elementwise::scale_slice(&mut z, -3.0);
    assert!(z.iter().zip(&x).all(|(a, b)| *a == *b * -3.0));
}

#[test]
fn gather_rows_matches_a_plain_gather_for_every_width_offset_and_grid() {
    let mut rng = fastrand::Rng::with_seed(41);
    const POISON: u8 = 0xA5;
    // Row sizes taking the 16-byte, 4-byte and byte paths; offsets that
    // misalign source or destination.
    for &row_bytes in &[32usize, 48, 12, 4, 7, 1] {
        for &(src_off, dst_off) in &[(0usize, 0usize), (4, 0), (0, 4), (1, 3)] {
            let src_rows = 37;
            // 16-byte-aligned backing, then the offset.
            let mut src_back = aligned(&mut rng, (src_rows * row_bytes + src_off).div_ceil(4) + 4);
            let src_all = bytemuck_bytes(&mut src_back);
            for b in src_all.iter_mut() {
                *b = rng.u8(..);
            }
            let src = &src_all[src_off..src_off + src_rows * row_bytes];
            let rows = 23;
            // Valid indices (repeats allowed), and one past the end.
            let mut idx: Vec<u64> = (0..rows).map(|_| rng.u64(0..src_rows as u64)).collect();
            idx[5] = src_rows as u64;
            for &stride in &[1usize, 3, 64, 1000] {
                let mut dst_back = aligned(&mut rng, (rows * row_bytes + dst_off).div_ceil(4) + 4);
                let dst_all = bytemuck_bytes(&mut dst_back);
                dst_all.fill(POISON);
                let dst = &mut dst_all[dst_off..dst_off + rows * row_bytes];
                for gid in 0..stride {
                    // SAFETY: the buffers are as long as stated; threads
                    // are simulated one after another.
                    unsafe {
                        thread::gather_rows(
                            src.as_ptr(),
                            src.len(),
                            idx.as_ptr(),
                            rows,
                            row_bytes,
                            dst.as_mut_ptr(),
                            gid,
                            stride,
                        )
                    };
                }
                for (r, &i) in idx.iter().enumerate() {
                    let got = &dst[r * row_bytes..(r + 1) * row_bytes];
                    if i as usize >= src_rows {
                        assert!(got.iter().all(|&b| b == POISON), "row {r} written");
                    } else {
                        let i = i as usize;
                        assert_eq!(
                            got,
                            &src[i * row_bytes..(i + 1) * row_bytes],
                            "row {r}, row_bytes {row_bytes}, offsets {src_off}/{dst_off}, stride {stride}"
                        );
                    }
                }
            }
        }
    }
}

fn bytemuck_bytes(v: &mut [elementwise::F32x4]) -> &mut [u8] {
    // SAFETY: F32x4 is 16 plain bytes with no padding.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), v.len() * 16) }
}
