//! `host kernels`: every kernel on the device against the CPU, bit for bit,
//! and `scale` timed against a device-to-device copy of the same bytes.

use super::fmt::{elems, ms, Words};
use super::report::{median, random_floats, write_json, Meta};
use gpufeed::block_on;
use gpufeed::{Device, DeviceBuffer, Kernel, PinnedBuffer, PinnedHost, Stream};
use serde::Serialize;
use std::path::Path;

#[derive(Serialize)]
struct Check {
    kernel: String,
    n: usize,
    mismatches: usize,
    bit_identical: bool,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    n: usize,
    checks: Vec<Check>,
    /// Median ms of `scale` (reads and writes 8 bytes per element).
    scale_ms: f64,
    /// Median ms of a device-to-device copy of the same 4n bytes (8n moved).
    copy_ms: f64,
    scale_gbps: f64,
    copy_gbps: f64,
    /// scale bandwidth / copy bandwidth (target: at least 0.85).
    scale_over_copy: f64,
    reps: usize,
}

/// Runs `f(offset, chunk)` on chunks of `out` in parallel, one per CPU
/// thread (CPU references and conversions of 10^8 elements).
pub fn par_chunks<T: Send>(out: &mut [T], f: impl Fn(usize, &mut [T]) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = out.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, c) in out.chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || f(i * chunk, c));
        }
    });
}

fn mismatches(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// Uploads `x`, applies `kernel`, downloads: the device result.
fn on_device(
    device: &Device,
    stream: &Stream,
    x: &[f32],
    kernel: Kernel,
) -> gpufeed::Result<PinnedBuffer<f32>> {
    let input = PinnedBuffer::from_slice(device, x)?;
    let mut output = PinnedBuffer::<f32>::new(device, x.len())?;
    gpufeed::testing::poison(output.as_mut_slice());
    let dev = DeviceBuffer::<f32>::new(device, x.len())?;
    let ((_, _, output), ()) = block_on(stream.run((input, dev, output), |c, (i, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.kernel(kernel, d)?;
        c.copy_d2h(d, o.host_mut())
    }))?;
    Ok(output)
}

pub fn run(device: &Device, n: usize, json: Option<&Path>) -> gpufeed::Result<()> {
    let w = Words::of(device);
    let pb = super::progress::bar(4);
    pb.set_message("random input");
    let stream = Stream::new(device)?;
    let x = random_floats(n, 0xC0FFEE);
    let mut checks = Vec::new();

    for kernel in [Kernel::Scale { s: 1.5 }, Kernel::Intensity { k: 64 }] {
        pb.set_message(format!("{} against the CPU", kernel.label()));
        let got = on_device(device, &stream, &x, kernel)?;
        let mut want = vec![0f32; n];
        par_chunks(&mut want, |off, c| {
            for (i, w) in c.iter_mut().enumerate() {
                *w = gpufeed::testing::expected(kernel, x[off + i]);
            }
        });
        let bad = mismatches(got.as_slice(), &want);
        checks.push(Check {
            kernel: kernel.label(),
            n,
            mismatches: bad,
            bit_identical: bad == 0,
        });
        pb.inc(1);
    }

    // saxpy: y = a*x + y with a second random input.
    pb.set_message("saxpy against the CPU");
    let a = 0.75f32;
    let y = random_floats(n, 0xBEEF);
    let xs = PinnedBuffer::from_slice(device, &x)?;
    let ys = PinnedBuffer::from_slice(device, &y)?;
    let mut out = PinnedBuffer::<f32>::new(device, n)?;
    gpufeed::testing::poison(out.as_mut_slice());
    let (dx, dy) = (
        DeviceBuffer::<f32>::new(device, n)?,
        DeviceBuffer::<f32>::new(device, n)?,
    );
    let ((_, _, out, _, _), ()) = block_on(stream.run(
        (xs, ys, out, dx, dy),
        |c, (xs, ys, out, dx, dy)| {
            let (dx, dy) = (dx.view_mut(), dy.view_mut());
            c.copy_h2d(xs.host(), dx)?;
            c.copy_h2d(ys.host(), dy)?;
            c.saxpy(a, dx, dy)?;
            c.copy_d2h(dy, out.host_mut())
        },
    ))?;
    let mut want = vec![0f32; n];
    par_chunks(&mut want, |off, c| {
        for (i, w) in c.iter_mut().enumerate() {
            // One fused multiply-add, as the kernel computes it.
            *w = a.mul_add(x[off + i], y[off + i]);
        }
    });
    let bad = mismatches(out.as_slice(), &want);
    checks.push(Check {
        kernel: "saxpy".into(),
        n,
        mismatches: bad,
        bit_identical: bad == 0,
    });

    pb.inc(1);
    // Timing: scale in place vs a device-to-device copy of the same bytes.
    pb.set_message("timing scale against a device copy");
    let reps = 20;
    let src = PinnedBuffer::from_slice(device, &x)?;
    let (d1, d2) = (
        DeviceBuffer::<f32>::new(device, n)?,
        DeviceBuffer::<f32>::new(device, n)?,
    );
    let ((_, d1, d2), times) = block_on(stream.run((src, d1, d2), |c, (s, d1, d2)| {
        let (d1, d2) = (d1.view_mut(), d2.view_mut());
        c.copy_h2d(s.host(), d1)?;
        let mut evs = Vec::new();
        // One warm-up of each, then alternate so drift hits both alike.
        for i in 0..=reps {
            let a = c.record_timed()?;
            c.kernel(Kernel::Scale { s: 1.0 }, d1)?;
            let b = c.record_timed()?;
            c.copy_d2d(d1, d2)?;
            let e = c.record_timed()?;
            if i > 0 {
                evs.push((a, b, e));
            }
        }
        Ok(evs)
    }))?;
    drop((d1, d2));
    pb.finish_and_clear();
    let mut scale_ms = Vec::new();
    let mut copy_ms = Vec::new();
    for (a, b, e) in &times {
        scale_ms.push(a.elapsed_ms(b)? as f64);
        copy_ms.push(b.elapsed_ms(e)? as f64);
    }
    let (s_ms, c_ms) = (median(&scale_ms), median(&copy_ms));
    let moved = 8.0 * n as f64;
    let res = Results {
        meta: Meta::new(device),
        n,
        scale_gbps: moved / s_ms / 1e6,
        copy_gbps: moved / c_ms / 1e6,
        scale_over_copy: c_ms / s_ms,
        scale_ms: s_ms,
        copy_ms: c_ms,
        checks,
        reps,
    };
    println!("kernels on {} floats — {}:", elems(n), device.info().name);
    for c in &res.checks {
        println!(
            "  {:<16} {}",
            c.kernel,
            if c.bit_identical {
                "bit-identical with the CPU reference".to_string()
            } else {
                format!("{} MISMATCHES", c.mismatches)
            }
        );
    }
    println!("  timing (medians of {reps}, {}):", w.event_clock());
    println!(
        "    scale {} ({:.0} GB/s); {} of the same bytes {} ({:.0} GB/s)",
        ms(res.scale_ms),
        res.scale_gbps,
        w.device_copy(),
        ms(res.copy_ms),
        res.copy_gbps,
    );
    println!(
        "    scale reaches {:.1}% of the copy bandwidth",
        100.0 * res.scale_over_copy
    );
    if let Some(path) = json {
        write_json(path, &res)?;
    }
    if res.checks.iter().any(|c| !c.bit_identical) {
        return Err(gpufeed::Error::InvalidArgument(
            "a kernel's result differs from the CPU".into(),
        ));
    }
    Ok(())
}
