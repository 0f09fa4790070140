//! `host fewer-bytes`: fewer bytes over the link. The same scaling done
//! three ways — f32 both ways, bf16 in / f32 out, bf16 both ways — with the
//! example kernel crate `examples/bf16-kernels` launched as a user's kernels
//! (its PTX built by this package's build.rs with kernel-builder), plus SAXPY
//! (two f32 inputs, one output) through the same `Pipeline::run_stage`. Each
//! is timed against its own bidirectional copy bound (its bytes in on one
//! stream while its bytes out go out on another); the host-side f32 → bf16
//! conversion, for data that starts as f32, is timed on its own.

use super::compare::bidirectional_bytes_ms;
use super::fmt::{elems, ms as fmt_ms, Words};
use super::kernels::par_chunks;
use super::report::{median, random_floats, write_csv, write_json, Meta};
use bf16_kernels::convert;
use gpufeed::testing::poison;
use gpufeed::{
    Chunk, Commands, Device, Error, Function, Job, JobError, Kernel, LaunchConfig, Module,
    PinnedPool, Pipeline, Plan, PooledBuffer, Result, RunInfo, Timeline,
};
use half::bf16;
use indicatif::ProgressBar;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// The example kernel crate's PTX (see build.rs).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/bf16_kernels.ptx"));

/// The factor every scaling variant applies.
const S: f32 = 1.5;
/// SAXPY's `a`.
const A: f32 = 0.75;

/// One way of moving the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Variant {
    /// f32 in, f32 out: the in-tree `scale` through `Pipeline::run`.
    F32,
    /// bf16 in, f32 out: the example's `scale_bf16_f32`.
    Bf16InF32Out,
    /// bf16 in, bf16 out: the example's `scale_bf16`.
    Bf16BothWays,
    /// SAXPY, f32: two inputs, one output (`out = a x + y`).
    Saxpy,
}

impl Variant {
    pub const ALL: [Variant; 4] = [
        Variant::F32,
        Variant::Bf16InF32Out,
        Variant::Bf16BothWays,
        Variant::Saxpy,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Variant::F32 => "f32 scale",
            Variant::Bf16InF32Out => "bf16 in, f32 out",
            Variant::Bf16BothWays => "bf16 both ways",
            Variant::Saxpy => "saxpy f32 (2 in, 1 out)",
        }
    }

    /// Bytes per element copied host to device (all inputs).
    pub fn in_bytes(self) -> usize {
        match self {
            Variant::F32 => 4,
            Variant::Bf16InF32Out | Variant::Bf16BothWays => 2,
            Variant::Saxpy => 8,
        }
    }

    /// Bytes per element copied device to host.
    pub fn out_bytes(self) -> usize {
        match self {
            Variant::F32 | Variant::Bf16InF32Out | Variant::Saxpy => 4,
            Variant::Bf16BothWays => 2,
        }
    }
}

/// One variant at one size.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub variant: Variant,
    pub n: usize,
    pub in_bytes_per_elem: usize,
    pub out_bytes_per_elem: usize,
    /// Median wall time of the pipelined run, best plan.
    pub ms: f64,
    /// Interquartile range of that plan's runs.
    pub iqr_ms: [f64; 2],
    pub plan: Plan,
    /// Every plan tried: `(plan, median ms)`.
    pub plans: Vec<(Plan, f64)>,
    /// The variant's bytes in and out at once, no kernel: the best chunking.
    pub bound_ms: f64,
    pub bound_by_pieces: Vec<(usize, f64)>,
    /// ms / bound_ms.
    pub over_bound: f64,
    /// ms / the f32 variant's ms at the same size.
    pub vs_f32: f64,
    /// Mismatching elements, over every plan's checked run (its warm-up,
    /// into an output poisoned beforehand), against a CPU reference written
    /// as plain arithmetic, bit for bit.
    pub mismatches: usize,
    /// No mismatch in any plan's checked run.
    pub verified: bool,
    /// For each plan in `plans`, its checked run had no mismatch.
    pub plan_verified: Vec<bool>,
    pub reps: usize,
}

/// The host-side f32 → bf16 conversion of `n` elements into pinned memory.
#[derive(Clone, Debug, Serialize)]
pub struct Conversion {
    pub n: usize,
    pub threads: usize,
    pub ms: f64,
    /// Bytes read plus written (6 per element) per second.
    pub gbps: f64,
    /// The same bits as the kernels' narrowing (`convert::narrow`).
    pub verified: bool,
}

#[derive(Serialize)]
struct File<'a> {
    meta: Meta,
    rows: &'a [Row],
    conversions: &'a [Conversion],
}

/// The plans each variant tries (the best is kept): the engines layout over
/// a range of chunk counts, plain and ramped (small first chunks: a shorter
/// fill), with 4 and 8 chunk buffers; two round-robin plans; [`Plan::auto`].
fn plans(n: usize, small: bool) -> Vec<Plan> {
    let counts: &[usize] = if small {
        &[4, 16]
    } else {
        &[8, 12, 16, 24, 32, 48, 64, 96]
    };
    let ramped: &[usize] = if small { &[] } else { &[16, 24, 32, 48, 64] };
    let mut v: Vec<Plan> = counts
        .iter()
        .map(|&c| Plan::engines(c, 4))
        .chain(ramped.iter().map(|&c| Plan::engines(c, 4).ramped()))
        .chain(ramped.iter().map(|&c| Plan::engines(c, 8)))
        .chain([Plan::uniform(16, 4), Plan::uniform(32, 4)])
        .filter(|p| p.chunks <= n)
        .collect();
    if !v.contains(&Plan::auto(n)) {
        v.push(Plan::auto(n));
    }
    v
}

/// The example's two scaling kernels, loaded on the device.
struct Bf16Kernels {
    to_f32: Function<bf16_kernels::scale_bf16_f32>,
    both: Function<bf16_kernels::scale_bf16>,
}

/// What [`best_plan`] found: the bundle back, the best plan, its median
/// and IQR, every plan's median, and every plan's mismatches.
type Best<B> = (B, Plan, f64, [f64; 2], Vec<(Plan, f64)>, Vec<usize>);

/// Runs `run` once per plan per repetition (plans interleaved, one warm-up
/// round) and keeps the plan with the least median time. Each plan's
/// warm-up is its checked run: `poison` fills the outputs beforehand (so an
/// element the run did not write cannot hold an earlier run's answer) and
/// `check` counts the mismatches afterwards.
async fn best_plan<B: Send + 'static>(
    plans: &[Plan],
    reps: usize,
    mut bundle: B,
    run: impl Fn(B, Plan) -> Job<B, RunInfo>,
    poison: impl Fn(&mut B),
    check: impl Fn(&B) -> usize,
    pb: &ProgressBar,
) -> Result<Best<B>> {
    let mut times = vec![Vec::new(); plans.len()];
    let mut bad = vec![usize::MAX; plans.len()];
    for rep in 0..=reps {
        for (k, &plan) in plans.iter().enumerate() {
            if rep == 0 {
                poison(&mut bundle);
            }
            let t = Instant::now();
            let (b, _) = run(bundle, plan).await.map_err(|e: JobError<B>| e.error)?;
            if rep > 0 {
                times[k].push(t.elapsed().as_secs_f64() * 1e3);
            } else {
                bad[k] = check(&b);
            }
            bundle = b;
            pb.inc(1);
        }
    }
    let tried: Vec<(Plan, f64)> = plans
        .iter()
        .zip(&times)
        .map(|(&p, t)| (p, median(t)))
        .collect();
    let best = (0..tried.len())
        .min_by(|&a, &b| tried[a].1.total_cmp(&tried[b].1))
        .ok_or_else(|| Error::InvalidArgument("no plan to try".into()))?;
    let t = &times[best];
    let iqr = [
        super::report::percentile(t, 0.25),
        super::report::percentile(t, 0.75),
    ];
    Ok((bundle, tried[best].0, tried[best].1, iqr, tried, bad))
}

/// A pipeline stage, its closure given the one signature `run_stage` needs
/// (the chunk's views and the batch share one lifetime).
fn stage<F>(f: F) -> F
where
    F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>,
{
    f
}

fn mismatches<T: bytemuck::Pod + Sync>(got: &[T], want: &[T]) -> usize {
    if got.len() != want.len() {
        return got.len().max(want.len());
    }
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let chunk = got.len().div_ceil(threads).max(1 << 16);
    std::thread::scope(|s| {
        got.chunks(chunk)
            .zip(want.chunks(chunk))
            .map(|(g, w)| {
                s.spawn(move || {
                    g.iter()
                        .zip(w)
                        .filter(|(a, b)| bytemuck::bytes_of(*a) != bytemuck::bytes_of(*b))
                        .count()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap_or(usize::MAX / threads))
            .sum()
    })
}

/// `f(i)` for every index below `n`, on all CPU threads (a CPU reference).
fn reference<U: bytemuck::Pod + Send>(n: usize, f: impl Fn(usize) -> U + Sync) -> Vec<U> {
    let mut want = vec![U::zeroed(); n];
    par_chunks(&mut want, |off, c| {
        for (i, w) in c.iter_mut().enumerate() {
            *w = f(off + i);
        }
    });
    want
}

/// f32 → bf16 on all CPU threads, with the kernels' rounding.
fn narrow_par(src: &[f32], dst: &mut [bf16]) {
    par_chunks(dst, |off, c| {
        for (d, s) in c.iter_mut().zip(&src[off..]) {
            *d = convert::narrow(*s);
        }
    });
}

fn pinned<T: bytemuck::Pod>(pool: &PinnedPool, data: &[T]) -> Result<PooledBuffer<T>> {
    let mut b = pool.alloc::<T>(data.len())?;
    b.as_mut_slice().copy_from_slice(data);
    Ok(b)
}

/// One variant at size `n`: pipelined runs over `plans`, the output
/// verified, the copy bound of its bytes.
#[allow(clippy::too_many_arguments)]
async fn measure(
    device: &Device,
    pool: &PinnedPool,
    pipe: &Pipeline,
    k: &Bf16Kernels,
    variant: Variant,
    n: usize,
    plans: &[Plan],
    reps: usize,
    pb: &ProgressBar,
) -> Result<Row> {
    let x = random_floats(n, 0x5EED ^ n as u64);
    // The references are plain arithmetic, not the kernel crates' code (which
    // the CPU emulation runs): scale `x * s`; the bf16 variants widen exactly
    // (`half`), multiply in f32 and narrow to nearest, ties to even (`half`);
    // SAXPY is one fused multiply-add, `a.mul_add(x, y)`.
    let (plan, ms, iqr_ms, tried, bad) = match variant {
        Variant::F32 => {
            let bundle = (pinned(pool, &x)?, pool.alloc::<f32>(n)?);
            let kernel = Kernel::Scale { s: S };
            let want = reference(n, |i| x[i] * S);
            let (_, plan, ms, iqr, tried, bad) = best_plan(
                plans,
                reps,
                bundle,
                |(i, o), plan| pipe.run(i, o, kernel, plan, Timeline::Off),
                |(_, o)| poison(o.as_mut_slice()),
                |(_, o)| mismatches(o.as_slice(), &want),
                pb,
            )
            .await?;
            (plan, ms, iqr, tried, bad)
        }
        Variant::Bf16InF32Out | Variant::Bf16BothWays => {
            let mut xb = vec![bf16::ZERO; n];
            narrow_par(&x, &mut xb);
            let input = pinned(pool, &xb)?;
            if variant == Variant::Bf16InF32Out {
                let stage = stage(|c, chunk| {
                    let (x, y) = (chunk.input::<bf16>(0)?, chunk.output::<f32>(0)?);
                    let config = LaunchConfig::grid_stride(c.device(), x.len());
                    c.launch(&k.to_f32, config, (S, x, y))
                });
                let bundle = ((input,), (pool.alloc::<f32>(n)?,));
                let want = reference(n, |i| xb[i].to_f32() * S);
                let (_, plan, ms, iqr, tried, bad) = best_plan(
                    plans,
                    reps,
                    bundle,
                    |(i, o), plan| pipe.run_stage(i, o, plan, Timeline::Off, stage),
                    |(_, (o,))| poison(o.as_mut_slice()),
                    |(_, (o,))| mismatches(o.as_slice(), &want),
                    pb,
                )
                .await?;
                (plan, ms, iqr, tried, bad)
            } else {
                let stage = stage(|c, chunk| {
                    let (x, y) = (chunk.input::<bf16>(0)?, chunk.output::<bf16>(0)?);
                    let config = LaunchConfig::grid_stride(c.device(), x.len());
                    c.launch(&k.both, config, (S, x, y))
                });
                let bundle = ((input,), (pool.alloc::<bf16>(n)?,));
                let want = reference(n, |i| bf16::from_f32(xb[i].to_f32() * S));
                let (_, plan, ms, iqr, tried, bad) = best_plan(
                    plans,
                    reps,
                    bundle,
                    |(i, o), plan| pipe.run_stage(i, o, plan, Timeline::Off, stage),
                    |(_, (o,))| poison(o.as_mut_slice()),
                    |(_, (o,))| mismatches(o.as_slice(), &want),
                    pb,
                )
                .await?;
                (plan, ms, iqr, tried, bad)
            }
        }
        Variant::Saxpy => {
            let y = random_floats(n, 0xBEEF ^ n as u64);
            // out = a x + y: y's chunk copied into the output's on the
            // device (device bandwidth, far above the link's), then SAXPY
            // in place there.
            let stage = stage(|c, chunk| {
                let out = chunk.output::<f32>(0)?;
                c.copy_d2d(chunk.input::<f32>(1)?, out)?;
                c.saxpy(A, chunk.input::<f32>(0)?, out)
            });
            let bundle = (
                (pinned(pool, &x)?, pinned(pool, &y)?),
                (pool.alloc::<f32>(n)?,),
            );
            let want = reference(n, |i| A.mul_add(x[i], y[i]));
            let (_, plan, ms, iqr, tried, bad) = best_plan(
                plans,
                reps,
                bundle,
                |(i, o), plan| pipe.run_stage(i, o, plan, Timeline::Off, stage),
                |(_, (o,))| poison(o.as_mut_slice()),
                |(_, (o,))| mismatches(o.as_slice(), &want),
                pb,
            )
            .await?;
            (plan, ms, iqr, tried, bad)
        }
    };
    let bound_by_pieces = bidirectional_bytes_ms(
        device,
        pool,
        n * variant.in_bytes(),
        n * variant.out_bytes(),
        reps,
        pb,
    )
    .await?;
    let bound_ms = bound_by_pieces
        .iter()
        .map(|b| b.1)
        .fold(f64::INFINITY, f64::min);
    Ok(Row {
        variant,
        n,
        in_bytes_per_elem: variant.in_bytes(),
        out_bytes_per_elem: variant.out_bytes(),
        ms,
        iqr_ms,
        plan,
        plans: tried,
        bound_ms,
        bound_by_pieces,
        over_bound: ms / bound_ms,
        vs_f32: f64::NAN,
        mismatches: bad.iter().fold(0usize, |a, &b| a.saturating_add(b)),
        verified: bad.iter().all(|&b| b == 0),
        plan_verified: bad.iter().map(|&b| b == 0).collect(),
        reps,
    })
}

/// The host conversion of `n` random floats into a pinned bf16 buffer,
/// median of `reps` (one warm-up), checked against the serial conversion.
fn conversion(pool: &PinnedPool, n: usize, reps: usize) -> Result<Conversion> {
    let x = random_floats(n, 0xF00D);
    let mut dst = pool.alloc::<bf16>(n)?;
    let mut times = Vec::new();
    for rep in 0..=reps {
        let t = Instant::now();
        narrow_par(&x, dst.as_mut_slice());
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let verified = dst
        .as_slice()
        .iter()
        .zip(&x)
        .all(|(d, s)| d.to_bits() == bf16::from_f32(*s).to_bits());
    let ms = median(&times);
    Ok(Conversion {
        n,
        threads: std::thread::available_parallelism().map_or(1, |t| t.get()),
        ms,
        gbps: 6.0 * n as f64 / ms / 1e6,
        verified,
    })
}

/// Steps of the progress bar for `sizes`.
fn steps(sizes: &[usize], reps: usize, small: bool) -> u64 {
    let per_size: usize = sizes
        .iter()
        .map(|&n| Variant::ALL.len() * (plans(n, small).len() + 5) * (reps + 1))
        .sum();
    per_size as u64
}

/// `host fewer-bytes`: every variant at every size, printed, written to
/// fewer_bytes.json and fewer_bytes.csv.
pub async fn run(
    device: &Device,
    pool: &PinnedPool,
    pipe: &Pipeline,
    sizes: &[usize],
    reps: usize,
    small: bool,
    out: &Path,
) -> Result<Vec<Row>> {
    // SAFETY: PTX is examples/bf16-kernels' PTX, built by this package's
    // build.rs from the crate whose declarations are taken below.
    let module = unsafe { Module::from_ptx(device, PTX)? };
    let k = Bf16Kernels {
        to_f32: module.function()?,
        both: module.function()?,
    };
    let pb = super::progress::bar(steps(sizes, reps, small));
    let mut rows = Vec::new();
    let mut conversions = Vec::new();
    for &n in sizes {
        let plans = plans(n, small);
        let first = rows.len();
        for variant in Variant::ALL {
            pb.set_message(format!("{} at {}", variant.label(), elems(n)));
            rows.push(measure(device, pool, pipe, &k, variant, n, &plans, reps, &pb).await?);
        }
        let f32_ms = rows[first].ms;
        for r in &mut rows[first..] {
            r.vs_f32 = r.ms / f32_ms;
        }
        pb.set_message(format!("f32 → bf16 on the host, {}", elems(n)));
        conversions.push(conversion(pool, n, reps)?);
    }
    pb.finish_and_clear();
    print(&rows, &conversions, Words::of(device));
    write_json(
        &out.join("fewer_bytes.json"),
        &File {
            meta: Meta::new(device),
            rows: &rows,
            conversions: &conversions,
        },
    )?;
    write_csv(&out.join("fewer_bytes.csv"), rows.iter().map(CsvRow::from))?;
    if rows.iter().any(|r| !r.verified) || conversions.iter().any(|c| !c.verified) {
        return Err(Error::InvalidArgument(
            "a fewer-bytes result differs from the CPU reference".into(),
        ));
    }
    Ok(rows)
}

#[derive(Serialize)]
struct CsvRow {
    variant: &'static str,
    n: usize,
    in_bytes_per_elem: usize,
    out_bytes_per_elem: usize,
    ms: f64,
    bound_ms: f64,
    over_bound: f64,
    vs_f32: f64,
    chunks: usize,
    layout: &'static str,
    verified: bool,
}

impl From<&Row> for CsvRow {
    fn from(r: &Row) -> CsvRow {
        CsvRow {
            variant: r.variant.label(),
            n: r.n,
            in_bytes_per_elem: r.in_bytes_per_elem,
            out_bytes_per_elem: r.out_bytes_per_elem,
            ms: r.ms,
            bound_ms: r.bound_ms,
            over_bound: r.over_bound,
            vs_f32: r.vs_f32,
            chunks: r.plan.chunks,
            layout: r.plan.layout.name(),
            verified: r.verified,
        }
    }
}

fn print(rows: &[Row], conversions: &[Conversion], w: Words) {
    println!(
        "{:<24} {:>6} {:>9} {:>10} {:>10} {:>8} {:>7}  {:<34} check",
        "variant", "n", "bytes/el", "time", "bound", "÷bound", "÷f32", "best plan"
    );
    for r in rows {
        println!(
            "{:<24} {:>6} {:>4}+{:<4} {:>10} {:>10} {:>7.3}x {:>6.2}x  {:<34} {}",
            r.variant.label(),
            elems(r.n),
            r.in_bytes_per_elem,
            r.out_bytes_per_elem,
            fmt_ms(r.ms),
            fmt_ms(r.bound_ms),
            r.over_bound,
            r.vs_f32,
            r.plan.to_string(),
            if r.verified {
                "bit-identical".to_string()
            } else {
                format!("{} MISMATCHES", r.mismatches)
            }
        );
    }
    for c in conversions {
        println!(
            "host f32 → bf16 of {} floats into pinned memory: {} on {} threads ({:.1} GB/s read+written){}",
            elems(c.n),
            fmt_ms(c.ms),
            c.threads,
            c.gbps,
            if c.verified { "" } else { " — WRONG BITS" }
        );
    }
    println!(
        "bytes/el = bytes per element in + out; bound = those bytes in and out at once with no kernel\n\
         (the best of whole arrays and 4-32 pieces). On a full-duplex link the slower direction decides:\n\
         bf16 in / f32 out halves only the way in, so it gains little over f32; bf16 both ways halves both."
    );
    if w.cpu {
        println!(
            "(CPU emulation: copies are memcpy on threads, so the times say nothing about a link.)"
        );
    }
}
