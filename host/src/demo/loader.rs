//! `host loader`: batches of rows gathered by index from an ordinary `Vec`
//! (shuffled: random rows) to the device by [`gpufeed::Loader`], on the host
//! and, with the `Vec` pinned in place, on the device, against the pinned
//! copy of the same bytes in the same run.
//!
//! Every batch of a first (untimed) epoch is read back into poisoned memory
//! and compared with a plain gather of the rows the epoch's order names;
//! then `reps` timed epochs of another seed's order.

use super::fmt::size;
use super::report::{cell, median, write_json, Meta};
use gpufeed::{
    block_on, epoch_indices, Device, DeviceBuffer, Gather, Loader, LoaderConfig, PinnedHost,
    PinnedPool, Registered, RowSource, Stream,
};
use rayon::prelude::*;
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const POISON: u32 = 0xDEAD_BEEF;

/// The array and batch sizes of one run.
pub struct Config {
    pub array_bytes: usize,
    pub row_bytes: usize,
    pub batch_bytes: Vec<usize>,
    /// Timed epochs per batch size (medians are quoted).
    pub reps: usize,
}

impl Config {
    pub fn for_device(device: &Device, small: bool) -> Config {
        if small || device.kind() == gpufeed::BackendKind::Cpu {
            Config {
                array_bytes: 16 << 20,
                row_bytes: 4096,
                batch_bytes: vec![1 << 20],
                reps: 2,
            }
        } else {
            Config {
                array_bytes: 1 << 30,
                row_bytes: 4096,
                batch_bytes: vec![1 << 20, 8 << 20, 16 << 20, 64 << 20],
                reps: 5,
            }
        }
    }
}

#[derive(Serialize)]
pub struct Row {
    pub batch_bytes: usize,
    pub batches_per_epoch: usize,
    /// Where the rows were gathered: on the host (from the `Vec`) or on the
    /// device (the `Vec` pinned in place).
    pub gather: Gather,
    /// GB/s of batch bytes delivered: medians of `reps` epochs.
    pub loader_gbps: Option<f64>,
    /// One DMA of a whole epoch's bytes from pinned memory (the link).
    pub pinned_gbps: Option<f64>,
    pub loader_over_pinned: Option<f64>,
    /// Every batch of the verification epoch equal to a plain gather.
    pub verified: bool,
    /// Where a timed epoch's time went, µs per batch (medians): gathering
    /// rows into pinned memory, allocating device buffers, issuing DMAs,
    /// and the whole (the rest is waiting for the DMAs).
    pub us_per_batch: Breakdown,
    /// GB/s of the host's gathers alone (its bound; none on the device).
    pub gather_gbps: Option<f64>,
}

#[derive(Serialize, Default)]
pub struct Breakdown {
    pub gather: Option<f64>,
    pub alloc: Option<f64>,
    pub issue: Option<f64>,
    pub total: Option<f64>,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    pub array_bytes: usize,
    pub row_bytes: usize,
    pub reps: usize,
    pub rows: Vec<Row>,
}

/// The rows `order` names, one after another: a plain loop.
fn gather(src: &[u32], row_len: usize, order: &[usize]) -> Vec<u32> {
    let mut out = Vec::with_capacity(order.len() * row_len);
    for &r in order {
        out.extend_from_slice(&src[r * row_len..(r + 1) * row_len]);
    }
    out
}

/// Random words, never the poison.
fn words(n: usize) -> Vec<u32> {
    let mut v = vec![0u32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut s = 0x10ad_u64 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
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

pub fn run(device: &Device, config: &Config, out: &Path) -> gpufeed::Result<Results> {
    let row_len = (config.row_bytes / 4).max(1);
    let n_rows = (config.array_bytes / 4 / row_len).max(1);
    let data = words(n_rows * row_len);
    // The same rows pinned in place: the loader gathers them on the device.
    let pinned_data = Arc::new(Registered::new(device, data.clone())?);
    let stream = Stream::new(device)?;
    let pool = PinnedPool::new(device);
    let mut rows = Vec::new();
    println!(
        "   {} array of {} rows, shuffled batches; GB/s, medians of {} epochs; every batch of a first epoch checked",
        size(config.array_bytes),
        size(row_len * 4),
        config.reps
    );
    println!(
        "   gathered on the host (a Vec) or on the device (the Vec pinned in place); µs per batch: all, the host's gather"
    );
    println!(
        "   {:>9} {:>8} {:>7} {:>10} {:>10} {:>8} {:>9} {:>8}",
        "batch", "batches", "gather", "loader", "pinned", "ratio", "µs/batch", "gather"
    );
    for &batch_bytes in &config.batch_bytes {
        let batch_rows = (batch_bytes / (row_len * 4)).clamp(1, n_rows);
        let mut lc = LoaderConfig::new(batch_rows);
        lc.shuffle = true;
        lc.seed = 7;
        lc.drop_last = true;
        // The link: the same bytes from pinned memory, batch by batch.
        let pinned_gbps = pinned_rate(
            device,
            &stream,
            &pool,
            batch_rows * row_len,
            n_rows / batch_rows,
            config.reps,
        )?;
        for on_device in [false, true] {
            let fields = if on_device {
                vec![RowSource::registered(pinned_data.clone(), row_len)?]
            } else {
                vec![RowSource::new(&data, row_len)?]
            };
            let mut loader = Loader::<u32>::new(device, fields, lc)?;
            let row = measure(
                &mut loader,
                &data,
                row_len,
                n_rows,
                &lc,
                config.reps,
                pinned_gbps,
            )?;
            println!(
                "   {:>9} {:>8} {:>7} {:>10.2} {:>10.2} {:>7.3}x {:>9.1} {:>8.1}{}",
                size(row.batch_bytes),
                row.batches_per_epoch,
                match row.gather {
                    Gather::Host => "host",
                    Gather::Device => "device",
                },
                row.loader_gbps.unwrap_or(f64::NAN),
                pinned_gbps,
                row.loader_over_pinned.unwrap_or(f64::NAN),
                row.us_per_batch.total.unwrap_or(f64::NAN),
                row.us_per_batch.gather.unwrap_or(f64::NAN),
                if row.verified { "" } else { "  WRONG DATA" }
            );
            rows.push(row);
        }
    }
    let bad = rows.iter().filter(|r| !r.verified).count();
    let results = Results {
        meta: Meta::new(device),
        array_bytes: n_rows * row_len * 4,
        row_bytes: row_len * 4,
        reps: config.reps,
        rows,
    };
    write_json(&out.join("loader.json"), &results)?;
    if bad > 0 {
        return Err(gpufeed::Error::Internal(format!(
            "loader: {bad} batch size(s) delivered wrong data"
        )));
    }
    Ok(results)
}

/// One loader's row: a verification epoch (every batch read back into
/// poisoned memory and compared with a plain gather), then `reps` timed
/// epochs of other seeds' orders.
fn measure(
    loader: &mut Loader<'_, u32>,
    data: &[u32],
    row_len: usize,
    n_rows: usize,
    lc: &LoaderConfig,
    reps: usize,
    pinned_gbps: f64,
) -> gpufeed::Result<Row> {
    let order = epoch_indices(n_rows, lc, 0);
    loader.start_epoch(0, 0);
    let (mut verified, mut seen, mut got) = (true, 0, Vec::new());
    while let Some(batch) = block_on(futures::StreamExt::next(&mut *loader)) {
        let mut batch = batch?;
        let want = &order[seen..seen + batch.rows];
        got.clear();
        got.resize(batch.fields[0].len(), POISON);
        batch.fields[0].copy_to_host_sync(&mut got)?;
        verified &= got == gather(data, row_len, want);
        seen += batch.rows;
    }
    verified &= seen == loader.len() * lc.batch_size;
    // Timed epochs (a batch is dropped as soon as it arrives: its device
    // memory goes back as a training step's would).
    let mut gbps = Vec::new();
    let (mut g, mut a, mut i, mut w, mut ggb) = (vec![], vec![], vec![], vec![], vec![]);
    for rep in 0..reps {
        loader.start_epoch(1 + rep as u64, 0);
        let before = loader.stats();
        let t = Instant::now();
        let mut bytes = 0usize;
        while let Some(batch) = block_on(futures::StreamExt::next(&mut *loader)) {
            bytes += batch?.rows * row_len * 4;
        }
        let wall = t.elapsed().as_secs_f64();
        gbps.push(bytes as f64 / wall / 1e9);
        let s = loader.stats();
        let n = (s.batches - before.batches).max(1) as f64;
        g.push((s.gather - before.gather).as_secs_f64() * 1e6 / n);
        a.push((s.alloc - before.alloc).as_secs_f64() * 1e6 / n);
        i.push((s.issue - before.issue).as_secs_f64() * 1e6 / n);
        w.push(wall * 1e6 / n);
        ggb.push((s.bytes - before.bytes) as f64 / (s.gather - before.gather).as_secs_f64() / 1e9);
    }
    let lg = median(&gbps);
    Ok(Row {
        batch_bytes: lc.batch_size * row_len * 4,
        batches_per_epoch: loader.len(),
        gather: loader.gather(),
        loader_gbps: cell(lg, 2),
        pinned_gbps: cell(pinned_gbps, 2),
        loader_over_pinned: cell(lg / pinned_gbps, 3),
        verified,
        us_per_batch: Breakdown {
            gather: cell(median(&g), 1),
            alloc: cell(median(&a), 1),
            issue: cell(median(&i), 1),
            total: cell(median(&w), 1),
        },
        gather_gbps: match loader.gather() {
            Gather::Host => cell(median(&ggb), 2),
            Gather::Device => None,
        },
    })
}

/// GB/s of `batches` copies of `len` words each from pinned memory into
/// fresh device buffers, one job per batch (the loader's own shape without
/// the gather): medians of `reps` runs.
fn pinned_rate(
    device: &Device,
    stream: &Stream,
    pool: &PinnedPool,
    len: usize,
    batches: usize,
    reps: usize,
) -> gpufeed::Result<f64> {
    let mut src = pool.alloc::<u32>(len)?;
    src.as_mut_slice().fill(3);
    let mut dev = DeviceBuffer::<u32>::new(device, len)?;
    let mut gbps = Vec::new();
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        for _ in 0..batches {
            let ((s, d), ()) = stream
                .run_sync((src, dev), |c, (s, d)| c.copy_h2d(s.host(), d.view_mut()))
                .map_err(gpufeed::Error::from)?;
            (src, dev) = (s, d);
        }
        gbps.push((len * 4 * batches) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(median(&gbps))
}
