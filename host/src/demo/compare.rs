//! `compare_sync_async`: the seed's experiment. The synchronous version runs
//! copy, kernel and copy on one stream, each waited for; the pipelined one
//! cuts the array into chunks over several streams. Both are timed on the
//! host clock (what a caller waits), in the same run as the bidirectional copy
//! bound: all bytes in and all bytes out at once, as two whole-array copies
//! on two streams, which no schedule of these copies can beat.

use super::fmt::{elems, faster_or_slower, size, Words};
use super::report::percentile;
use futures::TryFutureExt;
use gpufeed::testing::{poison, random_floats, verify};
use gpufeed::{
    Device, DeviceBuffer, Error, Kernel, PinnedHost, PinnedPool, Pipeline, Plan, PooledBuffer,
    Result, Stream,
};
use indicatif::ProgressBar;
use std::time::Instant;

/// Results of one comparison (milliseconds are medians over the repetitions).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    /// Elements.
    pub n: usize,
    /// The kernel.
    pub kernel: Kernel,
    /// Synchronous total.
    pub sync_ms: f64,
    /// Its interquartile range over the repetitions (p25, p75).
    pub sync_iqr_ms: [f64; 2],
    /// Synchronous stages: host-to-device, kernel, device-to-host.
    pub stage_ms: [f64; 3],
    /// Pipelined total, with the best plan tried.
    pub async_ms: f64,
    /// Its interquartile range over the repetitions (p25, p75).
    pub async_iqr_ms: [f64; 2],
    /// The plan of `async_ms`.
    pub plan: Plan,
    /// Host time to issue a run of `plan` (the call to `Pipeline::run`), median.
    pub enqueue_ms: f64,
    /// Every plan tried, with its median.
    pub plans: Vec<(Plan, f64)>,
    /// Issue time of each plan in `plans`, median.
    pub plan_enqueue_ms: Vec<f64>,
    /// sync / async.
    pub speedup: f64,
    /// (sum of stages - pipelined) / (sum of stages - longest stage): 0 is no
    /// overlap, 1 is perfect overlap.
    pub overlap: f64,
    /// All bytes in and out at once, as two whole-array copies on two streams
    /// (NaN when not measured).
    pub bidir_bound_ms: f64,
    /// The bound measured with each piece count: `(pieces, median ms)`.
    pub bound_by_pieces: Vec<(usize, f64)>,
    /// async / bound (1.0 is the copy bound itself).
    pub async_over_bound: f64,
    /// The synchronous run and every plan in `plans` verified
    /// (`sync_verified` and each of `plan_verified`).
    pub verified: bool,
    /// The synchronous variant's checked run (its warm-up, into an output
    /// poisoned with NaN beforehand) equalled the CPU reference bit for bit.
    pub sync_verified: bool,
    /// For each plan in `plans`, the same for its checked run (its warm-up,
    /// into an output poisoned beforehand).
    pub plan_verified: Vec<bool>,
    /// Mismatching elements of each plan's checked run.
    pub plan_mismatches: Vec<usize>,
    /// Elements checked in each checked run: all of them, or for heavy
    /// kernels (n * k over 4e9 FMAs) the first and last 4096 plus a million
    /// drawn uniformly (`gpufeed::testing::verify`).
    pub checked: usize,
    /// Repetitions behind each median.
    pub reps: usize,
}

fn median(v: Vec<f64>) -> f64 {
    super::report::median(&v)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// What to compare.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Elements.
    pub n: usize,
    /// The kernel.
    pub kernel: Kernel,
    /// Plans the pipelined variant tries (empty: [`Plan::auto`]); the best counts.
    pub plans: Vec<Plan>,
    /// Repetitions of each variant (after one warm-up).
    pub reps: usize,
    /// Also measure the bidirectional copy bound.
    pub with_bound: bool,
}

impl Spec {
    /// Timed runs [`compare`] makes (warm-ups included): the length of its
    /// progress bar.
    pub fn steps(&self) -> u64 {
        let runs = self.reps.max(1) as u64 + 1;
        let bound = if self.with_bound { 5 * runs } else { 0 };
        runs * (1 + self.plans.len().max(1) as u64) + bound
    }
}

fn iqr(v: &[f64]) -> [f64; 2] {
    [percentile(v, 0.25), percentile(v, 0.75)]
}

/// Runs the comparison described by `spec`, one `progress` step a run.
pub async fn compare(
    device: &Device,
    pool: &PinnedPool,
    pipeline: &Pipeline,
    spec: &Spec,
    progress: &ProgressBar,
) -> Result<Comparison> {
    let Spec {
        n,
        kernel,
        ref plans,
        reps,
        with_bound,
    } = *spec;
    if n == 0 {
        return Err(Error::InvalidArgument(
            "compare_sync_async needs at least one element".into(),
        ));
    }
    let reps = reps.max(1);
    let mut input: PooledBuffer<f32> = pool.alloc(n)?;
    random_floats(input.as_mut_slice(), n as u64 ^ 0x9E37_79B9);
    let mut output: PooledBuffer<f32> = pool.alloc(n)?;
    let mut dev = DeviceBuffer::<f32>::new(device, n)?;
    let stream = Stream::new(device)?;

    // Synchronous: each stage waited for before the next is issued. The
    // first repetition is a warm-up, and the checked run: its output is
    // poisoned beforehand, so an element it did not write cannot pass.
    let (mut sync, mut stages) = (Vec::new(), [Vec::new(), Vec::new(), Vec::new()]);
    let mut sync_verified = false;
    let mut checked = usize::MAX;
    for rep in 0..=reps {
        if rep == 0 {
            poison(output.as_mut_slice());
        }
        let t = Instant::now();
        let ((i, d), ()) = stream.copy_h2d(input, dev).await?;
        let h2d = ms(t);
        let t1 = Instant::now();
        let (d, ()) = stream.launch(kernel, d).await?;
        let k = ms(t1);
        let t2 = Instant::now();
        let ((d, o), ()) = stream.copy_d2h(d, output).await?;
        let d2h = ms(t2);
        if rep > 0 {
            sync.push(ms(t));
            for (s, v) in stages.iter_mut().zip([h2d, k, d2h]) {
                s.push(v);
            }
        }
        (input, dev, output) = (i, d, o);
        if rep == 0 {
            // Each repetition copies the input in afresh: one application.
            let (c, bad) = verify(kernel, input.as_slice(), output.as_slice());
            sync_verified = bad == 0 && c > 0;
            checked = checked.min(c);
        }
        progress.inc(1);
    }
    drop(dev);

    // Pipelined, for each plan; the input is re-read each time (the kernel
    // writes only device scratch and the output).
    let plans = if plans.is_empty() {
        vec![Plan::auto(n)]
    } else {
        plans.to_vec()
    };
    // Repetitions interleave the plans (plan 1, plan 2, ..., plan 1, ...), so
    // a drift in the machine's state affects every plan alike.
    // Each plan's warm-up run is its checked run, into a poisoned output.
    let mut times = vec![Vec::new(); plans.len()];
    let mut enqueue = vec![Vec::new(); plans.len()];
    let mut plan_mismatches = vec![usize::MAX; plans.len()];
    for rep in 0..=reps {
        for (k, &plan) in plans.iter().enumerate() {
            if rep == 0 {
                poison(output.as_mut_slice());
            }
            let t = Instant::now();
            let job = pipeline.run(input, output, kernel, plan, gpufeed::Timeline::Off);
            let issued = ms(t);
            let ((i, o), _) = job.await?;
            if rep > 0 {
                times[k].push(ms(t));
                enqueue[k].push(issued);
            }
            (input, output) = (i, o);
            if rep == 0 {
                let (c, bad) = verify(kernel, input.as_slice(), output.as_slice());
                plan_mismatches[k] = if c > 0 { bad } else { usize::MAX };
                checked = checked.min(c);
            }
            progress.inc(1);
        }
    }
    let plan_verified: Vec<bool> = plan_mismatches.iter().map(|&m| m == 0).collect();
    let iqrs: Vec<[f64; 2]> = times.iter().map(|t| iqr(t)).collect();
    let tried: Vec<(Plan, f64)> = plans
        .iter()
        .zip(times)
        .map(|(&p, t)| (p, median(t)))
        .collect();
    let enqueue_ms: Vec<f64> = enqueue.into_iter().map(median).collect();
    let (best, (plan, async_ms)) = tried
        .iter()
        .copied()
        .enumerate()
        .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .ok_or_else(|| Error::InvalidArgument("no plan".into()))?;

    let verified = sync_verified && plan_verified.iter().all(|&v| v);

    // The bidirectional bound: n floats in on one stream while n floats go out
    // on another.
    drop((input, output));
    let bound_by_pieces = if with_bound {
        bidirectional_ms(device, pool, n, reps, progress).await?
    } else {
        Vec::new()
    };
    let bound_ms = bound_by_pieces.iter().map(|b| b.1).fold(f64::NAN, f64::min);

    let stage_ms = stages.map(median);
    let sum: f64 = stage_ms.iter().sum();
    let longest = stage_ms.iter().copied().fold(0.0, f64::max);
    let sync_iqr_ms = iqr(&sync);
    let sync_ms = median(sync);
    Ok(Comparison {
        n,
        kernel,
        sync_ms,
        sync_iqr_ms,
        stage_ms,
        async_ms,
        async_iqr_ms: iqrs.get(best).copied().unwrap_or([f64::NAN; 2]),
        plan,
        enqueue_ms: enqueue_ms.get(best).copied().unwrap_or(f64::NAN),
        plans: tried,
        plan_enqueue_ms: enqueue_ms,
        speedup: sync_ms / async_ms,
        overlap: if sum > longest {
            ((sum - async_ms) / (sum - longest)).clamp(-1.0, 1.0)
        } else {
            0.0
        },
        bidir_bound_ms: bound_ms,
        bound_by_pieces,
        async_over_bound: async_ms / bound_ms,
        verified,
        sync_verified,
        plan_verified,
        plan_mismatches,
        checked,
        reps,
    })
}

/// The bidirectional copy bound: median wall time of copying `n` floats in
/// on one stream while `n` floats go out on another, with no dependency
/// between the two, for several chunkings (whole arrays, 4, 8, 16 and 32
/// pieces back to back): `(pieces, median ms)` each. The bound is the best.
pub async fn bidirectional_ms(
    device: &Device,
    pool: &PinnedPool,
    n: usize,
    reps: usize,
    progress: &ProgressBar,
) -> Result<Vec<(usize, f64)>> {
    bidirectional_bytes_ms(device, pool, 4 * n, 4 * n, reps, progress).await
}

/// [`bidirectional_ms`] for any byte counts: `in_bytes` copied in on one
/// stream while `out_bytes` go out on another (the bound of a pipeline whose
/// elements cross the link in different sizes each way).
pub async fn bidirectional_bytes_ms(
    device: &Device,
    pool: &PinnedPool,
    in_bytes: usize,
    out_bytes: usize,
    reps: usize,
    progress: &ProgressBar,
) -> Result<Vec<(usize, f64)>> {
    let (s1, s2) = (Stream::new(device)?, Stream::new(device)?);
    let (mut hin, mut hout) = (pool.alloc::<u8>(in_bytes)?, pool.alloc::<u8>(out_bytes)?);
    fastrand::Rng::with_seed(7).fill(hin.as_mut_slice());
    let (mut d1, mut d2) = (
        DeviceBuffer::<u8>::new(device, in_bytes)?,
        DeviceBuffer::<u8>::new(device, out_bytes)?,
    );
    let mut by_pieces = Vec::new();
    for pieces in [1usize, 4, 8, 16, 32] {
        let pin = Plan::uniform(pieces.min(in_bytes), 1);
        let pout = Plan::uniform(pieces.min(out_bytes), 1);
        let mut times = Vec::new();
        for _ in 0..=reps {
            let t = Instant::now();
            let up = s1.run((hin, d1), |c, (h, d)| {
                let d = d.view_mut();
                for i in 0..pin.chunks {
                    let r = pin.chunk(i, in_bytes);
                    c.copy_h2d(h.host().range(r.clone())?, d.range(r)?)?;
                }
                Ok(())
            });
            let down = s2.run((d2, hout), |c, (d, h)| {
                let mut h = h.host_mut();
                for i in 0..pout.chunks {
                    let r = pout.chunk(i, out_bytes);
                    let (head, rest) = h.split_at(r.len())?;
                    c.copy_d2h(d.view().range(r)?, head)?;
                    h = rest;
                }
                Ok(())
            });
            let (((a, b), ()), ((c, d), ())) =
                futures::future::try_join(up.err_into::<Error>(), down.err_into::<Error>()).await?;
            times.push(ms(t));
            (hin, d1, d2, hout) = (a, b, c, d);
            progress.inc(1);
        }
        times.remove(0);
        by_pieces.push((pieces, median(times)));
    }
    Ok(by_pieces)
}

/// How far a comparison can be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A clear difference (or a clear tie).
    Clear,
    /// The runs take so little time that fixed per-operation costs dominate.
    TooSmall,
    /// The middle halves of the two samples overlap: no clear difference.
    WithinNoise,
}

impl Comparison {
    pub fn verdict(&self, w: Words) -> Verdict {
        let [s25, s75] = self.sync_iqr_ms;
        let [a25, a75] = self.async_iqr_ms;
        if self.sync_ms.min(self.async_ms) < w.too_small_ms() {
            Verdict::TooSmall
        } else if s25 <= a75 && a25 <= s75 {
            Verdict::WithinNoise
        } else {
            Verdict::Clear
        }
    }

    /// `2.15x faster`, `1.19x slower`, with a word on how sure it is.
    pub fn result(&self, w: Words) -> String {
        let r = faster_or_slower(self.async_ms, self.sync_ms);
        match self.verdict(w) {
            Verdict::Clear => r,
            Verdict::TooSmall => format!("{r}, but too small to measure meaningfully"),
            Verdict::WithinNoise => format!("{r}, within the run-to-run spread"),
        }
    }

    /// `overlap 59%`, or why there is none.
    pub fn overlap_words(&self) -> String {
        let sum: f64 = self.stage_ms.iter().sum();
        if self.async_ms >= sum {
            "no overlap (async takes longer than the three steps in a row)".into()
        } else {
            format!("overlap {:.0}%", self.overlap * 100.0)
        }
    }

    /// The async time against the copy bound, or why that bound does not apply.
    pub fn bound_words(&self) -> Option<String> {
        if !self.bidir_bound_ms.is_finite() {
            return None;
        }
        let [h2d, k, d2h] = self.stage_ms;
        Some(if k >= h2d + d2h {
            format!(
                "copy bound {:.3} ms: not the limit here, the kernel takes {:.0}% of the sync time",
                self.bidir_bound_ms,
                100.0 * k / self.sync_ms,
            )
        } else {
            format!(
                "copy bound {:.3} ms: async takes {:.2}x that",
                self.bidir_bound_ms, self.async_over_bound
            )
        })
    }

    /// The seed's printout: sync and async times, and what they mean.
    pub fn print(&self, w: Words) {
        println!(
            "compare_sync_async({}): {} floats ({}), {}",
            self.n,
            elems(self.n),
            size(self.n * 4),
            self.kernel.label()
        );
        println!(
            "  sync  {:>9.3} ms  (H2D {:.3} + kernel {:.3} + D2H {:.3})",
            self.sync_ms, self.stage_ms[0], self.stage_ms[1], self.stage_ms[2]
        );
        println!(
            "  async {:>9.3} ms  ({}; issued in {:.3} ms)",
            self.async_ms, self.plan, self.enqueue_ms
        );
        println!("  async is {}", self.result(w));
        println!(
            "  {}; {}",
            self.overlap_words(),
            if self.verified {
                "verified bit for bit (a run of each variant and plan)"
            } else {
                "RESULT MISMATCH"
            }
        );
        if !self.sync_verified {
            println!("  RESULT MISMATCH: the synchronous run");
        }
        for ((plan, _), &bad) in self.plans.iter().zip(&self.plan_mismatches) {
            if bad != 0 {
                println!("  RESULT MISMATCH: {plan}: {bad} elements wrong");
            }
        }
        if let Some(b) = self.bound_words() {
            println!("  {b}");
        }
    }
}

/// The seed's `compare_sync_async(size)`: opens the device (`HOST_BACKEND`
/// chooses), runs both variants for `size` floats with `scale`, prints and
/// returns the comparison.
pub fn compare_sync_async(size: usize) -> Result<Comparison> {
    let device = Device::from_env()?;
    let pool = PinnedPool::new(&device);
    let pipeline = Pipeline::new(&device, 4)?;
    let spec = Spec {
        n: size,
        kernel: Kernel::Scale { s: 1.5 },
        plans: Vec::new(),
        reps: 10,
        with_bound: true,
    };
    let c = gpufeed::block_on(compare(
        &device,
        &pool,
        &pipeline,
        &spec,
        &ProgressBar::hidden(),
    ))?;
    c.print(Words::of(&device));
    Ok(c)
}
