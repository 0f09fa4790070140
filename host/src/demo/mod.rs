//! The demonstration's parts; each is a subcommand, and `demo` runs them all.

pub mod bandwidth;
pub mod bytes;
pub mod chunk_cost;
pub mod compare;
pub mod devices;
pub mod files;
pub mod fmt;
pub mod kernel_set;
pub mod kernels;
pub mod latency;
pub mod load;
pub mod loader;
pub mod multi_gpu;
pub mod pipeline;
pub mod plots;
pub mod progress;
pub mod ptx;
pub mod report;
pub mod small;
pub mod staging;
pub mod wait_path;
pub mod waits;

use gpufeed::{BackendKind, Device, DeviceOptions, Kernel, PinnedPool, Pipeline};
use report::{write_csv, write_json, Meta};
use serde::Serialize;
use std::path::Path;

/// Sizes of one demonstration run: the full set on a GPU, a small one on
/// the CPU emulation (CI runs it there).
pub struct Scale {
    pub kernels_n: usize,
    pub bandwidth_max: usize,
    pub alloc_sizes: Vec<usize>,
    pub latency_samples: usize,
    pub compare: Vec<(usize, Kernel)>,
    pub sweep: Vec<usize>,
    pub timeline_n: usize,
    /// Sizes of the fewer-bytes part.
    pub bytes_sizes: Vec<usize>,
    /// Floats and runs per executor of the waits part.
    pub waits_n: usize,
    pub waits_runs: usize,
    pub reps: usize,
}

impl Scale {
    pub fn for_device(device: &Device, small: bool) -> Scale {
        if small || device.kind() == BackendKind::Cpu {
            Scale {
                kernels_n: 1_000_003,
                bandwidth_max: 16 << 20,
                alloc_sizes: vec![4 << 20],
                latency_samples: 200,
                compare: vec![
                    (100_000, Kernel::Scale { s: 1.5 }),
                    (1_000_000, Kernel::Scale { s: 1.5 }),
                    (1_000_000, Kernel::Intensity { k: 1 }),
                    (1_000_000, Kernel::Intensity { k: 8 }),
                    (1_000_000, Kernel::Intensity { k: 64 }),
                ],
                sweep: vec![10_000, 100_000, 1_000_000, 3_000_000],
                timeline_n: 1_000_000,
                bytes_sizes: vec![100_000, 1_000_000],
                waits_n: 1_000_000,
                waits_runs: 10,
                reps: 5,
            }
        } else {
            Scale {
                kernels_n: 100_000_000,
                bandwidth_max: 1 << 30,
                alloc_sizes: vec![64 << 20, 1 << 30],
                latency_samples: 1000,
                compare: vec![
                    (10_000_000, Kernel::Scale { s: 1.5 }),
                    (100_000_000, Kernel::Scale { s: 1.5 }),
                    (100_000_000, Kernel::Intensity { k: 1 }),
                    (100_000_000, Kernel::Intensity { k: 2048 }),
                    (100_000_000, Kernel::Intensity { k: 16384 }),
                ],
                sweep: vec![
                    100_000,
                    300_000,
                    1_000_000,
                    3_000_000,
                    10_000_000,
                    30_000_000,
                    100_000_000,
                    300_000_000,
                    1_000_000_000,
                ],
                timeline_n: 100_000_000,
                bytes_sizes: vec![10_000_000, 100_000_000],
                waits_n: 10_000_000,
                waits_runs: 60,
                // As many as the peers (bench/peers) time per configuration.
                reps: 20,
            }
        }
    }
}

#[derive(Serialize)]
struct CompareFile<'a> {
    meta: Meta,
    comparisons: &'a [compare::Comparison],
    pool: gpufeed::PoolStats,
}

#[derive(Serialize)]
struct SweepFile<'a> {
    meta: Meta,
    rows: &'a [compare::Comparison],
}

#[derive(Serialize)]
struct TimelineFile<'a> {
    meta: Meta,
    n: usize,
    plan: gpufeed::Plan,
    chunks: &'a [pipeline::TimelineRow],
}

/// `host compare`: compare_sync_async for each case, written to compare.json
/// and (in the peers' schema) host-rust.json.
pub async fn compare(
    device: &Device,
    pool: &PinnedPool,
    pipe: &Pipeline,
    cases: &[(usize, Kernel)],
    reps: usize,
    out: &Path,
) -> gpufeed::Result<Vec<compare::Comparison>> {
    println!(
        "\ncompare_sync_async: sync = one stream, each step awaited; async = the array cut into"
    );
    println!(
        "chunks over several streams so that copies and kernels overlap (each case tries the plans"
    );
    println!(
        "of the peers' grid and keeps the best). Medians of {reps} runs. overlap = how much of the"
    );
    println!(
        "shorter steps' time is hidden behind the longest (0%: none, 100%: all); copy bound = all"
    );
    println!("bytes in and out at once with no kernel, which no schedule can beat.\n");
    let comps = pipeline::compare_all(device, pool, pipe, cases, reps).await?;
    write_json(
        &out.join("compare.json"),
        &CompareFile {
            meta: Meta::new(device),
            comparisons: &comps,
            pool: pool.stats(),
        },
    )?;
    write_json(
        &out.join("host-rust.json"),
        &pipeline::peer_json(device, &comps),
    )?;
    if comps.iter().any(|c| !c.verified) {
        return Err(gpufeed::Error::InvalidArgument(
            "a pipelined result differs from the CPU reference".into(),
        ));
    }
    Ok(comps)
}

/// `host sweep`.
pub async fn sweep(
    device: &Device,
    pool: &PinnedPool,
    pipe: &Pipeline,
    sizes: &[usize],
    out: &Path,
) -> gpufeed::Result<()> {
    let pb = progress::bar(sizes.len() as u64);
    let rows = pipeline::sweep(device, pool, pipe, sizes, &pb).await?;
    pb.finish_and_clear();
    pipeline::print_sweep(&rows, fmt::Words::of(device));
    write_json(
        &out.join("sweep.json"),
        &SweepFile {
            meta: Meta::new(device),
            rows: &rows,
        },
    )?;
    pipeline::write_sweep_csv(&out.join("sweep.csv"), &rows)?;
    pipeline::plot_sweep(&out.join("time_vs_size.svg"), &rows, &device.info().name)?;
    if rows.iter().any(|c| !c.verified) {
        return Err(gpufeed::Error::InvalidArgument(
            "a sweep result differs from the CPU reference".into(),
        ));
    }
    Ok(())
}

/// `host timeline`.
pub async fn timeline(
    device: &Device,
    pool: &PinnedPool,
    pipe: &Pipeline,
    n: usize,
    plan: gpufeed::Plan,
    out: &Path,
) -> gpufeed::Result<()> {
    println!(
        "one pipelined run of {} floats ({plan}), every chunk's steps timed by events:",
        fmt::elems(n)
    );
    let rows = pipeline::timeline(device, pool, pipe, n, plan, &out.join("timeline.svg")).await?;
    write_json(
        &out.join("timeline.json"),
        &TimelineFile {
            meta: Meta::new(device),
            n,
            plan,
            chunks: &rows,
        },
    )?;
    Ok(())
}

/// The devices the multi-device parts use: every device of the backend; on
/// the CPU emulation at least two emulated ones.
fn all_devices(opts: &DeviceOptions) -> gpufeed::Result<Vec<Device>> {
    let mut opts = *opts;
    opts.emulated_devices = opts.emulated_devices.max(2);
    Device::all(opts)
}

/// `host topology`.
pub fn topology(opts: &DeviceOptions, out: &Path) -> gpufeed::Result<()> {
    let devices = all_devices(opts)?;
    let t = devices::topology(&devices)?;
    devices::print_topology(&t);
    write_json(&out.join("topology.json"), &t)
}

/// `host multi-gpu`.
pub async fn multi_gpu(opts: &DeviceOptions, small: bool, out: &Path) -> gpufeed::Result<()> {
    let devices = all_devices(opts)?;
    multi_gpu::run(&devices, small, out).await.map(|_| ())
}

/// `host bandwidth`.
pub fn bandwidth(
    device: &Device,
    max: usize,
    alloc_sizes: &[usize],
    out: &Path,
) -> gpufeed::Result<()> {
    let pb = progress::bar((bandwidth::sizes(max).len() + alloc_sizes.len()) as u64);
    let res = bandwidth::run(device, max, alloc_sizes, &pb)?;
    pb.finish_and_clear();
    bandwidth::print(&res);
    write_json(&out.join("bandwidth.json"), &res)?;
    write_csv(
        &out.join("bandwidth.csv"),
        res.rows.iter().map(bandwidth::CsvRow::from),
    )?;
    let pts = |f: fn(&bandwidth::Row) -> f64| {
        res.rows
            .iter()
            .map(|r| (r.bytes as f64, f(r)))
            .collect::<Vec<_>>()
    };
    plots::lines(
        &out.join("bandwidth.svg"),
        &format!(
            "copy bandwidth: pinned vs pageable — {}",
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
        false,
        &[
            plots::Series {
                name: "H2D pinned",
                points: pts(|r| r.h2d_pinned),
            },
            plots::Series {
                name: "D2H pinned",
                points: pts(|r| r.d2h_pinned),
            },
            plots::Series {
                name: "H2D pageable",
                points: pts(|r| r.h2d_pageable),
            },
            plots::Series {
                name: "D2H pageable",
                points: pts(|r| r.d2h_pageable),
            },
            plots::Series {
                name: "both directions (total)",
                points: pts(|r| r.bidirectional),
            },
        ],
    )
}

/// `host latency`.
pub fn latency(opts: &DeviceOptions, samples: usize, out: &Path) -> gpufeed::Result<()> {
    let pb = progress::bar(latency::STEPS);
    let res = latency::run(opts, samples, &pb)?;
    pb.finish_and_clear();
    latency::print(&res);
    write_json(&out.join("latency.json"), &res)
}

/// The whole demonstration (no subcommand).
pub fn full(
    rt: &tokio::runtime::Runtime,
    device: &Device,
    opts: &DeviceOptions,
    small: bool,
    out: &Path,
) -> gpufeed::Result<()> {
    let t0 = std::time::Instant::now();
    let scale = Scale::for_device(device, small);
    if device.kind() == BackendKind::Cpu {
        println!("note: CPU emulation — copies and kernels run on CPU threads; sizes are reduced and the");
        println!("times say nothing about a GPU.");
    }
    std::fs::create_dir_all(out)?;
    println!("results go to {}", out.display());
    println!("\n== devices: PCIe links, NUMA nodes, peer access");
    topology(opts, out)?;
    if device.kind() == BackendKind::Cpu {
        println!("\n== kernels: the Rust kernels against a CPU reference");
        println!("   (the emulation runs their bodies on CPU threads; the PTX is built but not run: `host ptx`)");
    } else {
        println!("\n== kernels: Rust-written PTX against the CPU");
    }
    kernels::run(device, scale.kernels_n, Some(&out.join("kernels.json")))?;
    println!("\n== pinned vs pageable");
    bandwidth(device, scale.bandwidth_max, &scale.alloc_sizes, out)?;
    println!("\n== streams and events as futures");
    latency(opts, scale.latency_samples, out)?;
    println!("\n== ordinary memory: pageable arrays to the device and back at the link's speed");
    staging::run(device, &staging::Config::for_device(device, small), out)?;
    println!(
        "\n== files: a file to the device, warm and cold, against the disk's own O_DIRECT rate"
    );
    files::run(
        device,
        &files::Config::new(small || device.kind() == BackendKind::Cpu),
        out,
    )?;
    println!("\n== a loader for training loops: shuffled rows gathered into batches on the device");
    loader::run(device, &loader::Config::for_device(device, small), out)?;
    println!("\n== small transfers: 4 KiB to 4 MiB copies, one and 64 in flight");
    small::part(rt, device, &small::Config::for_device(device, small), out)?;
    let pool = PinnedPool::new(device);
    let pipe = Pipeline::new(device, 8)?;
    println!("\n== waiting for a pipeline: parking at once vs gpufeed::block_on");
    waits::run(device, scale.waits_n, scale.waits_runs, out)?;
    println!("\n== overlap");
    let comps = gpufeed::block_on(compare(
        device,
        &pool,
        &pipe,
        &scale.compare,
        scale.reps,
        out,
    ))?;
    println!("\n== size sweep");
    gpufeed::block_on(sweep(device, &pool, &pipe, &scale.sweep, out))?;
    let plan = comps
        .iter()
        .find(|c| c.n == scale.timeline_n && matches!(c.kernel, Kernel::Scale { .. }))
        .map_or(gpufeed::Plan::auto(scale.timeline_n), |c| c.plan);
    println!("\n== timeline");
    gpufeed::block_on(timeline(device, &pool, &pipe, scale.timeline_n, plan, out))?;
    println!("\n== fewer bytes: bf16 on the wire (a user's kernel crate), SAXPY with two inputs");
    let small_sizes = small || device.kind() == BackendKind::Cpu;
    gpufeed::block_on(bytes::run(
        device,
        &pool,
        &pipe,
        &scale.bytes_sizes,
        scale.reps,
        small_sizes,
        out,
    ))?;
    println!("\n== several devices: each alone and all at once, one array spread over all of them");
    gpufeed::block_on(multi_gpu(opts, small, out))?;
    let s = pool.stats();
    let w = fmt::Words::of(device);
    println!(
        "\npinned pool: {} hits, {} misses; peak {} in use, {} now;\n  {:.1} ms spent in {}, {:.1} ms in {}",
        s.hits,
        s.misses,
        fmt::bytes(s.peak_in_use_bytes),
        fmt::bytes(s.in_use_bytes),
        s.driver_alloc_ns as f64 / 1e6,
        w.host_alloc(),
        s.driver_free_ns as f64 / 1e6,
        w.host_free()
    );
    println!(
        "\ndemonstration done in {:.1} s; {} files written to {}",
        t0.elapsed().as_secs_f64(),
        report::written(),
        out.display()
    );
    Ok(())
}
