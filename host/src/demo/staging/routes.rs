//! The routes from ordinary memory to the device and back (the driver's
//! pageable copy, pin in place and copy, the staging engine forced and
//! automatic, the pinned copy), and `host staging` itself: the table of
//! every size and direction, then the pipeline and the sweep.

use crate::demo::fmt::size;
use crate::demo::report::{write_json, Meta};
use crate::demo::staging::case::{Case, Lands, Prep, Timed};
use crate::demo::staging::config::{engine, Config, Path4, PATHS};
use crate::demo::staging::data::{cpu_seconds, Bufs, Sources};
use crate::demo::staging::results::{plot, Results, Row};
use crate::demo::staging::slices::pipeline_row;
use crate::demo::staging::sweep::sweep;
use gpufeed::{
    Device, DeviceBuffer, PinnedHost, PinnedPool, Registered, Route, Staging, StagingConfig, Stream,
};
use std::path::Path;

/// Host to device by `path`.
fn h2d_by(
    path: Path4,
    device: &Device,
    stream: &Stream,
    engines: &[Staging; 2],
    s: &[u32],
    own: &mut Vec<u32>,
    mut b: Bufs,
) -> gpufeed::Result<Bufs> {
    match path {
        Path4::Pageable => b.dev.copy_from_host_sync(s)?,
        Path4::RegisterCopy => {
            // The user's array (made before the timer), pinned in place,
            // copied, unpinned.
            let reg = Registered::new(device, std::mem::take(own))?;
            let ((reg, dev), ()) = stream
                .run_sync((reg, b.dev), |c, (r, d)| c.copy_h2d(r.host(), d.view_mut()))
                .map_err(gpufeed::Error::from)?;
            b.dev = dev;
            drop(reg.into_inner());
        }
        Path4::Staged => engines[0].h2d_blocking(s, &mut b.dev)?,
        Path4::Auto => engines[1].h2d_blocking(s, &mut b.dev)?,
        // The link's own speed: the source already in pinned memory.
        Path4::Pinned => return b.pinned_copy(stream, true),
    }
    Ok(b)
}

/// Device to host by `path`, into the user's array `o`.
fn d2h_by(
    path: Path4,
    device: &Device,
    stream: &Stream,
    engines: &[Staging; 2],
    o: &mut Vec<u32>,
    mut b: Bufs,
) -> gpufeed::Result<Bufs> {
    match path {
        Path4::Pageable => b.dev.copy_to_host_sync(o)?,
        Path4::RegisterCopy => {
            let reg = Registered::new(device, std::mem::take(o))?;
            let ((reg, dev), ()) = stream
                .run_sync((reg, b.dev), |c, (r, d)| c.copy_d2h(d.view(), r.host_mut()))
                .map_err(gpufeed::Error::from)?;
            b.dev = dev;
            *o = reg.into_inner();
        }
        Path4::Staged => engines[0].d2h_blocking(&b.dev, o)?,
        Path4::Auto => engines[1].d2h_blocking(&b.dev, o)?,
        Path4::Pinned => return b.pinned_copy(stream, false),
    }
    Ok(b)
}

pub fn run(device: &Device, config: &Config, out: &Path) -> gpufeed::Result<Results> {
    let max = config
        .sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(config.sweep_bytes);
    let stream = Stream::new(device)?;
    let pool = PinnedPool::new(device);
    let src = Sources::new(max / 4);
    let default = StagingConfig::for_device(device);
    let shape = config
        .workers
        .map(|w| (w, default.block_bytes, default.blocks));
    let engines = [
        engine(device, Route::Staged, shape)?,
        engine(device, Route::Auto, shape)?,
    ];
    let mut rows = Vec::new();
    println!(
        "   {:>9} {:>4} {:>9} {:>9} {:>9} {:>9} {:>9}   GB/s, medians of {} runs ({} below 16 MiB, {} for the first two from 256 MiB); every element of every run checked",
        "size", "dir", "pageable", "reg+copy", "staged", "auto", "pinned", config.reps, config.small_runs(), config.slow_reps
    );
    for &bytes in &config.sizes {
        rows.extend(routes_at(
            device, &stream, &pool, &src, &engines, config, bytes,
        )?);
    }
    let staging_peak_bytes = engines
        .iter()
        .map(|e| e.pool_stats().peak_in_use_bytes)
        .max()
        .unwrap_or(0);
    // Idle: the workers must sleep once no copy is in flight.
    let c0 = cpu_seconds();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let idle_cpu_ms = (cpu_seconds() - c0) * 1e3;
    println!("   CPU used over 500 ms with no copy in flight: {idle_cpu_ms:.1} ms");

    let pipeline = pipeline_row(device, &pool, &src, config)?;
    let sweep = sweep(device, &stream, &pool, &src, config)?;
    let bad = rows.iter().filter(|r| !r.verified).count()
        + sweep.iter().filter(|r| !r.verified).count()
        + pipeline.iter().filter(|r| !r.verified).count();
    let results = Results {
        meta: Meta::new(device),
        default_config: default.into(),
        threads_used: engines[0].config().threads + 1,
        rows,
        settle_ms: config.settle_ms,
        sweep_bytes: config.sweep_bytes,
        sweep,
        idle_cpu_ms,
        staging_peak_bytes,
        staging_bound_bytes: default.total_bytes(),
        pipeline,
    };
    write_json(&out.join("staging.json"), &results)?;
    plot(device, &results, out)?;
    if bad > 0 {
        return Err(gpufeed::Error::Internal(format!(
            "staging: {bad} measurement(s) delivered wrong data (marked !)"
        )));
    }
    Ok(results)
}

/// Every route at `bytes`, host to device and back, the routes taking turns
/// run by run: a row per route and direction, and a line of the table per
/// direction.
fn routes_at(
    device: &Device,
    stream: &Stream,
    pool: &PinnedPool,
    src: &Sources,
    engines: &[Staging; 2],
    config: &Config,
    bytes: usize,
) -> gpufeed::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let n = bytes / 4;
    let case = |path: Path4| Case {
        stream,
        src,
        n,
        settle_ms: config.settle_ms,
        reps: config.runs(path, bytes),
    };
    let mut bufs = Bufs {
        pinned: pool.alloc::<u32>(n)?,
        dev: DeviceBuffer::new(device, n)?,
    };
    let mut user_out = vec![0u32; n];
    for dir in ["h2d", "d2h"] {
        // The routes take turns run by run, in a shuffled order (see
        // the module's notes).
        let paths: Vec<Path4> = PATHS
            .into_iter()
            .filter(|p| config.routes.contains(p))
            .collect();
        let cases: Vec<Case> = paths.iter().map(|&p| case(p)).collect();
        let mut timed: Vec<Timed> = paths.iter().map(|_| Timed::new()).collect();
        let most = cases.iter().map(|c| c.reps).max().unwrap_or(0);
        let mut rng = fastrand::Rng::with_seed(bytes as u64);
        let mut order: Vec<usize> = (0..paths.len()).collect();
        for rep in 0..=most {
            rng.shuffle(&mut order);
            for &i in &order {
                let (path, c) = (paths[i], &cases[i]);
                if rep > c.reps {
                    continue;
                }
                bufs = if dir == "h2d" {
                    let prep = match path {
                        Path4::RegisterCopy => Prep::OwnVec,
                        Path4::Pinned => Prep::Pinned,
                        _ => Prep::Nothing,
                    };
                    c.h2d_run(rep, bufs, prep, &mut timed[i], |s, own, b| {
                        h2d_by(path, device, stream, engines, s, own, b)
                    })?
                } else {
                    let lands = if path == Path4::Pinned {
                        Lands::Pinned
                    } else {
                        Lands::Out
                    };
                    c.d2h_run(rep, bufs, &mut user_out, lands, &mut timed[i], |o, b| {
                        d2h_by(path, device, stream, engines, o, b)
                    })?
                };
            }
        }
        let mut line = String::new();
        for path in PATHS {
            let Some(t) = paths.iter().position(|&p| p == path).map(|i| &timed[i]) else {
                line.push_str(&format!(" {:>8} ", "-"));
                continue;
            };
            let row = t.row(bytes, path, dir);
            let mark = if row.verified { ' ' } else { '!' };
            line.push_str(&format!(" {:>8.2}{mark}", row.gbps));
            rows.push(row);
        }
        println!("   {:>9} {:>4}{line}", size(bytes), dir);
    }
    Ok(rows)
}
