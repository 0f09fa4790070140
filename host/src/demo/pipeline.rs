//! `host compare`, `host sweep`, `host timeline`: the overlap pipeline measured.

use super::compare::{compare, Comparison, Spec};
use super::plots::{self, Bar, Series};
use host::{Device, Kernel, PinnedPool, Pipeline, Plan};
use serde::Serialize;
use std::path::Path;

/// The plans a comparison tries: for `scale`, the peers' grid (round robin,
/// 4..64 chunks over 2 or 4 streams), ramped and chained variants, more
/// streams, and the engines layout over a range of chunk counts; for the
/// tunable kernel (whose heavy settings take up to 50 ms a run), a compact
/// grid. Always [`Plan::auto`] too.
pub fn plan_grid(n: usize, kernel: Kernel) -> Vec<Plan> {
    if matches!(kernel, Kernel::Intensity { .. }) {
        let mut v: Vec<Plan> = [8, 16, 32]
            .iter()
            .flat_map(|&c| [Plan::uniform(c, 4), Plan::engines(c, 4)])
            .filter(|p| p.chunks <= n)
            .collect();
        if !v.contains(&Plan::auto(n)) {
            v.push(Plan::auto(n));
        }
        return v;
    }
    let mut v: Vec<Plan> = [4, 8, 16, 32, 64]
        .iter()
        .flat_map(|&chunks| [2, 4].map(|streams| Plan::uniform(chunks, streams)))
        .chain([8, 16, 32].map(|chunks| Plan {
            ramp: true,
            ..Plan::uniform(chunks, 4)
        }))
        .chain([8, 16, 32].map(|chunks| Plan {
            chain: true,
            ..Plan::uniform(chunks, 4)
        }))
        .chain(
            [12, 16, 24]
                .iter()
                .flat_map(|&c| [6, 8].map(|s| Plan::uniform(c, s))),
        )
        .chain([16, 24, 32].map(|c| Plan::engines(c, 8)))
        .chain([8, 12, 16, 24, 32, 48, 64].iter().flat_map(|&chunks| {
            [
                Plan::engines(chunks, 4),
                Plan {
                    ramp: true,
                    ..Plan::engines(chunks, 4)
                },
            ]
        }))
        .filter(|p| p.chunks <= n)
        .collect();
    let auto = Plan::auto(n);
    if !v.contains(&auto) {
        v.push(auto);
    }
    v
}

pub async fn compare_all(
    device: &Device,
    pool: &PinnedPool,
    pipeline: &Pipeline,
    cases: &[(usize, Kernel)],
    reps: usize,
) -> host::Result<Vec<Comparison>> {
    let mut out = Vec::new();
    for &(n, kernel) in cases {
        let spec = Spec {
            n,
            kernel,
            plans: plan_grid(n, kernel),
            reps,
            with_bound: true,
        };
        let c = compare(device, pool, pipeline, &spec).await?;
        c.print();
        pool.empty_cache();
        out.push(c);
    }
    Ok(out)
}

pub async fn sweep(
    device: &Device,
    pool: &PinnedPool,
    pipeline: &Pipeline,
    sizes: &[usize],
    progress: &indicatif::ProgressBar,
) -> host::Result<Vec<Comparison>> {
    let mut out = Vec::new();
    for &n in sizes {
        progress.set_message(format!("sweep n = {n:.0e}"));
        let reps = if n >= 300_000_000 {
            2
        } else if n >= 30_000_000 {
            4
        } else {
            10
        };
        let spec = Spec {
            n,
            kernel: Kernel::Scale { s: 1.5 },
            plans: vec![Plan::auto(n)],
            reps,
            with_bound: false,
        };
        let c = compare(device, pool, pipeline, &spec).await?;
        pool.empty_cache();
        out.push(c);
        progress.inc(1);
    }
    Ok(out)
}

pub fn print_sweep(rows: &[Comparison]) {
    println!("\nsize sweep (scale, sync vs pipelined with the automatic plan, medians):");
    println!(
        "{:>12} {:>11} {:>11} {:>8} {:>9} {:>9}",
        "n", "sync ms", "async ms", "speedup", "overlap", "verified"
    );
    for c in rows {
        println!(
            "{:>12} {:>11.3} {:>11.3} {:>7.2}x {:>8.0}% {:>9}",
            c.n,
            c.sync_ms,
            c.async_ms,
            c.speedup,
            c.overlap * 100.0,
            c.verified
        );
    }
}

pub fn write_sweep_csv(path: &Path, rows: &[Comparison]) -> host::Result<()> {
    let mut s = String::from("n,kernel,sync_ms,h2d_ms,kernel_ms,d2h_ms,async_ms,chunks,streams,speedup,overlap,bidir_bound_ms,verified\n");
    for c in rows {
        s += &format!(
            "{},{},{:.4},{:.4},{:.4},{:.4},{:.4},{},{},{:.4},{:.4},{:.4},{}\n",
            c.n,
            c.kernel.label(),
            c.sync_ms,
            c.stage_ms[0],
            c.stage_ms[1],
            c.stage_ms[2],
            c.async_ms,
            c.plan.chunks,
            c.plan.streams,
            c.speedup,
            c.overlap,
            c.bidir_bound_ms,
            c.verified
        );
    }
    std::fs::write(path, s)?;
    println!("wrote {}", path.display());
    Ok(())
}

pub fn plot_sweep(path: &Path, rows: &[Comparison], backend: &str) -> host::Result<()> {
    plots::lines(
        path,
        &format!("H2D + scale + D2H: time against size ({backend})"),
        "floats",
        "milliseconds (median)",
        true,
        &[
            Series {
                name: "synchronous (one stream, each step waited)",
                points: rows.iter().map(|c| (c.n as f64, c.sync_ms)).collect(),
            },
            Series {
                name: "pipelined (chunks over streams, .await)",
                points: rows.iter().map(|c| (c.n as f64, c.async_ms)).collect(),
            },
        ],
    )
}

#[derive(Serialize)]
pub struct TimelineRow {
    pub chunk: usize,
    pub stream: usize,
    /// ms from the first event: H2D start, H2D end = kernel start, kernel end, D2H end.
    pub t: [f64; 4],
}

/// One pipelined run with per-chunk events, drawn as lanes per stream and engine.
pub async fn timeline(
    device: &Device,
    pool: &PinnedPool,
    pipeline: &Pipeline,
    n: usize,
    plan: Plan,
    svg: &Path,
) -> host::Result<Vec<TimelineRow>> {
    let mut input = pool.alloc::<f32>(n)?;
    host::testing::random_floats(input.as_mut_slice(), 5);
    let output = pool.alloc::<f32>(n)?;
    let kernel = Kernel::Scale { s: 1.5 };
    // Warm-up, then the recorded run.
    let ((input, output), _) = pipeline.run(input, output, kernel, plan, false).await?;
    let ((input, output), info) = pipeline.run(input, output, kernel, plan, true).await?;
    let (checked, bad) = host::testing::verify(kernel, input.as_slice(), output.as_slice());
    if bad > 0 || checked == 0 {
        return Err(host::Error::InvalidArgument(
            "timeline run produced wrong results".into(),
        ));
    }
    let chunks = info.timeline.unwrap_or_default();
    let first = chunks
        .first()
        .ok_or_else(|| host::Error::InvalidArgument("no events".into()))?;
    let origin = &first.events[0];
    let mut rows = Vec::new();
    for c in &chunks {
        let mut t = [0.0; 4];
        for (k, e) in c.events.iter().enumerate() {
            t[k] = origin.elapsed_ms(e)? as f64;
        }
        rows.push(TimelineRow {
            chunk: c.chunk,
            stream: c.stream,
            t,
        });
    }
    let lanes: Vec<String> = if plan.engines {
        [
            "copy-in stream · H2D",
            "compute stream · kernel",
            "copy-out stream · D2H",
        ]
        .map(String::from)
        .to_vec()
    } else {
        (0..plan.streams)
            .flat_map(|s| ["H2D", "kernel", "D2H"].map(|e| format!("stream {s} · {e}")))
            .collect()
    };
    let bars: Vec<Bar> = rows
        .iter()
        .flat_map(|r| {
            (0..3).map(move |k| Bar {
                lane: r.stream * 3 + k,
                start: r.t[k],
                end: r.t[k + 1],
                kind: k,
            })
        })
        .collect();
    plots::timeline(
        svg,
        &format!(
            "one pipelined run: {n} floats, {plan} ({})",
            device.info().name
        ),
        &lanes,
        &bars,
    )?;
    Ok(rows)
}

/// Our results in the peers' JSON schema (bench/peers/README.md), so
/// bench/peers/compare.py can table them side by side.
pub fn peer_json(device: &Device, comps: &[Comparison]) -> serde_json::Value {
    let mut results = Vec::new();
    for c in comps {
        let (kernel, k) = match c.kernel {
            Kernel::Scale { .. } => ("scale", None),
            Kernel::Intensity { k } => ("intensity", Some(k)),
        };
        results.push(serde_json::json!({"n": c.n, "kernel": kernel, "k": k, "mode": "sync", "chunks": 1, "streams": 1,
            "median_ms": c.sync_ms, "min_ms": null, "reps": c.reps, "verified": c.verified, "best": true}));
        for (p, ms) in &c.plans {
            results.push(serde_json::json!({"n": c.n, "kernel": kernel, "k": k, "mode": "pipelined", "chunks": p.chunks, "streams": p.streams_used(), "buffers": p.streams, "ramp": p.ramp, "chain": p.chain,
                "layout": if p.engines { "engines" } else { "round-robin" },
                "median_ms": ms, "min_ms": null, "reps": c.reps, "verified": c.verified, "best": *p == c.plan}));
        }
    }
    serde_json::json!({"peer": "host-rust", "gpu": device.info().name, "driver": device.info().driver, "results": results})
}
