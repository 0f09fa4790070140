//! `cargo run -p host --release`: the whole demonstration; each part is also a
//! subcommand (`host --help`).

mod demo;

use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "host",
    about = "Pinned memory, streams as futures, overlapped copies and Rust kernels: demonstration and benchmarks"
)]
struct Cli {
    /// Backend: auto (CUDA if a GPU is present, else CPU emulation), cuda, cpu.
    /// Also settable with HOST_BACKEND.
    #[arg(long, global = true)]
    backend: Option<String>,
    /// Directory for results (JSON, CSV, plots).
    #[arg(long, global = true, default_value = "out")]
    out_dir: PathBuf,
    /// How CUDA completion is awaited: spin, blocking or poll.
    #[arg(long, global = true, default_value = "spin")]
    wait: String,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The whole demonstration (the default).
    Demo {
        /// Small sizes (what CI runs on the CPU emulation).
        #[arg(long)]
        small: bool,
    },
    /// Print the kernels' PTX and list its entry points.
    Ptx {
        /// Write the PTX to this file instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The sm_80 build (with the tensor-core GEMM) instead of sm_70's.
        #[arg(long)]
        sm80: bool,
        /// Write the inspection (instructions, ptxas registers/spills) as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The block-level kernels (sum, max, scan, softmax, histogram, SGEMM,
    /// the bf16 tensor-core GEMM) timed against the device copy, each checked.
    KernelSet {
        /// Bytes of the memory-bound kernels' inputs.
        #[arg(long, default_value_t = 1 << 30)]
        bytes: usize,
        /// The GEMMs' size (n x n by n x n).
        #[arg(long, default_value_t = 4096)]
        gemm: usize,
        /// Timed runs per kernel (the median is reported).
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
    /// Check every kernel against the CPU bit for bit; time `scale` against a device copy.
    Kernels {
        #[arg(long, default_value_t = 100_000_000)]
        n: usize,
    },
    /// Ordinary (pageable) memory to the device and back, 64 KiB to 4 GiB:
    /// the driver's copy, pin-in-place + copy, the staging engine (forced
    /// and automatic) and the pinned copy; then the engine's shape swept.
    Staging {
        /// Sizes in bytes, comma-separated (default: 64 KiB to 4 GiB by
        /// powers of 4 on a GPU, up to 64 MiB on the CPU emulation).
        #[arg(long, value_delimiter = ',')]
        sizes: Option<Vec<usize>>,
        /// Timed runs per route, size and direction (default 11; below 16
        /// MiB at least 51 on a GPU).
        #[arg(long)]
        reps: Option<usize>,
        /// Size of the shape sweep in bytes (0: none).
        #[arg(long)]
        sweep_bytes: Option<usize>,
        /// Timed runs per shape in the sweep (default 7 on a GPU).
        #[arg(long)]
        sweep_reps: Option<usize>,
        /// Workers of the routes' engines instead of the default (to
        /// compare two defaults in one call).
        #[arg(long)]
        workers: Option<usize>,
        /// Milliseconds of idle before each timed run (default 10: the
        /// engine's workers, which spin 2 ms after a copy, are parked).
        #[arg(long)]
        settle_ms: Option<u64>,
        /// The routes to measure, comma-separated (default: all five).
        #[arg(long, value_delimiter = ',')]
        routes: Option<Vec<demo::staging::Path4>>,
    },
    /// Shuffled rows of a Vec gathered into batches on the device by the
    /// Loader, every batch of a first epoch checked, against the pinned
    /// copy of the same bytes.
    Loader {
        /// Small sizes (what CI runs).
        #[arg(long)]
        small: bool,
        /// Timed epochs per batch size.
        #[arg(long)]
        reps: Option<usize>,
        /// Batch sizes in bytes, comma-separated (default: 1, 8, 16 and
        /// 64 MiB on a GPU, 1 MiB on the CPU emulation).
        #[arg(long, value_delimiter = ',')]
        batch_bytes: Option<Vec<usize>>,
    },
    /// A file to the device through the staging ring, warm (page cache)
    /// and cold (evicted; O_DIRECT and buffered), every byte checked,
    /// against the disk's own O_DIRECT rate and the staged copy from
    /// memory in the same run; the GPUDirect Storage probe's finding.
    Files {
        /// Bytes of data in the file (default 1 GiB; 24 MiB with --small).
        #[arg(long)]
        bytes: Option<usize>,
        /// Small sizes (what CI runs).
        #[arg(long)]
        small: bool,
        /// Timed warm runs (cold: fewer).
        #[arg(long)]
        reps: Option<usize>,
        /// Directory for the file (default: --out-dir; use a real disk).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Pinned vs pageable bandwidth, raw driver copies, allocation cost.
    Bandwidth {
        /// Largest copy in MiB.
        #[arg(long, default_value_t = 1024)]
        max_mib: usize,
    },
    /// Wake latency of awaited events and CPU cost per awaited operation.
    Latency {
        #[arg(long, default_value_t = 1000)]
        samples: usize,
    },
    /// Small copies (4 KiB to 4 MiB), one and 64 in flight, both directions:
    /// run_sync, awaited and raw driver copies, in copies per second and GB/s.
    SmallTransfers {
        /// Timed rounds per mode, size and direction (default: 11 on a GPU,
        /// 3 on the CPU emulation).
        #[arg(long)]
        rounds: Option<usize>,
        /// Bytes per copy, comma-separated, multiples of 8 (default:
        /// 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB; up to 1 MiB on the CPU emulation).
        #[arg(long, value_delimiter = ',')]
        sizes: Option<Vec<usize>>,
    },
    /// Where a pipeline's per-chunk cost goes: the bidirectional copy in
    /// 1-64 pieces, plain, with an event per piece, with a wait per piece
    /// (plain driver calls; CUDA only).
    ChunkCost {
        /// Bytes each way.
        #[arg(long, default_value_t = 40_000_000)]
        bytes: usize,
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
    /// What the waiting thread costs a pipeline: one run awaited by an
    /// executor that parks at once and by `gpufeed::block_on` (spins, then parks)
    Waits {
        /// Floats (default: 10^7 on a GPU, 10^6 on the CPU emulation).
        #[arg(long)]
        n: Option<usize>,
        #[arg(long, default_value_t = 60)]
        runs: usize,
    },
    /// Where an awaited copy's time goes: one copy at a time waited for by
    /// the driver's stream wait, an event wait, a hand-off to another thread
    /// (plain driver calls), and by ours (CUDA only).
    WaitPath {
        /// Bytes per copy, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "4096,1048576")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 200)]
        copies: usize,
        #[arg(long, default_value_t = 15)]
        rounds: usize,
    },
    /// The machine's devices: PCIe links, NUMA nodes, peer access.
    Topology,
    /// Several devices: copies per device alone and all at once, one array
    /// spread over all of them, peer copies, NUMA placement. On the CPU
    /// emulation, HOST_CPU_DEVICES devices (at least two).
    MultiGpu,
    /// compare_sync_async for the given sizes (floats).
    Compare {
        #[arg(long, value_delimiter = ',', default_value = "10000000,100000000")]
        sizes: Vec<usize>,
        /// FMAs per element for the intensity kernel; scale when absent.
        #[arg(long)]
        k: Option<u32>,
        #[arg(long, default_value_t = 10)]
        reps: usize,
    },
    /// The task's `compare_sync_async(size)`: sync vs pipelined for one size,
    /// printed (the device comes from HOST_BACKEND).
    CompareSyncAsync {
        #[arg(long, default_value_t = 10_000_000)]
        size: usize,
    },
    /// Sync vs pipelined over sizes.
    Sweep {
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "100000,1000000,10000000,100000000,1000000000"
        )]
        sizes: Vec<usize>,
    },
    /// Fewer bytes over the link: f32, bf16-in/f32-out, bf16 both ways and
    /// SAXPY pipelines, each against its own copy bound.
    FewerBytes {
        #[arg(long, value_delimiter = ',', default_value = "10000000,100000000")]
        sizes: Vec<usize>,
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
    /// Many tasks sharing one pool and a few streams, every result verified,
    /// RSS and pool statistics sampled.
    Load {
        #[arg(long, default_value_t = 64)]
        tasks: usize,
        #[arg(long, default_value_t = 4)]
        streams: usize,
        #[arg(long, default_value_t = 30.0)]
        seconds: f64,
        /// Cap on the pool's cached (free) bytes, MiB; 0: no cap. Random sizes
        /// keep finding size classes with no free block for a long while, so an
        /// uncapped cache grows slowly towards a plateau; the cap bounds it.
        #[arg(long, default_value_t = 256)]
        max_cached_mib: usize,
    },
    /// Draw the stream/engine timeline of one pipelined run.
    Timeline {
        #[arg(long, default_value_t = 100_000_000)]
        n: usize,
        #[arg(long)]
        chunks: Option<usize>,
        /// Streams (round robin), or device chunk buffers (with --engines).
        #[arg(long, default_value_t = 4)]
        streams: usize,
        /// One stream per engine (copy-in, compute, copy-out).
        #[arg(long)]
        engines: bool,
        /// Ramped chunk sizes (small first and last chunks).
        #[arg(long)]
        ramp: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> gpufeed::Result<()> {
    if let Some(Cmd::Ptx { out, sm80, json }) = &cli.cmd {
        return demo::ptx::run(out.as_deref(), *sm80, json.as_deref());
    }
    let mut opts = gpufeed::DeviceOptions::from_env()?;
    if let Some(b) = &cli.backend {
        opts.backend = b.parse()?;
    }
    opts.wait_mode = match cli.wait.as_str() {
        "spin" => gpufeed::WaitMode::Spin,
        "blocking" => gpufeed::WaitMode::Blocking,
        "poll" => gpufeed::WaitMode::Poll,
        other => {
            return Err(gpufeed::Error::InvalidArgument(format!(
                "--wait {other}: use spin, blocking or poll"
            )))
        }
    };
    let device = gpufeed::Device::open(opts)?;
    println!("{}", device.banner());
    std::fs::create_dir_all(&cli.out_dir)?;
    // Absolute, so every "wrote" line says exactly where the file is.
    let out = std::fs::canonicalize(&cli.out_dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let pool = gpufeed::PinnedPool::new(&device);
    match cli.cmd.unwrap_or(Cmd::Demo { small: false }) {
        Cmd::Demo { small } => demo::full(&rt, &device, &opts, small, &out),
        Cmd::Ptx { .. } => Ok(()),
        Cmd::Kernels { n } => demo::kernels::run(&device, n, Some(&out.join("kernels.json"))),
        Cmd::KernelSet { bytes, gemm, reps } => {
            demo::kernel_set::run(&device, bytes, gemm, reps, &out.join("kernel_set.json"))
        }
        Cmd::Bandwidth { max_mib } => {
            demo::bandwidth(&device, max_mib << 20, &[64 << 20, 1 << 30], &out)
        }
        Cmd::Staging {
            sizes,
            reps,
            sweep_bytes,
            sweep_reps,
            workers,
            settle_ms,
            routes,
        } => {
            let mut c = demo::staging::Config::for_device(&device, false);
            c.routes = routes.unwrap_or(c.routes);
            c.settle_ms = settle_ms.unwrap_or(c.settle_ms);
            c.sizes = sizes.unwrap_or(c.sizes);
            c.reps = reps.unwrap_or(c.reps).max(1);
            c.sweep_bytes = sweep_bytes.unwrap_or(c.sweep_bytes);
            c.sweep_reps = sweep_reps.unwrap_or(c.sweep_reps).max(1);
            c.workers = workers;
            demo::staging::run(&device, &c, &out).map(|_| ())
        }
        Cmd::Loader {
            small,
            reps,
            batch_bytes,
        } => {
            let mut c = demo::loader::Config::for_device(&device, small);
            c.reps = reps.unwrap_or(c.reps).max(1);
            c.batch_bytes = batch_bytes.unwrap_or(c.batch_bytes);
            demo::loader::run(&device, &c, &out).map(|_| ())
        }
        Cmd::Files {
            bytes,
            small,
            reps,
            dir,
        } => {
            let mut c = demo::files::Config::new(small);
            c.bytes = bytes.unwrap_or(c.bytes).max(4);
            c.reps = reps.unwrap_or(c.reps).max(1);
            c.dir = dir;
            demo::files::run(&device, &c, &out)
        }
        Cmd::Latency { samples } => demo::latency(&opts, samples, &out),
        Cmd::SmallTransfers { rounds, sizes } => demo::small::part(
            &rt,
            &device,
            &demo::small::Config::for_device(&device, false).with(rounds, sizes),
            &out,
        ),
        Cmd::ChunkCost { bytes, reps } => demo::chunk_cost::run(&device, bytes, reps, &out),
        Cmd::Waits { n, runs } => {
            let n = n.unwrap_or(if device.kind() == gpufeed::BackendKind::Cpu {
                1_000_000
            } else {
                10_000_000
            });
            demo::waits::run(&device, n, runs, &out)
        }
        Cmd::WaitPath {
            sizes,
            copies,
            rounds,
        } => demo::wait_path::run(&device, &sizes, copies, rounds, &out),
        Cmd::Topology => demo::topology(&opts, &out),
        Cmd::MultiGpu => gpufeed::block_on(demo::multi_gpu(&opts, false, &out)),
        Cmd::Compare { sizes, k, reps } => {
            let kernel = k.map_or(gpufeed::Kernel::Scale { s: 1.5 }, |k| {
                gpufeed::Kernel::Intensity { k }
            });
            let cases: Vec<_> = sizes.iter().map(|&n| (n, kernel)).collect();
            let pipe = gpufeed::Pipeline::new(&device, 8)?;
            gpufeed::block_on(demo::compare(&device, &pool, &pipe, &cases, reps, &out)).map(|_| ())
        }
        Cmd::CompareSyncAsync { size } => {
            let c = demo::compare::compare_sync_async(size)?;
            if c.verified {
                Ok(())
            } else {
                Err(gpufeed::Error::InvalidArgument(
                    "compare-sync-async: a result differs from the CPU reference".into(),
                ))
            }
        }
        Cmd::Sweep { sizes } => {
            let pipe = gpufeed::Pipeline::new(&device, 4)?;
            gpufeed::block_on(demo::sweep(&device, &pool, &pipe, &sizes, &out))
        }
        Cmd::FewerBytes { sizes, reps } => {
            let pipe = gpufeed::Pipeline::new(&device, 8)?;
            let small = device.kind() == gpufeed::BackendKind::Cpu;
            gpufeed::block_on(demo::bytes::run(
                &device, &pool, &pipe, &sizes, reps, small, &out,
            ))
            .map(|_| ())
        }
        Cmd::Load {
            tasks,
            streams,
            seconds,
            max_cached_mib,
        } => demo::load::run(
            &rt,
            &device,
            demo::load::Config {
                tasks,
                streams,
                seconds,
                max_cached_bytes: (max_cached_mib > 0).then_some(max_cached_mib << 20),
            },
            &out,
        ),
        Cmd::Timeline {
            n,
            chunks,
            streams,
            engines,
            ramp,
        } => {
            let pipe = gpufeed::Pipeline::new(&device, streams.max(3))?;
            let plan = chunks.map_or(gpufeed::Plan::auto(n), |chunks| {
                if engines {
                    gpufeed::Plan::engines(chunks, streams)
                } else {
                    gpufeed::Plan::uniform(chunks, streams)
                }
            });
            let plan = if ramp { plan.ramped() } else { plan };
            gpufeed::block_on(demo::timeline(&device, &pool, &pipe, n, plan, &out))
        }
    }
}
