//! What a run of `host staging` keeps (the routes' rows, the sweep's, the
//! pipeline's, the default shape) and its plot.

use crate::demo::plots;
use crate::demo::report::{cell, Meta};
use crate::demo::staging::config::Path4;
use gpufeed::{Device, StagingConfig};
use serde::Serialize;
use std::path::Path;

#[derive(Serialize, Clone)]
pub struct Row {
    pub bytes: usize,
    pub path: Path4,
    /// "h2d" or "d2h".
    pub dir: &'static str,
    /// GB/s (1e9 bytes per second): median, lowest and highest run.
    pub gbps: f64,
    pub gbps_min: f64,
    pub gbps_max: f64,
    pub reps: usize,
    /// Every element of every run matched its source.
    pub verified: bool,
    /// CPU seconds (user + system, whole process) per GB moved.
    pub cpu_s_per_gb: f64,
}

#[derive(Serialize, Clone)]
pub struct SweepRow {
    pub threads: usize,
    pub block_bytes: usize,
    pub blocks: usize,
    pub h2d_gbps: f64,
    pub d2h_gbps: f64,
    /// The medians above ÷ the pinned copy's, measured in turn with them.
    pub h2d_of_pinned: f64,
    pub d2h_of_pinned: f64,
    pub verified: bool,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    /// The default configuration on this machine.
    pub default_config: ConfigJson,
    /// Threads the engine uses (workers plus the polling thread).
    pub threads_used: usize,
    pub rows: Vec<Row>,
    /// Milliseconds of idle before each timed run.
    pub settle_ms: u64,
    pub sweep_bytes: usize,
    pub sweep: Vec<SweepRow>,
    /// CPU milliseconds the whole process used over 500 ms with no copy in
    /// flight, right after the staged runs (the workers sleep).
    pub idle_cpu_ms: f64,
    /// Peak pinned bytes the default engine held, and its bound.
    pub staging_peak_bytes: u64,
    pub staging_bound_bytes: usize,
    /// `y = 3 x` through a pipeline, from and into ordinary memory
    /// (`run_slices`) and from and into pinned memory (`run`).
    pub pipeline: Option<PipelineRow>,
}

#[derive(Serialize, Clone)]
pub struct PipelineRow {
    pub bytes: usize,
    pub reps: usize,
    /// Medians, milliseconds.
    pub slices_ms: f64,
    pub pinned_ms: f64,
    /// `pinned_ms / slices_ms`: the ordinary-memory run's speed as a
    /// fraction of the pinned run's.
    pub ratio: f64,
    /// Every element of every run equal to a plain loop's `3 x`.
    pub verified: bool,
}

#[derive(Serialize, Clone, Copy)]
pub struct ConfigJson {
    pub block_bytes: usize,
    pub blocks: usize,
    pub threads: usize,
    pub direct_h2d_below: usize,
    pub direct_d2h_below: usize,
}

impl From<StagingConfig> for ConfigJson {
    fn from(c: StagingConfig) -> Self {
        ConfigJson {
            block_bytes: c.block_bytes,
            blocks: c.blocks,
            threads: c.threads,
            direct_h2d_below: c.direct_h2d_below,
            direct_d2h_below: c.direct_d2h_below,
        }
    }
}

pub(super) fn plot(device: &Device, r: &Results, out: &Path) -> gpufeed::Result<()> {
    let mut series = Vec::new();
    let names = [
        (Path4::Pageable, "driver, pageable"),
        (Path4::RegisterCopy, "pin in place + copy"),
        (Path4::Staged, "staged"),
        (Path4::Auto, "automatic"),
        (Path4::Pinned, "pinned (the link)"),
    ];
    for dir in ["h2d", "d2h"] {
        for (path, name) in names {
            let points: Vec<(f64, f64)> = r
                .rows
                .iter()
                .filter(|x| x.dir == dir && x.path == path)
                .filter_map(|x| cell(x.gbps, 3).map(|g| (x.bytes as f64, g)))
                .collect();
            series.push((format!("{} {name}", dir.to_uppercase()), points));
        }
    }
    let series: Vec<plots::Series> = series
        .iter()
        .map(|(name, points)| plots::Series {
            name,
            points: points.clone(),
        })
        .collect();
    plots::lines(
        &out.join("staging.svg"),
        &format!(
            "ordinary memory to the device and back — {}",
            device.info().name
        ),
        plots::Axis {
            desc: "bytes per copy",
            label: plots::Label::Bytes,
        },
        plots::Axis {
            desc: "GB/s (median)",
            label: plots::Label::Number,
        },
        true,
        &series,
    )
}
