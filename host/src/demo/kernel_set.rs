//! `host kernel-set`: the block-level kernels of `gpu-kernels` (sum, max,
//! inclusive scan, row softmax, byte histogram, SGEMM, the bf16 tensor-core
//! GEMM) timed on the device with CUDA events, each against the
//! device-to-device copy of the same bytes (the memory bound) or in
//! TFLOPS, every result checked on the host: sum, max, scan and histogram
//! exactly (inputs chosen so every partial sum is an integer below 2^24),
//! softmax and the GEMMs on sampled rows and elements against f64 within
//! their documented bounds.

use super::report::{median, write_json, Meta};
use gpufeed::kernels::{self, Gemm};
use gpufeed::{block_on, Device, DeviceBuffer, Stream};
use serde::Serialize;
use std::path::Path;

#[derive(Serialize)]
struct Row {
    op: &'static str,
    /// What the figure counts: bytes read (sum, max, histogram), bytes read
    /// and written (copy, scan, softmax), or flops (GEMMs).
    unit: &'static str,
    size: String,
    median_ms: f64,
    /// GB/s or TFLOPS.
    value: f64,
    /// value / the copy's GB/s (memory-bound kernels only).
    over_copy: Option<f64>,
    verified: bool,
    detail: String,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    bytes: usize,
    gemm: usize,
    reps: usize,
    rows: Vec<Row>,
}

fn e(what: &str) -> impl FnOnce(String) -> gpufeed::Error + '_ {
    move |m| gpufeed::Error::InvalidArgument(format!("{what}: {m}"))
}

/// The median over `reps` of the time between two timed events around the
/// commands `f` enqueues, each rep its own job (after one untimed warm-up).
fn time<B: Send + 'static>(
    stream: &Stream,
    mut bundle: B,
    reps: usize,
    f: impl for<'a> Fn(&mut gpufeed::Commands<'a>, &'a mut B) -> gpufeed::Result<()>
        + Copy
        + Send
        + 'static,
) -> gpufeed::Result<(B, f64)> {
    let mut times = Vec::with_capacity(reps);
    for rep in 0..=reps {
        let (b, ms) = block_on(stream.run(bundle, move |c, b| {
            let t0 = c.record_timed()?;
            f(c, b)?;
            let t1 = c.record_timed()?;
            Ok((t0, t1))
        }))
        .map(|(b, (t0, t1))| (b, t0.elapsed_ms(&t1)))
        .map_err(|e| e.error)?;
        bundle = b;
        if rep > 0 {
            times.push(ms? as f64);
        }
    }
    Ok((bundle, median(&times)))
}

fn upload<T: bytemuck::Pod>(device: &Device, v: &[T]) -> gpufeed::Result<DeviceBuffer<T>> {
    let mut d = DeviceBuffer::<T>::new(device, v.len())?;
    d.copy_from_host_sync(v)?;
    Ok(d)
}

fn download<T: bytemuck::Pod + Default>(d: &mut DeviceBuffer<T>) -> gpufeed::Result<Vec<T>> {
    let mut v = vec![T::default(); d.len()];
    d.copy_to_host_sync(&mut v)?;
    Ok(v)
}

pub fn run(
    device: &Device,
    bytes: usize,
    gemm: usize,
    reps: usize,
    json: &Path,
) -> gpufeed::Result<()> {
    let stream = Stream::new(device)?;
    let n = bytes / 4;
    let gb = |b: usize, ms: f64| b as f64 / (ms * 1e-3) / 1e9;
    let mut rows = Vec::new();
    let mut rng = fastrand::Rng::with_seed(0x6b65_726e);

    // Inputs of +-1: every partial sum, in any order, is an integer of
    // magnitude below 2^24, so sums and scans are exact in f32.
    let x: Vec<f32> = (0..n)
        .map(|_| if rng.bool() { 1.0 } else { -1.0 })
        .collect();
    let mut xmax = x.clone();
    let top = rng.usize(..n.max(1));
    if n > 0 {
        xmax[top] = 7.0;
    }
    let dx = upload(device, &x)?;

    // The memory bound: a device-to-device copy of the same bytes.
    let dst = DeviceBuffer::<f32>::new(device, n)?;
    let ((dx, mut dst), copy_ms) = time(&stream, (dx, dst), reps, |c, (s, d)| {
        c.copy_d2d(s.view(), d.view_mut())
    })?;
    let copy_ok = download(&mut dst)? == x;
    let copy_gbps = gb(2 * bytes, copy_ms);
    rows.push(Row {
        op: "copy d2d",
        unit: "GB/s read + written",
        size: format!("{bytes} B"),
        median_ms: copy_ms,
        value: copy_gbps,
        over_copy: Some(1.0),
        verified: copy_ok,
        detail: String::new(),
    });

    // Sum and max: bytes read.
    let scratch = DeviceBuffer::<f32>::new(device, kernels::reduce_scratch_len(n))?;
    let out = DeviceBuffer::<f32>::new(device, 1)?;
    let ((dx, scratch, mut out), sum_ms) =
        time(&stream, (dx, scratch, out), reps, |c, (x, s, o)| {
            c.sum(x.view(), s.view_mut(), o.view_mut())
        })?;
    let want: f64 = x.iter().map(|&v| v as f64).sum();
    let got = download(&mut out)?[0] as f64;
    rows.push(Row {
        op: "sum f32",
        unit: "GB/s read",
        size: format!("{n} f32"),
        median_ms: sum_ms,
        value: gb(bytes, sum_ms),
        over_copy: Some(gb(bytes, sum_ms) / copy_gbps),
        verified: got == want,
        detail: format!("{got} (exact {want})"),
    });
    let dmax = upload(device, &xmax)?;
    let ((_, _, mut out), max_ms) = time(&stream, (dmax, scratch, out), reps, |c, (x, s, o)| {
        c.max(x.view(), s.view_mut(), o.view_mut())
    })?;
    let got = download(&mut out)?[0];
    let want = if n > 0 { 7.0 } else { f32::NEG_INFINITY };
    rows.push(Row {
        op: "max f32",
        unit: "GB/s read",
        size: format!("{n} f32"),
        median_ms: max_ms,
        value: gb(bytes, max_ms),
        over_copy: Some(gb(bytes, max_ms) / copy_gbps),
        verified: got == want,
        detail: format!("{got}"),
    });

    // Inclusive scan (f32): bytes read + written; every element checked.
    let y = DeviceBuffer::<f32>::new(device, n)?;
    let sc = DeviceBuffer::<u64>::new(device, kernels::scan_scratch_len(n))?;
    let ((dx, mut y, _), scan_ms) = time(&stream, (dx, y, sc), reps, |c, (x, y, s)| {
        c.inclusive_scan(x.view(), y.view_mut(), s.view_mut())
    })?;
    let got = download(&mut y)?;
    let mut acc = 0.0f32;
    let bad = x
        .iter()
        .zip(&got)
        .filter(|(v, g)| {
            acc += **v;
            acc.to_bits() != g.to_bits()
        })
        .count();
    rows.push(Row {
        op: "inclusive scan f32",
        unit: "GB/s read + written",
        size: format!("{n} f32"),
        median_ms: scan_ms,
        value: gb(2 * bytes, scan_ms),
        over_copy: Some(gb(2 * bytes, scan_ms) / copy_gbps),
        verified: bad == 0,
        detail: format!("{bad} elements wrong"),
    });
    drop(y);

    // Softmax over rows of 4096: bytes read + written; sampled rows checked.
    let cols = 4096;
    let rws = n / cols;
    let xs: Vec<f32> = (0..rws * cols).map(|_| rng.f32() * 16.0 - 8.0).collect();
    let dxs = upload(device, &xs)?;
    let ys = DeviceBuffer::<f32>::new(device, rws * cols)?;
    let ((_, mut ys), sm_ms) = time(&stream, (dxs, ys), reps, move |c, (x, y)| {
        c.softmax_rows(x.view(), y.view_mut(), rws, cols)
    })?;
    let got = download(&mut ys)?;
    let mut worst = 0.0f64;
    for r in (0..rws).step_by((rws / 64).max(1)) {
        let row = &xs[r * cols..(r + 1) * cols];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        for (j, &v) in row.iter().enumerate() {
            let exact = (v as f64 - m).exp() / s;
            let rel = ((got[r * cols + j] as f64 - exact) / exact).abs();
            worst = worst.max(rel);
        }
    }
    let sm_bytes = 2 * rws * cols * 4;
    rows.push(Row {
        op: "softmax rows f32",
        unit: "GB/s read + written",
        size: format!("{rws} x {cols}"),
        median_ms: sm_ms,
        value: gb(sm_bytes, sm_ms),
        over_copy: Some(gb(sm_bytes, sm_ms) / copy_gbps),
        verified: worst < 64.0 * f32::EPSILON as f64,
        detail: format!("worst relative error {worst:.2e} (sampled rows)"),
    });
    drop(ys);
    drop(dx);
    drop(dst);

    // Histogram of bytes: bytes read; exact counts.
    let hb = bytes.min(u32::MAX as usize);
    let hx: Vec<u8> = (0..hb).map(|_| rng.u8(..)).collect();
    let mut want = [0u64; 256];
    for &v in &hx {
        want[v as usize] += 1;
    }
    let dh = upload(device, &hx)?;
    let bins = DeviceBuffer::<u32>::new(device, 256)?;
    let ((_, mut bins), h_ms) = time(&stream, (dh, bins), reps, |c, (x, b)| {
        c.histogram_u8(x.view(), b.view_mut())
    })?;
    let got = download(&mut bins)?;
    let ok = got.iter().zip(want).all(|(&g, w)| g as u64 == w);
    rows.push(Row {
        op: "histogram u8 (256 bins)",
        unit: "GB/s read",
        size: format!("{hb} B"),
        median_ms: h_ms,
        value: gb(hb, h_ms),
        over_copy: Some(gb(hb, h_ms) / copy_gbps),
        verified: ok,
        detail: String::new(),
    });
    drop(hx);

    // GEMMs: TFLOPS; sampled elements against f64 within the bound.
    let g = gemm;
    let a: Vec<f32> = (0..g * g).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let b: Vec<f32> = (0..g * g).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let check = |c: &[f32], a: &[f32], b: &[f32], gamma: f64| -> (bool, f64) {
        let mut worst = 0.0f64;
        let mut ok = true;
        for s in 0..256 {
            let (i, j) = ((s * 7919) % g.max(1), (s * 104_729) % g.max(1));
            let (mut exact, mut mag) = (0.0f64, 0.0f64);
            for p in 0..g {
                let t = a[i * g + p] as f64 * b[p * g + j] as f64;
                exact += t;
                mag += t.abs();
            }
            let err = (c[i * g + j] as f64 - exact).abs();
            worst = worst.max(err / mag.max(f64::MIN_POSITIVE));
            ok &= err <= gamma * mag;
        }
        (ok, worst)
    };
    let u = f64::powi(2.0, -24);
    let flops = 2.0 * (g as f64).powi(3);
    if g > 0 {
        let (da, db) = (upload(device, &a)?, upload(device, &b)?);
        let dc = DeviceBuffer::<f32>::new(device, g * g)?;
        let ((da, db, mut dc), ms) =
            time(&stream, (da, db, dc), reps.min(10), move |c, (a, b, d)| {
                c.sgemm(Gemm::new(g, g, g), a.view(), b.view(), d.view_mut())
            })?;
        drop((da, db));
        let got = download(&mut dc)?;
        let gamma = (g as f64 + 2.0) * u / (1.0 - (g as f64 + 2.0) * u);
        let (ok, worst) = check(&got, &a, &b, gamma);
        rows.push(Row {
            op: "sgemm f32",
            unit: "TFLOPS",
            size: format!("{g}^3"),
            median_ms: ms,
            value: flops / (ms * 1e-3) / 1e12,
            over_copy: None,
            verified: ok,
            detail: format!("worst |err| / sum|ab| {worst:.2e} (256 sampled elements)"),
        });
        if kernels::bf16_gemm_supported(device.info().compute_capability) {
            let bf = |v: &[f32]| -> (Vec<u16>, Vec<f32>) {
                let bits: Vec<u16> = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
                let back = bits
                    .iter()
                    .map(|&h| f32::from_bits((h as u32) << 16))
                    .collect();
                (bits, back)
            };
            let ((ab, af), (bb, bf_)) = (bf(&a), bf(&b));
            let (da, db) = (upload(device, &ab)?, upload(device, &bb)?);
            let dc = DeviceBuffer::<f32>::new(device, g * g)?;
            let ((_, _, mut dc), ms) =
                time(&stream, (da, db, dc), reps.min(10), move |c, (a, b, d)| {
                    c.gemm_bf16(Gemm::new(g, g, g), a.view(), b.view(), d.view_mut())
                })?;
            let got = download(&mut dc)?;
            let gamma = 2.0 * (g as f64 + 2.0) * u / (1.0 - 2.0 * (g as f64 + 2.0) * u);
            let (ok, worst) = check(&got, &af, &bf_, gamma);
            rows.push(Row {
                op: "gemm bf16 (tensor cores)",
                unit: "TFLOPS",
                size: format!("{g}^3"),
                median_ms: ms,
                value: flops / (ms * 1e-3) / 1e12,
                over_copy: None,
                verified: ok,
                detail: format!("worst |err| / sum|ab| {worst:.2e} (256 sampled elements)"),
            });
        }
    }

    println!(
        "{:<26} {:>10} {:>12} {:>9}  verified",
        "kernel", "ms", "value", "÷ copy"
    );
    for r in &rows {
        println!(
            "{:<26} {:>10.3} {:>8.1} {:<4} {:>9}  {} {}",
            r.op,
            r.median_ms,
            r.value,
            if r.unit == "TFLOPS" { "TF" } else { "GB/s" },
            r.over_copy.map_or("-".into(), |v| format!("{v:.3}")),
            r.verified,
            r.detail
        );
    }
    let all = rows.iter().all(|r| r.verified);
    write_json(
        json,
        &Results {
            meta: Meta::new(device),
            bytes,
            gemm,
            reps,
            rows,
        },
    )?;
    if !all {
        return Err(e("kernel-set")(
            "a result did not verify (see the table)".into(),
        ));
    }
    Ok(())
}
