//! `host topology` and `host multi-gpu`: the machine's devices and how they
//! connect (what `nvidia-smi topo -m` shows: PCIe link, NUMA node, peer
//! access), then copies and the pipeline on one device against all of them.

use super::fmt::{elems, ms as fmt_ms};
use super::plots;
use super::report::{median, random_floats, write_json, Meta};
use futures::future::join_all;
use host::{
    BackendKind, Device, DeviceBuffer, Error, Job, Kernel, MultiPipeline, PinnedHost, PinnedPool,
    Plan, PooledBuffer, Result, Stream,
};
use indicatif::ProgressBar;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

/// A PCIe link as sysfs reports it.
#[derive(Clone, Debug, Serialize)]
pub struct Link {
    pub generation: Option<u32>,
    pub width: Option<u32>,
    pub max_generation: Option<u32>,
    pub max_width: Option<u32>,
}

/// One device of the machine.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceTopo {
    pub ordinal: usize,
    pub name: String,
    pub pci_bus_id: Option<String>,
    pub link: Option<Link>,
    pub numa_node: Option<u32>,
    /// Copies to each device (by ordinal) go directly (peer access).
    pub peer_direct: Vec<bool>,
}

#[derive(Serialize)]
pub struct Topology {
    pub meta: Meta,
    /// NUMA nodes the host has online.
    pub host_numa_nodes: Vec<u32>,
    pub devices: Vec<DeviceTopo>,
}

/// The PCIe generation of a link speed as sysfs writes it (`32.0 GT/s PCIe`).
fn generation(speed: &str) -> Option<u32> {
    let gt: f64 = speed.split_whitespace().next()?.parse().ok()?;
    [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ]
    .iter()
    .find(|(s, _)| (gt - s).abs() < 0.1)
    .map(|&(_, g)| g)
}

fn link(bus_id: &str) -> Option<Link> {
    let dir = Path::new("/sys/bus/pci/devices").join(bus_id);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let num = |f: &str| read(f).and_then(|s| s.trim().parse().ok());
    let gen = |f: &str| read(f).and_then(|s| generation(&s));
    let l = Link {
        generation: gen("current_link_speed"),
        width: num("current_link_width"),
        max_generation: gen("max_link_speed"),
        max_width: num("max_link_width"),
    };
    (l.generation.is_some() || l.width.is_some()).then_some(l)
}

/// The topology of `devices` (which [`Device::all`] opened).
pub fn topology(devices: &[Device]) -> Result<Topology> {
    let mut out = Vec::new();
    for d in devices {
        let bus = d.pci_bus_id();
        let peer_direct = devices
            .iter()
            .map(|e| d.enable_peer_access(e))
            .collect::<Result<_>>()?;
        out.push(DeviceTopo {
            ordinal: d.ordinal(),
            name: d.info().name.clone(),
            link: bus.as_deref().and_then(link),
            pci_bus_id: bus,
            numa_node: d.numa_node(),
            peer_direct,
        });
    }
    let first = devices
        .first()
        .ok_or_else(|| Error::InvalidArgument("no device".into()))?;
    Ok(Topology {
        meta: Meta::new(first),
        host_numa_nodes: host::online_nodes(),
        devices: out,
    })
}

pub fn print_topology(t: &Topology) {
    let opt = |v: Option<u32>| v.map_or("?".to_string(), |v| v.to_string());
    println!(
        "host NUMA nodes online: {}",
        if t.host_numa_nodes.is_empty() {
            "none reported".to_string()
        } else {
            format!("{:?}", t.host_numa_nodes)
        }
    );
    for d in &t.devices {
        let link = d
            .link
            .as_ref()
            .map_or("PCIe link: not reported".to_string(), |l| {
                format!(
                    "PCIe Gen{} x{} (max Gen{} x{})",
                    opt(l.generation),
                    opt(l.width),
                    opt(l.max_generation),
                    opt(l.max_width)
                )
            });
        println!(
            "device {}: {} — {} — {} — NUMA node {}",
            d.ordinal,
            d.name,
            d.pci_bus_id.as_deref().unwrap_or("no PCI address"),
            link,
            d.numa_node
                .map_or("not reported (one node, or a VM)".to_string(), |n| n
                    .to_string())
        );
    }
    if t.devices.len() > 1 {
        print!("peer copies   ");
        for d in &t.devices {
            print!(" dev{:<3}", d.ordinal);
        }
        println!();
        for d in &t.devices {
            print!("  from dev{:<3}", d.ordinal);
            for (j, direct) in d.peer_direct.iter().enumerate() {
                let cell = if j == d.ordinal {
                    "  -   "
                } else if *direct {
                    "direct"
                } else {
                    "staged"
                };
                print!(" {cell}");
            }
            println!();
        }
    }
}

/// Copy bandwidth in GB/s, each direction alone and both at once.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Dirs {
    pub h2d: f64,
    pub d2h: f64,
    pub both: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct SpreadRow {
    pub n: usize,
    pub devices: usize,
    pub ms: f64,
    /// 8n bytes over the bidirectional aggregate of as many devices.
    pub bound_ms: f64,
    pub over_bound: f64,
    pub verified: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct PeerRow {
    pub from: usize,
    pub to: usize,
    pub bytes: usize,
    pub gbps: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct NumaRow {
    pub device: usize,
    pub node: u32,
    pub right_node: bool,
    pub h2d_gbps: f64,
}

#[derive(Serialize)]
pub struct MultiResults {
    pub meta: Meta,
    pub topology: Vec<DeviceTopo>,
    pub copy_bytes: usize,
    /// Each device alone.
    pub solo: Vec<Dirs>,
    /// All devices at once, in total.
    pub all: Dirs,
    /// all / the sum of the solo figures.
    pub all_over_sum: Dirs,
    pub spread: Vec<SpreadRow>,
    pub peer: Vec<PeerRow>,
    /// Pinned memory on the device's node and on another (hosts with more
    /// than one node; empty otherwise).
    pub numa: Vec<NumaRow>,
    pub reps: usize,
}

/// One device's copy rig: host and device buffers for each direction.
struct Rig {
    up: Stream,
    down: Stream,
    /// (pinned source, device destination) and (pinned destination, device source).
    bufs: Option<[Pair; 2]>,
}

/// A pinned buffer and a device buffer of one copy direction.
type Pair = (PooledBuffer<u8>, DeviceBuffer<u8>);
type CopyJob = Job<Pair, ()>;

impl Rig {
    fn new(device: &Device, pool: &PinnedPool, bytes: usize) -> Result<Rig> {
        let mut src = pool.alloc::<u8>(bytes)?;
        fastrand::Rng::with_seed(bytes as u64).fill(src.as_mut_slice());
        Ok(Rig {
            up: Stream::new(device)?,
            down: Stream::new(device)?,
            bufs: Some([
                (src, DeviceBuffer::new(device, bytes)?),
                (pool.alloc::<u8>(bytes)?, DeviceBuffer::new(device, bytes)?),
            ]),
        })
    }

    /// Enqueues this rig's copies (`h2d`, `d2h` or both).
    fn start(&mut self, h2d: bool, d2h: bool) -> Result<Vec<(usize, CopyJob)>> {
        let [a, b] = self
            .bufs
            .take()
            .ok_or_else(|| Error::Internal("a copy rig lost its buffers".into()))?;
        let up = if h2d {
            self.up
                .run(a, |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()))
        } else {
            self.up.run(a, |_, _| Ok(()))
        };
        let down = if d2h {
            self.down
                .run(b, |c, (h, d)| c.copy_d2h(d.view(), h.host_mut()))
        } else {
            self.down.run(b, |_, _| Ok(()))
        };
        Ok(vec![(0, up), (1, down)])
    }
}

/// Runs the copies of `rigs[which]` at once: seconds from issue to the last.
async fn round(rigs: &mut [Rig], which: &[usize], h2d: bool, d2h: bool) -> Result<f64> {
    let t = Instant::now();
    let mut jobs = Vec::new();
    for &r in which {
        for (slot, job) in rigs[r].start(h2d, d2h)? {
            jobs.push((r, slot, job));
        }
    }
    let (owners, futs): (Vec<_>, Vec<_>) = jobs.into_iter().map(|(r, s, j)| ((r, s), j)).unzip();
    let results = join_all(futs).await;
    let secs = t.elapsed().as_secs_f64();
    let mut back: Vec<[Option<Pair>; 2]> = (0..rigs.len()).map(|_| [None, None]).collect();
    let mut first_err = None;
    for ((r, s), res) in owners.into_iter().zip(results) {
        match res {
            Ok((bundle, ())) => back[r][s] = Some(bundle),
            Err(e) => {
                first_err.get_or_insert(e.error);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    for (rig, [a, b]) in rigs.iter_mut().zip(back) {
        if let (Some(a), Some(b)) = (a, b) {
            rig.bufs = Some([a, b]);
        }
    }
    Ok(secs)
}

/// Median GB/s of `reps` rounds (after one warm-up) of `rigs[which]`.
async fn gbps(
    rigs: &mut [Rig],
    which: &[usize],
    bytes: usize,
    reps: usize,
    pb: &ProgressBar,
) -> Result<Dirs> {
    let mut d = Dirs::default();
    for (h2d, d2h) in [(true, false), (false, true), (true, true)] {
        let mut times = Vec::new();
        for rep in 0..=reps {
            let s = round(rigs, which, h2d, d2h).await?;
            if rep > 0 {
                times.push(s);
            }
            pb.inc(1);
        }
        let moved = (bytes * which.len() * (h2d as usize + d2h as usize)) as f64;
        let g = moved / median(&times) / 1e9;
        match (h2d, d2h) {
            (true, false) => d.h2d = g,
            (false, true) => d.d2h = g,
            _ => d.both = g,
        }
    }
    Ok(d)
}

/// Median ms of the spread pipeline over `devices` on `n` floats, and
/// whether its output matches the CPU bit for bit.
async fn spread(
    devices: &[Device],
    pool: &PinnedPool,
    n: usize,
    reps: usize,
    pb: &ProgressBar,
) -> Result<(f64, bool)> {
    let multi = MultiPipeline::new(devices, 4)?;
    let part = multi.parts(n).first().map_or(n, |r| r.len());
    let plan = Plan::auto(part);
    let kernel = Kernel::Scale { s: 1.5 };
    let mut input = pool.alloc::<f32>(n)?;
    input
        .as_mut_slice()
        .copy_from_slice(&random_floats(n, 0xD1CE ^ n as u64));
    let mut output = pool.alloc::<f32>(n)?;
    let mut times = Vec::new();
    for rep in 0..=reps {
        let t = Instant::now();
        let ((i, o), _) = multi
            .run(input, output, kernel, plan)
            .await
            .map_err(Error::from)?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        (input, output) = (i, o);
        pb.inc(1);
    }
    let verified = input
        .as_slice()
        .iter()
        .zip(output.as_slice())
        .all(|(x, y)| kernel.reference(*x).to_bits() == y.to_bits());
    Ok((median(&times), verified))
}

/// Median GB/s of peer copies of `bytes` from `a` to `b` (on `a`'s stream).
async fn peer(a: &Device, b: &Device, bytes: usize, reps: usize) -> Result<f64> {
    let s = Stream::new(a)?;
    let mut bufs = (
        DeviceBuffer::<u8>::new(a, bytes)?,
        DeviceBuffer::<u8>::new(b, bytes)?,
    );
    let mut times = Vec::new();
    for rep in 0..=reps {
        let t = Instant::now();
        let (back, ()) = s
            .run(bufs, |c, (x, y)| c.copy_peer(x.view(), y.view_mut()))
            .await?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        bufs = back;
    }
    Ok(bytes as f64 / median(&times) / 1e9)
}

/// `host multi-gpu`: copies per device alone and all at once, the spread
/// pipeline on one device and on all, peer copies, NUMA placement.
pub async fn run(devices: &[Device], small: bool, out: &Path) -> Result<MultiResults> {
    let first = devices
        .first()
        .ok_or_else(|| Error::InvalidArgument("no device".into()))?;
    let k = devices.len();
    let cpu = first.kind() == BackendKind::Cpu;
    let (bytes, reps) = if small || cpu {
        (16 << 20, 3)
    } else {
        (256 << 20, 10)
    };
    let sizes: Vec<usize> = if small || cpu {
        vec![1_000_000]
    } else if k > 1 {
        vec![100_000_000, 1_000_000_000]
    } else {
        vec![100_000_000]
    };
    let topo = topology(devices)?.devices;
    let pools: Vec<PinnedPool> = devices.iter().map(PinnedPool::near).collect();
    let steps = 3 * (reps + 1) * (k + 1) + sizes.len() * (reps + 1) * 2;
    let pb = super::progress(steps as u64);
    pb.set_message("copies, each device alone, then all at once");
    let mut rigs = devices
        .iter()
        .zip(&pools)
        .map(|(d, p)| Rig::new(d, p, bytes))
        .collect::<Result<Vec<_>>>()?;
    let mut solo = Vec::new();
    for i in 0..k {
        solo.push(gbps(&mut rigs, &[i], bytes, reps, &pb).await?);
    }
    let everyone: Vec<usize> = (0..k).collect();
    let all = gbps(&mut rigs, &everyone, bytes, reps, &pb).await?;
    drop(rigs);
    let sum = solo.iter().fold(Dirs::default(), |a, s| Dirs {
        h2d: a.h2d + s.h2d,
        d2h: a.d2h + s.d2h,
        both: a.both + s.both,
    });
    let all_over_sum = Dirs {
        h2d: all.h2d / sum.h2d,
        d2h: all.d2h / sum.d2h,
        both: all.both / sum.both,
    };

    let mut spread_rows = Vec::new();
    for &n in &sizes {
        for (used, agg) in [(1, solo[0].both), (k, all.both)] {
            if used == 1 && k == 1 && !spread_rows.is_empty() {
                continue;
            }
            pb.set_message(format!("pipeline over {used} device(s), {}", elems(n)));
            let (ms, verified) = spread(&devices[..used], &pools[0], n, reps, &pb).await?;
            let bound_ms = 8.0 * n as f64 / agg / 1e6;
            spread_rows.push(SpreadRow {
                n,
                devices: used,
                ms,
                bound_ms,
                over_bound: ms / bound_ms,
                verified,
            });
            if k == 1 {
                break;
            }
        }
    }

    let mut peers = Vec::new();
    if k > 1 {
        pb.set_message("peer copies");
        for (i, a) in devices.iter().enumerate() {
            for (j, b) in devices.iter().enumerate() {
                if i != j {
                    peers.push(PeerRow {
                        from: i,
                        to: j,
                        bytes,
                        gbps: peer(a, b, bytes, reps).await?,
                    });
                }
            }
        }
    }

    let mut numa = Vec::new();
    let nodes = host::online_nodes();
    if nodes.len() > 1 {
        for (i, d) in devices.iter().enumerate() {
            let Some(right) = d.numa_node() else { continue };
            for &node in &nodes {
                let pool = PinnedPool::on_node(d, node);
                let mut rigs = vec![Rig::new(d, &pool, bytes)?];
                let g = gbps(&mut rigs, &[0], bytes, reps, &pb).await?;
                numa.push(NumaRow {
                    device: i,
                    node,
                    right_node: node == right,
                    h2d_gbps: g.h2d,
                });
            }
        }
    }
    pb.finish_and_clear();
    let res = MultiResults {
        meta: Meta::new(first),
        topology: topo,
        copy_bytes: bytes,
        solo,
        all,
        all_over_sum,
        spread: spread_rows,
        peer: peers,
        numa,
        reps,
    };
    print(&res, cpu);
    write_json(&out.join("multi_gpu.json"), &res)?;
    plot(&out.join("multi_gpu.svg"), &res)?;
    if res.spread.iter().any(|r| !r.verified) {
        return Err(Error::InvalidArgument(
            "a multi-device result differs from the CPU reference".into(),
        ));
    }
    Ok(res)
}

fn print(r: &MultiResults, cpu: bool) {
    let k = r.solo.len();
    println!(
        "copies of {} per direction and device (medians of {}), GB/s:",
        super::fmt::bytes(r.copy_bytes as u64),
        r.reps
    );
    println!("{:<22} {:>9} {:>9} {:>9}", "", "H2D", "D2H", "both");
    for (i, s) in r.solo.iter().enumerate() {
        println!(
            "{:<22} {:>9.1} {:>9.1} {:>9.1}",
            format!("device {i} alone"),
            s.h2d,
            s.d2h,
            s.both
        );
    }
    println!(
        "{:<22} {:>9.1} {:>9.1} {:>9.1}",
        format!("all {k} at once"),
        r.all.h2d,
        r.all.d2h,
        r.all.both
    );
    println!(
        "{:<22} {:>8.2}x {:>8.2}x {:>8.2}x",
        "  ÷ sum of solo runs", r.all_over_sum.h2d, r.all_over_sum.d2h, r.all_over_sum.both
    );
    println!("pipeline (scale) spread over the devices; bound = 8 bytes per element over the both-ways rate:");
    for s in &r.spread {
        println!(
            "  {:>5} floats on {} device(s): {} (bound {}, {:.3}x){}",
            elems(s.n),
            s.devices,
            fmt_ms(s.ms),
            fmt_ms(s.bound_ms),
            s.over_bound,
            if s.verified {
                ", bit-identical with the CPU"
            } else {
                ", MISMATCHES"
            }
        );
    }
    for p in &r.peer {
        println!(
            "  peer copy device {} → device {}: {:.1} GB/s",
            p.from, p.to, p.gbps
        );
    }
    if r.numa.is_empty() {
        println!("NUMA placement: this host has one NUMA node (or the GPUs' nodes are not reported): right vs wrong node not measurable here.");
    }
    for n in &r.numa {
        println!(
            "  device {} H2D from pinned memory on node {} ({}): {:.1} GB/s",
            n.device,
            n.node,
            if n.right_node {
                "its own"
            } else {
                "the other socket's"
            },
            n.h2d_gbps
        );
    }
    if cpu {
        println!("(CPU emulation: emulated devices share the host's memory bandwidth; the figures say nothing about GPUs.)");
    }
}

fn plot(path: &Path, r: &MultiResults) -> Result<()> {
    let k = r.solo.len() as f64;
    let s0 = r.solo.first().copied().unwrap_or_default();
    let series = |name, f: fn(&Dirs) -> f64| plots::Series {
        name,
        points: if k > 1.0 {
            vec![(1.0, f(&s0)), (k, f(&r.all))]
        } else {
            vec![(1.0, f(&s0))]
        },
    };
    plots::lines(
        path,
        &format!("copy bandwidth on 1 and {k} device(s) — {}", r.meta.device),
        plots::Axis {
            desc: "devices used at once",
            label: plots::Label::Number,
        },
        plots::Axis {
            desc: "GB/s in total (median)",
            label: plots::Label::Number,
        },
        false,
        &[
            series("H2D", |d| d.h2d),
            series("D2H", |d| d.d2h),
            series("both directions", |d| d.both),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::generation;

    #[test]
    fn link_speeds_name_their_generation() {
        assert_eq!(generation("32.0 GT/s PCIe\n"), Some(5));
        assert_eq!(generation("16.0 GT/s PCIe"), Some(4));
        assert_eq!(generation("2.5 GT/s PCIe"), Some(1));
        assert_eq!(generation("Unknown"), None);
    }
}
