//! `y = 3 x` through a pipeline from and into ordinary memory
//! (`run_slices`) against the same from and into pinned memory (`run`).

use crate::demo::fmt::size;
use crate::demo::report::median;
use crate::demo::staging::config::Config;
use crate::demo::staging::data::{settle, Sources};
use crate::demo::staging::results::PipelineRow;
use gpufeed::{Device, Kernel, PinnedPool, Pipeline, Plan, Staging, Timeline};
use rayon::prelude::*;
use std::time::Instant;

/// `y = 3 x` through a pipeline at the largest size up to 1 GiB: from and
/// into `Vec`s (`run_slices`, the default engine) against the same run
/// from and into pinned memory (`run`), every element of every run
/// checked against a plain loop, outputs poisoned (NaN) before each run.
pub(super) fn pipeline_row(
    device: &Device,
    pool: &PinnedPool,
    src: &Sources,
    config: &Config,
) -> gpufeed::Result<Option<PipelineRow>> {
    let Some(bytes) = config.sizes.iter().copied().filter(|&b| b <= 1 << 30).max() else {
        return Ok(None);
    };
    let n = bytes / 4;
    // Integers below 2^23: 3 x is exact, so the bits must match.
    let x: Vec<f32> = src.a[..n].par_iter().map(|&w| (w >> 9) as f32).collect();
    let want: Vec<u32> = x.par_iter().map(|v| (v * 3.0).to_bits()).collect();
    let check = |y: &[f32]| {
        y.len() == want.len()
            && y.par_chunks(1 << 16)
                .zip(want.par_chunks(1 << 16))
                .all(|(a, b)| a.iter().zip(b).all(|(a, b)| a.to_bits() == *b))
    };
    let pipe = Pipeline::new(device, 3)?;
    let staging = Staging::new(device)?;
    let mut y = vec![0f32; n];
    let (mut pin_x, mut pin_y) = (pool.alloc::<f32>(n)?, pool.alloc::<f32>(n)?);
    pin_x.as_mut_slice().copy_from_slice(&x);
    let (mut slices, mut pinned, mut verified) = (vec![], vec![], true);
    for rep in 0..=config.reps {
        y.par_chunks_mut(1 << 16).for_each(|c| c.fill(f32::NAN));
        settle(config.settle_ms);
        let t0 = Instant::now();
        gpufeed::block_on(pipe.run_slices(&staging, &x, &mut y, |c, chunk| {
            c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)?;
            c.kernel(Kernel::Scale { s: 3.0 }, chunk.output::<f32>(0)?)
        }))?;
        let t = t0.elapsed().as_secs_f64() * 1e3;
        verified &= check(&y);

        pin_y
            .as_mut_slice()
            .par_chunks_mut(1 << 16)
            .for_each(|c| c.fill(f32::NAN));
        settle(config.settle_ms);
        let t1 = Instant::now();
        let ((px, py), _) = gpufeed::block_on(pipe.run(
            pin_x,
            pin_y,
            Kernel::Scale { s: 3.0 },
            Plan::auto_for(n, 3),
            Timeline::Off,
        ))?;
        let tp = t1.elapsed().as_secs_f64() * 1e3;
        verified &= check(py.as_slice());
        (pin_x, pin_y) = (px, py);
        // The pinned run scales its input in place: restore it.
        pin_x.as_mut_slice().copy_from_slice(&x);
        if rep > 0 {
            slices.push(t);
            pinned.push(tp);
        }
    }
    let (slices_ms, pinned_ms) = (median(&slices), median(&pinned));
    println!(
        "\n   pipeline y = 3x at {}: from and into Vecs {slices_ms:.3} ms, pinned {pinned_ms:.3} ms ({:.3}x){}",
        size(bytes),
        pinned_ms / slices_ms,
        if verified { "" } else { " WRONG" }
    );
    Ok(Some(PipelineRow {
        bytes,
        reps: config.reps,
        slices_ms,
        pinned_ms,
        ratio: pinned_ms / slices_ms,
        verified,
    }))
}
