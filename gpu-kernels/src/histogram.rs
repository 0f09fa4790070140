//! A 256-bin histogram of bytes: `bins[v] += |{i : x[i] == v}|`.
//!
//! # Launch plan ([`histogram_launch`])
//! `G = clamp(ceil(n / (256 * 64)), 1, 1024)` blocks of
//! [`HISTOGRAM_BLOCK`] = 256 threads, no dynamic shared memory (the bins
//! are a static 1 KiB shared array).
//!
//! # The algorithm
//! Each block zeroes its 256 shared bins (one barrier), counts its
//! grid-stride share of the input with shared-memory atomics
//! (`atom.shared.add.u32`), the body read in 16-byte `ld.global.nc.v4`
//! loads (four in flight per thread) and the unaligned head and the tail
//! (fewer than 16 bytes each) byte by byte; a barrier; then thread `t`
//! adds bin `t` to `bins[t]` with one global atomic if it is not zero.
//! Counts are integers: the result is exact and does not depend on the
//! order (on either backend).
//!
//! # Contract
//! `x` is valid device memory for its length; `bins` has at least 256
//! `u32`s and is **added to** (zero it first for a fresh histogram); every
//! count fits in `u32`; the launch is [`histogram_launch`]`(x.len())`.

use crate::vec16::unroll;
use kernel_abi::atomic::Ordering::Relaxed;
use kernel_abi::thread::{self, sync_threads};
use kernel_abi::{kernels, shared_array, Slice, SliceMut};

/// Threads per block.
pub const HISTOGRAM_BLOCK: u32 = 256;
/// The most blocks.
pub const HISTOGRAM_MAX_GRID: u32 = 1024;
/// Bins.
pub const BINS: usize = 256;

/// Blocks for `n` bytes.
pub const fn histogram_grid(n: usize) -> u32 {
    let g = n.div_ceil(HISTOGRAM_BLOCK as usize * 64);
    if g < 1 {
        1
    } else if g > HISTOGRAM_MAX_GRID as usize {
        HISTOGRAM_MAX_GRID
    } else {
        g as u32
    }
}

/// The launch for `n` bytes.
#[cfg(not(target_arch = "nvptx64"))]
pub fn histogram_launch(n: usize) -> kernel_abi::thread::Launch {
    kernel_abi::thread::Launch::linear(histogram_grid(n), HISTOGRAM_BLOCK)
}

kernels! {
    /// Adds the counts of each byte value of `x` to `bins` (module docs).
    ///
    /// # Safety
    /// The module's contract.
    pub unsafe fn histogram_u8(x: Slice<u8>, bins: SliceMut<u32>) {
        let local = shared_array!(u32, 256);
        if bins.len() < BINS {
            thread::trap();
        }
        local.fill_and_sync(|_| 0);
        let count = |b: u32| {
            local.atomic_add(b as usize & 0xff, 1, Relaxed);
        };
        let n = x.len();
        let (id, stride) = (thread::global_id(), thread::grid_stride());
        let head = ((16 - x.as_ptr() as usize % 16) % 16).min(n);
        let words = (n - head) / 16 * 4;
        let tail = head + words * 4;
        // SAFETY: bytes head .. head + 4 * words lie inside `x` (head +
        // 4 * words <= n), start 16-byte aligned, and are read as `u32`s.
        let body = unsafe { Slice::from_raw_parts(x.as_ptr().add(head).cast::<u32>(), words) };
        let bytes = |w: u32| {
            count(w & 0xff);
            count((w >> 8) & 0xff);
            count((w >> 16) & 0xff);
            count(w >> 24);
        };
        let chunks = words / 4;
        let mut c = id;
        while c + 3 * stride < chunks {
            // SAFETY: chunks c .. c + 3 stride are inside the aligned body.
            let v = unsafe {
                [
                    body.load4_nc_unchecked(4 * c),
                    body.load4_nc_unchecked(4 * (c + stride)),
                    body.load4_nc_unchecked(4 * (c + 2 * stride)),
                    body.load4_nc_unchecked(4 * (c + 3 * stride)),
                ]
            };
            unroll!(a in [0 1 2 3] {
                unroll!(b in [0 1 2 3] {
                    bytes(v[a][b]);
                });
            });
            c += 4 * stride;
        }
        while c < chunks {
            // SAFETY: chunk c is inside the aligned body.
            let v = unsafe { body.load4_nc_unchecked(4 * c) };
            unroll!(b in [0 1 2 3] {
                bytes(v[b]);
            });
            c += stride;
        }
        // The head and the tail: fewer than 16 bytes each.
        if id < head {
            // SAFETY: id < head <= n.
            count(unsafe { x.read(id) } as u32);
        }
        if tail + id < n {
            // SAFETY: tail + id < n.
            count(unsafe { x.read(tail + id) } as u32);
        }
        sync_threads();
        let mut b = thread::thread_idx() as usize;
        while b < BINS {
            let v = local.get(b);
            if v != 0 {
                bins.atomic_add(b, v, Relaxed);
            }
            b += thread::block_dim() as usize;
        }
    }
}
