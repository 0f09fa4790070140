//! `host waits`: what the waiting thread costs a pipeline. The same
//! pipeline run (10^7 floats on a GPU, `scale`, `Plan::auto`) awaited many
//! times by three executors on the calling thread, the runs interleaved:
//!
//! - `futures::executor::block_on`: the thread parks at once;
//! - `gpufeed::block_on`: it spins for the wake-up (up to `gpufeed::SPIN`), then
//!   parks;
//! - `gpufeed::block_on_spinning(.., 0)`: parks at once (our executor, no
//!   spin: separates the spin from the executor).
//!
//! Per executor: the median, the 90th percentile and the worst run, and how
//! many runs took over 5% more than the median. A parked thread's wake-up
//! is sometimes slow (a VM's idle virtual CPU), which shows as a second
//! mode of slow runs.

use super::report::{median, write_json, Meta};
use gpufeed::{Device, Kernel, PinnedPool, Pipeline, Plan};
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Executor {
    FuturesBlockOn,
    HostBlockOn,
    HostBlockOnNoSpin,
}

#[derive(Serialize)]
struct Row {
    executor: Executor,
    median_ms: f64,
    p90_ms: f64,
    max_ms: f64,
    /// Runs over 1.05x the median.
    slow_runs: usize,
    runs: usize,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    n: usize,
    plan: Plan,
    spin_ms: f64,
    rows: Vec<Row>,
}

/// Runs `runs` rounds (after one warm-up round), each executor once per round.
pub fn run(device: &Device, n: usize, runs: usize, out: &Path) -> gpufeed::Result<()> {
    let pool = PinnedPool::new(device);
    let pipe = Pipeline::new(device, 4)?;
    let mut input = pool.alloc::<f32>(n)?;
    gpufeed::testing::random_floats(input.as_mut_slice(), 11);
    let mut output = pool.alloc::<f32>(n)?;
    let kernel = Kernel::Scale { s: 2.0 };
    let plan = Plan::auto(n);
    let executors = [
        Executor::FuturesBlockOn,
        Executor::HostBlockOn,
        Executor::HostBlockOnNoSpin,
    ];
    let mut times = vec![Vec::new(); executors.len()];
    for round in 0..=runs {
        for (k, &e) in executors.iter().enumerate() {
            // The last run is the checked one: its output poisoned first.
            if round == runs && k == executors.len() - 1 {
                gpufeed::testing::poison(output.as_mut_slice());
            }
            let t = Instant::now();
            let job = pipe.run(input, output, kernel, plan, gpufeed::Timeline::Off);
            let ((i, o), _) = match e {
                Executor::FuturesBlockOn => futures::executor::block_on(job)?,
                Executor::HostBlockOn => gpufeed::block_on(job)?,
                Executor::HostBlockOnNoSpin => gpufeed::block_on_spinning(job, Duration::ZERO)?,
            };
            if round > 0 {
                times[k].push(t.elapsed().as_secs_f64() * 1e3);
            }
            (input, output) = (i, o);
        }
    }
    let (checked, bad) = gpufeed::testing::verify(kernel, input.as_slice(), output.as_slice());
    if bad > 0 || checked == 0 {
        return Err(gpufeed::Error::InvalidArgument(
            "the waits' pipeline produced wrong results".into(),
        ));
    }
    let rows: Vec<Row> = executors
        .iter()
        .zip(&times)
        .map(|(&executor, v)| {
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            let med = median(&s);
            Row {
                executor,
                median_ms: med,
                p90_ms: s[s.len() * 9 / 10],
                max_ms: s[s.len() - 1],
                slow_runs: s.iter().filter(|&&x| x > med * 1.05).count(),
                runs: s.len(),
            }
        })
        .collect();
    println!(
        "one pipeline ({} floats, {plan}) awaited {runs} times by each executor, interleaved:",
        super::fmt::elems(n)
    );
    println!(
        "gpufeed::block_on spins {:?} here (zero on fewer than {} cores)",
        gpufeed::spin_here(),
        gpufeed::SPIN_MIN_CORES
    );
    println!(
        "{:<38} {:>9} {:>9} {:>9} {:>12}",
        "executor", "median", "p90", "max", "runs >1.05x"
    );
    for r in &rows {
        let name = match r.executor {
            Executor::FuturesBlockOn => "futures::executor::block_on (parks)",
            Executor::HostBlockOn => "gpufeed::block_on (spin, then park)",
            Executor::HostBlockOnNoSpin => "gpufeed::block_on_spinning(.., 0) (parks)",
        };
        println!(
            "{name:<38} {:>6.3} ms {:>6.3} ms {:>6.3} ms {:>7} of {}",
            r.median_ms, r.p90_ms, r.max_ms, r.slow_runs, r.runs
        );
    }
    write_json(
        &out.join("waits.json"),
        &Results {
            meta: Meta::new(device),
            n,
            plan,
            spin_ms: gpufeed::spin_here().as_secs_f64() * 1e3,
            rows,
        },
    )
}
