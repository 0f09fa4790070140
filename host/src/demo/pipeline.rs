//! `host compare`, `host sweep`, `host timeline`: the overlap pipeline measured.

use super::compare::{compare, Comparison, Spec, Verdict};
use super::fmt::{elems, faster_or_slower, Words};
use super::plots::{self, Axis, Bar, Label, Series};
use super::report::{cell, write_csv};
use gpufeed::{Device, Kernel, PinnedPool, Pipeline, Plan, Timeline};
use indicatif::ProgressBar;
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
        .chain([8, 16, 32].map(|chunks| Plan::uniform(chunks, 4).chained()))
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
) -> gpufeed::Result<Vec<Comparison>> {
    let w = Words::of(device);
    let specs: Vec<Spec> = cases
        .iter()
        .map(|&(n, kernel)| Spec {
            n,
            kernel,
            plans: plan_grid(n, kernel),
            reps,
            with_bound: true,
        })
        .collect();
    let pb = super::progress::bar(specs.iter().map(Spec::steps).sum());
    let mut out = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        pb.set_message(format!(
            "{} floats, {} ({} of {})",
            elems(spec.n),
            spec.kernel.label(),
            i + 1,
            specs.len()
        ));
        let c = compare(device, pool, pipeline, spec, &pb).await?;
        pb.suspend(|| {
            c.print(w);
            println!();
        });
        pool.empty_cache();
        out.push(c);
    }
    pb.finish_and_clear();
    Ok(out)
}

pub async fn sweep(
    device: &Device,
    pool: &PinnedPool,
    pipeline: &Pipeline,
    sizes: &[usize],
    progress: &ProgressBar,
) -> gpufeed::Result<Vec<Comparison>> {
    let mut out = Vec::new();
    for &n in sizes {
        progress.set_message(format!("{} floats", elems(n)));
        // Small sizes take little time each: more repetitions steady their medians.
        let reps = if n >= 300_000_000 {
            2
        } else if n >= 30_000_000 {
            4
        } else if n > 1_000_000 {
            10
        } else {
            30
        };
        let spec = Spec {
            n,
            kernel: Kernel::Scale { s: 1.5 },
            plans: vec![Plan::auto(n)],
            reps,
            with_bound: false,
        };
        let c = compare(device, pool, pipeline, &spec, &ProgressBar::hidden()).await?;
        pool.empty_cache();
        out.push(c);
        progress.inc(1);
    }
    Ok(out)
}

pub fn print_sweep(rows: &[Comparison], w: Words) {
    println!("\nsize sweep (scale; sync vs pipelined with the automatic plan; medians):");
    println!(
        "{:>12} {:>11} {:>11} {:>16} {:>10} {:>9}  note",
        "floats", "sync ms", "async ms", "async is", "overlap", "verified"
    );
    let mut notes = Vec::new();
    for c in rows {
        let sum: f64 = c.stage_ms.iter().sum();
        let overlap = if c.async_ms >= sum {
            "none".to_string()
        } else {
            format!("{:.0}%", c.overlap * 100.0)
        };
        let v = c.verdict(w);
        let note = match v {
            Verdict::Clear => "",
            Verdict::TooSmall => "too small to measure",
            Verdict::WithinNoise => "within noise",
        };
        if v != Verdict::Clear && !notes.contains(&v) {
            notes.push(v);
        }
        let result = faster_or_slower(c.async_ms, c.sync_ms);
        println!(
            "{:>12} {:>11.3} {:>11.3} {:>16} {:>10} {:>9}  {}",
            elems(c.n),
            c.sync_ms,
            c.async_ms,
            if v == Verdict::Clear {
                result
            } else {
                format!("({result})")
            },
            overlap,
            c.verified,
            note
        );
    }
    if !notes.is_empty() {
        println!("a result in parentheses is not a measurement to rely on:");
    }
    for v in notes {
        match v {
            Verdict::TooSmall => println!(
                "  too small to measure: a run takes under {} ms, where fixed {} outweigh\n  \
                 the copies and the kernel",
                w.too_small_ms(),
                w.fixed_costs()
            ),
            Verdict::WithinNoise => println!(
                "  within noise: the middle halves (p25..p75) of the sync and the async runs overlap"
            ),
            Verdict::Clear => {}
        }
    }
    println!(
        "overlap: how much of the shorter steps' time the pipeline hid behind the longest one"
    );
    println!("(none: async took longer than the three steps one after another)");
}

/// A line of sweep.csv: milliseconds to four decimals, an empty cell where
/// nothing was measured (the copy bound is not measured in the sweep).
#[derive(Serialize)]
struct SweepCsv {
    n: usize,
    kernel: String,
    sync_ms: Option<f64>,
    h2d_ms: Option<f64>,
    kernel_ms: Option<f64>,
    d2h_ms: Option<f64>,
    async_ms: Option<f64>,
    chunks: usize,
    streams: usize,
    speedup: Option<f64>,
    overlap: Option<f64>,
    bidir_bound_ms: Option<f64>,
    verified: bool,
}

pub fn write_sweep_csv(path: &Path, rows: &[Comparison]) -> gpufeed::Result<()> {
    let c4 = |v: f64| cell(v, 4);
    write_csv(
        path,
        rows.iter().map(|c| SweepCsv {
            n: c.n,
            kernel: c.kernel.label(),
            sync_ms: c4(c.sync_ms),
            h2d_ms: c4(c.stage_ms[0]),
            kernel_ms: c4(c.stage_ms[1]),
            d2h_ms: c4(c.stage_ms[2]),
            async_ms: c4(c.async_ms),
            chunks: c.plan.chunks,
            streams: c.plan.slots(),
            speedup: c4(c.speedup),
            overlap: c4(c.overlap),
            bidir_bound_ms: c4(c.bidir_bound_ms),
            verified: c.verified,
        }),
    )
}

pub fn plot_sweep(path: &Path, rows: &[Comparison], backend: &str) -> gpufeed::Result<()> {
    plots::lines(
        path,
        &format!("H2D + scale + D2H: time against size — {backend}"),
        Axis {
            desc: "floats per array",
            label: Label::Count,
        },
        Axis {
            desc: "milliseconds (median)",
            label: Label::Number,
        },
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
) -> gpufeed::Result<Vec<TimelineRow>> {
    let mut input = pool.alloc::<f32>(n)?;
    gpufeed::testing::random_floats(input.as_mut_slice(), 5);
    let output = pool.alloc::<f32>(n)?;
    let kernel = Kernel::Scale { s: 1.5 };
    // Warm-up, then the recorded run.
    let ((input, mut output), _) = pipeline
        .run(input, output, kernel, plan, Timeline::Off)
        .await?;
    gpufeed::testing::poison(output.as_mut_slice());
    let ((input, output), info) = pipeline
        .run(input, output, kernel, plan, Timeline::Record)
        .await?;
    let (checked, bad) = gpufeed::testing::verify(kernel, input.as_slice(), output.as_slice());
    if bad > 0 || checked == 0 {
        return Err(gpufeed::Error::InvalidArgument(
            "timeline run produced wrong results".into(),
        ));
    }
    let chunks = info.timeline.unwrap_or_default();
    let first = chunks
        .first()
        .ok_or_else(|| gpufeed::Error::InvalidArgument("no events".into()))?;
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
    let lanes: Vec<String> = if matches!(plan.layout, gpufeed::Layout::Engines { .. }) {
        [
            "copy-in stream · H2D",
            "compute stream · kernel",
            "copy-out stream · D2H",
        ]
        .map(String::from)
        .to_vec()
    } else {
        (0..plan.slots())
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
            "one pipelined run: {} floats, {plan} — {}",
            elems(n),
            device.info().name
        ),
        &format!(
            "ms since the first copy was issued ({})",
            Words::of(device).event_clock()
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
            "median_ms": c.sync_ms, "min_ms": null, "reps": c.reps, "verified": c.sync_verified, "best": true}));
        for ((p, ms), verified) in c.plans.iter().zip(&c.plan_verified) {
            results.push(serde_json::json!({"n": c.n, "kernel": kernel, "k": k, "mode": "pipelined", "chunks": p.chunks, "streams": p.streams_used(), "buffers": p.slots(), "ramp": p.ramp,
                "chain": matches!(p.layout, gpufeed::Layout::RoundRobin { chain: true, .. }),
                "layout": p.layout.name(),
                "median_ms": ms, "min_ms": null, "reps": c.reps, "verified": verified, "best": *p == c.plan}));
        }
    }
    serde_json::json!({"peer": "host-rust", "gpu": device.info().name, "driver": device.info().driver, "results": results})
}
