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
//!   [`Commands::copy_batch`](gpufeed::Commands::copy_batch) of the 64 copies (one driver call,
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
//!
//! The module's files, by job: `config` what is measured (sizes, modes,
//! directions); `data` the checked rounds' random data; `ours` the
//! library's modes; `raw_set` the raw driver's; `bench` one size's
//! buffers and streams, a round and a checked round of any mode;
//! `measure` every size and direction measured; `results` and `print`
//! what is kept and shown.

mod bench;
mod config;
mod data;
mod measure;
mod ours;
mod print;
mod raw_set;
mod results;

use crate::demo::report::{write_csv, write_json};
pub use config::Config;
use config::{Mode, DIRECTIONS, MODES};
use gpufeed::Device;
use measure::run;
use print::print;
use results::CsvRow;
use std::path::Path;

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
