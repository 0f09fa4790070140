//! One route of one size and direction: its runs (an untimed warm-up, then
//! the timed ones), each prepared, timed and checked, and their timings.

use crate::demo::report::median;
use crate::demo::staging::config::Path4;
use crate::demo::staging::data::{cpu_seconds, same, settle, Bufs, Sources, POISON};
use crate::demo::staging::results::Row;
use gpufeed::Stream;
use rayon::prelude::*;
use std::time::Instant;

/// The timings of one route, size and direction, and whether every run was right.
pub(super) struct Timed {
    secs: Vec<f64>,
    cpu: f64,
    pub(super) verified: bool,
}

impl Timed {
    pub(super) fn new() -> Timed {
        Timed {
            secs: vec![],
            cpu: 0.0,
            verified: true,
        }
    }

    /// Notes run `rep` (the warm-up, run 0, only for its check).
    fn note(&mut self, rep: usize, secs: f64, cpu: f64, ok: bool) {
        self.verified &= ok;
        if rep > 0 {
            self.secs.push(secs);
            self.cpu += cpu;
        }
    }

    pub(super) fn row(&self, bytes: usize, path: Path4, dir: &'static str) -> Row {
        let gbps: Vec<f64> = self.secs.iter().map(|s| bytes as f64 / s / 1e9).collect();
        let (lo, hi) = gbps
            .iter()
            .fold((f64::MAX, 0f64), |(a, b), &g| (a.min(g), b.max(g)));
        Row {
            bytes,
            path,
            dir,
            gbps: median(&gbps),
            gbps_min: lo,
            gbps_max: hi,
            reps: self.secs.len(),
            verified: self.verified,
            cpu_s_per_gb: self.cpu / (bytes as f64 * self.secs.len() as f64 / 1e9),
        }
    }
}

/// Where a device-to-host run's result lands, for the check.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Lands {
    /// In the user's pageable array.
    Out,
    /// In the pinned buffer (the pinned route's own destination).
    Pinned,
}

/// Where a host-to-device run's source must be before the timer starts.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Prep {
    /// In the sources (a borrowed slice).
    Nothing,
    /// Also in a `Vec` of its own (the route that pins it in place).
    OwnVec,
    /// In the pinned buffer (the pinned route).
    Pinned,
}

/// One route of one size and direction, `reps` timed runs after one
/// untimed warm-up (first touch, pool, JIT), every run checked.
pub(super) struct Case<'a> {
    pub(super) stream: &'a Stream,
    pub(super) src: &'a Sources,
    pub(super) n: usize,
    pub(super) reps: usize,
    pub(super) settle_ms: u64,
}

impl Case<'_> {
    /// Run `rep` host to device (run 0 the untimed warm-up; runs alternate
    /// between the sources): `copy(src, bufs)` is timed; the device is
    /// checked after the run (the sources differ everywhere). `prep` says
    /// where the source must be before the timer starts.
    pub(super) fn h2d_run(
        &self,
        rep: usize,
        mut bufs: Bufs,
        prep: Prep,
        t: &mut Timed,
        copy: impl FnOnce(&[u32], &mut Vec<u32>, Bufs) -> gpufeed::Result<Bufs>,
    ) -> gpufeed::Result<Bufs> {
        let src = self.src.get(rep, self.n);
        let mut own = Vec::new();
        settle(self.settle_ms);
        match prep {
            Prep::Nothing => {}
            Prep::OwnVec => own = src.to_vec(),
            Prep::Pinned => bufs.pinned.as_mut_slice().copy_from_slice(src),
        }
        let (c0, t0) = (cpu_seconds(), Instant::now());
        bufs = copy(src, &mut own, bufs)?;
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let (bufs, ok) = bufs.check(self.stream, src)?;
        t.note(rep, secs, cpu, ok);
        Ok(bufs)
    }

    /// Run `rep` device to host into `out` (the user's array, poisoned
    /// before the run, as is the pinned buffer).
    pub(super) fn d2h_run(
        &self,
        rep: usize,
        mut bufs: Bufs,
        out: &mut Vec<u32>,
        lands: Lands,
        t: &mut Timed,
        copy: impl FnOnce(&mut Vec<u32>, Bufs) -> gpufeed::Result<Bufs>,
    ) -> gpufeed::Result<Bufs> {
        let src = self.src.get(rep, self.n);
        bufs = bufs.upload(self.stream, src)?;
        out.par_chunks_mut(1 << 16).for_each(|c| c.fill(POISON));
        bufs.pinned.as_mut_slice().fill(POISON);
        settle(self.settle_ms);
        let (c0, t0) = (cpu_seconds(), Instant::now());
        bufs = copy(out, bufs)?;
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        let ok = match lands {
            Lands::Out => same(out, src),
            Lands::Pinned => same(bufs.pinned.as_slice(), src),
        };
        t.note(rep, secs, cpu, ok);
        Ok(bufs)
    }
}
