//! `host small-transfers`: many small copies, 4 KiB to 4 MiB, one and 64 in
//! flight, in copies per second and GB/s, both directions: awaited jobs and
//! [`gpufeed::Stream::run_sync`] against raw driver copies of the same sizes in
//! the same run (and, through `bench/peers/torch_small.py`, against
//! PyTorch's `non_blocking` copies of pinned tensors).
//!
//! Modes (ours on one stream but for one variant; the raw driver copies on a
//! stream of their own; per size, 64 pairs of a pinned host buffer and a
//! device buffer, the copies cycling over them):
//! - `run_sync_1`: `stream.run_sync(pair, |c, p| c.copy_h2d(..))` per copy:
//!   each copy is waited for in the driver on the calling thread before the
//!   next is issued.
//! - `awaited_1`: `stream.run(pair, ..).await` per copy, in a loop, run by
//!   [`gpufeed::block_on`] on the calling thread (which spins for the wake-up
//!   before it parks), as every awaited mode but the next.
//! - `awaited_1_tokio`: the same loop on the demonstration's tokio runtime
//!   (`Runtime::block_on`, whose thread parks at once).
//! - `awaited_64`: 64 separate jobs, one per pair, kept outstanding with a
//!   `FuturesUnordered` window: as each resolves, its buffers go straight
//!   into the next copy.
//! - `awaited_64_batch`: 64 jobs issued, then `try_join_all`; repeated.
//! - `awaited_64_one_job`: one job whose batch issues the 64 copies (the 64
//!   pairs are its bundle), awaited; repeated.
//! - `awaited_64_4_streams`: the window of `awaited_64`, its jobs spread
//!   round robin over 4 streams (a variant: the rest use one stream).
//! - `awaited_64_copy_batch`: one job whose batch is one
//!   [`Commands::copy_batch`] of the 64 copies (one driver call,
//!   `cuMemcpyBatchAsync`), awaited; repeated.
//! - `raw_1`: `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` then
//!   `cuStreamSynchronize`, per copy (cudarc's `sys` layer, driver-allocated
//!   pinned memory: [`super::bandwidth::raw`]).
//! - `raw_64`: 64 of those copies issued, then one `cuStreamSynchronize`.
//!
//! Method, per size and direction: each mode first runs one checked round of
//! 64 copies (every buffer once, fresh random bytes in, every byte compared
//! with what came back; it is also the warm-up), whose time sizes the mode's
//! timed rounds (about [`Config::target`] each; a multiple of 64 copies for
//! the 64-in-flight modes); then the timed rounds, the modes taking turns
//! within each round so that a drift of the machine hits all alike. Copies
//! per second = copies of a round / its host wall time (the awaited modes
//! time inside the future); medians over rounds; GB/s = that median × bytes
//! / 1e9.

use super::bandwidth::raw;
use super::fmt::{size, Words};
use super::report::{cell, median, write_csv, write_json, Meta};
use cudarc::driver::sys;
use futures::stream::{FuturesUnordered, StreamExt};
use gpufeed::{
    Commands, Device, DeviceBuffer, Job, PinnedHost, PinnedPool, PooledBuffer, Stream, Transfer,
};
use indicatif::ProgressBar;
use serde::Serialize;
use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};

/// Copy sizes in bytes: 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB.
pub const SIZES: [usize; 5] = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];

/// Buffers (and copies outstanding) of the "64 in flight" modes.
pub const IN_FLIGHT: usize = 64;

/// Every byte of the test data has its lowest bit set: random, never zero.
/// A buffer's data is a fresh random pattern (one per checked round) XORed
/// with a random key of its own whose bytes have that bit clear, so buffers
/// differ from each other and a copy into the wrong buffer shows.
const NONZERO: u64 = 0x0101_0101_0101_0101;
/// What a destination is overwritten with before a checked copy into it:
/// keeps every byte nonzero and makes every byte differ from the data.
const SCRIBBLE: u64 = 0x0202_0202_0202_0202;

/// How much to measure.
#[derive(Clone, Debug)]
pub struct Config {
    pub sizes: Vec<usize>,
    /// Timed rounds per mode, size and direction.
    pub rounds: usize,
    /// Wall time a timed round aims at.
    pub target: Duration,
    /// Most copies in a round.
    pub max_copies: usize,
}

impl Config {
    /// A GPU: every size, rounds of about 25 ms, 11 of them. The CPU
    /// emulation (and `demo --small`): 4 KiB to 1 MiB (64 buffers of 4 MiB
    /// are a memory-bound half second a round of memcpy there), rounds of
    /// about 2 ms, 3 of them, so CI stays fast.
    pub fn for_device(device: &Device, small: bool) -> Config {
        if small || device.kind() == gpufeed::BackendKind::Cpu {
            Config {
                sizes: SIZES.iter().copied().filter(|&b| b <= 1 << 20).collect(),
                rounds: 3,
                target: Duration::from_millis(2),
                max_copies: 1024,
            }
        } else {
            Config {
                sizes: SIZES.to_vec(),
                rounds: 11,
                target: Duration::from_millis(25),
                max_copies: 16384,
            }
        }
    }

    /// The same with `rounds` timed rounds and these sizes (bytes), if given.
    pub fn with(mut self, rounds: Option<usize>, sizes: Option<Vec<usize>>) -> Config {
        if let Some(r) = rounds {
            self.rounds = r;
        }
        if let Some(s) = sizes {
            self.sizes = s;
        }
        self
    }
}

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    H2d,
    D2h,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::H2d => "H2D",
            Direction::D2h => "D2H",
        }
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::H2d, Direction::D2h];

/// How the copies are issued and waited for (see the module's docs).
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    #[serde(rename = "run_sync_1")]
    RunSync1,
    #[serde(rename = "awaited_1")]
    Awaited1,
    #[serde(rename = "awaited_1_tokio")]
    Awaited1Tokio,
    #[serde(rename = "raw_1")]
    Raw1,
    #[serde(rename = "awaited_64")]
    Awaited64,
    #[serde(rename = "awaited_64_batch")]
    Awaited64Batch,
    #[serde(rename = "awaited_64_one_job")]
    Awaited64OneJob,
    #[serde(rename = "awaited_64_4_streams")]
    Awaited64Streams4,
    #[serde(rename = "awaited_64_copy_batch")]
    Awaited64CopyBatch,
    #[serde(rename = "raw_64")]
    Raw64,
}

const MODES: [Mode; 10] = [
    Mode::RunSync1,
    Mode::Awaited1,
    Mode::Awaited1Tokio,
    Mode::Raw1,
    Mode::Awaited64,
    Mode::Awaited64Batch,
    Mode::Awaited64OneJob,
    Mode::Awaited64Streams4,
    Mode::Awaited64CopyBatch,
    Mode::Raw64,
];

/// Streams of the `awaited_64_4_streams` variant.
const STREAMS: usize = 4;

impl Mode {
    fn in_flight(self) -> usize {
        match self {
            Mode::RunSync1 | Mode::Awaited1 | Mode::Awaited1Tokio | Mode::Raw1 => 1,
            _ => IN_FLIGHT,
        }
    }

    fn is_raw(self) -> bool {
        matches!(self, Mode::Raw1 | Mode::Raw64)
    }

    /// Streams the mode's copies go over.
    fn streams(self) -> usize {
        match self {
            Mode::Awaited64Streams4 => STREAMS,
            _ => 1,
        }
    }

    /// Column header.
    fn short(self) -> &'static str {
        match self {
            Mode::RunSync1 => "run_sync 1",
            Mode::Awaited1 => "awaited 1",
            Mode::Awaited1Tokio => "tokio 1",
            Mode::Raw1 => "raw 1",
            Mode::Awaited64 => "awaited 64",
            Mode::Awaited64Batch => "64 batch",
            Mode::Awaited64OneJob => "64 one job",
            Mode::Awaited64Streams4 => "64 4 strms",
            Mode::Awaited64CopyBatch => "64 copy_batch",
            Mode::Raw64 => "raw 64",
        }
    }

    /// Legend of the plot.
    fn long(self) -> &'static str {
        match self {
            Mode::RunSync1 => "run_sync, 1 in flight",
            Mode::Awaited1 => "awaited (gpufeed::block_on), 1 in flight",
            Mode::Awaited1Tokio => "awaited (tokio), 1 in flight",
            Mode::Raw1 => "raw driver copy + stream sync, 1 in flight",
            Mode::Awaited64 => "awaited, 64 jobs in flight (window)",
            Mode::Awaited64Batch => "awaited, 64 jobs then join all",
            Mode::Awaited64OneJob => "awaited, one job of 64 copies",
            Mode::Awaited64Streams4 => "awaited, 64 jobs in flight over 4 streams",
            Mode::Awaited64CopyBatch => "awaited, one job of one copy_batch of 64",
            Mode::Raw64 => "raw driver, 64 copies then one sync",
        }
    }
}

/// One mode at one size and direction. The same fields as the rows of
/// `bench/peers/torch_small.py`'s JSON, so the two compare directly.
#[derive(Serialize, Clone)]
pub struct Row {
    pub bytes: usize,
    pub direction: Direction,
    pub mode: Mode,
    pub in_flight: usize,
    /// Streams the copies went over.
    pub streams: usize,
    /// Copies per second, median over rounds (None: not measured).
    pub ops_per_s: Option<f64>,
    /// GB/s (1e9 bytes per second) of that median.
    pub gb_per_s: Option<f64>,
    pub ops_per_s_min: Option<f64>,
    pub ops_per_s_max: Option<f64>,
    pub copies_per_round: usize,
    pub rounds: usize,
    /// The checked round's bytes all came back right (None: not measured).
    pub verified: Option<bool>,
    /// Why the row is empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<&'static str>,
}

/// The issue's comparisons, per size and direction: ours over the raw
/// driver's copies per second (None where raw copies were not measured).
#[derive(Serialize, Clone)]
pub struct Ratio {
    pub bytes: usize,
    pub direction: Direction,
    pub awaited_1_vs_raw_1: Option<f64>,
    pub awaited_64_copy_batch_vs_raw_64: Option<f64>,
    pub run_sync_1_vs_raw_1: Option<f64>,
    pub awaited_64_vs_raw_64: Option<f64>,
    pub awaited_64_batch_vs_raw_64: Option<f64>,
    pub awaited_64_one_job_vs_raw_64: Option<f64>,
    /// Measured everywhere: the price of awaiting over a blocking wait.
    pub awaited_1_vs_run_sync_1: Option<f64>,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    pub peer: &'static str,
    /// How the awaited modes run.
    pub executor: &'static str,
    /// Host buffers were page-locked (false only on the CPU emulation when
    /// the memlock limit refused `mlock`).
    pub locked: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_note: Option<&'static str>,
    pub rows: Vec<Row>,
    pub ratios: Vec<Ratio>,
}

const NO_RAW_CPU: &str = "no raw driver on the CPU emulation: not measured";
const NO_RAW_CTX: &str = "the raw driver context could not be set up: not measured";

/// A line of small_transfers.csv: numbers rounded, empty cells where nothing
/// was measured.
#[derive(Serialize)]
struct CsvRow {
    bytes: usize,
    direction: Direction,
    mode: Mode,
    in_flight: usize,
    streams: usize,
    ops_per_s: Option<f64>,
    gb_per_s: Option<f64>,
    ops_per_s_min: Option<f64>,
    ops_per_s_max: Option<f64>,
    copies_per_round: usize,
    rounds: usize,
    verified: Option<bool>,
}

impl From<&Row> for CsvRow {
    fn from(r: &Row) -> CsvRow {
        let c = |v: Option<f64>, d| v.and_then(|v| cell(v, d));
        CsvRow {
            bytes: r.bytes,
            direction: r.direction,
            mode: r.mode,
            in_flight: r.in_flight,
            streams: r.streams,
            ops_per_s: c(r.ops_per_s, 0),
            gb_per_s: c(r.gb_per_s, 3),
            ops_per_s_min: c(r.ops_per_s_min, 0),
            ops_per_s_max: c(r.ops_per_s_max, 0),
            copies_per_round: r.copies_per_round,
            rounds: r.rounds,
            verified: r.verified,
        }
    }
}

/// The random data of a checked round: a pattern of one buffer's length,
/// and the keys that make each buffer's copy of it its own.
struct Data {
    pattern: Vec<u64>,
    rng: fastrand::Rng,
}

impl Data {
    fn new(words: usize, seed: u64) -> Data {
        Data {
            pattern: vec![0; words],
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// A fresh pattern, every byte with its lowest bit set.
    fn fresh(&mut self) {
        for x in &mut self.pattern {
            *x = self.rng.u64(..) | NONZERO;
        }
    }

    /// A fresh key: random, every byte's lowest bit clear.
    fn key(&mut self) -> u64 {
        self.rng.u64(..) & !NONZERO
    }
}

/// Fills `v` with the pattern under `key`: every byte nonzero.
fn fill(v: &mut [u64], pattern: &[u64], key: u64) {
    for (x, p) in v.iter_mut().zip(pattern) {
        *x = p ^ key;
    }
}

/// Whether `v` holds exactly what `fill(_, pattern, key)` writes.
fn holds(v: &[u64], pattern: &[u64], key: u64) -> bool {
    v.len() == pattern.len() && v.iter().zip(pattern).all(|(x, p)| *x == p ^ key)
}

fn scribble(v: &mut [u64]) {
    for x in v {
        *x ^= SCRIBBLE;
    }
}

/// A host buffer and a device buffer copied between; `key` names the data
/// the last checked copy should have left in them.
struct Slot {
    host: PooledBuffer<u64>,
    dev: DeviceBuffer<u64>,
    key: u64,
}

/// The one copy of a slot, in a batch.
fn issue<'a>(c: &mut Commands<'a>, s: &'a mut Slot, dir: Direction) -> gpufeed::Result<()> {
    let Slot { host, dev, .. } = s;
    match dir {
        Direction::H2d => c.copy_h2d(host.host(), dev.view_mut()),
        Direction::D2h => c.copy_d2h(dev.view(), host.host_mut()),
    }
}

/// The one copy of a slot, as a part of a [`Commands::copy_batch`].
fn transfer(s: &mut Slot, dir: Direction) -> Transfer<'_, u64> {
    let Slot { host, dev, .. } = s;
    match dir {
        Direction::H2d => Transfer::h2d(host.host(), dev.view_mut()),
        Direction::D2h => Transfer::d2h(dev.view(), host.host_mut()),
    }
}

/// A job of the one copy of a slot.
fn job(stream: &Stream, s: Slot, dir: Direction) -> Job<Slot, ()> {
    stream.run(s, move |c, s| issue(c, s, dir))
}

fn run_sync_1(
    stream: &Stream,
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let mut q: VecDeque<Slot> = slots.into();
    let t = Instant::now();
    for _ in 0..copies {
        let Some(s) = q.pop_front() else { break };
        let (s, ()) = stream.run_sync(s, |c, s| issue(c, s, dir))?;
        q.push_back(s);
    }
    let took = t.elapsed();
    Ok((q.into(), took))
}

async fn awaited_1(
    stream: &Stream,
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let mut q: VecDeque<Slot> = slots.into();
    let t = Instant::now();
    for _ in 0..copies {
        let Some(s) = q.pop_front() else { break };
        let (s, ()) = job(stream, s, dir).await?;
        q.push_back(s);
    }
    let took = t.elapsed();
    Ok((q.into(), took))
}

/// 64 jobs outstanding: each slot's next copy is issued as soon as its last
/// one resolves, on the next of `streams` in turn.
async fn awaited_window(
    streams: &[Stream],
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    let mut next = streams.iter().cycle();
    let mut issue_next = |s: Slot| {
        next.next()
            .map(|stream| job(stream, s, dir))
            .ok_or_else(|| gpufeed::Error::InvalidArgument("a window over no stream".into()))
    };
    let mut done = Vec::with_capacity(slots.len());
    let mut pending = FuturesUnordered::new();
    let mut issued = 0;
    for s in slots {
        if issued < copies {
            pending.push(issue_next(s)?);
            issued += 1;
        } else {
            done.push(s);
        }
    }
    while let Some(r) = pending.next().await {
        let (s, ()) = r?;
        if issued < copies {
            pending.push(issue_next(s)?);
            issued += 1;
        } else {
            done.push(s);
        }
    }
    Ok((done, t.elapsed()))
}

/// A job per slot, then all of them awaited; `copies / 64` times.
async fn awaited_batch(
    stream: &Stream,
    mut slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    for _ in 0..copies / slots.len().max(1) {
        let jobs: Vec<_> = slots.into_iter().map(|s| job(stream, s, dir)).collect();
        slots = futures::future::try_join_all(jobs)
            .await?
            .into_iter()
            .map(|(s, ())| s)
            .collect();
    }
    Ok((slots, t.elapsed()))
}

/// One job copying every slot, awaited; `copies / 64` times.
async fn awaited_one_job(
    stream: &Stream,
    mut slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
    batched: bool,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    for _ in 0..copies / slots.len().max(1) {
        (slots, ()) = stream
            .run(slots, move |c, v| {
                if batched {
                    return c.copy_batch(v.iter_mut().map(|s| transfer(s, dir)));
                }
                for s in v.iter_mut() {
                    issue(c, s, dir)?;
                }
                Ok(())
            })
            .await?;
    }
    Ok((slots, t.elapsed()))
}

/// The raw driver's buffers of one size, and the keys of their data.
struct RawSet<'r> {
    raw: &'r raw::Raw,
    bufs: Vec<raw::Buffers>,
    keys: Vec<u64>,
}

impl RawSet<'_> {
    fn issue(&self, b: &raw::Buffers, dir: Direction) -> gpufeed::Result<()> {
        // SAFETY: live driver allocations of b.bytes each, on this context's
        // stream; every copy is synchronized before the round returns, and
        // no host code touches the memory meanwhile.
        unsafe {
            match dir {
                Direction::H2d => raw::check(
                    sys::cuMemcpyHtoDAsync_v2(b.dev, b.host, b.bytes, self.raw.stream),
                    "cuMemcpyHtoDAsync",
                ),
                Direction::D2h => raw::check(
                    sys::cuMemcpyDtoHAsync_v2(b.host, b.dev, b.bytes, self.raw.stream),
                    "cuMemcpyDtoHAsync",
                ),
            }
        }
    }

    fn sync(&self) -> gpufeed::Result<()> {
        // SAFETY: our stream, alive while `raw` is.
        raw::check(
            unsafe { sys::cuStreamSynchronize(self.raw.stream) },
            "cuStreamSynchronize",
        )
    }

    /// `copies` copies: each synchronized (`batched == false`), or 64 issued
    /// and then one synchronize.
    fn round(&self, dir: Direction, copies: usize, batched: bool) -> gpufeed::Result<Duration> {
        let t = Instant::now();
        if batched {
            for _ in 0..copies / self.bufs.len().max(1) {
                for b in &self.bufs {
                    self.issue(b, dir)?;
                }
                self.sync()?;
            }
        } else {
            for b in self.bufs.iter().cycle().take(copies) {
                self.issue(b, dir)?;
                self.sync()?;
            }
        }
        Ok(t.elapsed())
    }

    /// Fills buffer `i`'s host memory with the pattern under `key`.
    fn fill(&mut self, i: usize, pattern: &[u64], key: u64) {
        if let (Some(b), Some(k)) = (self.bufs.get(i), self.keys.get_mut(i)) {
            let p = b.host.cast::<u64>();
            for (j, w) in pattern.iter().take(b.bytes / 8).enumerate() {
                // SAFETY: inside the driver's page-aligned allocation of
                // b.bytes; no copy on it is pending. Written through the raw
                // pointer: the memory may not be initialised yet.
                unsafe { p.add(j).write(w ^ key) };
            }
            *k = key;
        }
    }

    /// Buffer `i`'s host memory (initialised by [`RawSet::fill`] first).
    fn host_mut(&mut self, i: usize) -> &mut [u64] {
        match self.bufs.get(i) {
            // SAFETY: the driver's page-aligned allocation of b.bytes,
            // written by `fill` before any read; no copy on it is pending
            // (every round synchronizes), and `&mut self` keeps it exclusive.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.host.cast::<u64>(), b.bytes / 8) },
            None => &mut [],
        }
    }

    /// One checked round of the mode: fresh data in, every byte compared.
    fn checked(
        &mut self,
        dir: Direction,
        batched: bool,
        data: &mut Data,
    ) -> gpufeed::Result<(bool, Duration)> {
        let n = self.bufs.len();
        let took;
        data.fresh();
        for i in 0..n {
            let key = data.key();
            self.fill(i, &data.pattern, key);
        }
        if dir == Direction::D2h {
            // The data goes to the device first; the host copy is then
            // scribbled over, so only the timed mode's copy can restore it.
            for i in 0..n {
                if let Some(b) = self.bufs.get(i) {
                    self.raw.copy_ms(b, true)?;
                }
                scribble(self.host_mut(i));
            }
            took = self.round(dir, n, batched)?;
        } else {
            took = self.round(dir, n, batched)?;
            // Scribble the source, bring the device's bytes back over it.
            for i in 0..n {
                scribble(self.host_mut(i));
                if let Some(b) = self.bufs.get(i) {
                    self.raw.copy_ms(b, false)?;
                }
            }
        }
        let keys = self.keys.clone();
        let ok = keys
            .iter()
            .enumerate()
            .all(|(i, &key)| holds(self.host_mut(i), &data.pattern, key));
        Ok((ok, took))
    }
}

/// The buffers and streams of one size.
struct Bench<'r> {
    rt: &'r tokio::runtime::Runtime,
    /// The stream of every mode of ours...
    stream: &'r Stream,
    /// ...but `awaited_64_4_streams`, which spreads its jobs over these
    /// (`stream` first).
    streams: &'r [Stream],
    slots: Vec<Slot>,
    /// Where a device buffer's bytes are brought back to be checked.
    check: Option<PooledBuffer<u64>>,
    raw: Option<RawSet<'r>>,
    data: Data,
}

impl Bench<'_> {
    /// One round of `copies` copies of `mode`.
    fn round(&mut self, mode: Mode, dir: Direction, copies: usize) -> gpufeed::Result<Duration> {
        if mode.is_raw() {
            return match &self.raw {
                Some(r) => r.round(dir, copies, mode == Mode::Raw64),
                None => Err(gpufeed::Error::InvalidArgument(
                    "raw driver copies without a driver".into(),
                )),
            };
        }
        let slots = std::mem::take(&mut self.slots);
        let stream = self.stream;
        let (slots, took) = match mode {
            Mode::RunSync1 => run_sync_1(stream, slots, dir, copies)?,
            Mode::Awaited1 => gpufeed::block_on(awaited_1(stream, slots, dir, copies))?,
            Mode::Awaited1Tokio => self.rt.block_on(awaited_1(stream, slots, dir, copies))?,
            Mode::Awaited64 => gpufeed::block_on(awaited_window(
                std::slice::from_ref(stream),
                slots,
                dir,
                copies,
            ))?,
            Mode::Awaited64Streams4 => {
                gpufeed::block_on(awaited_window(self.streams, slots, dir, copies))?
            }
            Mode::Awaited64Batch => gpufeed::block_on(awaited_batch(stream, slots, dir, copies))?,
            Mode::Awaited64OneJob => {
                gpufeed::block_on(awaited_one_job(stream, slots, dir, copies, false))?
            }
            Mode::Awaited64CopyBatch => {
                gpufeed::block_on(awaited_one_job(stream, slots, dir, copies, true))?
            }
            Mode::Raw1 | Mode::Raw64 => (slots, Duration::ZERO),
        };
        self.slots = slots;
        Ok(took)
    }

    /// One round of 64 copies of `mode` (each buffer once) on fresh random
    /// data: whether every byte arrived, and how long the round took.
    fn checked(&mut self, mode: Mode, dir: Direction) -> gpufeed::Result<(bool, Duration)> {
        if mode.is_raw() {
            return match self.raw.as_mut() {
                Some(r) => r.checked(dir, mode == Mode::Raw64, &mut self.data),
                None => Err(gpufeed::Error::InvalidArgument(
                    "raw driver copies without a driver".into(),
                )),
            };
        }
        let mut slots = std::mem::take(&mut self.slots);
        self.data.fresh();
        for s in &mut slots {
            s.key = self.data.key();
            fill(s.host.as_mut_slice(), &self.data.pattern, s.key);
        }
        if dir == Direction::D2h {
            // To the device first, then the host copy is scribbled over: only
            // the mode's own copy can restore it.
            let mut up = Vec::with_capacity(slots.len());
            for s in slots {
                let (mut s, ()) = self
                    .stream
                    .run_sync(s, |c, s| issue(c, s, Direction::H2d))?;
                scribble(s.host.as_mut_slice());
                up.push(s);
            }
            slots = up;
        }
        let n = slots.len();
        self.slots = slots;
        let took = self.round(mode, dir, n)?;
        let mut ok = true;
        let mut back = Vec::with_capacity(n);
        for s in std::mem::take(&mut self.slots) {
            match dir {
                Direction::D2h => {
                    ok &= holds(s.host.as_slice(), &self.data.pattern, s.key);
                    back.push(s);
                }
                Direction::H2d => {
                    // The device's bytes, brought back into `check`.
                    let mut check = self.check.take().ok_or_else(|| {
                        gpufeed::Error::InvalidArgument("small transfers: check buffer lost".into())
                    })?;
                    scribble(check.as_mut_slice());
                    let ((check, s), ()) = self.stream.run_sync((check, s), |c, (k, s)| {
                        c.copy_d2h(s.dev.view(), k.host_mut())
                    })?;
                    ok &= check.as_slice() == s.host.as_slice()
                        && holds(s.host.as_slice(), &self.data.pattern, s.key);
                    self.check = Some(check);
                    back.push(s);
                }
            }
        }
        self.slots = back;
        Ok((ok, took))
    }
}

/// Copies of a timed round of `mode`: about `cfg.target`, judging by a
/// round of `n` copies that took `took`; a multiple of the copies the mode
/// keeps in flight, at least one such batch.
fn copies_for(cfg: &Config, mode: Mode, took: Duration, n: usize) -> usize {
    let step = mode.in_flight();
    let per_copy = took.as_secs_f64() / n.max(1) as f64;
    let want = if per_copy > 0.0 {
        cfg.target.as_secs_f64() / per_copy
    } else {
        cfg.max_copies as f64
    };
    let want = (want.min(cfg.max_copies as f64) as usize).div_ceil(step) * step;
    want.clamp(step, cfg.max_copies.max(step))
}

/// Every mode at one size and direction: a checked round each (which also
/// sizes its timed rounds), then the timed rounds, the modes taking turns.
fn measure(
    bench: &mut Bench,
    cfg: &Config,
    bytes: usize,
    dir: Direction,
) -> gpufeed::Result<Vec<Row>> {
    let modes: Vec<Mode> = MODES
        .into_iter()
        .filter(|m| !m.is_raw() || bench.raw.is_some())
        .collect();
    let mut verified = Vec::with_capacity(modes.len());
    let mut copies = Vec::with_capacity(modes.len());
    for &m in &modes {
        let (ok, took) = bench.checked(m, dir)?;
        verified.push(ok);
        copies.push(copies_for(cfg, m, took, IN_FLIGHT));
    }
    let mut ops: Vec<Vec<f64>> = vec![Vec::with_capacity(cfg.rounds); modes.len()];
    for _ in 0..cfg.rounds {
        for ((&m, &n), samples) in modes.iter().zip(&copies).zip(&mut ops) {
            let took = bench.round(m, dir, n)?;
            samples.push(n as f64 / took.as_secs_f64());
        }
    }
    let mut rows = Vec::new();
    for m in MODES {
        let row = match modes.iter().position(|&x| x == m) {
            Some(k) => {
                let v = &ops[k];
                let med = median(v);
                Row {
                    bytes,
                    direction: dir,
                    mode: m,
                    in_flight: m.in_flight(),
                    streams: m.streams(),
                    ops_per_s: Some(med),
                    gb_per_s: Some(med * bytes as f64 / 1e9),
                    ops_per_s_min: v.iter().copied().reduce(f64::min),
                    ops_per_s_max: v.iter().copied().reduce(f64::max),
                    copies_per_round: copies[k],
                    rounds: v.len(),
                    verified: Some(verified[k]),
                    note: None,
                }
            }
            None => Row {
                bytes,
                direction: dir,
                mode: m,
                in_flight: m.in_flight(),
                streams: m.streams(),
                ops_per_s: None,
                gb_per_s: None,
                ops_per_s_min: None,
                ops_per_s_max: None,
                copies_per_round: 0,
                rounds: 0,
                verified: None,
                note: Some(
                    if bench.stream.device().kind() == gpufeed::BackendKind::Cpu {
                        NO_RAW_CPU
                    } else {
                        NO_RAW_CTX
                    },
                ),
            },
        };
        rows.push(row);
    }
    Ok(rows)
}

fn ratios(rows: &[Row]) -> Vec<Ratio> {
    let mut out = Vec::new();
    for &bytes in rows
        .iter()
        .map(|r| &r.bytes)
        .collect::<std::collections::BTreeSet<_>>()
    {
        for dir in DIRECTIONS {
            let get = |m: Mode| {
                rows.iter()
                    .find(|r| r.bytes == bytes && r.direction == dir && r.mode == m)
                    .and_then(|r| r.ops_per_s)
            };
            let over = |a: Mode, b: Mode| Some(get(a)? / get(b)?);
            out.push(Ratio {
                bytes,
                direction: dir,
                awaited_1_vs_raw_1: over(Mode::Awaited1, Mode::Raw1),
                awaited_64_copy_batch_vs_raw_64: over(Mode::Awaited64CopyBatch, Mode::Raw64),
                run_sync_1_vs_raw_1: over(Mode::RunSync1, Mode::Raw1),
                awaited_64_vs_raw_64: over(Mode::Awaited64, Mode::Raw64),
                awaited_64_batch_vs_raw_64: over(Mode::Awaited64Batch, Mode::Raw64),
                awaited_64_one_job_vs_raw_64: over(Mode::Awaited64OneJob, Mode::Raw64),
                awaited_1_vs_run_sync_1: over(Mode::Awaited1, Mode::RunSync1),
            });
        }
    }
    out
}

/// Measures every size, both directions.
pub fn run(
    rt: &tokio::runtime::Runtime,
    device: &Device,
    cfg: &Config,
    progress: &ProgressBar,
) -> gpufeed::Result<Results> {
    if cfg.rounds == 0 {
        return Err(gpufeed::Error::InvalidArgument(
            "small transfers: --rounds must be at least 1".into(),
        ));
    }
    let streams = (0..STREAMS)
        .map(|_| Stream::new(device))
        .collect::<gpufeed::Result<Vec<_>>>()?;
    let stream = streams
        .first()
        .ok_or_else(|| gpufeed::Error::InvalidArgument("no stream".into()))?;
    let pool = PinnedPool::new(device);
    let raw = raw::Raw::new(device);
    // Fresh data every run.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0x5EED, |d| d.as_nanos() as u64);
    let mut seeds = fastrand::Rng::with_seed(seed);
    let mut rows = Vec::new();
    let mut locked = true;
    for &bytes in &cfg.sizes {
        if bytes == 0 || bytes % 8 != 0 {
            return Err(gpufeed::Error::InvalidArgument(format!(
                "small transfers: {bytes} bytes is not a positive multiple of 8"
            )));
        }
        let n = bytes / 8;
        let mut slots = Vec::with_capacity(IN_FLIGHT);
        for _ in 0..IN_FLIGHT {
            let host = pool.alloc::<u64>(n)?;
            locked &= host.is_locked();
            slots.push(Slot {
                host,
                dev: DeviceBuffer::new(device, n)?,
                key: 0,
            });
        }
        let raw_set = match &raw {
            Some(r) => Some(RawSet {
                raw: r,
                bufs: (0..IN_FLIGHT)
                    .map(|_| r.buffers(bytes))
                    .collect::<gpufeed::Result<_>>()?,
                keys: vec![0; IN_FLIGHT],
            }),
            None => None,
        };
        let mut bench = Bench {
            rt,
            stream,
            streams: &streams,
            slots,
            check: Some(pool.alloc::<u64>(n)?),
            raw: raw_set,
            data: Data::new(n, seeds.u64(..)),
        };
        for dir in DIRECTIONS {
            progress.set_message(format!("small transfers, {} {}", size(bytes), dir.name()));
            rows.extend(measure(&mut bench, cfg, bytes, dir)?);
            progress.inc(1);
        }
        drop(bench);
        pool.empty_cache();
    }
    let raw_note = match (&raw, device.kind()) {
        (Some(_), _) => None,
        (None, gpufeed::BackendKind::Cpu) => Some(NO_RAW_CPU),
        (None, _) => Some(NO_RAW_CTX),
    };
    Ok(Results {
        meta: Meta::new(device),
        peer: "host-rust",
        executor: "gpufeed::block_on on the calling thread (awaited_1_tokio: a tokio multi-thread runtime's Runtime::block_on)",
        locked,
        raw_note,
        ratios: ratios(&rows),
        rows,
    })
}

/// `1.23M`, `456.7k`, `812`: copies per second in a table cell.
fn rate(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 1e6 => format!("{:.2}M", v / 1e6),
        Some(v) if v >= 1e3 => format!("{:.1}k", v / 1e3),
        Some(v) => format!("{v:.0}"),
        None => "-".into(),
    }
}

fn gb(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}x"))
}

pub fn print(res: &Results) {
    let w = Words::for_kind(res.meta.backend);
    let rounds = res.rows.iter().map(|r| r.rounds).max().unwrap_or(0);
    let has_raw = res
        .rows
        .iter()
        .any(|r| r.mode.is_raw() && r.ops_per_s.is_some());
    println!(
        "\nsmall copies: copies per second (medians of {rounds} rounds) and GB/s; every mode on one stream except \"64 4 strms\" (four)."
    );
    println!("  run_sync 1  each copy waited for on the calling thread (Stream::run_sync) before the next");
    println!(
        "  awaited 1   each copy a job, awaited before the next (gpufeed::block_on; every awaited"
    );
    println!("              mode runs there but tokio 1: the same on tokio's Runtime::block_on)");
    println!(
        "  awaited 64  64 jobs kept in flight (a FuturesUnordered window over 64 buffer pairs)"
    );
    println!("  64 batch    64 jobs issued, then all awaited (try_join_all)");
    println!("  64 one job  one job issuing 64 copies, awaited");
    println!("  64 4 strms  the awaited 64 window, its jobs round robin over 4 streams");
    println!("  64 copy_batch  one job of one Commands::copy_batch of the 64 copies, awaited");
    if w.cpu {
        println!(
            "  raw 1/64    raw driver copies: not measured on the CPU emulation (no driver); the"
        );
        println!(
            "              emulation's copies are memcpy on a stream worker thread, the rates say"
        );
        println!("              nothing about a GPU.");
        if res.rows.iter().all(|r| r.bytes < 4 << 20) {
            println!("  (up to 1 MiB on the CPU emulation, to keep CI fast: `host small-transfers --sizes`");
            println!("  takes others, in bytes)");
        }
    } else if res.raw_note.is_some() {
        println!("  raw 1/64    raw driver copies: not measured (the driver's own context could not be set up)");
    } else {
        println!("  raw 1       cuMemcpy{{HtoD,DtoH}}Async + cuStreamSynchronize per copy (cudarc sys layer)");
        println!("  raw 64      64 of those copies, then one cuStreamSynchronize");
    }
    println!("Every mode's copies were checked byte for byte on fresh random data at every size.");
    if has_raw {
        println!("Ratios: copies per second of ours over the raw driver's (aw = awaited, sy = run_sync),");
        println!("and awaited over run_sync, one in flight.");
    } else {
        println!("aw1/sy1: copies per second awaited over run_sync, one in flight.");
    }
    for dir in DIRECTIONS {
        let rows: Vec<&Row> = res.rows.iter().filter(|r| r.direction == dir).collect();
        let mut sizes: Vec<usize> = rows.iter().map(|r| r.bytes).collect();
        sizes.dedup();
        let get = |bytes: usize, m: Mode| rows.iter().find(|r| r.bytes == bytes && r.mode == m);
        println!("\n{} copies per second", dir.name());
        print!("{:>9}", "size");
        for m in MODES {
            print!(" {:>10}", m.short());
        }
        if has_raw {
            print!(" {:>9} {:>9} {:>9}", "aw1/raw1", "sy1/raw1", "aw64/r64");
        }
        println!(" {:>9}", "aw1/sy1");
        for &b in &sizes {
            print!("{:>9}", size(b));
            for m in MODES {
                print!(" {:>10}", rate(get(b, m).and_then(|r| r.ops_per_s)));
            }
            let r = res
                .ratios
                .iter()
                .find(|r| r.bytes == b && r.direction == dir);
            if has_raw {
                print!(
                    " {:>9} {:>9} {:>9}",
                    ratio(r.and_then(|r| r.awaited_1_vs_raw_1)),
                    ratio(r.and_then(|r| r.run_sync_1_vs_raw_1)),
                    ratio(r.and_then(|r| r.awaited_64_vs_raw_64))
                );
            }
            println!(" {:>9}", ratio(r.and_then(|r| r.awaited_1_vs_run_sync_1)));
        }
        println!("{} GB/s", dir.name());
        print!("{:>9}", "size");
        for m in MODES {
            print!(" {:>10}", m.short());
        }
        println!();
        for &b in &sizes {
            print!("{:>9}", size(b));
            for m in MODES {
                print!(" {:>10}", gb(get(b, m).and_then(|r| r.gb_per_s)));
            }
            println!();
        }
    }
    if !res.locked {
        println!(
            "note: the memlock limit refused to lock some host buffers; they ran as plain memory"
        );
    }
    if res.rows.iter().any(|r| r.verified == Some(false)) {
        println!("ERROR: some copies brought back wrong bytes (verified = false in the JSON)");
    }
}

/// `host small-transfers`: measure, print, write small_transfers.json, .csv
/// and a plot per direction.
pub fn part(
    rt: &tokio::runtime::Runtime,
    device: &Device,
    cfg: &Config,
    out: &Path,
) -> gpufeed::Result<()> {
    let pb = super::progress::bar((cfg.sizes.len() * DIRECTIONS.len()) as u64);
    let res = run(rt, device, cfg, &pb)?;
    pb.finish_and_clear();
    print(&res);
    write_json(&out.join("small_transfers.json"), &res)?;
    write_csv(
        &out.join("small_transfers.csv"),
        res.rows.iter().map(CsvRow::from),
    )?;
    for dir in DIRECTIONS {
        let series: Vec<super::plots::Series> = MODES
            .into_iter()
            // Six colours: the batch and 4-stream variants are in the table
            // and the files only.
            .filter(|&m| !matches!(m, Mode::Awaited64Batch | Mode::Awaited64Streams4))
            .map(|m| super::plots::Series {
                name: m.long(),
                points: res
                    .rows
                    .iter()
                    .filter(|r| r.direction == dir && r.mode == m)
                    .filter_map(|r| Some((r.bytes as f64, r.ops_per_s?)))
                    .collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect();
        super::plots::lines(
            &out.join(format!("small_transfers_{}.svg", dir.name().to_lowercase())),
            &format!(
                "small copies, {}: copies per second — {}",
                dir.name(),
                device.info().name
            ),
            super::plots::Axis {
                desc: "bytes per copy",
                label: super::plots::Label::Bytes,
            },
            super::plots::Axis {
                desc: "copies per second (median)",
                label: super::plots::Label::Number,
            },
            true,
            &series,
        )?;
    }
    if res.rows.iter().any(|r| r.verified == Some(false)) {
        return Err(gpufeed::Error::InvalidArgument(
            "small transfers: a copy brought back wrong bytes".into(),
        ));
    }
    Ok(())
}
