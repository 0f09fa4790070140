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
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the kernels' PTX and list its entry points.
    Ptx {
        /// Write the PTX to this file instead of printing it.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check every kernel against the CPU bit for bit, and time `scale`
    /// against a device-to-device copy.
    Kernels {
        /// Elements.
        #[arg(long, default_value_t = 100_000_000)]
        n: usize,
        /// Write JSON results here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> host::Result<()> {
    if let Some(Cmd::Ptx { out }) = &cli.cmd {
        return demo::ptx::run(out.as_deref());
    }
    let mut opts = host::DeviceOptions::from_env()?;
    if let Some(b) = &cli.backend {
        opts.backend = b.parse()?;
    }
    let device = host::Device::open(opts)?;
    println!("{}", device.banner());
    match cli.cmd {
        Some(Cmd::Kernels { n, json }) => demo::kernels::run(&device, n, json.as_deref()),
        Some(Cmd::Ptx { .. }) => Ok(()),
        None => demo::kernels::run(
            &device,
            100_000_000,
            Some(&cli.out_dir.join("kernels.json")),
        ),
    }
}
