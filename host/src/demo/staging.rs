//! `host staging`: ordinary (pageable) memory to the device and back, by
//! four routes, against size: the driver's own pageable copy, pinning in
//! place then copying (register, copy, unregister), the staging engine
//! (forced through its ring, and its automatic choice), and the pinned copy
//! the link allows. Then the engine's shape swept at one size (threads,
//! block size, blocks), which is where its defaults come from.
//!
//! Every run is checked, every element: runs alternate between two random
//! sources that differ in every word, so a destination still holding the
//! run before's data (an element skipped) is caught, and host destinations
//! are poisoned before each run.
//!
//! The routes of one size and direction take turns run by run, each run's
//! order shuffled (seeded), so a change in the machine's speed during the
//! measurement (this VM's staged figures swing by up to half between runs)
//! falls on every route alike rather than on whichever ran then, and no
//! route always follows the same other one (whose after-effects, a
//! staged copy's workers and caches say, it would then always inherit).

use super::fmt::size;
use super::plots;
use super::report::{cell, median, write_json, Meta};
use gpufeed::{
    Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Pipeline, Plan, Registered, Route,
    Staging, StagingConfig, Stream, Timeline,
};
use rayon::prelude::*;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

const POISON: u32 = 0xDEAD_BEEF;

/// Sizes below this many bytes get [`Config::small_reps`] runs.
pub const SMALL_BELOW: usize = 16 << 20;

/// The sizes and repetitions of one run.
pub struct Config {
    pub sizes: Vec<usize>,
    /// Timed runs per route, size and direction (medians are quoted).
    pub reps: usize,
    /// Timed runs of the two slow routes (the driver's pageable copy, pin
    /// in place + copy) from 256 MiB up, where each run takes seconds.
    pub slow_reps: usize,
    /// Timed runs per route below [`SMALL_BELOW`] bytes (at least `reps`):
    /// a run there takes well under a millisecond, so more of them settle
    /// the median.
    pub small_reps: usize,
    /// Size at which the engine's shape is swept (0: no sweep).
    pub sweep_bytes: usize,
    pub sweep_reps: usize,
    /// Milliseconds of idle before each timed run (10: the workers parked).
    pub settle_ms: u64,
    /// The routes measured (all five by default).
    pub routes: Vec<Path4>,
    /// Workers of the engines of the routes' table (`None`: the default,
    /// [`StagingConfig::for_device`]); the sweep sets its own.
    pub workers: Option<usize>,
}

impl Config {
    pub fn for_device(device: &Device, small: bool) -> Config {
        if small || device.kind() == gpufeed::BackendKind::Cpu {
            Config {
                sizes: vec![64 << 10, 1 << 20, 16 << 20, 64 << 20],
                reps: 3,
                slow_reps: 3,
                small_reps: 3,
                sweep_bytes: 16 << 20,
                sweep_reps: 2,
                settle_ms: 10,
                routes: PATHS.to_vec(),
                workers: None,
            }
        } else {
            Config {
                sizes: [16, 18, 20, 22, 24, 26, 28, 30, 32]
                    .iter()
                    .map(|s| 1usize << s)
                    .collect(),
                reps: 11,
                slow_reps: 3,
                small_reps: 51,
                sweep_bytes: 1 << 30,
                sweep_reps: 7,
                settle_ms: 10,
                routes: PATHS.to_vec(),
                workers: None,
            }
        }
    }

    /// Timed runs below [`SMALL_BELOW`] bytes: `small_reps`, never fewer
    /// than `reps`.
    fn small_runs(&self) -> usize {
        self.small_reps.max(self.reps)
    }

    /// Timed runs of `path` at `bytes`.
    fn runs(&self, path: Path4, bytes: usize) -> usize {
        match path {
            Path4::Pageable | Path4::RegisterCopy if bytes >= 256 << 20 => self.slow_reps,
            _ if bytes < SMALL_BELOW => self.small_runs(),
            _ => self.reps,
        }
    }
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Path4 {
    /// The driver's synchronous copy of pageable memory.
    Pageable,
    /// `Registered::new` (pin in place), the copy, `into_inner` (unpin).
    RegisterCopy,
    /// The staging engine, forced through its ring.
    Staged,
    /// The staging engine's automatic choice (`Route::Auto`).
    Auto,
    /// From (into) memory already pinned: the link's own speed.
    Pinned,
}

#[derive(Serialize, Clone)]
pub struct Row {
    pub bytes: usize,
    pub path: Path4,
    /// "h2d" or "d2h".
    pub dir: &'static str,
    /// GB/s (1e9 bytes per second): median, lowest and highest run.
    pub gbps: f64,
    pub gbps_min: f64,
    pub gbps_max: f64,
    pub reps: usize,
    /// Every element of every run matched its source.
    pub verified: bool,
    /// CPU seconds (user + system, whole process) per GB moved.
    pub cpu_s_per_gb: f64,
}

#[derive(Serialize, Clone)]
pub struct SweepRow {
    pub threads: usize,
    pub block_bytes: usize,
    pub blocks: usize,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
    /// The medians above ÷ the pinned copy's, measured in turn with them.
    pub h2d_of_pinned: f64,
    pub d2h_of_pinned: f64,
    pub verified: bool,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    /// The default configuration on this machine.
    pub default_config: ConfigJson,
    /// Threads the engine uses (workers plus the polling thread).
    pub threads_used: usize,
    pub rows: Vec<Row>,
    /// Milliseconds of idle before each timed run.
    pub settle_ms: u64,
    pub sweep_bytes: usize,
    pub sweep: Vec<SweepRow>,
    /// CPU milliseconds the whole process used over 500 ms with no copy in
    /// flight, right after the staged runs (the workers sleep).
    pub idle_cpu_ms: f64,
    /// Peak pinned bytes the default engine held, and its bound.
    pub staging_peak_bytes: u64,
    pub staging_bound_bytes: usize,
    /// `y = 3 x` through a pipeline, from and into ordinary memory
    /// (`run_slices`) and from and into pinned memory (`run`).
    pub pipeline: Option<PipelineRow>,
}

#[derive(Serialize, Clone)]
pub struct PipelineRow {
    pub bytes: usize,
    pub reps: usize,
    /// Medians, milliseconds.
    pub slices_ms: f64,
    pub pinned_ms: f64,
    /// `pinned_ms / slices_ms`: the ordinary-memory run's speed as a
    /// fraction of the pinned run's.
    pub ratio: f64,
    /// Every element of every run equal to a plain loop's `3 x`.
    pub verified: bool,
}

#[derive(Serialize, Clone, Copy)]
pub struct ConfigJson {
    pub block_bytes: usize,
    pub blocks: usize,
    pub threads: usize,
    pub direct_h2d_below: usize,
    pub direct_d2h_below: usize,
}

impl From<StagingConfig> for ConfigJson {
    fn from(c: StagingConfig) -> Self {
        ConfigJson {
            block_bytes: c.block_bytes,
            blocks: c.blocks,
            threads: c.threads,
            direct_h2d_below: c.direct_h2d_below,
            direct_d2h_below: c.direct_d2h_below,
        }
    }
}

/// Lets the checker's own threads (rayon's, which spin a while after their
/// work) go idle before a timed run, so the run measures the engine, not a
/// fight for cores with the bench: `ms` milliseconds (10 by default). The
/// engine's workers park then too (they spin 2 ms after a copy): each run
/// starts as a copy after idle does.
fn settle(ms: u64) {
    if ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// CPU seconds (user + system) this process has used.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Random words (never the poison), in parallel.
fn random_words(n: usize, seed: u64) -> Vec<u32> {
    let mut v = vec![0u32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut s = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for x in c {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = (s >> 16) as u32;
            if *x == POISON {
                *x = 1;
            }
        }
    });
    v
}

/// Whether every element of `got` equals `want`: a plain comparison.
fn same(got: &[u32], want: &[u32]) -> bool {
    got.len() == want.len()
        && got
            .par_chunks(1 << 16)
            .zip(want.par_chunks(1 << 16))
            .all(|(a, b)| a == b)
}

/// The two sources runs alternate between: `b` differs from `a` in every word.
struct Sources {
    a: Vec<u32>,
    b: Vec<u32>,
}

impl Sources {
    fn new(n: usize) -> Sources {
        let a = random_words(n, 0x5eed);
        let b = a.par_iter().map(|x| x ^ 0x5A5A_5A5A).collect();
        Sources { a, b }
    }
    fn get(&self, rep: usize, n: usize) -> &[u32] {
        if rep.is_multiple_of(2) {
            &self.a[..n]
        } else {
            &self.b[..n]
        }
    }
}

/// Pinned memory and device memory of one size, moved through jobs.
struct Bufs {
    pinned: gpufeed::PooledBuffer<u32>,
    dev: DeviceBuffer<u32>,
}

impl Bufs {
    /// The pinned copy, one way or the other, of the whole buffers.
    fn pinned_copy(self, stream: &Stream, h2d: bool) -> gpufeed::Result<Bufs> {
        let ((pinned, dev), ()) = stream
            .run_sync((self.pinned, self.dev), |c, (p, d)| {
                if h2d {
                    c.copy_h2d(p.host(), d.view_mut())
                } else {
                    c.copy_d2h(d.view(), p.host_mut())
                }
            })
            .map_err(gpufeed::Error::from)?;
        Ok(Bufs { pinned, dev })
    }

    /// Puts `src` on the device through pinned memory (untimed set-up).
    fn upload(mut self, stream: &Stream, src: &[u32]) -> gpufeed::Result<Bufs> {
        self.pinned.as_mut_slice().copy_from_slice(src);
        self.pinned_copy(stream, true)
    }

    /// Whether the device holds exactly `want`, read back through pinned
    /// memory poisoned first.
    fn check(mut self, stream: &Stream, want: &[u32]) -> gpufeed::Result<(Bufs, bool)> {
        self.pinned.as_mut_slice().fill(POISON);
        let b = self.pinned_copy(stream, false)?;
        let ok = same(b.pinned.as_slice(), want);
        Ok((b, ok))
    }
}

/// The timings of one route, size and direction, and whether every run was right.
struct Timed {
    secs: Vec<f64>,
    cpu: f64,
    verified: bool,
}

impl Timed {
    fn new() -> Timed {
        Timed {
            secs: vec![],
            cpu: 0.0,
            verified: true,
        }
    }

    /// Notes run `rep` (the warm-up, run 0, only for its check).
    fn note(&mut self, rep: usize, secs: f64, cpu: f64, ok: bool) {
        self.verified &= ok;
        if rep > 0 {
            self.secs.push(secs);
            self.cpu += cpu;
        }
    }

    fn row(&self, bytes: usize, path: Path4, dir: &'static str) -> Row {
        let gbps: Vec<f64> = self.secs.iter().map(|s| bytes as f64 / s / 1e9).collect();
        let (lo, hi) = gbps
            .iter()
            .fold((f64::MAX, 0f64), |(a, b), &g| (a.min(g), b.max(g)));
        Row {
            bytes,
            path,
            dir,
            gbps: median(&gbps),
            gbps_min: lo,
            gbps_max: hi,
            reps: self.secs.len(),
            verified: self.verified,
            cpu_s_per_gb: self.cpu / (bytes as f64 * self.secs.len() as f64 / 1e9),
        }
    }
}

/// Where a device-to-host run's result lands, for the check.
#[derive(Clone, Copy, PartialEq)]
enum Lands {
    /// In the user's pageable array.
    Out,
    /// In the pinned buffer (the pinned route's own destination).
    Pinned,
}

/// Where a host-to-device run's source must be before the timer starts.
#[derive(Clone, Copy, PartialEq)]
enum Prep {
    /// In the sources (a borrowed slice).
    Nothing,
    /// Also in a `Vec` of its own (the route that pins it in place).
    OwnVec,
    /// In the pinned buffer (the pinned route).
    Pinned,
}

/// One route of one size and direction, `reps` timed runs after one
/// untimed warm-up (first touch, pool, JIT), every run checked.
struct Case<'a> {
    stream: &'a Stream,
    src: &'a Sources,
    n: usize,
    reps: usize,
    settle_ms: u64,
}

impl Case<'_> {
    /// Run `rep` host to device (run 0 the untimed warm-up; runs alternate
    /// between the sources): `copy(src, bufs)` is timed; the device is
    /// checked after the run (the sources differ everywhere). `prep` says
    /// where the source must be before the timer starts.
    fn h2d_run(
        &self,
        rep: usize,
        mut bufs: Bufs,
        prep: Prep,
        t: &mut Timed,
        copy: impl FnOnce(&[u32], &mut Vec<u32>, Bufs) -> gpufeed::Result<Bufs>,
    ) -> gpufeed::Result<Bufs> {
        let src = self.src.get(rep, self.n);
        let mut own = Vec::new();
        settle(self.settle_ms);
        match prep {
            Prep::Nothing => {}
            Prep::OwnVec => own = src.to_vec(),
            Prep::Pinned => bufs.pinned.as_mut_slice().copy_from_slice(src),
        }
        let (c0, t0) = (cpu_seconds(), Instant::now());
        bufs = copy(src, &mut own, bufs)?;
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let (bufs, ok) = bufs.check(self.stream, src)?;
        t.note(rep, secs, cpu, ok);
        Ok(bufs)
    }

    /// Run `rep` device to host into `out` (the user's array, poisoned
    /// before the run, as is the pinned buffer).
    fn d2h_run(
        &self,
        rep: usize,
        mut bufs: Bufs,
        out: &mut Vec<u32>,
        lands: Lands,
        t: &mut Timed,
        copy: impl FnOnce(&mut Vec<u32>, Bufs) -> gpufeed::Result<Bufs>,
    ) -> gpufeed::Result<Bufs> {
        let src = self.src.get(rep, self.n);
        bufs = bufs.upload(self.stream, src)?;
        out.par_chunks_mut(1 << 16).for_each(|c| c.fill(POISON));
        bufs.pinned.as_mut_slice().fill(POISON);
        settle(self.settle_ms);
        let (c0, t0) = (cpu_seconds(), Instant::now());
        bufs = copy(out, bufs)?;
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let ok = match lands {
            Lands::Out => same(out, src),
            Lands::Pinned => same(bufs.pinned.as_slice(), src),
        };
        t.note(rep, secs, cpu, ok);
        Ok(bufs)
    }
}

/// An engine of the default shape (or `shape`: threads, block bytes,
/// blocks) taking `route`.
fn engine(
    device: &Device,
    route: Route,
    shape: Option<(usize, usize, usize)>,
) -> gpufeed::Result<Staging> {
    let mut c = StagingConfig::for_device(device);
    c.route = route;
    if let Some((threads, block_bytes, blocks)) = shape {
        c.threads = threads;
        c.block_bytes = block_bytes;
        c.blocks = blocks;
    }
    Staging::with_config(device, c)
}

const PATHS: [Path4; 5] = [
    Path4::Pageable,
    Path4::RegisterCopy,
    Path4::Staged,
    Path4::Auto,
    Path4::Pinned,
];

/// Host to device by `path`.
fn h2d_by(
    path: Path4,
    device: &Device,
    stream: &Stream,
    engines: &[Staging; 2],
    s: &[u32],
    own: &mut Vec<u32>,
    mut b: Bufs,
) -> gpufeed::Result<Bufs> {
    match path {
        Path4::Pageable => b.dev.copy_from_host_sync(s)?,
        Path4::RegisterCopy => {
            // The user's array (made before the timer), pinned in place,
            // copied, unpinned.
            let reg = Registered::new(device, std::mem::take(own))?;
            let ((reg, dev), ()) = stream
                .run_sync((reg, b.dev), |c, (r, d)| c.copy_h2d(r.host(), d.view_mut()))
                .map_err(gpufeed::Error::from)?;
            b.dev = dev;
            drop(reg.into_inner());
        }
        Path4::Staged => engines[0].h2d_blocking(s, &mut b.dev)?,
        Path4::Auto => engines[1].h2d_blocking(s, &mut b.dev)?,
        // The link's own speed: the source already in pinned memory.
        Path4::Pinned => return b.pinned_copy(stream, true),
    }
    Ok(b)
}

/// Device to host by `path`, into the user's array `o`.
fn d2h_by(
    path: Path4,
    device: &Device,
    stream: &Stream,
    engines: &[Staging; 2],
    o: &mut Vec<u32>,
    mut b: Bufs,
) -> gpufeed::Result<Bufs> {
    match path {
        Path4::Pageable => b.dev.copy_to_host_sync(o)?,
        Path4::RegisterCopy => {
            let reg = Registered::new(device, std::mem::take(o))?;
            let ((reg, dev), ()) = stream
                .run_sync((reg, b.dev), |c, (r, d)| c.copy_d2h(d.view(), r.host_mut()))
                .map_err(gpufeed::Error::from)?;
            b.dev = dev;
            *o = reg.into_inner();
        }
        Path4::Staged => engines[0].d2h_blocking(&b.dev, o)?,
        Path4::Auto => engines[1].d2h_blocking(&b.dev, o)?,
        Path4::Pinned => return b.pinned_copy(stream, false),
    }
    Ok(b)
}

pub fn run(device: &Device, config: &Config, out: &Path) -> gpufeed::Result<Results> {
    let max = config
        .sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(config.sweep_bytes);
    let stream = Stream::new(device)?;
    let pool = PinnedPool::new(device);
    let src = Sources::new(max / 4);
    let default = StagingConfig::for_device(device);
    let shape = config
        .workers
        .map(|w| (w, default.block_bytes, default.blocks));
    let engines = [
        engine(device, Route::Staged, shape)?,
        engine(device, Route::Auto, shape)?,
    ];
    let mut rows = Vec::new();
    println!(
        "   {:>9} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9}   GB/s, medians of {} runs ({} below 16 MiB, {} for the first two from 256 MiB); every element of every run checked",
        "size", "dir", "pageable", "reg+copy", "staged", "auto", "pinned", config.reps, config.small_runs(), config.slow_reps
    );
    for &bytes in &config.sizes {
        let n = bytes / 4;
        let case = |path: Path4| Case {
            stream: &stream,
            src: &src,
            n,
            settle_ms: config.settle_ms,
            reps: config.runs(path, bytes),
        };
        let mut bufs = Bufs {
            pinned: pool.alloc::<u32>(n)?,
            dev: DeviceBuffer::new(device, n)?,
        };
        let mut user_out = vec![0u32; n];
        for dir in ["h2d", "d2h"] {
            // The routes take turns run by run, in a shuffled order (see
            // the module's notes).
            let paths: Vec<Path4> = PATHS
                .into_iter()
                .filter(|p| config.routes.contains(p))
                .collect();
            let cases: Vec<Case> = paths.iter().map(|&p| case(p)).collect();
            let mut timed: Vec<Timed> = paths.iter().map(|_| Timed::new()).collect();
            let most = cases.iter().map(|c| c.reps).max().unwrap_or(0);
            let mut rng = fastrand::Rng::with_seed(bytes as u64);
            let mut order: Vec<usize> = (0..paths.len()).collect();
            for rep in 0..=most {
                rng.shuffle(&mut order);
                for &i in &order {
                    let (path, c) = (paths[i], &cases[i]);
                    if rep > c.reps {
                        continue;
                    }
                    bufs = if dir == "h2d" {
                        let prep = match path {
                            Path4::RegisterCopy => Prep::OwnVec,
                            Path4::Pinned => Prep::Pinned,
                            _ => Prep::Nothing,
                        };
                        c.h2d_run(rep, bufs, prep, &mut timed[i], |s, own, b| {
                            h2d_by(path, device, &stream, &engines, s, own, b)
                        })?
                    } else {
                        let lands = if path == Path4::Pinned {
                            Lands::Pinned
                        } else {
                            Lands::Out
                        };
                        c.d2h_run(rep, bufs, &mut user_out, lands, &mut timed[i], |o, b| {
                            d2h_by(path, device, &stream, &engines, o, b)
                        })?
                    };
                }
            }
            let mut line = String::new();
            for path in PATHS {
                let Some(t) = paths.iter().position(|&p| p == path).map(|i| &timed[i]) else {
                    line.push_str(&format!(" {:>8} ", "-"));
                    continue;
                };
                let row = t.row(bytes, path, dir);
                let mark = if row.verified { ' ' } else { '!' };
                line.push_str(&format!(" {:>8.2}{mark}", row.gbps));
                rows.push(row);
            }
            println!("   {:>9} {:>4}{line}", size(bytes), dir);
        }
    }
    let staging_peak_bytes = engines
        .iter()
        .map(|e| e.pool_stats().peak_in_use_bytes)
        .max()
        .unwrap_or(0);
    // Idle: the workers must sleep once no copy is in flight.
    let c0 = cpu_seconds();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let idle_cpu_ms = (cpu_seconds() - c0) * 1e3;
    println!("   CPU used over 500 ms with no copy in flight: {idle_cpu_ms:.1} ms");

    let pipeline = pipeline_row(device, &pool, &src, config)?;
    let sweep = sweep(device, &stream, &pool, &src, config)?;
    let bad = rows.iter().filter(|r| !r.verified).count()
        + sweep.iter().filter(|r| !r.verified).count()
        + pipeline.iter().filter(|r| !r.verified).count();
    let results = Results {
        meta: Meta::new(device),
        default_config: default.into(),
        threads_used: engines[0].config().threads + 1,
        rows,
        settle_ms: config.settle_ms,
        sweep_bytes: config.sweep_bytes,
        sweep,
        idle_cpu_ms,
        staging_peak_bytes,
        staging_bound_bytes: default.total_bytes(),
        pipeline,
    };
    write_json(&out.join("staging.json"), &results)?;
    plot(device, &results, out)?;
    if bad > 0 {
        return Err(gpufeed::Error::Internal(format!(
            "staging: {bad} measurement(s) delivered wrong data (marked !)"
        )));
    }
    Ok(results)
}

/// `y = 3 x` through a pipeline at the largest size up to 1 GiB: from and
/// into `Vec`s (`run_slices`, the default engine) against the same run
/// from and into pinned memory (`run`), every element of every run
/// checked against a plain loop, outputs poisoned (NaN) before each run.
fn pipeline_row(
    device: &Device,
    pool: &PinnedPool,
    src: &Sources,
    config: &Config,
) -> gpufeed::Result<Option<PipelineRow>> {
    let Some(bytes) = config.sizes.iter().copied().filter(|&b| b <= 1 << 30).max() else {
        return Ok(None);
    };
    let n = bytes / 4;
    // Integers below 2^23: 3 x is exact, so the bits must match.
    let x: Vec<f32> = src.a[..n].par_iter().map(|&w| (w >> 9) as f32).collect();
    let want: Vec<u32> = x.par_iter().map(|v| (v * 3.0).to_bits()).collect();
    let check = |y: &[f32]| {
        y.len() == want.len()
            && y.par_chunks(1 << 16)
                .zip(want.par_chunks(1 << 16))
                .all(|(a, b)| a.iter().zip(b).all(|(a, b)| a.to_bits() == *b))
    };
    let pipe = Pipeline::new(device, 3)?;
    let staging = Staging::new(device)?;
    let mut y = vec![0f32; n];
    let (mut pin_x, mut pin_y) = (pool.alloc::<f32>(n)?, pool.alloc::<f32>(n)?);
    pin_x.as_mut_slice().copy_from_slice(&x);
    let (mut slices, mut pinned, mut verified) = (vec![], vec![], true);
    for rep in 0..=config.reps {
        y.par_chunks_mut(1 << 16).for_each(|c| c.fill(f32::NAN));
        settle(config.settle_ms);
        let t0 = Instant::now();
        gpufeed::block_on(pipe.run_slices(&staging, &x, &mut y, |c, chunk| {
            c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)?;
            c.kernel(Kernel::Scale { s: 3.0 }, chunk.output::<f32>(0)?)
        }))?;
        let t = t0.elapsed().as_secs_f64() * 1e3;
        verified &= check(&y);

        pin_y
            .as_mut_slice()
            .par_chunks_mut(1 << 16)
            .for_each(|c| c.fill(f32::NAN));
        settle(config.settle_ms);
        let t1 = Instant::now();
        let ((px, py), _) = gpufeed::block_on(pipe.run(
            pin_x,
            pin_y,
            Kernel::Scale { s: 3.0 },
            Plan::auto_for(n, 3),
            Timeline::Off,
        ))?;
        let tp = t1.elapsed().as_secs_f64() * 1e3;
        verified &= check(py.as_slice());
        (pin_x, pin_y) = (px, py);
        // The pinned run scales its input in place: restore it.
        pin_x.as_mut_slice().copy_from_slice(&x);
        if rep > 0 {
            slices.push(t);
            pinned.push(tp);
        }
    }
    let (slices_ms, pinned_ms) = (median(&slices), median(&pinned));
    println!(
        "\n   pipeline y = 3x at {}: from and into Vecs {slices_ms:.3} ms, pinned {pinned_ms:.3} ms ({:.3}x){}",
        size(bytes),
        pinned_ms / slices_ms,
        if verified { "" } else { " WRONG" }
    );
    Ok(Some(PipelineRow {
        bytes,
        reps: config.reps,
        slices_ms,
        pinned_ms,
        ratio: pinned_ms / slices_ms,
        verified,
    }))
}

/// The engine's shape swept at one size: threads × block size × blocks,
/// every shape within the default 64 MiB bound, against the pinned copy.
/// Like the routes above, every shape and the pinned copy take turns run
/// by run in a shuffled order, so the machine's drift falls on all alike
/// and each shape's ratio to the pinned copy is of the same minutes.
fn sweep(
    device: &Device,
    stream: &Stream,
    pool: &PinnedPool,
    src: &Sources,
    config: &Config,
) -> gpufeed::Result<Vec<SweepRow>> {
    if config.sweep_bytes == 0 {
        return Ok(vec![]);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut threads: Vec<usize> = [12, 15].into_iter().filter(|&t| t <= cores).collect();
    threads.push(StagingConfig::for_device(device).threads);
    threads.sort_unstable();
    threads.dedup();
    // Rings of 16, 24, 32 and 64 MiB in all.
    let blocks = [
        (2 << 20, 8),
        (4 << 20, 4),
        (8 << 20, 2),
        (4 << 20, 6),
        (8 << 20, 3),
        (4 << 20, 8),
        (8 << 20, 4),
        (16 << 20, 4),
    ];
    // `None`: the pinned copy, the reference of every shape.
    let mut shapes: Vec<Option<(usize, usize, usize)>> = vec![None];
    for &t in &threads {
        shapes.extend(blocks.iter().map(|&(b, n)| Some((t, b, n))));
    }
    let engines = shapes
        .iter()
        .map(|s| {
            s.map(|shape| engine(device, Route::Staged, Some(shape)))
                .transpose()
        })
        .collect::<gpufeed::Result<Vec<Option<Staging>>>>()?;
    let n = config.sweep_bytes / 4;
    let case = Case {
        stream,
        src,
        n,
        reps: config.sweep_reps,
        settle_ms: config.settle_ms,
    };
    let mut bufs = Bufs {
        pinned: pool.alloc::<u32>(n)?,
        dev: DeviceBuffer::new(device, n)?,
    };
    let mut user_out = vec![0u32; n];
    let mut timed: [Vec<Timed>; 2] = [
        shapes.iter().map(|_| Timed::new()).collect(),
        shapes.iter().map(|_| Timed::new()).collect(),
    ];
    let mut rng = fastrand::Rng::with_seed(config.sweep_bytes as u64 ^ 0x5eed);
    let mut order: Vec<usize> = (0..shapes.len()).collect();
    for (d, t) in timed.iter_mut().enumerate() {
        for rep in 0..=config.sweep_reps {
            rng.shuffle(&mut order);
            for &i in &order {
                bufs = match (&engines[i], d) {
                    (None, 0) => case.h2d_run(rep, bufs, Prep::Pinned, &mut t[i], |_, _, b| {
                        b.pinned_copy(stream, true)
                    })?,
                    (None, _) => case.d2h_run(
                        rep,
                        bufs,
                        &mut user_out,
                        Lands::Pinned,
                        &mut t[i],
                        |_, b| b.pinned_copy(stream, false),
                    )?,
                    (Some(e), 0) => {
                        case.h2d_run(rep, bufs, Prep::Nothing, &mut t[i], |s, _, mut b| {
                            e.h2d_blocking(s, &mut b.dev)?;
                            Ok(b)
                        })?
                    }
                    (Some(e), _) => {
                        case.d2h_run(rep, bufs, &mut user_out, Lands::Out, &mut t[i], |o, b| {
                            e.d2h_blocking(&b.dev, o)?;
                            Ok(b)
                        })?
                    }
                };
            }
        }
    }
    let bytes = config.sweep_bytes;
    let pinned = |d: usize| timed[d][0].row(bytes, Path4::Pinned, "").gbps;
    let (pin_h, pin_d) = (pinned(0), pinned(1));
    println!(
        "\n   the engine's shape at {} ({} runs each, shapes and the pinned copy in turn, medians; pinned {pin_h:.2} / {pin_d:.2} GB/s):",
        size(bytes),
        config.sweep_reps
    );
    println!(
        "   {:>7} {:>9} {:>6} {:>8} {:>8} {:>8} {:>8}",
        "threads", "block", "blocks", "h2d", "÷pinned", "d2h", "÷pinned"
    );
    let mut rows = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let Some((t, block_bytes, blocks)) = *shape else {
            continue;
        };
        let h = timed[0][i].row(bytes, Path4::Staged, "h2d");
        let d = timed[1][i].row(bytes, Path4::Staged, "d2h");
        let verified = h.verified && d.verified && timed[0][0].verified && timed[1][0].verified;
        println!(
            "   {t:>7} {:>9} {blocks:>6} {:>8.2} {:>8.3} {:>8.2} {:>8.3}{}",
            size(block_bytes),
            h.gbps,
            h.gbps / pin_h,
            d.gbps,
            d.gbps / pin_d,
            if verified { "" } else { " WRONG" }
        );
        rows.push(SweepRow {
            threads: t,
            block_bytes,
            blocks,
            h2d_gbps: h.gbps,
            d2h_gbps: d.gbps,
            h2d_of_pinned: h.gbps / pin_h,
            d2h_of_pinned: d.gbps / pin_d,
            verified,
        });
    }
    Ok(rows)
}

fn plot(device: &Device, r: &Results, out: &Path) -> gpufeed::Result<()> {
    let mut series = Vec::new();
    let names = [
        (Path4::Pageable, "driver, pageable"),
        (Path4::RegisterCopy, "pin in place + copy"),
        (Path4::Staged, "staged"),
        (Path4::Auto, "automatic"),
        (Path4::Pinned, "pinned (the link)"),
    ];
    for dir in ["h2d", "d2h"] {
        for (path, name) in names {
            let points: Vec<(f64, f64)> = r
                .rows
                .iter()
                .filter(|x| x.dir == dir && x.path == path)
                .filter_map(|x| cell(x.gbps, 3).map(|g| (x.bytes as f64, g)))
                .collect();
            series.push((format!("{} {name}", dir.to_uppercase()), points));
        }
    }
    let series: Vec<plots::Series> = series
        .iter()
        .map(|(name, points)| plots::Series {
            name,
            points: points.clone(),
        })
        .collect();
    plots::lines(
        &out.join("staging.svg"),
        &format!(
            "ordinary memory to the device and back — {}",
            device.info().name
        ),
        plots::Axis {
            desc: "bytes per copy",
            label: plots::Label::Bytes,
        },
        plots::Axis {
            desc: "GB/s (median)",
            label: plots::Label::Number,
        },
        true,
        &series,
    )
}
