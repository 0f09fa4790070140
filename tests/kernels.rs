//! The kernel set's typed commands (`Commands::sum`, `max`, `sum_bf16`,
//! `max_bf16`, `inclusive_scan`, `softmax_rows`, `histogram_u8`, `sgemm`,
//! `gemm_bf16`) on every backend: fresh random inputs (the seed is printed;
//! `KERNELS_SEED=` replays one), outputs and scratch poisoned, every
//! element checked against a plain loop written here (f64 accumulation
//! within the documented bound; exact for the integer scan, the maximum and
//! the histogram; SGEMM also bit for bit against a sequential `fma` loop),
//! at sizes 0, 1, 31, 33, 1000 and 1e6 + 7 (GEMM: 0 dimensions and shapes
//! that are not multiples of the tiles), aligned and misaligned. On the
//! CUDA half the same inputs run on the CPU emulation too, and the results
//! must be the same bits wherever the algorithm fixes the order (all but
//! the bf16 GEMM). Bad input is a typed error that hands the buffers back.

use gpufeed::kernels::{self, bf16_gemm_supported, Gemm, ScanElement};
use gpufeed::{block_on, BackendKind, Commands, Device, DeviceBuffer, Error, Stream};

const ALL_SIZES: [usize; 6] = [0, 1, 31, 33, 1000, 1_000_007];

/// The sizes a test runs: all, or with `KERNEL_TESTS_SMALL=1` (the
/// sanitizer runs, where every access is checked) all but the largest.
fn sizes() -> Vec<usize> {
    let small = std::env::var("KERNEL_TESTS_SMALL").is_ok_and(|v| v == "1");
    ALL_SIZES
        .into_iter()
        .filter(|&n| !small || n < 100_000)
        .collect()
}
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A fresh seed (printed), or `KERNELS_SEED`.
fn rng(test: &str) -> fastrand::Rng {
    let seed = std::env::var("KERNELS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("{test}: KERNELS_SEED={seed}");
    fastrand::Rng::with_seed(seed)
}

/// Whether the costly variants run: the misaligned runs of the largest size
/// and the largest shapes. Always on a GPU (its emulation twin included);
/// on the CPU emulation in release builds (a debug build's emulation runs
/// the largest size aligned only, to stay fast).
fn full(device: &Device) -> bool {
    let small = std::env::var("KERNEL_TESTS_SMALL").is_ok_and(|v| v == "1");
    !small && (device.kind() == BackendKind::Cuda || !cfg!(debug_assertions))
}

/// The offsets (in elements) at which an input of `n` elements is placed:
/// aligned, and misaligned (`more`) where [`full`] or `n` is small.
fn offsets(device: &Device, n: usize, more: &[usize]) -> Vec<usize> {
    let mut v = vec![0];
    if full(device) || n < 100_000 {
        v.extend_from_slice(more);
    }
    v
}

/// On the CUDA half: the CPU emulation, to run the same inputs on.
fn emulation_twin(device: &Device) -> Option<Device> {
    (device.kind() == BackendKind::Cuda).then(Device::cpu)
}

/// Floats over a wide range of magnitudes (so a change of order shows).
fn wide(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.f32() * 2.0 - 1.0) * 2f32.powi(rng.i32(-8..=8)))
        .collect()
}

fn upload<T: bytemuck::Pod>(device: &Device, v: &[T]) -> DeviceBuffer<T> {
    let mut b = DeviceBuffer::new(device, v.len()).unwrap();
    b.copy_from_host_sync(v).unwrap();
    b
}

/// `n` elements of all-ones bytes (NaN, `u32::MAX`, ...).
fn poisoned<T: bytemuck::Pod>(device: &Device, n: usize) -> DeviceBuffer<T> {
    let mut v = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).fill(0xFF);
    upload(device, &v)
}

fn download<T: bytemuck::Pod>(mut b: DeviceBuffer<T>) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len()];
    b.copy_to_host_sync(&mut v).unwrap();
    v
}

/// Runs one batch and waits: the bundle and the batch's value.
fn job<B: Send + 'static>(
    device: &Device,
    bundle: B,
    f: impl for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> gpufeed::Result<()>,
) -> B {
    let stream = Stream::new(device).unwrap();
    block_on(stream.run(bundle, f)).unwrap().0
}

/// The batch's error, checking the buffers came back.
#[track_caller]
fn job_error<B: Send + 'static>(
    device: &Device,
    bundle: B,
    f: impl for<'a> FnOnce(&mut Commands<'a>, &'a mut B) -> gpufeed::Result<()>,
) -> Error {
    let stream = Stream::new(device).unwrap();
    let Err(err) = block_on(stream.run(bundle, f)) else {
        panic!("a bad command must fail")
    };
    assert!(err.bundle.is_some(), "the buffers come back on error");
    err.error
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Sum,
    Max,
}

/// `op` of `x` (f32) placed `offset` elements into its buffer.
fn reduce_f32(device: &Device, x: &[f32], offset: usize, op: Op) -> f32 {
    let mut host = vec![0f32; offset];
    host.extend_from_slice(x);
    // A scratch longer than needed, poisoned: only the plan's part is used.
    let bundle = (
        upload(device, &host),
        poisoned::<f32>(device, kernels::reduce_scratch_len(x.len()) + 3),
        poisoned::<f32>(device, 1),
    );
    let (_, _, out) = job(device, bundle, |c, (x, s, o)| {
        let x = x.view().range(offset..)?;
        match op {
            Op::Sum => c.sum(x, s.view_mut(), o.view_mut()),
            Op::Max => c.max(x, s.view_mut(), o.view_mut()),
        }
    });
    download(out)[0]
}

/// `op` of bf16 bits `x`.
fn reduce_bf16(device: &Device, x: &[u16], offset: usize, op: Op) -> f32 {
    let mut host = vec![0u16; offset];
    host.extend_from_slice(x);
    let bundle = (
        upload(device, &host),
        poisoned::<f32>(device, kernels::reduce_bf16_scratch_len(x.len()) + 1),
        poisoned::<f32>(device, 1),
    );
    let (_, _, out) = job(device, bundle, |c, (x, s, o)| {
        let x = x.view().range(offset..)?;
        match op {
            Op::Sum => c.sum_bf16(x, s.view_mut(), o.view_mut()),
            Op::Max => c.max_bf16(x, s.view_mut(), o.view_mut()),
        }
    });
    download(out)[0]
}

/// Checks a reduction's result against the plain loop over `x` (as f64).
fn check_reduce(what: &str, x: &[f64], got: f32, op: Op, depth: usize) {
    match op {
        Op::Sum => {
            let exact: f64 = x.iter().sum();
            let abs: f64 = x.iter().map(|v| v.abs()).sum();
            let bound = depth as f64 * U * abs * 1.01;
            assert!(
                (got as f64 - exact).abs() <= bound,
                "{what}: sum {got} vs {exact} (bound {bound:e})"
            );
        }
        Op::Max => {
            // NaNs are ignored (IEEE maxNum); -inf when there is no number.
            let exact = x
                .iter()
                .filter(|v| !v.is_nan())
                .fold(f64::NEG_INFINITY, |a, &v| a.max(v));
            assert_eq!(got as f64, exact, "{what}: max");
        }
    }
}

gpufeed::backend_tests!(sum_and_max_f32);
fn sum_and_max_f32(device: Device) {
    let mut rng = rng("sum_and_max_f32");
    let twin = emulation_twin(&device);
    for n in sizes() {
        let mut x = wide(&mut rng, n);
        if n >= 33 {
            // A few NaNs and infinities' neighbours for max; sum gets finite values.
            x[n / 3] = f32::MAX / 2.0;
        }
        for offset in offsets(&device, n, &[1]) {
            for op in [Op::Sum, Op::Max] {
                let mut x = x.clone();
                if op == Op::Max && n >= 33 {
                    x[7] = f32::NAN;
                    x[n - 1] = f32::NAN;
                }
                if op == Op::Sum && n >= 33 {
                    x[n / 3] = 1e4;
                }
                let got = reduce_f32(&device, &x, offset, op);
                let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                let what = format!("{op:?} n={n} offset={offset}");
                check_reduce(&what, &x64, got, op, kernels::sum_depth(n));
                if let Some(cpu) = &twin {
                    let emulated = reduce_f32(cpu, &x, offset, op);
                    assert_eq!(
                        got.to_bits(),
                        emulated.to_bits(),
                        "{what}: GPU vs emulation"
                    );
                }
            }
        }
    }
    // NaNs are ignored: every input NaN gives -inf, as no input does.
    let got = reduce_f32(&device, &[f32::NAN; 40], 0, Op::Max);
    assert_eq!(got, f32::NEG_INFINITY);
}

/// bf16 bits of `v` (truncated: any bits are a bf16 value).
fn bf16_bits(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}

fn bf16_value(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

gpufeed::backend_tests!(sum_and_max_bf16);
fn sum_and_max_bf16(device: Device) {
    let mut rng = rng("sum_and_max_bf16");
    let twin = emulation_twin(&device);
    for n in sizes() {
        let x: Vec<u16> = wide(&mut rng, n).into_iter().map(bf16_bits).collect();
        // Offsets of 0, 1 (misaligned: the element path) and 8 (aligned again).
        for offset in offsets(&device, n, &[1, 8]) {
            for op in [Op::Sum, Op::Max] {
                let got = reduce_bf16(&device, &x, offset, op);
                let x64: Vec<f64> = x.iter().map(|&b| bf16_value(b) as f64).collect();
                let what = format!("bf16 {op:?} n={n} offset={offset}");
                check_reduce(&what, &x64, got, op, kernels::sum_bf16_depth(n));
                // half's conversion agrees with the shift.
                if n > 0 {
                    assert_eq!(half::bf16::from_bits(x[0]).to_f32(), bf16_value(x[0]));
                }
                if let Some(cpu) = &twin {
                    let emulated = reduce_bf16(cpu, &x, offset, op);
                    assert_eq!(
                        got.to_bits(),
                        emulated.to_bits(),
                        "{what}: GPU vs emulation"
                    );
                }
            }
        }
    }
}

/// The inclusive scan of `x` placed `offset` elements into its buffer.
fn scan_on<T: ScanElement>(device: &Device, x: &[T], offset: usize) -> Vec<T> {
    let mut host = vec![T::zeroed(); offset];
    host.extend_from_slice(x);
    let bundle = (
        upload(device, &host),
        poisoned::<T>(device, x.len()),
        poisoned::<u64>(device, kernels::scan_scratch_len(x.len()) + 2),
    );
    let (_, y, _) = job(device, bundle, |c, (x, y, s)| {
        c.inclusive_scan(x.view().range(offset..)?, y.view_mut(), s.view_mut())
    });
    download(y)
}

gpufeed::backend_tests!(inclusive_scan_u32_i32_exact);
fn inclusive_scan_u32_i32_exact(device: Device) {
    let mut rng = rng("inclusive_scan_u32_i32_exact");
    let twin = emulation_twin(&device);
    for n in sizes() {
        let xu: Vec<u32> = (0..n).map(|_| rng.u32(..)).collect();
        let xi: Vec<i32> = (0..n).map(|_| rng.i32(..)).collect();
        for offset in offsets(&device, n, &[1]) {
            let yu = scan_on(&device, &xu, offset);
            let mut acc = 0u32;
            for (j, (&x, &y)) in xu.iter().zip(&yu).enumerate() {
                acc = acc.wrapping_add(x);
                assert_eq!(y, acc, "u32 n={n} offset={offset} at {j}");
            }
            let yi = scan_on(&device, &xi, offset);
            let mut acc = 0i32;
            for (j, (&x, &y)) in xi.iter().zip(&yi).enumerate() {
                acc = acc.wrapping_add(x);
                assert_eq!(y, acc, "i32 n={n} offset={offset} at {j}");
            }
            if let Some(cpu) = &twin {
                assert_eq!(yu, scan_on(cpu, &xu, offset), "u32 n={n}: GPU vs emulation");
                assert_eq!(yi, scan_on(cpu, &xi, offset), "i32 n={n}: GPU vs emulation");
            }
        }
    }
}

gpufeed::backend_tests!(inclusive_scan_f32_within_bound_and_deterministic);
fn inclusive_scan_f32_within_bound_and_deterministic(device: Device) {
    let mut rng = rng("inclusive_scan_f32");
    let twin = emulation_twin(&device);
    for n in sizes() {
        let x = wide(&mut rng, n);
        for offset in offsets(&device, n, &[1]) {
            let y = scan_on(&device, &x, offset);
            let (mut exact, mut abs) = (0f64, 0f64);
            for (j, (&xj, &yj)) in x.iter().zip(&y).enumerate() {
                exact += xj as f64;
                abs += (xj as f64).abs();
                let bound = kernels::scan_depth(j) as f64 * U * abs * 1.01;
                assert!(
                    (yj as f64 - exact).abs() <= bound,
                    "f32 n={n} offset={offset} at {j}: {yj} vs {exact} (bound {bound:e})"
                );
            }
            // Run to run: the same bits.
            if full(&device) || n < 100_000 {
                assert_eq!(bits(&y), bits(&scan_on(&device, &x, offset)), "rerun n={n}");
            }
            if let Some(cpu) = &twin {
                let e = scan_on(cpu, &x, offset);
                assert_eq!(bits(&y), bits(&e), "f32 n={n}: GPU vs emulation");
            }
        }
    }
}

/// The row softmax of `x` (`rows x cols`).
fn softmax_on(device: &Device, x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let bundle = (upload(device, x), poisoned::<f32>(device, x.len()));
    let (_, y) = job(device, bundle, |c, (x, y)| {
        c.softmax_rows(x.view(), y.view_mut(), rows, cols)
    });
    download(y)
}

gpufeed::backend_tests!(softmax_rows_within_bound);
fn softmax_rows_within_bound(device: Device) {
    let mut rng = rng("softmax_rows");
    let twin = emulation_twin(&device);
    // Warp rows (up to 512 columns), block rows of 256 and 512 threads,
    // rows longer than the registers hold, and about 1e6 elements.
    let shapes = [
        (0, 0),
        (0, 7),
        (5, 0),
        (1, 1),
        (3, 31),
        (9, 33),
        (17, 512),
        (5, 513),
        (3, 1000),
        (2, 4097),
        (1, 8193),
        (2, 20_000),
    ];
    // About 1e6 elements: a block a row, warp rows, and one-element rows
    // (125 001 blocks: the emulation runs a sample of their rows).
    let large = [(61, 16_394), (1009, 991), (1_000_007, 1)];
    let large = match (device.kind(), full(&device)) {
        (BackendKind::Cuda, _) => &large[..],
        (_, true) => &large[..2], // the CPU emulation in release: 61 and 127 blocks
        _ => &[],
    };
    for &(rows, cols) in shapes.iter().chain(large) {
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.f32() * 16.0 - 8.0).collect();
        let y = softmax_on(&device, &x, rows, cols);
        let depth = kernels::softmax_sum_depth(cols) as f64;
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let max = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            for (c, &v) in row.iter().enumerate() {
                let d = v as f64 - max;
                let exact = d.exp() / sum;
                let got = y[r * cols + c] as f64;
                let bound = (d.abs() + depth + 7.0) * U * exact * 1.01 + 1e-44;
                assert!(
                    (got - exact).abs() <= bound,
                    "{rows}x{cols} at ({r}, {c}): {got} vs {exact} (bound {bound:e})"
                );
            }
        }
        // Rows are independent: the emulation runs the first and the last
        // (up to) 64 rows of the large shapes, the whole of the others.
        let emulate = |cpu: &Device, r0: usize, r1: usize| {
            let part = softmax_on(cpu, &x[r0 * cols..r1 * cols], r1 - r0, cols);
            assert_eq!(
                bits(&y[r0 * cols..r1 * cols]),
                bits(&part),
                "{rows}x{cols}, rows {r0}..{r1}: GPU vs emulation"
            );
        };
        if let Some(cpu) = &twin {
            if rows <= 128 {
                emulate(cpu, 0, rows);
            } else {
                emulate(cpu, 0, 64);
                emulate(cpu, (rows - 64) / 8 * 8, rows);
            }
        }
    }
}

/// The histogram of `x` placed `offset` bytes into its buffer.
fn histogram_on(device: &Device, x: &[u8], offset: usize) -> Vec<u32> {
    let mut host = vec![0u8; offset];
    host.extend_from_slice(x);
    let bundle = (upload(device, &host), poisoned::<u32>(device, 256));
    let (_, bins) = job(device, bundle, |c, (x, b)| {
        c.histogram_u8(x.view().range(offset..)?, b.view_mut())
    });
    download(bins)
}

gpufeed::backend_tests!(histogram_u8_exact);
fn histogram_u8_exact(device: Device) {
    let mut rng = rng("histogram_u8");
    let twin = emulation_twin(&device);
    for n in sizes() {
        // Uniform bytes, and a skewed input (most bytes one value: many
        // atomics on one shared bin).
        for skewed in [false, true] {
            let x: Vec<u8> = (0..n)
                .map(|_| {
                    if skewed && rng.u8(..) < 200 {
                        42
                    } else {
                        rng.u8(..)
                    }
                })
                .collect();
            for offset in offsets(&device, n, &[3, 16]) {
                let bins = histogram_on(&device, &x, offset);
                let mut exact = vec![0u32; 256];
                for &b in &x {
                    exact[b as usize] += 1;
                }
                assert_eq!(bins, exact, "n={n} skewed={skewed} offset={offset}");
                if let Some(cpu) = &twin {
                    assert_eq!(
                        bins,
                        histogram_on(cpu, &x, offset),
                        "n={n}: GPU vs emulation"
                    );
                }
            }
        }
    }
}

/// The GEMM shapes: zero dimensions, one element, not multiples of the tiles,
/// and vector-friendly ones (`k`, `n` multiples of 8).
const GEMM_SHAPES: [(usize, usize, usize); 9] = [
    (0, 0, 0),
    (0, 5, 3),
    (4, 0, 3),
    (4, 5, 0),
    (1, 1, 1),
    (33, 31, 17),
    (129, 257, 65),
    (130, 136, 72),
    (256, 128, 40),
];

/// SGEMM on `device`: `c0` is C before (poisoned when `beta == 0`).
fn sgemm_on(device: &Device, g: Gemm, a: &[f32], b: &[f32], c0: &[f32]) -> Vec<f32> {
    let bundle = (upload(device, a), upload(device, b), upload(device, c0));
    let (_, _, c) = job(device, bundle, |cmd, (a, b, c)| {
        cmd.sgemm(g, a.view(), b.view(), c.view_mut())
    });
    download(c)
}

/// The bf16 GEMM on `device`.
fn gemm_bf16_on(device: &Device, g: Gemm, a: &[u16], b: &[u16], c0: &[f32]) -> Vec<f32> {
    let bundle = (upload(device, a), upload(device, b), upload(device, c0));
    let (_, _, c) = job(device, bundle, |cmd, (a, b, c)| {
        cmd.gemm_bf16(g, a.view(), b.view(), c.view_mut())
    });
    download(c)
}

/// Checks `got` against the f64 product within `gamma_j * (|alpha| sum |a b|
/// + |beta c0|)`, `j = scale * (k + 2)`; with `fma_loop`, also bit for bit
/// against the sequential `fma` loop in ascending `k`.
#[allow(clippy::too_many_arguments)]
fn check_gemm(
    what: &str,
    g: Gemm,
    a: &[f32],
    b: &[f32],
    c0: &[f32],
    got: &[f32],
    scale: f64,
    fma_loop: bool,
) {
    let (m, n, k) = (g.m, g.n, g.k);
    let j = scale * (k as f64 + 2.0);
    let gamma = j * U / (1.0 - j * U);
    for i in 0..m {
        for col in 0..n {
            let (mut exact, mut abs) = (0f64, 0f64);
            let mut acc = 0f32;
            for p in 0..k {
                let (x, y) = (a[i * k + p], b[p * n + col]);
                exact += x as f64 * y as f64;
                abs += (x as f64 * y as f64).abs();
                acc = x.mul_add(y, acc);
            }
            let old = c0[i * n + col];
            let (full, mag) = if g.beta == 0.0 {
                (g.alpha as f64 * exact, g.alpha.abs() as f64 * abs)
            } else {
                (
                    g.alpha as f64 * exact + g.beta as f64 * old as f64,
                    g.alpha.abs() as f64 * abs + (g.beta as f64 * old as f64).abs(),
                )
            };
            let v = got[i * n + col];
            assert!(
                (v as f64 - full).abs() <= gamma * mag * 1.01,
                "{what} at ({i}, {col}): {v} vs {full} (bound {:e})",
                gamma * mag
            );
            if fma_loop {
                let seq = if g.beta == 0.0 {
                    g.alpha * acc
                } else {
                    g.beta.mul_add(old, g.alpha * acc)
                };
                assert_eq!(
                    v.to_bits(),
                    seq.to_bits(),
                    "{what} at ({i}, {col}): fma loop"
                );
            }
        }
    }
}

gpufeed::backend_tests!(sgemm_any_shape);
fn sgemm_any_shape(device: Device) {
    let mut rng = rng("sgemm");
    let twin = emulation_twin(&device);
    for (m, n, k) in GEMM_SHAPES {
        let a: Vec<f32> = (0..m * k).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.f32() * 2.0 - 1.0).collect();
        for g in [Gemm::new(m, n, k), Gemm::new(m, n, k).scaled(1.5, -0.75)] {
            // beta == 0: C is not read, so NaN there must not show.
            let c0: Vec<f32> = if g.beta == 0.0 {
                vec![f32::NAN; m * n]
            } else {
                (0..m * n).map(|_| rng.f32() * 2.0 - 1.0).collect()
            };
            let got = sgemm_on(&device, g, &a, &b, &c0);
            let what = format!("sgemm {m}x{n}x{k} alpha={} beta={}", g.alpha, g.beta);
            check_gemm(&what, g, &a, &b, &c0, &got, 1.0, true);
            if let Some(cpu) = &twin {
                let e = sgemm_on(cpu, g, &a, &b, &c0);
                assert_eq!(bits(&got), bits(&e), "{what}: GPU vs emulation");
            }
        }
    }
}

gpufeed::backend_tests!(gemm_bf16_any_shape);
fn gemm_bf16_any_shape(device: Device) {
    let mut rng = rng("gemm_bf16");
    if !bf16_gemm_supported(device.info().compute_capability) {
        // Below sm_80: a typed error, before anything runs.
        let bundle = (
            upload(&device, &[0u16; 4]),
            upload(&device, &[0u16; 4]),
            poisoned::<f32>(&device, 4),
        );
        let err = job_error(&device, bundle, |c, (a, b, o)| {
            c.gemm_bf16(Gemm::new(2, 2, 2), a.view(), b.view(), o.view_mut())
        });
        assert!(
            matches!(
                err,
                Error::InvalidLaunch {
                    kernel: "gemm_bf16",
                    ..
                }
            ),
            "{err}"
        );
        return;
    }
    let emulated = device.kind() == BackendKind::Cpu;
    for (m, n, k) in GEMM_SHAPES {
        if (m, n, k) == (130, 136, 72) && !full(&device) {
            continue; // 7 s in a debug build's emulation; 129x257x65 covers the edges
        }
        let a: Vec<u16> = (0..m * k)
            .map(|_| bf16_bits(rng.f32() * 2.0 - 1.0))
            .collect();
        let b: Vec<u16> = (0..k * n)
            .map(|_| bf16_bits(rng.f32() * 2.0 - 1.0))
            .collect();
        let (af, bf): (Vec<f32>, Vec<f32>) = (
            a.iter().map(|&v| bf16_value(v)).collect(),
            b.iter().map(|&v| bf16_value(v)).collect(),
        );
        // Both forms at every shape but the largest (one each there).
        let forms = match (m, n, k) {
            (129, 257, 65) => vec![Gemm::new(m, n, k).scaled(0.5, 2.0)],
            (130, 136, 72) => vec![Gemm::new(m, n, k)],
            _ => vec![Gemm::new(m, n, k), Gemm::new(m, n, k).scaled(0.5, 2.0)],
        };
        for g in forms {
            let c0: Vec<f32> = if g.beta == 0.0 {
                vec![f32::NAN; m * n]
            } else {
                (0..m * n).map(|_| rng.f32() * 2.0 - 1.0).collect()
            };
            let got = gemm_bf16_on(&device, g, &a, &b, &c0);
            let what = format!("gemm_bf16 {m}x{n}x{k} alpha={} beta={}", g.alpha, g.beta);
            // The documented bound (2u a step); on the emulation, also the
            // sequential fma loop bit for bit. The GPU's mma adds in its own
            // order: within the bound only, never compared bit for bit.
            check_gemm(&what, g, &af, &bf, &c0, &got, 2.0, emulated);
        }
    }
}

gpufeed::backend_tests!(bad_operands_are_typed_errors_with_the_buffers_back);
fn bad_operands_are_typed_errors_with_the_buffers_back(device: Device) {
    let d = &device;
    let n = 10_000;
    let length = |e: &Error| matches!(e, Error::LengthMismatch { .. });
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument(_));
    let overlap = |e: &Error| matches!(e, Error::Overlap { .. });

    // Reductions: `out` of two elements; a scratch one short.
    let need = kernels::reduce_scratch_len(n);
    let bundle = (
        poisoned::<f32>(d, n),
        poisoned::<f32>(d, need),
        poisoned::<f32>(d, 2),
    );
    let e = job_error(d, bundle, |c, (x, s, o)| {
        c.sum(x.view(), s.view_mut(), o.view_mut())
    });
    assert!(length(&e), "{e}");
    let bundle = (
        poisoned::<f32>(d, n),
        poisoned::<f32>(d, need - 1),
        poisoned::<f32>(d, 1),
    );
    let e = job_error(d, bundle, |c, (x, s, o)| {
        c.max(x.view(), s.view_mut(), o.view_mut())
    });
    assert!(invalid(&e), "{e}");
    let bundle = (
        poisoned::<u16>(d, n),
        poisoned::<f32>(d, kernels::reduce_bf16_scratch_len(n) - 1),
        poisoned::<f32>(d, 1),
    );
    let e = job_error(d, bundle, |c, (x, s, o)| {
        c.sum_bf16(x.view(), s.view_mut(), o.view_mut())
    });
    assert!(invalid(&e), "{e}");
    // The output inside the scratch: refused before either pass runs.
    let bundle = (poisoned::<f32>(d, n), poisoned::<f32>(d, need));
    let e = job_error(d, bundle, |c, (x, s)| {
        let s = s.view_mut();
        c.sum(x.view(), s, s.range(need - 1..need)?)
    });
    assert!(overlap(&e), "{e}");
    let bundle = (poisoned::<f32>(d, need), poisoned::<f32>(d, 1));
    let e = job_error(d, bundle, |c, (s, o)| {
        let s = s.view_mut();
        c.sum(s.as_view(), s, o.view_mut()) // the input is the scratch
    });
    assert!(overlap(&e), "{e}");

    // Scan: y of another length; a scratch too small; y over x.
    let bundle = (
        poisoned::<u32>(d, n),
        poisoned::<u32>(d, n + 1),
        poisoned::<u64>(d, 64),
    );
    let e = job_error(d, bundle, |c, (x, y, s)| {
        c.inclusive_scan(x.view(), y.view_mut(), s.view_mut())
    });
    assert!(length(&e), "{e}");
    let short = kernels::scan_scratch_len(n) - 1;
    let bundle = (
        poisoned::<f32>(d, n),
        poisoned::<f32>(d, n),
        poisoned::<u64>(d, short),
    );
    let e = job_error(d, bundle, |c, (x, y, s)| {
        c.inclusive_scan(x.view(), y.view_mut(), s.view_mut())
    });
    assert!(invalid(&e), "{e}");
    let bundle = (poisoned::<i32>(d, n + 1), poisoned::<u64>(d, 64));
    let e = job_error(d, bundle, |c, (xy, s)| {
        let xy = xy.view_mut();
        c.inclusive_scan(xy.range(..n)?.as_view(), xy.range(1..)?, s.view_mut())
    });
    assert!(overlap(&e), "{e}");
    // Not in place either (the contract: y disjoint from x).
    let bundle = (poisoned::<i32>(d, n), poisoned::<u64>(d, 64));
    let e = job_error(d, bundle, |c, (xy, s)| {
        let xy = xy.view_mut();
        c.inclusive_scan(xy.as_view(), xy, s.view_mut())
    });
    assert!(overlap(&e), "{e}");

    // Softmax: x or y not rows * cols; y over x; a size past u32.
    let bundle = (poisoned::<f32>(d, 100), poisoned::<f32>(d, 100));
    let e = job_error(d, bundle, |c, (x, y)| {
        c.softmax_rows(x.view(), y.view_mut(), 9, 11)
    });
    assert!(length(&e), "{e}");
    let bundle = (poisoned::<f32>(d, 100), poisoned::<f32>(d, 99));
    let e = job_error(d, bundle, |c, (x, y)| {
        c.softmax_rows(x.view(), y.view_mut(), 10, 10)
    });
    assert!(length(&e), "{e}");
    let bundle = poisoned::<f32>(d, 100);
    let e = job_error(d, bundle, |c, x| {
        let x = x.view_mut();
        c.softmax_rows(x.as_view(), x, 10, 10)
    });
    assert!(overlap(&e), "{e}");
    let bundle = (poisoned::<f32>(d, 0), poisoned::<f32>(d, 0));
    let e = job_error(d, bundle, |c, (x, y)| {
        c.softmax_rows(x.view(), y.view_mut(), 1 << 33, 0)
    });
    assert!(invalid(&e), "{e}");

    // Histogram: 255 bins; bins over the input.
    let bundle = (poisoned::<u8>(d, n), poisoned::<u32>(d, 255));
    let e = job_error(d, bundle, |c, (x, b)| {
        c.histogram_u8(x.view(), b.view_mut())
    });
    assert!(length(&e), "{e}");

    // GEMM: each operand one element short; C over A.
    let (m, nn, k) = (33, 31, 17);
    for short in 0..3 {
        let len = |i: usize, l: usize| if i == short { l - 1 } else { l };
        let bundle = (
            poisoned::<f32>(d, len(0, m * k)),
            poisoned::<f32>(d, len(1, k * nn)),
            poisoned::<f32>(d, len(2, m * nn)),
        );
        let e = job_error(d, bundle, |c, (a, b, o)| {
            c.sgemm(Gemm::new(m, nn, k), a.view(), b.view(), o.view_mut())
        });
        assert!(length(&e), "operand {short}: {e}");
    }
    let bundle = (poisoned::<f32>(d, 4), poisoned::<f32>(d, 4));
    let e = job_error(d, bundle, |c, (ac, b)| {
        let ac = ac.view_mut();
        c.sgemm(Gemm::new(2, 2, 2), ac.as_view(), b.view(), ac)
    });
    assert!(overlap(&e), "{e}");
    if bf16_gemm_supported(device.info().compute_capability) {
        let bundle = (
            poisoned::<u16>(d, 6),
            poisoned::<u16>(d, 6),
            poisoned::<f32>(d, 4),
        );
        let e = job_error(d, bundle, |c, (a, b, o)| {
            c.gemm_bf16(Gemm::new(2, 2, 2), a.view(), b.view(), o.view_mut())
        });
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
    }

    // After all that, the device still works.
    let bundle = (
        upload(d, &[1.0f32, 2.0, 3.0]),
        poisoned::<f32>(d, 1),
        poisoned::<f32>(d, 1),
    );
    let (_, _, out) = job(d, bundle, |c, (x, s, o)| {
        c.sum(x.view(), s.view_mut(), o.view_mut())
    });
    assert_eq!(download(out), [6.0]);
}

gpufeed::backend_tests!(memset_zero_clears_only_its_range);
fn memset_zero_clears_only_its_range(device: Device) {
    let b = poisoned::<u32>(&device, 1000);
    let b = job(&device, b, |c, b| {
        let b = b.view_mut();
        c.memset_zero(b.range(3..997)?)?;
        c.memset_zero(b.range(0..0)?)
    });
    let v = download(b);
    assert!(v[..3].iter().chain(&v[997..]).all(|&x| x == u32::MAX));
    assert!(v[3..997].iter().all(|&x| x == 0));
}
