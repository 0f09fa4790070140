//! Several copies as one command: [`Transfer`], for
//! [`Commands::copy_batch`](crate::Commands::copy_batch).
//!
//! A copy engine pays a fixed cost per copy operation it is handed (3 to 5
//! µs on the H200, `host chunk-cost`), whatever the copy's size: 64 copies
//! of 64 KiB issued one by one run at about 260k copies per second, as one
//! batch (`cuMemcpyBatchAsync`) at about 600k. The copies of a batch are not
//! ordered among themselves, so no copy of a batch may write memory that
//! another copy of it reads or writes; [`check`] enforces that.

use crate::backend::RawCopy;
use crate::base::error::{Error, Result};
use crate::runtime::memory::{DeviceSlice, DeviceSliceMut, HostSlice, HostSliceMut};

/// One copy of a batch: a source and a destination of one length, views
/// from the job's bundle (as for every command).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, PinnedBuffer, PinnedHost, Stream, Transfer};
/// let device = Device::cpu();
/// let host = PinnedBuffer::from_slice(&device, &[1u32, 2, 3, 4])?;
/// let (dev, out) = (DeviceBuffer::<u32>::new(&device, 4)?, PinnedBuffer::new(&device, 4)?);
/// let ((_, _, out), ()) = block_on(Stream::new(&device)?.run((host, dev, out), |c, (h, d, o)| {
///     let (h, d) = (h.host(), d.view_mut());
///     // Two copies, one command: the halves of `h` swapped on the device.
///     c.copy_batch([
///         Transfer::h2d(h.range(..2)?, d.range(2..)?),
///         Transfer::h2d(h.range(2..)?, d.range(..2)?),
///     ])?;
///     c.copy_d2h(d, o.host_mut()) // after the whole batch (stream order)
/// }))?;
/// assert_eq!(out.as_slice(), &[3, 4, 1, 2]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub enum Transfer<'a, T> {
    /// Pinned host memory to device memory.
    H2d {
        /// Source.
        src: HostSlice<'a, T>,
        /// Destination.
        dst: DeviceSliceMut<'a, T>,
    },
    /// Device memory to pinned host memory.
    D2h {
        /// Source.
        src: DeviceSlice<'a, T>,
        /// Destination.
        dst: HostSliceMut<'a, T>,
    },
    /// Device memory to device memory of the same device.
    D2d {
        /// Source.
        src: DeviceSlice<'a, T>,
        /// Destination.
        dst: DeviceSliceMut<'a, T>,
    },
}

impl<'a, T> Transfer<'a, T> {
    /// Host to device.
    pub fn h2d(src: HostSlice<'a, T>, dst: DeviceSliceMut<'a, T>) -> Self {
        Transfer::H2d { src, dst }
    }

    /// Device to host.
    pub fn d2h(src: impl Into<DeviceSlice<'a, T>>, dst: HostSliceMut<'a, T>) -> Self {
        Transfer::D2h {
            src: src.into(),
            dst,
        }
    }

    /// Device to device.
    pub fn d2d(src: impl Into<DeviceSlice<'a, T>>, dst: DeviceSliceMut<'a, T>) -> Self {
        Transfer::D2d {
            src: src.into(),
            dst,
        }
    }
}

/// No copy's destination overlaps another copy's source or destination
/// (a copy's own source and destination are checked by the caller: they
/// are of different memories but for device-to-device copies). Host and
/// device addresses are compared in one space: on CUDA (unified
/// addressing) and on the CPU emulation they are one space. O(n log n).
pub(crate) fn check(copies: &[RawCopy]) -> Result<()> {
    let overlap = || Error::Overlap {
        what: "copy_batch (a destination and another copy's range)",
    };
    let mut dsts: Vec<(u64, u64)> = copies
        .iter()
        .filter(|c| c.bytes > 0)
        .map(|c| (c.dst, c.dst + c.bytes as u64))
        .collect();
    dsts.sort_unstable();
    // Destinations pairwise disjoint: sorted by start, each ends before the
    // next starts.
    if dsts.windows(2).any(|w| w[0].1 > w[1].0) {
        return Err(overlap());
    }
    // Each source against the destinations of the other copies: the
    // destinations are disjoint and sorted, so their ends are sorted too,
    // and the only candidates are those starting before the source ends.
    for c in copies.iter().filter(|c| c.bytes > 0) {
        let (s0, s1) = (c.src, c.src + c.bytes as u64);
        let before = dsts.partition_point(|d| d.0 < s1);
        for d in dsts[..before].iter().rev() {
            if d.1 <= s0 {
                break;
            }
            // Destinations are disjoint, so a start names one copy: a copy's
            // own destination is the caller's to check.
            if d.0 != c.dst {
                return Err(overlap());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(dst: u64, src: u64, bytes: usize) -> RawCopy {
        RawCopy { dst, src, bytes }
    }

    #[test]
    fn disjoint_copies_pass_and_every_kind_of_overlap_is_refused() {
        assert!(check(&[c(0, 1000, 100), c(100, 1100, 100), c(200, 1000, 100)]).is_ok());
        // Two destinations overlap.
        assert!(check(&[c(0, 1000, 100), c(50, 2000, 100)]).is_err());
        // A source overlaps another copy's destination.
        assert!(check(&[c(0, 1000, 100), c(2000, 50, 10)]).is_err());
        assert!(check(&[c(0, 1000, 100), c(2000, 0, 1)]).is_err());
        // Touching ranges do not overlap; empty copies never do.
        assert!(check(&[c(0, 1000, 100), c(2000, 100, 10)]).is_ok());
        assert!(check(&[c(0, 1000, 100), c(50, 60, 0)]).is_ok());
        // Sources may overlap each other (both only read).
        assert!(check(&[c(0, 1000, 100), c(100, 1000, 100)]).is_ok());
    }

    #[test]
    fn the_overlap_check_agrees_with_a_pairwise_check_on_random_batches() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..2000 {
            let n = 1 + next(6) as usize;
            let copies: Vec<RawCopy> = (0..n)
                .map(|_| c(next(400), next(400), next(60) as usize))
                .collect();
            let hit = |a: (u64, usize), b: (u64, usize)| {
                a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
            };
            let mut pairwise_bad = false;
            for (i, a) in copies.iter().enumerate() {
                for (j, b) in copies.iter().enumerate() {
                    if i != j
                        && (hit((a.dst, a.bytes), (b.dst, b.bytes))
                            || hit((a.dst, a.bytes), (b.src, b.bytes)))
                    {
                        pairwise_bad = true;
                    }
                }
            }
            assert_eq!(check(&copies).is_err(), pairwise_bad, "{copies:?}");
        }
    }
}
