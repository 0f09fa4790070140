//! The staging engine's shape swept at one size (threads, block size,
//! blocks) against the pinned copy, the shapes taking turns run by run.

use crate::demo::fmt::size;
use crate::demo::staging::case::{Case, Lands, Prep, Timed};
use crate::demo::staging::config::{engine, Config, Path4};
use crate::demo::staging::data::{Bufs, Sources};
use crate::demo::staging::results::SweepRow;
use gpufeed::{Device, DeviceBuffer, PinnedPool, Route, Staging, StagingConfig, Stream};

/// An engine's shape: threads, block bytes, blocks.
type Shape = (usize, usize, usize);

/// The shapes swept, after `None` (the pinned copy, the reference of every
/// shape): 12 and 15 threads where there are the cores, and the default
/// count, each with rings of 16, 24, 32 and 64 MiB in all.
fn shapes(device: &Device) -> Vec<Option<Shape>> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut threads: Vec<usize> = [12, 15].into_iter().filter(|&t| t <= cores).collect();
    threads.push(StagingConfig::for_device(device).threads);
    threads.sort_unstable();
    threads.dedup();
    // Rings of 16, 24, 32 and 64 MiB in all.
    let blocks = [
        (2 << 20, 8),
        (4 << 20, 4),
        (8 << 20, 2),
        (4 << 20, 6),
        (8 << 20, 3),
        (4 << 20, 8),
        (8 << 20, 4),
        (16 << 20, 4),
    ];
    // `None`: the pinned copy, the reference of every shape.
    let mut shapes: Vec<Option<Shape>> = vec![None];
    for &t in &threads {
        shapes.extend(blocks.iter().map(|&(b, n)| Some((t, b, n))));
    }
    shapes
}

/// The engine's shape swept at one size: threads × block size × blocks,
/// every shape within the default 64 MiB bound, against the pinned copy.
/// Like the routes above, every shape and the pinned copy take turns run
/// by run in a shuffled order, so the machine's drift falls on all alike
/// and each shape's ratio to the pinned copy is of the same minutes.
pub(super) fn sweep(
    device: &Device,
    stream: &Stream,
    pool: &PinnedPool,
    src: &Sources,
    config: &Config,
) -> gpufeed::Result<Vec<SweepRow>> {
    if config.sweep_bytes == 0 {
        return Ok(vec![]);
    }
    let shapes = shapes(device);
    let engines = shapes
        .iter()
        .map(|s| {
            s.map(|shape| engine(device, Route::Staged, Some(shape)))
                .transpose()
        })
        .collect::<gpufeed::Result<Vec<Option<Staging>>>>()?;
    let n = config.sweep_bytes / 4;
    let case = Case {
        stream,
        src,
        n,
        reps: config.sweep_reps,
        settle_ms: config.settle_ms,
    };
    let mut bufs = Bufs {
        pinned: pool.alloc::<u32>(n)?,
        dev: DeviceBuffer::new(device, n)?,
    };
    let mut user_out = vec![0u32; n];
    let mut timed: [Vec<Timed>; 2] = [
        shapes.iter().map(|_| Timed::new()).collect(),
        shapes.iter().map(|_| Timed::new()).collect(),
    ];
    let mut rng = fastrand::Rng::with_seed(config.sweep_bytes as u64 ^ 0x5eed);
    let mut order: Vec<usize> = (0..shapes.len()).collect();
    for (d, t) in timed.iter_mut().enumerate() {
        for rep in 0..=config.sweep_reps {
            rng.shuffle(&mut order);
            for &i in &order {
                bufs = match (&engines[i], d) {
                    (None, 0) => case.h2d_run(rep, bufs, Prep::Pinned, &mut t[i], |_, _, b| {
                        b.pinned_copy(stream, true)
                    })?,
                    (None, _) => case.d2h_run(
                        rep,
                        bufs,
                        &mut user_out,
                        Lands::Pinned,
                        &mut t[i],
                        |_, b| b.pinned_copy(stream, false),
                    )?,
                    (Some(e), 0) => {
                        case.h2d_run(rep, bufs, Prep::Nothing, &mut t[i], |s, _, mut b| {
                            e.h2d_blocking(s, &mut b.dev)?;
                            Ok(b)
                        })?
                    }
                    (Some(e), _) => {
                        case.d2h_run(rep, bufs, &mut user_out, Lands::Out, &mut t[i], |o, b| {
                            e.d2h_blocking(&b.dev, o)?;
                            Ok(b)
                        })?
                    }
                };
            }
        }
    }
    Ok(report(&shapes, &timed, config))
}

/// The sweep's table, printed, and its rows: each shape's medians both ways
/// and their ratios to the pinned copy's (`timed[d][0]`).
fn report(shapes: &[Option<Shape>], timed: &[Vec<Timed>; 2], config: &Config) -> Vec<SweepRow> {
    let bytes = config.sweep_bytes;
    let pinned = |d: usize| timed[d][0].row(bytes, Path4::Pinned, "").gbps;
    let (pin_h, pin_d) = (pinned(0), pinned(1));
    println!(
        "\n   the engine's shape at {} ({} runs each, shapes and the pinned copy in turn, medians; pinned {pin_h:.2} / {pin_d:.2} GB/s):",
        size(bytes),
        config.sweep_reps
    );
    println!(
        "   {:>7} {:>9} {:>6} {:>8} {:>8} {:>8} {:>8}",
        "threads", "block", "blocks", "h2d", "÷pinned", "d2h", "÷pinned"
    );
    let mut rows = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let Some((t, block_bytes, blocks)) = *shape else {
            continue;
        };
        let h = timed[0][i].row(bytes, Path4::Staged, "h2d");
        let d = timed[1][i].row(bytes, Path4::Staged, "d2h");
        let verified = h.verified && d.verified && timed[0][0].verified && timed[1][0].verified;
        println!(
            "   {t:>7} {:>9} {blocks:>6} {:>8.2} {:>8.3} {:>8.2} {:>8.3}{}",
            size(block_bytes),
            h.gbps,
            h.gbps / pin_h,
            d.gbps,
            d.gbps / pin_d,
            if verified { "" } else { " WRONG" }
        );
        rows.push(SweepRow {
            threads: t,
            block_bytes,
            blocks,
            h2d_gbps: h.gbps,
            d2h_gbps: d.gbps,
            h2d_of_pinned: h.gbps / pin_h,
            d2h_of_pinned: d.gbps / pin_d,
            verified,
        });
    }
    rows
}
