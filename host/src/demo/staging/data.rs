//! The data every run is checked with: two random sources that differ in
//! every word, the pinned and device buffers of one size, the check of the
//! device's contents, and the idle and CPU-time helpers of a timed run.

use gpufeed::{DeviceBuffer, PinnedHost, Stream};
use rayon::prelude::*;

pub(super) const POISON: u32 = 0xDEAD_BEEF;

/// Lets the checker's own threads (rayon's, which spin a while after their
/// work) go idle before a timed run, so the run measures the engine, not a
/// fight for cores with the bench: `ms` milliseconds (10 by default). The
/// engine's workers park then too (they spin 2 ms after a copy): each run
/// starts as a copy after idle does.
pub(super) fn settle(ms: u64) {
    if ms > 0 {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// CPU seconds (user + system) this process has used.
pub(super) fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to a rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Random words (never the poison), in parallel.
fn random_words(n: usize, seed: u64) -> Vec<u32> {
    let mut v = vec![0u32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        let mut s = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for x in c {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = (s >> 16) as u32;
            if *x == POISON {
                *x = 1;
            }
        }
    });
    v
}

/// Whether every element of `got` equals `want`: a plain comparison.
pub(super) fn same(got: &[u32], want: &[u32]) -> bool {
    got.len() == want.len()
        && got
            .par_chunks(1 << 16)
            .zip(want.par_chunks(1 << 16))
            .all(|(a, b)| a == b)
}

/// The two sources runs alternate between: `b` differs from `a` in every word.
pub(super) struct Sources {
    pub(super) a: Vec<u32>,
    pub(super) b: Vec<u32>,
}

impl Sources {
    pub(super) fn new(n: usize) -> Sources {
        let a = random_words(n, 0x5eed);
        let b = a.par_iter().map(|x| x ^ 0x5A5A_5A5A).collect();
        Sources { a, b }
    }
    pub(super) fn get(&self, rep: usize, n: usize) -> &[u32] {
        if rep.is_multiple_of(2) {
            &self.a[..n]
        } else {
            &self.b[..n]
        }
    }
}

/// Pinned memory and device memory of one size, moved through jobs.
pub(super) struct Bufs {
    pub(super) pinned: gpufeed::PooledBuffer<u32>,
    pub(super) dev: DeviceBuffer<u32>,
}

impl Bufs {
    /// The pinned copy, one way or the other, of the whole buffers.
    pub(super) fn pinned_copy(self, stream: &Stream, h2d: bool) -> gpufeed::Result<Bufs> {
        let ((pinned, dev), ()) = stream
            .run_sync((self.pinned, self.dev), |c, (p, d)| {
                if h2d {
                    c.copy_h2d(p.host(), d.view_mut())
                } else {
                    c.copy_d2h(d.view(), p.host_mut())
                }
            })
            .map_err(gpufeed::Error::from)?;
        Ok(Bufs { pinned, dev })
    }

    /// Puts `src` on the device through pinned memory (untimed set-up).
    pub(super) fn upload(mut self, stream: &Stream, src: &[u32]) -> gpufeed::Result<Bufs> {
        self.pinned.as_mut_slice().copy_from_slice(src);
        self.pinned_copy(stream, true)
    }

    /// Whether the device holds exactly `want`, read back through pinned
    /// memory poisoned first.
    pub(super) fn check(mut self, stream: &Stream, want: &[u32]) -> gpufeed::Result<(Bufs, bool)> {
        self.pinned.as_mut_slice().fill(POISON);
        let b = self.pinned_copy(stream, false)?;
        let ok = same(b.pinned.as_slice(), want);
        Ok((b, ok))
    }
}
