//! The raw driver's modes: its buffers of one size, their copies issued
//! through cudarc's `sys` layer, synchronized one by one or 64 at a time,
//! and their checked round.

use crate::demo::bandwidth::raw;
use crate::demo::small::config::Direction;
use crate::demo::small::data::{holds, scribble, Data};
use cudarc::driver::sys;
use std::time::{Duration, Instant};

/// The raw driver's buffers of one size, and the keys of their data.
pub(super) struct RawSet<'r> {
    pub(super) raw: &'r raw::Raw,
    pub(super) bufs: Vec<raw::Buffers>,
    pub(super) keys: Vec<u64>,
}

impl RawSet<'_> {
    fn issue(&self, b: &raw::Buffers, dir: Direction) -> gpufeed::Result<()> {
        // SAFETY: live driver allocations of b.bytes each, on this context's
        // stream; every copy is synchronized before the round returns, and
        // no host code touches the memory meanwhile.
        unsafe {
            match dir {
                Direction::H2d => raw::check(
                    sys::cuMemcpyHtoDAsync_v2(b.dev, b.host, b.bytes, self.raw.stream),
                    "cuMemcpyHtoDAsync",
                ),
                Direction::D2h => raw::check(
                    sys::cuMemcpyDtoHAsync_v2(b.host, b.dev, b.bytes, self.raw.stream),
                    "cuMemcpyDtoHAsync",
                ),
            }
        }
    }

    fn sync(&self) -> gpufeed::Result<()> {
        // SAFETY: our stream, alive while `raw` is.
        raw::check(
            unsafe { sys::cuStreamSynchronize(self.raw.stream) },
            "cuStreamSynchronize",
        )
    }

    /// `copies` copies: each synchronized (`batched == false`), or 64 issued
    /// and then one synchronize.
    pub(super) fn round(
        &self,
        dir: Direction,
        copies: usize,
        batched: bool,
    ) -> gpufeed::Result<Duration> {
        let t = Instant::now();
        if batched {
            for _ in 0..copies / self.bufs.len().max(1) {
                for b in &self.bufs {
                    self.issue(b, dir)?;
                }
                self.sync()?;
            }
        } else {
            for b in self.bufs.iter().cycle().take(copies) {
                self.issue(b, dir)?;
                self.sync()?;
            }
        }
        Ok(t.elapsed())
    }

    /// Fills buffer `i`'s host memory with the pattern under `key`.
    fn fill(&mut self, i: usize, pattern: &[u64], key: u64) {
        if let (Some(b), Some(k)) = (self.bufs.get(i), self.keys.get_mut(i)) {
            let p = b.host.cast::<u64>();
            for (j, w) in pattern.iter().take(b.bytes / 8).enumerate() {
                // SAFETY: inside the driver's page-aligned allocation of
                // b.bytes; no copy on it is pending. Written through the raw
                // pointer: the memory may not be initialised yet.
                unsafe { p.add(j).write(w ^ key) };
            }
            *k = key;
        }
    }

    /// Buffer `i`'s host memory (initialised by [`RawSet::fill`] first).
    fn host_mut(&mut self, i: usize) -> &mut [u64] {
        match self.bufs.get(i) {
            // SAFETY: the driver's page-aligned allocation of b.bytes,
            // written by `fill` before any read; no copy on it is pending
            // (every round synchronizes), and `&mut self` keeps it exclusive.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.host.cast::<u64>(), b.bytes / 8) },
            None => &mut [],
        }
    }

    /// One checked round of the mode: fresh data in, every byte compared.
    pub(super) fn checked(
        &mut self,
        dir: Direction,
        batched: bool,
        data: &mut Data,
    ) -> gpufeed::Result<(bool, Duration)> {
        let n = self.bufs.len();
        let took;
        data.fresh();
        for i in 0..n {
            let key = data.key();
            self.fill(i, &data.pattern, key);
        }
        if dir == Direction::D2h {
            // The data goes to the device first; the host copy is then
            // scribbled over, so only the timed mode's copy can restore it.
            for i in 0..n {
                if let Some(b) = self.bufs.get(i) {
                    self.raw.copy_ms(b, true)?;
                }
                scribble(self.host_mut(i));
            }
            took = self.round(dir, n, batched)?;
        } else {
            took = self.round(dir, n, batched)?;
            // Scribble the source, bring the device's bytes back over it.
            for i in 0..n {
                scribble(self.host_mut(i));
                if let Some(b) = self.bufs.get(i) {
                    self.raw.copy_ms(b, false)?;
                }
            }
        }
        let keys = self.keys.clone();
        let ok = keys
            .iter()
            .enumerate()
            .all(|(i, &key)| holds(self.host_mut(i), &data.pattern, key));
        Ok((ok, took))
    }
}
