//! `host latency`: how long from GPU completion to the awaiting task running,
//! against the driver's own blocking event wait on the calling thread, and
//! what an awaited operation costs the CPU.
//!
//! Method: a `gate_wait` kernel holds the stream while a point is recorded
//! behind it; after the kernel has had time to start spinning, the host opens
//! the gate at `t0`. Ours: a tokio task awaiting the event notes `t1` when it
//! runs. Baseline: the thread calls `cuEventSynchronize` (`synchronize_direct`)
//! and notes `t1` when it returns. Both include the same GPU part (the flag
//! crossing PCIe, the kernel ending, the event firing), so their ratio is the
//! price of the future. Each wait mode runs in its own device handle.

use super::report::{percentile, Meta};
use host::{Device, DeviceBuffer, MappedFlag, PinnedHost, PinnedPool, Stream, WaitMode};
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Serialize, Clone)]
pub struct ModeResult {
    pub wait_mode: WaitMode,
    pub samples: usize,
    /// Microseconds from opening the gate to the awaiting tokio task running.
    pub wake_median_us: f64,
    pub wake_p99_us: f64,
    /// The same, awaited with `futures::executor::block_on` on a plain thread
    /// (thread park/unpark instead of a tokio worker).
    pub block_on_median_us: f64,
    pub block_on_p99_us: f64,
    /// Microseconds from opening the gate to `cuEventSynchronize` returning.
    pub sync_median_us: f64,
    pub sync_p99_us: f64,
    /// wake_median / sync_median (target: at most 1.3).
    pub median_ratio: f64,
    /// Process CPU time per awaited 4-byte copy, and per synchronized one
    /// (medians over `cpu_rounds` rounds that alternate the two).
    pub cpu_us_per_awaited_op: f64,
    pub cpu_us_per_synced_op: f64,
    /// The difference, median over rounds: what awaiting costs the CPU
    /// beyond the driver's wait; and its spread over rounds.
    pub cpu_overhead_us: f64,
    pub cpu_overhead_p10_us: f64,
    pub cpu_overhead_p90_us: f64,
    pub cpu_rounds: usize,
    pub wall_us_per_awaited_op: f64,
    pub wall_us_per_synced_op: f64,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    pub modes: Vec<ModeResult>,
    pub summary: Summary,
}

/// The figures, taken from the modes above (same run).
#[derive(Serialize)]
pub struct Summary {
    /// The default (spin) watcher, tokio task: median and p99 wake latency.
    pub wake_median_us: f64,
    pub wake_p99_us: f64,
    /// `cuEventSynchronize` on an event made with `CU_EVENT_BLOCKING_SYNC`,
    /// CUDA's "blocking synchronization" (the caller sleeps, like an awaiting
    /// task): the baseline of the target.
    pub blocking_sync_median_us: f64,
    /// `cuEventSynchronize` on a default event, which spins on the caller's
    /// core (what no executor thread may do): the floor.
    pub spinning_sync_median_us: f64,
    pub ratio_vs_blocking_sync: f64,
    pub ratio_vs_spinning_sync: f64,
    /// CPU per awaited operation beyond a synchronized one (spin watcher),
    /// median over rounds, and the rounds' 10th and 90th percentiles.
    pub cpu_overhead_us: f64,
    pub cpu_overhead_p10_us: f64,
    pub cpu_overhead_p90_us: f64,
}

/// CPU time of the whole process (every thread), to the nanosecond.
fn cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    Duration::new(
        t.tv_sec.max(0) as u64,
        t.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

pub fn run(base: &host::DeviceOptions, samples: usize) -> host::Result<Results> {
    let mut modes = Vec::new();
    let mut meta = None;
    for mode in [WaitMode::Spin, WaitMode::Blocking] {
        let device = Device::open(host::DeviceOptions {
            wait_mode: mode,
            ..*base
        })?;
        meta.get_or_insert_with(|| Meta::new(&device));
        modes.push(run_mode(&device, mode, samples)?);
    }
    let (spin, blocking) = match (modes.first(), modes.get(1)) {
        (Some(s), Some(b)) => (s, b),
        _ => {
            return Err(host::Error::InvalidArgument(
                "a wait mode did not run".into(),
            ))
        }
    };
    let summary = Summary {
        wake_median_us: spin.wake_median_us,
        wake_p99_us: spin.wake_p99_us,
        blocking_sync_median_us: blocking.sync_median_us,
        spinning_sync_median_us: spin.sync_median_us,
        ratio_vs_blocking_sync: spin.wake_median_us / blocking.sync_median_us,
        ratio_vs_spinning_sync: spin.wake_median_us / spin.sync_median_us,
        cpu_overhead_us: spin.cpu_overhead_us,
        cpu_overhead_p10_us: spin.cpu_overhead_p10_us,
        cpu_overhead_p90_us: spin.cpu_overhead_p90_us,
    };
    Ok(Results {
        meta: meta.ok_or_else(|| host::Error::InvalidArgument("no mode ran".into()))?,
        modes,
        summary,
    })
}

fn run_mode(device: &Device, mode: WaitMode, samples: usize) -> host::Result<ModeResult> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let stream = Stream::new(device)?;
    let gate = Arc::new(MappedFlag::new(device)?);
    let warm = 50;
    // How long the kernel gets to start spinning before the gate opens.
    let settle = Duration::from_micros(200);

    // Ours: a tokio task awaits the job behind the gate.
    let (s2, g2) = (stream.clone(), gate.clone());
    let wake: Vec<f64> = rt.block_on(async move {
        tokio::spawn(async move {
            let mut v = Vec::with_capacity(samples);
            for i in 0..warm + samples {
                g2.set(0);
                let job = s2.run(g2.clone(), |c, g| c.gate(g));
                spin(settle);
                let t0 = Instant::now();
                g2.set(1);
                job.await?;
                if i >= warm {
                    v.push(t0.elapsed().as_secs_f64() * 1e6);
                }
            }
            Ok::<_, host::Error>(v)
        })
        .await
        .map_err(|e| host::Error::InvalidArgument(format!("latency task: {e}")))?
    })?;

    // The same with the simplest executor: block_on parks this thread.
    let mut parked = Vec::with_capacity(samples);
    for i in 0..warm + samples {
        gate.set(0);
        let job = stream.run(gate.clone(), |c, g| c.gate(g));
        spin(settle);
        let t0 = Instant::now();
        gate.set(1);
        futures::executor::block_on(job)?;
        if i >= warm {
            parked.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }

    // Baseline: the driver's blocking wait on the calling thread.
    let mut sync = Vec::with_capacity(samples);
    for i in 0..warm + samples {
        gate.set(0);
        let job = stream.run(gate.clone(), |c, g| c.gate(g));
        let ev = stream.record()?;
        spin(settle);
        let t0 = Instant::now();
        gate.set(1);
        ev.synchronize_direct()?;
        if i >= warm {
            sync.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        futures::executor::block_on(job)?;
    }

    // CPU cost per operation: a 4-byte copy, awaited vs synchronized. Both
    // reuse the same two buffers, so they differ only in the wait; rounds
    // alternate the two (a block of each per round), and the figures are
    // medians over rounds, so a drift in the machine hits both alike.
    let pool = PinnedPool::new(device);
    let (rounds, per_round) = (20, samples.max(1000).div_ceil(20));
    let mut bundle = (pool.alloc::<f32>(1)?, DeviceBuffer::<f32>::new(device, 1)?);
    let (mut awaited, mut synced, mut extra) = (Vec::new(), Vec::new(), Vec::new());
    let (mut wall_a, mut wall_s) = (Vec::new(), Vec::new());
    let per = |d: Duration| d.as_secs_f64() * 1e6 / per_round as f64;
    for _ in 0..rounds {
        let s3 = stream.clone();
        let (cpu0, w0) = (cpu_time(), Instant::now());
        bundle = rt.block_on(async move {
            tokio::spawn(async move {
                let mut b = bundle;
                for _ in 0..per_round {
                    (b, ()) = s3.copy_h2d(b.0, b.1).await?;
                }
                Ok::<_, host::Error>(b)
            })
            .await
            .map_err(|e| host::Error::InvalidArgument(format!("latency task: {e}")))?
        })?;
        let (a, wa) = (per(cpu_time() - cpu0), per(w0.elapsed()));
        let (cpu0, w0) = (cpu_time(), Instant::now());
        for _ in 0..per_round {
            let job = stream.run(bundle, |c, (h, d)| c.copy_h2d(h.host(), d.view()));
            let ev = stream.record()?;
            ev.synchronize_direct()?;
            (bundle, ()) = futures::executor::block_on(job)?;
        }
        let (s, ws) = (per(cpu_time() - cpu0), per(w0.elapsed()));
        awaited.push(a);
        synced.push(s);
        extra.push(a - s);
        wall_a.push(wa);
        wall_s.push(ws);
    }

    let m = |v: &[f64]| percentile(v, 0.5);
    Ok(ModeResult {
        wait_mode: mode,
        samples,
        wake_median_us: m(&wake),
        wake_p99_us: percentile(&wake, 0.99),
        block_on_median_us: m(&parked),
        block_on_p99_us: percentile(&parked, 0.99),
        sync_median_us: m(&sync),
        sync_p99_us: percentile(&sync, 0.99),
        median_ratio: m(&wake) / m(&sync),
        cpu_us_per_awaited_op: m(&awaited),
        cpu_us_per_synced_op: m(&synced),
        cpu_overhead_us: m(&extra),
        cpu_overhead_p10_us: percentile(&extra, 0.1),
        cpu_overhead_p90_us: percentile(&extra, 0.9),
        cpu_rounds: rounds,
        wall_us_per_awaited_op: m(&wall_a),
        wall_us_per_synced_op: m(&wall_s),
    })
}

pub fn print(res: &Results) {
    println!("\nwake latency (gate opened -> awaiting task runs; tokio task, and block_on) vs cuEventSynchronize on the calling thread:");
    println!(
        "{:>9} {:>8} {:>12} {:>10} {:>12} {:>10} {:>7} {:>12} {:>12} {:>10}",
        "mode",
        "samples",
        "await med",
        "await p99",
        "sync med",
        "sync p99",
        "ratio",
        "CPU/await",
        "CPU/sync",
        "overhead"
    );
    for m in &res.modes {
        println!(
            "{:>9} block_on: median {:.1}us, p99 {:.1}us ({:.2}x the synchronize median)",
            format!("{:?}", m.wait_mode),
            m.block_on_median_us,
            m.block_on_p99_us,
            m.block_on_median_us / m.sync_median_us
        );
        println!(
            "{:>9} {:>8} {:>10.1}us {:>8.1}us {:>10.1}us {:>8.1}us {:>6.2}x {:>10.2}us {:>10.2}us {:>8.2}us",
            format!("{:?}", m.wait_mode), m.samples, m.wake_median_us, m.wake_p99_us, m.sync_median_us, m.sync_p99_us,
            m.median_ratio, m.cpu_us_per_awaited_op, m.cpu_us_per_synced_op, m.cpu_overhead_us
        );
    }
    let s = &res.summary;
    println!(
        "awaited (spin watcher, tokio): median {:.1}us, p99 {:.1}us = {:.2}x a blocking-sync event wait ({:.1}us), \
         {:.2}x a spinning one ({:.1}us); CPU +{:.2}us per awaited op (rounds: {:.2} to {:.2})",
        s.wake_median_us,
        s.wake_p99_us,
        s.ratio_vs_blocking_sync,
        s.blocking_sync_median_us,
        s.ratio_vs_spinning_sync,
        s.spinning_sync_median_us,
        s.cpu_overhead_us,
        s.cpu_overhead_p10_us,
        s.cpu_overhead_p90_us
    );
}
