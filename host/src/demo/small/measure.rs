//! Every size and direction measured: the buffers of each size set up,
//! each mode's checked round sizing its timed rounds, the timed rounds
//! taken in turns, and the ratios of ours over the raw driver's.

use crate::demo::bandwidth::raw;
use crate::demo::fmt::size;
use crate::demo::report::{median, Meta};
use crate::demo::small::bench::Bench;
use crate::demo::small::config::{Config, Direction, Mode, DIRECTIONS, IN_FLIGHT, MODES, STREAMS};
use crate::demo::small::data::Data;
use crate::demo::small::ours::Slot;
use crate::demo::small::raw_set::RawSet;
use crate::demo::small::results::{Ratio, Results, Row, NO_RAW_CPU, NO_RAW_CTX};
use gpufeed::{Device, DeviceBuffer, PinnedPool, Stream};
use indicatif::ProgressBar;
use std::time::Duration;

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
pub(super) fn measure(
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

pub(super) fn ratios(rows: &[Row]) -> Vec<Ratio> {
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

/// The [`IN_FLIGHT`] slots of `n` words: a pinned buffer of `pool` and a
/// device buffer each. `locked` is cleared when a host buffer is not locked.
fn slots(
    device: &Device,
    pool: &PinnedPool,
    n: usize,
    locked: &mut bool,
) -> gpufeed::Result<Vec<Slot>> {
    let mut slots = Vec::with_capacity(IN_FLIGHT);
    for _ in 0..IN_FLIGHT {
        let host = pool.alloc::<u64>(n)?;
        *locked &= host.is_locked();
        slots.push(Slot {
            host,
            dev: DeviceBuffer::new(device, n)?,
            key: 0,
        });
    }
    Ok(slots)
}

/// The raw driver's [`IN_FLIGHT`] buffer pairs of `bytes`, where there is a
/// raw driver.
fn raw_set(raw: Option<&raw::Raw>, bytes: usize) -> gpufeed::Result<Option<RawSet<'_>>> {
    let Some(r) = raw else { return Ok(None) };
    Ok(Some(RawSet {
        raw: r,
        bufs: (0..IN_FLIGHT)
            .map(|_| r.buffers(bytes))
            .collect::<gpufeed::Result<_>>()?,
        keys: vec![0; IN_FLIGHT],
    }))
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
        let slots = slots(device, &pool, n, &mut locked)?;
        let raw_set = raw_set(raw.as_ref(), bytes)?;
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
