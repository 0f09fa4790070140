//! Block-wide reductions and scans: every thread of the block calls them
//! (each has barriers inside), each gives one value per thread, and they
//! may be called again and again (back to back) in one kernel.
//!
//! They use a scratch array of 72 `u64` in static shared memory (576 bytes,
//! one `.shared` symbol for every block operation of the kernel) and warp
//! shuffles, in a fixed order, the same on the GPU and on the CPU emulation
//! (bit-identical floating-point results):
//! - [`reduce`]: each warp reduces its lanes ([`crate::warp::reduce`]'s
//!   tree, the total in lane 0), lane 0 of warp `w` stores it in slot `w`;
//!   barrier; warp 0 reduces slots `0..warps` with the same tree; lane 0
//!   stores the total; barrier; every thread reads it. Two barriers.
//! - [`scan`]: each warp scans its lanes ([`crate::warp::inclusive_scan`]);
//!   the last lane of warp `w` stores the warp's total; barrier; warp 0
//!   scans the totals and stores each warp's prefix (the combination of the
//!   warps before it) and the block's total; barrier; thread `t` of warp
//!   `w > 0` gets `op(prefix[w], its warp's inclusive value)` (warp 0: its
//!   warp's value alone). The exclusive value is `op(prefix[w], the warp's
//!   exclusive value)` (the warp's exclusive value alone in warp 0, the
//!   identity in thread 0).
//!
//! ```
//! use kernel_abi::{block, thread};
//! thread::emulate(2, 100, 2, &|| {
//!     let t = thread::thread_idx();
//!     assert_eq!(block::reduce_sum(t), 99 * 100 / 2);
//!     assert_eq!(block::inclusive_scan_sum(1u32), t + 1);
//!     assert_eq!(block::reduce_max(t as f32), 99.0);
//! })
//! .unwrap();
//! ```

use crate::elem::{Arith, Plain};
use crate::shared::SharedArray;
use crate::thread::{sync_threads, warp_id, warps_per_block};
use crate::warp::{self, lane_id, lanes_in_warp};

/// Slots: 0..32 the warps' values, 32..64 the warps' prefixes, 64 the total.
const TOTAL: usize = 64;

#[inline(always)]
fn scratch() -> SharedArray<u64> {
    crate::shared_array!(u64, 72; kernel_abi_block_scratch)
}

#[inline(always)]
fn put<T: Plain>(s: SharedArray<u64>, i: usize, v: T) {
    // SAFETY: callers pass i < 72 (warp ids are < 32, the other slots fixed).
    unsafe { s.set_unchecked(i, v.to_bits()) }
}

#[inline(always)]
fn take<T: Plain>(s: SharedArray<u64>, i: usize) -> T {
    // SAFETY: as for `put`.
    T::from_bits(unsafe { s.get_unchecked(i) })
}

/// The combination of every thread's `v` by `op` (associative), valid in
/// every thread. Order: see the module docs.
#[inline(always)]
pub fn reduce<T: Plain>(v: T, op: impl Fn(T, T) -> T + Copy) -> T {
    let s = scratch();
    let (w, lane, nw) = (warp_id(), lane_id(), warps_per_block());
    let r = warp::reduce_to_lane0(v, lanes_in_warp(), op);
    if lane == 0 {
        put(s, w as usize, r);
    }
    sync_threads();
    // Every warp reduces the warps' results, with no branch around the
    // shuffles: every lane loads a slot (lanes past the block's warps read
    // slots their lane 0 never combines), then the same tree as warp 0's.
    // A branch here (only warp 0, or only lanes < nw loading) lets LLVM
    // duplicate the shuffles into the two paths, and shuffles the lanes of
    // one warp execute at different instructions hang a GPU.
    // Warp 0's result is the block's (a partial last warp lacks the lanes
    // its tree would read): its lane 0 passes it on through shared memory.
    let x: T = take(s, lane as usize);
    let t = warp::reduce_to_lane0(x, nw, op);
    if w == 0 && lane == 0 {
        put(s, TOTAL, t);
    }
    sync_threads();
    take(s, TOTAL)
}

/// The block's sum (wrapping for integers), in every thread.
#[inline(always)]
pub fn reduce_sum<T: Arith>(v: T) -> T {
    reduce(v, T::add)
}

/// The block's maximum, in every thread.
#[inline(always)]
pub fn reduce_max<T: Arith>(v: T) -> T {
    reduce(v, T::max)
}

/// The block's minimum, in every thread.
#[inline(always)]
pub fn reduce_min<T: Arith>(v: T) -> T {
    reduce(v, T::min)
}

/// One thread's results of a block scan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scan<T> {
    /// `op` over threads `0..=t` (linear index `t`).
    pub inclusive: T,
    /// `op` over threads `0..t`; the identity in thread 0.
    pub exclusive: T,
    /// `op` over every thread of the block.
    pub total: T,
}

/// A scan of every thread's `v` by `op` (associative) in linear thread
/// order, with `identity` (`op(identity, x) == x`) as thread 0's exclusive
/// value. Order: see the module docs.
#[inline(always)]
pub fn scan<T: Plain>(v: T, identity: T, op: impl Fn(T, T) -> T + Copy) -> Scan<T> {
    let s = scratch();
    let (w, lane, nw) = (warp_id(), lane_id(), warps_per_block());
    let inc = warp::inclusive_scan(v, op);
    let up = warp::shfl_up(inc, 1);
    if lane == lanes_in_warp() - 1 {
        put(s, w as usize, inc);
    }
    sync_threads();
    // Every warp scans the warps' totals, with no branch around the
    // shuffles (see `reduce`): a load in every lane, then a select.
    // Warp 0's scan is the block's (a partial last warp lacks lanes): it
    // passes the warps' prefixes and the total on through shared memory.
    let loaded: T = take(s, lane as usize);
    let x = if lane < nw { loaded } else { identity };
    let incl = warp::inclusive_scan(x, op);
    let before = warp::shfl_up(incl, 1);
    if w == 0 && lane < nw {
        put(
            s,
            32 + lane as usize,
            if lane == 0 { identity } else { before },
        );
    }
    if w == 0 && lane == nw - 1 {
        put(s, TOTAL, incl);
    }
    sync_threads();
    let total = take(s, TOTAL);
    let prefix: T = take(s, 32 + w as usize);
    if w == 0 {
        Scan {
            inclusive: inc,
            exclusive: if lane == 0 { identity } else { up },
            total,
        }
    } else {
        Scan {
            inclusive: op(prefix, inc),
            exclusive: if lane == 0 { prefix } else { op(prefix, up) },
            total,
        }
    }
}

/// Thread `t` gets the sum of threads `0..=t` (linear order).
#[inline(always)]
pub fn inclusive_scan_sum<T: Arith>(v: T) -> T {
    scan(v, T::ZERO, T::add).inclusive
}

/// Thread `t` gets the sum of threads `0..t` (0 in thread 0).
#[inline(always)]
pub fn exclusive_scan_sum<T: Arith>(v: T) -> T {
    scan(v, T::ZERO, T::add).exclusive
}
