//! `host load`: many tokio tasks sharing one pool and a few streams for a
//! while, every result verified, with process RSS and pool statistics sampled
//! once a second to show that memory stays flat.

use super::fmt::{bytes, size, Words};
use super::report::{write_json, Meta};
use gpufeed::{Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, PoolStats, Stream};
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Serialize, Clone)]
pub struct Sample {
    pub t_s: f64,
    pub rss_mib: f64,
    pub jobs_done: u64,
    pub pool: PoolStats,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    pub tasks: usize,
    pub streams: usize,
    pub seconds: f64,
    pub max_cached_bytes: Option<usize>,
    pub jobs: u64,
    pub elements: u64,
    pub mismatches: u64,
    pub samples: Vec<Sample>,
    /// RSS at the last sample over RSS at the first sample after warm-up.
    /// RSS at the end over RSS at the third sample (the pool's cache fills
    /// up to every size class the random sizes touch, then stays).
    pub rss_growth: f64,
    /// The same over the second half of the run only, and the driver
    /// allocations the pool made in that half: a leak would keep both growing.
    pub rss_growth_second_half: f64,
    pub driver_allocs_second_half: u64,
    pub pool_in_use_at_end: u64,
}

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as f64;
    pages * page / 1048576.0
}

/// What `host load` runs.
pub struct Config {
    pub tasks: usize,
    pub streams: usize,
    pub seconds: f64,
    /// The pool's cap on cached bytes (`None`: uncapped).
    pub max_cached_bytes: Option<usize>,
}

pub fn run(
    rt: &tokio::runtime::Runtime,
    device: &Device,
    cfg: Config,
    out: &Path,
) -> gpufeed::Result<()> {
    let Config {
        tasks,
        streams,
        seconds,
        max_cached_bytes,
    } = cfg;
    let pool = PinnedPool::new(device);
    if let Some(cap) = max_cached_bytes {
        pool.set_max_cached_bytes(cap);
    }
    let streams: Vec<Stream> = (0..streams.max(1))
        .map(|_| Stream::new(device))
        .collect::<gpufeed::Result<_>>()?;
    let max_n = 1 << 20;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let (jobs, elements, bad) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let t0 = Instant::now();
    let pb = super::progress::bar(seconds.ceil().max(1.0) as u64);
    pb.set_message(format!("{tasks} tasks on {} streams", streams.len()));
    let samples = rt.block_on(async {
        let mut handles = Vec::new();
        for t in 0..tasks {
            let (pool, stream, device) = (
                pool.clone(),
                streams[t % streams.len()].clone(),
                device.clone(),
            );
            let (jobs, elements, bad) = (jobs.clone(), elements.clone(), bad.clone());
            handles.push(tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(t as u64);
                let mut dev = DeviceBuffer::<f32>::new(&device, max_n)?;
                while Instant::now() < deadline {
                    let n = rng.usize(1_000..max_n);
                    let mut input = pool.alloc::<f32>(n)?;
                    gpufeed::testing::random_floats(input.as_mut_slice(), rng.u64(..));
                    // Poisoned: a pooled block may hold an earlier job's answer.
                    let mut output = pool.alloc::<f32>(n)?;
                    gpufeed::testing::poison(output.as_mut_slice());
                    let kernel = if rng.bool() {
                        Kernel::Scale { s: 0.75 }
                    } else {
                        Kernel::Intensity { k: 16 }
                    };
                    let ((input, d, output), ()) = stream
                        .run((input, dev, output), move |c, (i, d, o)| {
                            let v = d.view_mut().range(0..n)?;
                            c.copy_h2d(i.host(), v)?;
                            c.kernel(kernel, v)?;
                            c.copy_d2h(v, o.host_mut())
                        })
                        .await?;
                    dev = d;
                    let wrong = input
                        .as_slice()
                        .iter()
                        .zip(output.as_slice())
                        .filter(|(x, y)| {
                            gpufeed::testing::expected(kernel, **x).to_bits() != y.to_bits()
                        })
                        .count();
                    bad.fetch_add(wrong as u64, Ordering::Relaxed);
                    elements.fetch_add(n as u64, Ordering::Relaxed);
                    jobs.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, gpufeed::Error>(())
            }));
        }
        let sampler = {
            let (pool, jobs, pb) = (pool.clone(), jobs.clone(), pb.clone());
            tokio::spawn(async move {
                let mut v = Vec::new();
                while Instant::now() < deadline {
                    tokio::time::sleep(
                        Duration::from_secs(1).min(
                            deadline
                                .saturating_duration_since(Instant::now())
                                .max(Duration::from_millis(10)),
                        ),
                    )
                    .await;
                    pb.set_position(t0.elapsed().as_secs_f64() as u64);
                    v.push(Sample {
                        t_s: t0.elapsed().as_secs_f64(),
                        rss_mib: rss_mib(),
                        jobs_done: jobs.load(Ordering::Relaxed),
                        pool: pool.stats(),
                    });
                }
                v
            })
        };
        for h in handles {
            h.await
                .map_err(|e| gpufeed::Error::InvalidArgument(format!("load task: {e}")))??;
        }
        sampler
            .await
            .map_err(|e| gpufeed::Error::InvalidArgument(format!("sampler: {e}")))
    })?;
    pb.finish_and_clear();
    let first = samples
        .get(samples.len().min(3).saturating_sub(1))
        .map_or(1.0, |s| s.rss_mib);
    let last = samples.last().map_or(1.0, |s| s.rss_mib);
    let half = samples.iter().find(|s| s.t_s >= seconds / 2.0);
    let allocs_at = |s: Option<&Sample>| s.map_or(0, |s| s.pool.driver_allocs);
    let res = Results {
        meta: Meta::new(device),
        tasks,
        streams: streams.len(),
        seconds: t0.elapsed().as_secs_f64(),
        max_cached_bytes,
        jobs: jobs.load(Ordering::Relaxed),
        elements: elements.load(Ordering::Relaxed),
        mismatches: bad.load(Ordering::Relaxed),
        rss_growth: last / first,
        rss_growth_second_half: last / half.map_or(1.0, |s| s.rss_mib),
        driver_allocs_second_half: allocs_at(samples.last()) - allocs_at(half),
        pool_in_use_at_end: pool.stats().in_use_bytes,
        samples,
    };
    let stats = pool.stats();
    println!(
        "load: {} tasks on {} streams for {:.1} s: {} jobs, {:.2e} elements, {} mismatches",
        res.tasks, res.streams, res.seconds, res.jobs, res.elements as f64, res.mismatches
    );
    println!(
        "  RSS {first:.0} -> {last:.0} MiB ({:.3}x; second half {:.3}x, {} {} in it)",
        res.rss_growth,
        res.rss_growth_second_half,
        res.driver_allocs_second_half,
        Words::of(device).host_allocs()
    );
    println!(
        "  pinned pool: {} hits / {} misses, {} cached (cap {}), {} in use at the end",
        stats.hits,
        stats.misses,
        bytes(stats.cached_bytes),
        res.max_cached_bytes.map_or("none".into(), size),
        bytes(res.pool_in_use_at_end)
    );
    write_json(&out.join("load.json"), &res)?;
    if res.mismatches > 0 || res.pool_in_use_at_end > 0 || res.jobs == 0 {
        return Err(gpufeed::Error::InvalidArgument(
            "load test failed: wrong results or leaked pool memory".into(),
        ));
    }
    Ok(())
}
