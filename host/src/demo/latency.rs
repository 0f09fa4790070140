//! `host latency`: how long from GPU completion to the awaiting task running,
//! against the driver's own event wait on the calling thread, and what an
//! awaited operation costs the CPU; for three executors.
//!
//! Method: a `gate_wait` kernel holds the stream while a point is recorded
//! behind it; after the kernel has had time to start spinning, the host opens
//! the gate at `t0`. Awaited: a task awaiting the job notes `t1` when it runs,
//! on a tokio multi-thread runtime (2 workers), a tokio current-thread runtime
//! and `futures::executor::block_on`. Baseline: the thread calls
//! `cuEventSynchronize` (`synchronize_direct`) and notes `t1` when it returns.
//! All include the same GPU part (the flag crossing PCIe, the kernel ending,
//! the event firing), so their ratio is the price of the future. CPU cost:
//! process CPU time per 4-byte copy, awaited, against the same copy done
//! with [`gpufeed::Stream::run_sync`] (the driver's wait on the calling thread,
//! no completion thread involved). Rounds
//! alternate the baseline and the executors, so a drift of this shared
//! machine hits all alike. Each wait mode runs in its own device handle.

use super::fmt::Words;
use super::report::{percentile, Meta};
use gpufeed::{
    Device, DeviceBuffer, MappedFlag, PinnedHost, PinnedPool, PooledBuffer, Stream, WaitMode,
};
use indicatif::ProgressBar;
use serde::Serialize;
use std::future::Future;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Where the awaiting task runs.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Executor {
    /// `tokio::runtime::Builder::new_multi_thread()` with its default worker
    /// count (one per core, as `#[tokio::main]`); the task is spawned.
    TokioMultiThread,
    /// The same with two workers.
    TokioMultiThread2,
    /// `tokio::runtime::Builder::new_current_thread()` (`flavor = "current_thread"`).
    TokioCurrentThread,
    /// `futures::executor::block_on` on a plain thread (thread park/unpark).
    BlockOn,
    /// `gpufeed::block_on` on a plain thread: spins for the wake-up (up to
    /// `gpufeed::SPIN`, on 4+ cores), then parks.
    HostBlockOn,
}

const EXECUTORS: [Executor; 5] = [
    Executor::TokioMultiThread,
    Executor::TokioMultiThread2,
    Executor::TokioCurrentThread,
    Executor::BlockOn,
    Executor::HostBlockOn,
];

#[derive(Serialize, Clone)]
pub struct ExecutorResult {
    pub executor: Executor,
    /// Microseconds from opening the gate to the awaiting task running.
    pub wake_median_us: f64,
    pub wake_p90_us: f64,
    pub wake_p99_us: f64,
    pub wake_max_us: f64,
    /// Samples over 50 us.
    pub wake_over_50us: usize,
    /// wake_median over this mode's synchronize median.
    pub ratio_vs_sync: f64,
    /// Process CPU time per awaited 4-byte copy (median over rounds).
    pub cpu_us_per_awaited_op: f64,
    /// CPU per awaited op minus CPU per synchronized op of the same round:
    /// what awaiting costs beyond the driver's wait (median, p10, p90 over rounds).
    pub cpu_overhead_us: f64,
    pub cpu_overhead_p10_us: f64,
    pub cpu_overhead_p90_us: f64,
    pub wall_us_per_awaited_op: f64,
    /// Reference with no GPU: CPU and wall time per round trip of the same
    /// two hand-offs through other code (the task sends a request over a std
    /// channel to a plain thread, which answers on a `tokio::sync::oneshot`).
    pub echo_cpu_us_per_op: f64,
    pub echo_wall_us_per_op: f64,
    /// cpu_overhead minus the echo's CPU, per round (median): what awaiting
    /// costs beyond two plain hand-offs under the same executor.
    pub cpu_overhead_beyond_echo_us: f64,
}

#[derive(Serialize, Clone)]
pub struct ModeResult {
    pub wait_mode: WaitMode,
    /// Wake samples per executor and for the synchronize.
    pub samples: usize,
    /// Microseconds from opening the gate to `cuEventSynchronize` returning.
    pub sync_median_us: f64,
    pub sync_p99_us: f64,
    /// Process CPU time per synchronized 4-byte copy (median over rounds).
    pub cpu_us_per_synced_op: f64,
    pub wall_us_per_synced_op: f64,
    pub cpu_rounds: usize,
    /// Process CPU time over wall time while a task awaits work that takes
    /// [`IDLE_WAIT`] (a gate held closed): how much of a core the watcher
    /// takes while waiting (1.0 = one busy core).
    pub waiting_core_share: f64,
    pub executors: Vec<ExecutorResult>,
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
    /// `cuEventSynchronize` on an event made with `CU_EVENT_BLOCKING_SYNC`,
    /// CUDA's "blocking synchronization" (the caller sleeps, like an awaiting
    /// task).
    pub blocking_sync_median_us: f64,
    /// `cuEventSynchronize` on a default event, which spins on the caller's
    /// core (what no executor thread may do): the floor.
    pub spinning_sync_median_us: f64,
    /// Per executor, with the default (spin) watcher.
    pub awaited: Vec<SummaryRow>,
}

#[derive(Serialize)]
pub struct SummaryRow {
    pub executor: Executor,
    pub wake_median_us: f64,
    pub wake_p99_us: f64,
    pub ratio_vs_blocking_sync: f64,
    pub ratio_vs_spinning_sync: f64,
    pub cpu_overhead_us: f64,
    pub cpu_overhead_p10_us: f64,
    pub cpu_overhead_p90_us: f64,
    /// The echo's CPU per round trip (two hand-offs, no GPU) and the
    /// overhead beyond it.
    pub echo_cpu_us: f64,
    pub cpu_overhead_beyond_echo_us: f64,
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

/// Runs `f`; returns its value, the process CPU time and the wall time it
/// took. Pauses before and after: Linux brings a running thread's CPU time
/// up to date only at a tick or a context switch, so a helper thread still
/// running when the clock is read (a spinning watcher, a worker) would have
/// part of its time charged to the next block (seen on the H200 machine:
/// time moved from awaited blocks into the next ones). After the pause
/// every helper thread is asleep and its time is exact.
fn measured<T>(f: impl FnOnce() -> gpufeed::Result<T>) -> gpufeed::Result<(T, Duration, Duration)> {
    let pause = Duration::from_millis(2);
    std::thread::sleep(pause);
    let (cpu0, w0) = (cpu_time(), Instant::now());
    let v = f()?;
    let wall = w0.elapsed();
    std::thread::sleep(pause);
    Ok((v, cpu_time() - cpu0, wall))
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// Rounds of wake samples and of CPU blocks, per wait mode.
const WAKE_ROUNDS: usize = 10;
const CPU_ROUNDS: usize = 20;
const MODES: [WaitMode; 3] = [WaitMode::Spin, WaitMode::Blocking, WaitMode::Poll];

/// Progress steps of [`run`]: one a round.
pub const STEPS: u64 = (MODES.len() * (WAKE_ROUNDS + CPU_ROUNDS)) as u64;

pub fn run(
    base: &gpufeed::DeviceOptions,
    samples: usize,
    progress: &ProgressBar,
) -> gpufeed::Result<Results> {
    let mut modes = Vec::new();
    let mut meta = None;
    for mode in MODES {
        let device = Device::open(gpufeed::DeviceOptions {
            wait_mode: mode,
            ..*base
        })?;
        meta.get_or_insert_with(|| Meta::new(&device));
        modes.push(run_mode(&device, mode, samples, progress)?);
    }
    let (spin, blocking) = match (modes.first(), modes.get(1)) {
        (Some(s), Some(b)) => (s, b),
        _ => {
            return Err(gpufeed::Error::InvalidArgument(
                "a wait mode did not run".into(),
            ))
        }
    };
    let awaited = spin
        .executors
        .iter()
        .map(|e| SummaryRow {
            executor: e.executor,
            wake_median_us: e.wake_median_us,
            wake_p99_us: e.wake_p99_us,
            ratio_vs_blocking_sync: e.wake_median_us / blocking.sync_median_us,
            ratio_vs_spinning_sync: e.wake_median_us / spin.sync_median_us,
            cpu_overhead_us: e.cpu_overhead_us,
            cpu_overhead_p10_us: e.cpu_overhead_p10_us,
            cpu_overhead_p90_us: e.cpu_overhead_p90_us,
            echo_cpu_us: e.echo_cpu_us_per_op,
            cpu_overhead_beyond_echo_us: e.cpu_overhead_beyond_echo_us,
        })
        .collect();
    let summary = Summary {
        blocking_sync_median_us: blocking.sync_median_us,
        spinning_sync_median_us: spin.sync_median_us,
        awaited,
    };
    Ok(Results {
        meta: meta.ok_or_else(|| gpufeed::Error::InvalidArgument("no mode ran".into()))?,
        modes,
        summary,
    })
}

/// The three tokio runtimes (built once per mode) and `block_on`.
struct Executors {
    multi: tokio::runtime::Runtime,
    multi2: tokio::runtime::Runtime,
    current: tokio::runtime::Runtime,
}

impl Executors {
    fn new() -> gpufeed::Result<Self> {
        Ok(Executors {
            multi: tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?,
            multi2: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?,
            current: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
        })
    }

    /// Runs `fut` to completion as a task of `ex`.
    fn run<T: Send + 'static>(
        &self,
        ex: Executor,
        fut: impl Future<Output = gpufeed::Result<T>> + Send + 'static,
    ) -> gpufeed::Result<T> {
        match ex {
            Executor::TokioMultiThread => Self::spawned(&self.multi, fut),
            Executor::TokioMultiThread2 => Self::spawned(&self.multi2, fut),
            Executor::TokioCurrentThread => self.current.block_on(fut),
            Executor::BlockOn => futures::executor::block_on(fut),
            Executor::HostBlockOn => gpufeed::block_on(fut),
        }
    }

    /// Spawned, so the task runs on a worker, not on this thread.
    fn spawned<T: Send + 'static>(
        rt: &tokio::runtime::Runtime,
        fut: impl Future<Output = gpufeed::Result<T>> + Send + 'static,
    ) -> gpufeed::Result<T> {
        rt.block_on(async move {
            tokio::spawn(fut)
                .await
                .map_err(|e| gpufeed::Error::InvalidArgument(format!("latency task: {e}")))?
        })
    }
}

/// How long the kernel gets to start spinning before the gate opens.
const SETTLE: Duration = Duration::from_micros(200);

/// `n` wake samples (after `warm` unrecorded ones) awaited by a task.
async fn wake_awaited(
    stream: Stream,
    gate: Arc<MappedFlag>,
    warm: usize,
    n: usize,
) -> gpufeed::Result<Vec<f64>> {
    let mut v = Vec::with_capacity(n);
    for i in 0..warm + n {
        gate.set(0);
        let job = stream.run(gate.clone(), |c, g| c.gate(g));
        spin(SETTLE);
        let t0 = Instant::now();
        gate.set(1);
        job.await?;
        if i >= warm {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(v)
}

/// `n` round trips to the echo thread (no GPU): the hand-offs alone.
async fn echoes(tx: mpsc::Sender<oneshot::Sender<()>>, n: usize) -> gpufeed::Result<()> {
    let gone = || gpufeed::Error::InvalidArgument("the echo thread stopped".into());
    for _ in 0..n {
        let (s, r) = oneshot::channel();
        tx.send(s).map_err(|_| gone())?;
        r.await.map_err(|_| gone())?;
    }
    Ok(())
}

/// The same with the driver's wait on this thread.
fn wake_synced(
    stream: &Stream,
    gate: &Arc<MappedFlag>,
    warm: usize,
    n: usize,
) -> gpufeed::Result<Vec<f64>> {
    let mut v = Vec::with_capacity(n);
    for i in 0..warm + n {
        gate.set(0);
        let job = stream.run(gate.clone(), |c, g| c.gate(g));
        let ev = stream.record()?;
        spin(SETTLE);
        let t0 = Instant::now();
        gate.set(1);
        ev.synchronize_direct()?;
        if i >= warm {
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        futures::executor::block_on(job)?;
    }
    Ok(v)
}

type Bundle = (PooledBuffer<f32>, DeviceBuffer<f32>);

/// Per-operation CPU and wall microseconds of one kind of block, a value per round.
#[derive(Default, Clone)]
struct Block {
    cpu: Vec<f64>,
    wall: Vec<f64>,
}

impl Block {
    fn push(&mut self, cpu: f64, wall: f64) {
        self.cpu.push(cpu);
        self.wall.push(wall);
    }
}

/// `n` awaited 4-byte copies, each reusing the same two buffers.
async fn copies_awaited(stream: Stream, mut b: Bundle, n: usize) -> gpufeed::Result<Bundle> {
    for _ in 0..n {
        (b, ()) = stream.copy_h2d(b.0, b.1).await?;
    }
    Ok(b)
}

/// The same copies, each waited for with `cuEventSynchronize` on this
/// thread (`run_sync`: no completion thread involved).
fn copies_synced(stream: &Stream, mut b: Bundle, n: usize) -> gpufeed::Result<Bundle> {
    for _ in 0..n {
        (b, ()) = stream.run_sync(b, |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()))?;
    }
    Ok(b)
}

/// How long the idle-wait measurement holds the gate.
const IDLE_WAIT: Duration = Duration::from_millis(300);

/// Process CPU time over wall time while a job held by a closed gate is
/// awaited (the thread awaiting it parks): the watcher's share of a core.
fn waiting_core_share(stream: &Stream, gate: &Arc<MappedFlag>) -> gpufeed::Result<f64> {
    gate.set(0);
    let job = stream.run(gate.clone(), |c, g| c.gate(g));
    let (_, cpu, wall) = measured(|| {
        let g = gate.clone();
        let opener = std::thread::spawn(move || {
            std::thread::sleep(IDLE_WAIT);
            g.set(1);
        });
        let r = futures::executor::block_on(job);
        let _ = opener.join();
        r.map_err(gpufeed::Error::from)
    })?;
    Ok(cpu.as_secs_f64() / wall.as_secs_f64())
}

fn run_mode(
    device: &Device,
    mode: WaitMode,
    samples: usize,
    progress: &ProgressBar,
) -> gpufeed::Result<ModeResult> {
    let ex = Executors::new()?;
    let stream = Stream::new(device)?;
    let gate = Arc::new(MappedFlag::new(device)?);
    let rounds = WAKE_ROUNDS;
    let per_round = samples.div_ceil(rounds);
    let warm = 5;

    // Wake latency: each round takes a block of samples from the synchronize
    // and from each executor, in turn.
    let mut sync = Vec::new();
    let mut wake: Vec<Vec<f64>> = vec![Vec::new(); EXECUTORS.len()];
    let mode_name = format!("{mode:?}").to_lowercase();
    for _ in 0..rounds {
        progress.set_message(format!("wake latency, {mode_name} watcher"));
        sync.extend(wake_synced(&stream, &gate, warm, per_round)?);
        for (k, &e) in EXECUTORS.iter().enumerate() {
            let v = ex.run(
                e,
                wake_awaited(stream.clone(), gate.clone(), warm, per_round),
            )?;
            wake[k].extend(v);
        }
        progress.inc(1);
    }

    progress.set_message(format!("CPU while waiting, {mode_name} watcher"));
    let waiting_core_share = waiting_core_share(&stream, &gate)?;

    // CPU cost per operation: a 4-byte copy, awaited vs synchronized, with
    // the same two buffers, so they differ only in the wait. Each round runs
    // a block of each; figures are medians over rounds.
    let pool = PinnedPool::new(device);
    let (cpu_rounds, per_block) = (CPU_ROUNDS, samples.max(1000).div_ceil(CPU_ROUNDS));
    let mut bundle = (pool.alloc::<f32>(1)?, DeviceBuffer::<f32>::new(device, 1)?);
    let mut synced = Block::default();
    let mut awaited = vec![Block::default(); EXECUTORS.len()];
    let mut echoed = vec![Block::default(); EXECUTORS.len()];
    let (echo_tx, echo_rx) = mpsc::channel::<oneshot::Sender<()>>();
    let echo = std::thread::spawn(move || {
        while let Ok(s) = echo_rx.recv() {
            let _ = s.send(());
        }
    });
    let per = |d: Duration| d.as_secs_f64() * 1e6 / per_block as f64;
    for _ in 0..cpu_rounds {
        progress.set_message(format!("CPU per operation, {mode_name} watcher"));
        let (b, cpu, wall) = measured(|| copies_synced(&stream, bundle, per_block))?;
        bundle = b;
        synced.push(per(cpu), per(wall));
        for (k, &e) in EXECUTORS.iter().enumerate() {
            let (b, cpu, wall) =
                measured(|| ex.run(e, copies_awaited(stream.clone(), bundle, per_block)))?;
            bundle = b;
            awaited[k].push(per(cpu), per(wall));
            let ((), cpu, wall) = measured(|| ex.run(e, echoes(echo_tx.clone(), per_block)))?;
            echoed[k].push(per(cpu), per(wall));
        }
        progress.inc(1);
    }
    drop(echo_tx);
    let _ = echo.join();

    let m = |v: &[f64]| super::report::median(v);
    let sync_median = m(&sync);
    let executors = EXECUTORS
        .iter()
        .enumerate()
        .map(|(k, &e)| {
            // Per round: awaiting minus synchronizing, and minus the echo too.
            let extra: Vec<f64> = awaited[k]
                .cpu
                .iter()
                .zip(&synced.cpu)
                .map(|(a, s)| a - s)
                .collect();
            let beyond: Vec<f64> = extra
                .iter()
                .zip(&echoed[k].cpu)
                .map(|(x, e)| x - e)
                .collect();
            ExecutorResult {
                executor: e,
                wake_median_us: m(&wake[k]),
                wake_p90_us: percentile(&wake[k], 0.9),
                wake_p99_us: percentile(&wake[k], 0.99),
                wake_max_us: wake[k].iter().copied().fold(0.0, f64::max),
                wake_over_50us: wake[k].iter().filter(|&&w| w > 50.0).count(),
                ratio_vs_sync: m(&wake[k]) / sync_median,
                cpu_us_per_awaited_op: m(&awaited[k].cpu),
                cpu_overhead_us: m(&extra),
                cpu_overhead_p10_us: percentile(&extra, 0.1),
                cpu_overhead_p90_us: percentile(&extra, 0.9),
                wall_us_per_awaited_op: m(&awaited[k].wall),
                echo_cpu_us_per_op: m(&echoed[k].cpu),
                echo_wall_us_per_op: m(&echoed[k].wall),
                cpu_overhead_beyond_echo_us: m(&beyond),
            }
        })
        .collect();
    Ok(ModeResult {
        wait_mode: mode,
        samples: sync.len(),
        sync_median_us: sync_median,
        sync_p99_us: percentile(&sync, 0.99),
        cpu_us_per_synced_op: m(&synced.cpu),
        wall_us_per_synced_op: m(&synced.wall),
        cpu_rounds,
        waiting_core_share,
        executors,
    })
}

pub fn print(res: &Results) {
    let w = Words::for_kind(res.meta.backend);
    println!("\nwake latency: from the gate opening (a kernel holds the stream until the host sets a flag)");
    println!(
        "to the awaiting task running, against {}.",
        w.thread_wait_long()
    );
    if w.cpu {
        println!("The watcher (spin or blocking) is how CUDA's completion thread waits; the CPU emulation has");
        println!("none, so its two blocks run the same code and show the run-to-run spread.");
    }
    println!(
        "{:>9} {:>20} {:>9} {:>9} {:>9} {:>6} {:>7}",
        "watcher", "waiter", "median", "p99", "max", ">50us", "ratio"
    );
    for m in &res.modes {
        let mode = format!("{:?}", m.wait_mode);
        println!(
            "{:>9} {:>20} {:>7.1}us {:>7.1}us {:>9} {:>6} {:>7}",
            mode,
            w.thread_wait(),
            m.sync_median_us,
            m.sync_p99_us,
            "",
            "",
            "1.00x"
        );
        for e in &m.executors {
            println!(
                "{:>9} {:>20} {:>7.1}us {:>7.1}us {:>7.0}us {:>6} {:>6.2}x",
                mode,
                format!("{:?}", e.executor),
                e.wake_median_us,
                e.wake_p99_us,
                e.wake_max_us,
                e.wake_over_50us,
                e.ratio_vs_sync
            );
        }
    }
    println!(
        "\nCPU while waiting: process CPU time over wall time while a task awaits {} ms of GPU work",
        IDLE_WAIT.as_millis()
    );
    for m in &res.modes {
        println!(
            "{:>9}: {:.1}% of a core",
            format!("{:?}", m.wait_mode),
            100.0 * m.waiting_core_share
        );
    }
    if w.cpu {
        println!("(CPU emulation: the gate kernel itself polls on a worker thread, so this measures the gate, not a watcher.)");
    }
    println!("\nCPU per operation: process CPU time per 4-byte copy, awaited or waited for on the calling");
    println!("thread; overhead = awaited minus waited-for, per round (median, and p10..p90 over rounds);");
    println!(
        "echo = the same two thread hand-offs with no copy (std channel out, tokio oneshot back)."
    );
    println!(
        "{:>9} {:>20} {:>9} {:>9} {:>17} {:>9} {:>9}",
        "watcher", "waiter", "CPU/op", "overhead", "(p10..p90)", "echo CPU", "echo wall"
    );
    for m in &res.modes {
        let mode = format!("{:?}", m.wait_mode);
        println!(
            "{:>9} {:>20} {:>7.2}us",
            mode,
            w.thread_wait(),
            m.cpu_us_per_synced_op
        );
        for e in &m.executors {
            println!(
                "{:>9} {:>20} {:>7.2}us {:>7.2}us {:>7.2}..{:>6.2}us {:>7.2}us {:>7.2}us",
                mode,
                format!("{:?}", e.executor),
                e.cpu_us_per_awaited_op,
                e.cpu_overhead_us,
                e.cpu_overhead_p10_us,
                e.cpu_overhead_p90_us,
                e.echo_cpu_us_per_op,
                e.echo_wall_us_per_op
            );
        }
    }
    let s = &res.summary;
    println!("\nin short (spin watcher):");
    for r in &s.awaited {
        let against = if w.cpu {
            format!(
                "{:.2}x a {} ({:.1}us)",
                r.ratio_vs_spinning_sync,
                w.thread_wait(),
                s.spinning_sync_median_us
            )
        } else {
            format!(
                "{:.2}x a blocking-sync event wait ({:.1}us), {:.2}x a spinning one ({:.1}us)",
                r.ratio_vs_blocking_sync,
                s.blocking_sync_median_us,
                r.ratio_vs_spinning_sync,
                s.spinning_sync_median_us
            )
        };
        let beyond = r.cpu_overhead_beyond_echo_us;
        let vs_echo = if beyond <= 0.0 {
            format!("awaiting costs no more than them ({beyond:+.2}us)")
        } else {
            format!("awaiting costs {beyond:.2}us more")
        };
        println!(
            "  {:?}: wake median {:.1}us, p99 {:.1}us",
            r.executor, r.wake_median_us, r.wake_p99_us
        );
        println!("    = {against}");
        println!(
            "    CPU overhead {:+.2}us per awaited op (p10..p90 {:.2}..{:.2}); two plain hand-offs cost {:.2}us,",
            r.cpu_overhead_us, r.cpu_overhead_p10_us, r.cpu_overhead_p90_us, r.echo_cpu_us
        );
        println!("    {vs_echo}");
    }
}
