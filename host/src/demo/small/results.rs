//! What a run of `host small-transfers` keeps: a row per mode, size and
//! direction, the ratios, and the lines of the CSV.

use crate::demo::report::{cell, Meta};
use crate::demo::small::config::{Direction, Mode};
use serde::Serialize;

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

/// The comparisons, per size and direction: ours over the raw
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

pub(super) const NO_RAW_CPU: &str = "no raw driver on the CPU emulation: not measured";
pub(super) const NO_RAW_CTX: &str = "the raw driver context could not be set up: not measured";

/// A line of small_transfers.csv: numbers rounded, empty cells where nothing
/// was measured.
#[derive(Serialize)]
pub(super) struct CsvRow {
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
