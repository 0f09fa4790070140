//! `host multi-gpu`: copies on each device alone and on all at once, each
//! against plain driver copies of the same bytes in the same run; the spread
//! pipeline on one device and on all; peer copies against a plain
//! `cuMemcpyPeerAsync`; pinned memory on the right and the wrong NUMA node.

use super::bandwidth::raw;
use super::devices::{topology, DeviceTopo};
use super::fmt::{elems, ms as fmt_ms};
use super::plots;
use super::report::{median, random_floats, write_json, Meta};
use futures::future::join_all;
use gpufeed::{
    BackendKind, Device, DeviceBuffer, Error, Job, Kernel, MultiPipeline, PinnedHost, PinnedPool,
    Plan, PooledBuffer, Result, Stream,
};
use indicatif::ProgressBar;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

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
    /// 8n bytes over the bidirectional aggregate of as many devices (the
    /// faster of ours and plain driver copies).
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
    /// A plain `cuMemcpyPeerAsync` of the same bytes, interleaved with ours
    /// (None on the CPU emulation).
    pub plain_gbps: Option<f64>,
    /// gbps / plain_gbps.
    pub over_plain: Option<f64>,
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
    /// Plain driver copies of the same bytes (cudarc's `sys` layer, memory
    /// from `cuMemHostAlloc` / `cuMemAlloc`, two streams per device),
    /// interleaved round by round with ours: each device alone, then all at
    /// once. Empty / None on the CPU emulation.
    pub solo_plain: Vec<Dirs>,
    pub all_plain: Option<Dirs>,
    /// all / all_plain: ours against plain driver copies, all devices at once.
    pub all_over_plain: Option<Dirs>,
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

/// Plain driver copies of one device, the baseline for ours: two streams
/// (one per direction) on the device's primary context and memory from the
/// driver, as a CUDA C++ program would do it.
struct PlainRig {
    up: raw::Raw,
    down: raw::Raw,
    /// The H2D buffers, then the D2H buffers.
    bufs: [raw::Buffers; 2],
}

impl PlainRig {
    /// None on the CPU emulation (or where the driver's context can't be had).
    fn new(device: &Device, bytes: usize) -> Result<Option<PlainRig>> {
        let (Some(up), Some(down)) = (raw::Raw::new(device), raw::Raw::new(device)) else {
            return Ok(None);
        };
        up.bind()?;
        let bufs = [up.buffers(bytes)?, up.buffers(bytes)?];
        // SAFETY: bufs[0].host is a live allocation of `bytes` bytes (just made).
        let src = unsafe { std::slice::from_raw_parts_mut(bufs[0].host.cast::<u8>(), bytes) };
        fastrand::Rng::with_seed(bytes as u64).fill(src);
        Ok(Some(PlainRig { up, down, bufs }))
    }
}

impl Drop for PlainRig {
    fn drop(&mut self) {
        // The buffers are freed with their own device's context current.
        let _ = self.up.bind();
    }
}

/// Plain driver copies of `rigs[which]` at once: seconds from issue to the
/// last stream's synchronize.
fn plain_round(rigs: &[PlainRig], which: &[usize], h2d: bool, d2h: bool) -> Result<f64> {
    let t = Instant::now();
    for &r in which {
        let rig = &rigs[r];
        rig.up.bind()?;
        // SAFETY: the buffers live in `rigs`, borrowed until every stream is
        // synchronized below.
        unsafe {
            if h2d {
                rig.up.enqueue(&rig.bufs[0], true)?;
            }
            if d2h {
                rig.down.enqueue(&rig.bufs[1], false)?;
            }
        }
    }
    for &r in which {
        rigs[r].up.sync()?;
        rigs[r].down.sync()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Median GB/s of `reps` rounds (after one warm-up) of `rigs[which]`, and
/// of plain driver copies of the same bytes (`plain`), round by round in
/// turn so drift hits both alike.
async fn gbps(
    rigs: &mut [Rig],
    plain: Option<&[PlainRig]>,
    which: &[usize],
    bytes: usize,
    reps: usize,
    pb: &ProgressBar,
) -> Result<(Dirs, Option<Dirs>)> {
    let mut d = Dirs::default();
    let mut p = Dirs::default();
    for (h2d, d2h) in [(true, false), (false, true), (true, true)] {
        let (mut times, mut plain_times) = (Vec::new(), Vec::new());
        for rep in 0..=reps {
            let s = round(rigs, which, h2d, d2h).await?;
            let ps = plain
                .map(|rigs| plain_round(rigs, which, h2d, d2h))
                .transpose()?;
            if rep > 0 {
                times.push(s);
                plain_times.extend(ps);
            }
            pb.inc(1);
        }
        let moved = (bytes * which.len() * (h2d as usize + d2h as usize)) as f64;
        let g = moved / median(&times) / 1e9;
        let pg = if plain_times.is_empty() {
            0.0
        } else {
            moved / median(&plain_times) / 1e9
        };
        match (h2d, d2h) {
            (true, false) => (d.h2d, p.h2d) = (g, pg),
            (false, true) => (d.d2h, p.d2h) = (g, pg),
            _ => (d.both, p.both) = (g, pg),
        }
    }
    Ok((d, plain.map(|_| p)))
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
    let mut verified = false;
    for rep in 0..=reps {
        // The warm-up is the checked run, into an output poisoned beforehand
        // (a pooled block may hold an earlier run's answer).
        if rep == 0 {
            gpufeed::testing::poison(output.as_mut_slice());
        }
        let t = Instant::now();
        let ((i, o), _) = multi
            .run(input, output, kernel, plan)
            .await
            .map_err(Error::from)?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        } else {
            let (checked, bad) = gpufeed::testing::verify(kernel, i.as_slice(), o.as_slice());
            verified = checked == n && bad == 0;
        }
        (input, output) = (i, o);
        pb.inc(1);
    }
    Ok((median(&times), verified))
}

/// Median GB/s of peer copies of `bytes` from `a` to `b` (on `a`'s stream),
/// and of a plain `cuMemcpyPeerAsync` of the same bytes, rep by rep in turn.
async fn peer(a: &Device, b: &Device, bytes: usize, reps: usize) -> Result<(f64, Option<f64>)> {
    let s = Stream::new(a)?;
    let mut bufs = (
        DeviceBuffer::<u8>::new(a, bytes)?,
        DeviceBuffer::<u8>::new(b, bytes)?,
    );
    let plain = match (raw::Raw::new(a), raw::Raw::new(b)) {
        (Some(ra), Some(rb)) => {
            let (src, dst) = (ra.device_alloc(bytes)?, rb.device_alloc(bytes)?);
            Some((ra, rb, src, dst))
        }
        _ => None,
    };
    let (mut times, mut plain_times) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let t = Instant::now();
        let (back, ()) = s
            .run(bufs, |c, (x, y)| c.copy_peer(x.view(), y.view_mut()))
            .await?;
        let ours = t.elapsed().as_secs_f64();
        bufs = back;
        let theirs = plain
            .as_ref()
            .map(|(ra, _, src, dst)| ra.peer_ms(dst, src, bytes))
            .transpose()?;
        if rep > 0 {
            times.push(ours);
            plain_times.extend(theirs.map(|ms| ms / 1e3));
        }
    }
    let gbps = |t: &[f64]| bytes as f64 / median(t) / 1e9;
    Ok((
        gbps(&times),
        (!plain_times.is_empty()).then(|| gbps(&plain_times)),
    ))
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
    let pb = super::progress::bar(steps as u64);
    pb.set_message("copies, each device alone, then all at once");
    let mut rigs = devices
        .iter()
        .zip(&pools)
        .map(|(d, p)| Rig::new(d, p, bytes))
        .collect::<Result<Vec<_>>>()?;
    let plain_rigs = devices
        .iter()
        .map(|d| PlainRig::new(d, bytes))
        .collect::<Result<Option<Vec<_>>>>()?;
    let plain = plain_rigs.as_deref();
    let (mut solo, mut solo_plain) = (Vec::new(), Vec::new());
    for i in 0..k {
        let (ours, theirs) = gbps(&mut rigs, plain, &[i], bytes, reps, &pb).await?;
        solo.push(ours);
        solo_plain.extend(theirs);
    }
    let everyone: Vec<usize> = (0..k).collect();
    let (all, all_plain) = gbps(&mut rigs, plain, &everyone, bytes, reps, &pb).await?;
    drop(rigs);
    drop(plain_rigs);
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
    let all_over_plain = all_plain.map(|p| Dirs {
        h2d: all.h2d / p.h2d,
        d2h: all.d2h / p.d2h,
        both: all.both / p.both,
    });

    // The bound: the faster of our copies and plain driver copies, both ways.
    let fastest = |ours: f64, plain: Option<&Dirs>| plain.map_or(ours, |p| ours.max(p.both));
    let one = fastest(solo[0].both, solo_plain.first());
    let every = fastest(all.both, all_plain.as_ref());
    let mut spread_rows = Vec::new();
    for &n in &sizes {
        for (used, agg) in [(1, one), (k, every)] {
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
                    let (gbps, plain_gbps) = peer(a, b, bytes, reps).await?;
                    peers.push(PeerRow {
                        from: i,
                        to: j,
                        bytes,
                        gbps,
                        plain_gbps,
                        over_plain: plain_gbps.map(|p| gbps / p),
                    });
                }
            }
        }
    }

    let mut numa = Vec::new();
    let nodes = gpufeed::online_nodes();
    if nodes.len() > 1 {
        for (i, d) in devices.iter().enumerate() {
            let Some(right) = d.numa_node() else { continue };
            for &node in &nodes {
                let pool = PinnedPool::on_node(d, node);
                let mut rigs = vec![Rig::new(d, &pool, bytes)?];
                let (g, _) = gbps(&mut rigs, None, &[0], bytes, reps, &pb).await?;
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
        solo_plain,
        all_plain,
        all_over_plain,
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
    let row = |name: String, d: &Dirs| {
        println!("{:<22} {:>9.1} {:>9.1} {:>9.1}", name, d.h2d, d.d2h, d.both)
    };
    for (i, s) in r.solo_plain.iter().enumerate() {
        row(format!("plain, device {i} alone"), s);
    }
    if let (Some(p), Some(o)) = (&r.all_plain, &r.all_over_plain) {
        row(format!("plain, all {k} at once"), p);
        println!(
            "{:<22} {:>8.3}x {:>8.3}x {:>8.3}x",
            "  ours ÷ plain", o.h2d, o.d2h, o.both
        );
    } else {
        println!("(plain driver copies: not measured on this backend)");
    }
    println!("pipeline (scale) spread over the devices; bound = 8 bytes per element over the both-ways rate\n(the faster of ours and plain driver copies):");
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
        let plain = match (p.plain_gbps, p.over_plain) {
            (Some(g), Some(o)) => format!(", plain cuMemcpyPeerAsync {g:.1} GB/s (ours {o:.3}x)"),
            _ => String::new(),
        };
        println!(
            "  peer copy device {} → device {}: {:.1} GB/s{plain}",
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
