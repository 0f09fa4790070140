//! Warp operations: shuffles, votes, and the reductions and scans built on
//! them. A warp is 32 threads of a block with consecutive linear indices
//! ([`crate::thread::linear_thread_idx`] / 32); all of them run these
//! operations together.
//!
//! **Every lane of the warp calls each warp operation** (the mask is the
//! full warp, `0xffffffff`, [`FULL_MASK`]): a warp operation inside a
//! branch some lanes skip is a bug (on the CPU emulation,
//! [`FaultKind::IncompleteWarp`](crate::thread::FaultKind::IncompleteWarp)).
//! A block whose size is not a multiple of 32 has a partial last warp:
//! only its existing lanes take part ([`lanes_in_warp`] says how many); a
//! shuffle whose source lane does not exist returns the caller's own value
//! on the emulation and an undefined value on the GPU: the reductions and
//! scans below never use such a value.
//!
//! Shuffles follow CUDA's rules for a source outside the warp: `shfl_down`
//! past lane 31 and `shfl_up` before lane 0 return the caller's own value;
//! `shfl_idx` takes the index modulo 32. 8-byte types move as two 32-bit
//! shuffles.
//!
//! The reductions and scans have a fixed order, the same on the GPU and on
//! the CPU emulation (which runs the same shuffles), so their
//! floating-point results are bit-identical:
//! - [`reduce`]: a tree by [`shfl_down`] with offsets 16, 8, 4, 2, 1, where
//!   lane `l` combines `op(own, lane l + offset)` when that lane exists;
//!   lane 0's total is then broadcast ([`shfl_idx`] from lane 0), so the
//!   result is valid in every lane. For 32 lanes: `((x0 + x16) + (x8 + x24)) + ...`.
//! - [`inclusive_scan`]: Kogge-Stone by [`shfl_up`] with offsets 1, 2, 4,
//!   8, 16: lane `l >= offset` combines `op(lane l - offset, own)`.
//!
//! ```
//! use kernel_abi::{thread, warp};
//! thread::emulate(1, 64, 1, &|| {
//!     let l = warp::lane_id();
//!     assert_eq!(warp::reduce_sum(1u32), 32);
//!     assert_eq!(warp::inclusive_scan_sum(1u32), l + 1);
//!     assert_eq!(warp::shfl_xor(l, 1), l ^ 1);
//!     assert_eq!(warp::ballot(l % 2 == 0), 0x5555_5555);
//! })
//! .unwrap();
//! ```

use crate::elem::{Arith, Plain};
pub use crate::thread::{lane_id, warp_id, WARP_SIZE};

/// The mask of every warp operation here: all 32 lanes.
pub const FULL_MASK: u32 = 0xffff_ffff;

/// Lanes of the calling thread's warp that exist: 32, or fewer in the
/// partial last warp of a block whose size is not a multiple of 32.
#[inline(always)]
pub fn lanes_in_warp() -> u32 {
    let n = crate::thread::block_threads();
    let first = warp_id() * WARP_SIZE;
    let left = n - first;
    if left < WARP_SIZE {
        left
    } else {
        WARP_SIZE
    }
}

#[cfg(target_arch = "nvptx64")]
mod imp {
    // LLVM's NVVM intrinsics, not inline PTX: LLVM knows them as
    // `convergent`, so it never duplicates one into divergent branches (it
    // does so to inline assembly).
    #[allow(improper_ctypes)]
    extern "C" {
        #[link_name = "llvm.nvvm.shfl.sync.down.i32"]
        fn shfl_down(mask: u32, v: u32, b: u32, c: u32) -> u32;
        #[link_name = "llvm.nvvm.shfl.sync.up.i32"]
        fn shfl_up(mask: u32, v: u32, b: u32, c: u32) -> u32;
        #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
        fn shfl_bfly(mask: u32, v: u32, b: u32, c: u32) -> u32;
        #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
        fn shfl_idx(mask: u32, v: u32, b: u32, c: u32) -> u32;
        #[link_name = "llvm.nvvm.vote.any.sync"]
        fn vote_any(mask: u32, p: bool) -> bool;
        #[link_name = "llvm.nvvm.vote.all.sync"]
        fn vote_all(mask: u32, p: bool) -> bool;
        #[link_name = "llvm.nvvm.vote.ballot.sync"]
        fn vote_ballot(mask: u32, p: bool) -> u32;
    }

    // SAFETY (all below): register exchanges among the warp's lanes, every
    // lane reaching them (the module's contract); no memory.
    #[inline(always)]
    pub fn down(v: u32, b: u32) -> u32 {
        // SAFETY: see above.
        unsafe { shfl_down(super::FULL_MASK, v, b, 0x1f) }
    }
    #[inline(always)]
    pub fn up(v: u32, b: u32) -> u32 {
        // SAFETY: see above.
        unsafe { shfl_up(super::FULL_MASK, v, b, 0) }
    }
    #[inline(always)]
    pub fn bfly(v: u32, b: u32) -> u32 {
        // SAFETY: see above.
        unsafe { shfl_bfly(super::FULL_MASK, v, b, 0x1f) }
    }
    #[inline(always)]
    pub fn idx(v: u32, b: u32) -> u32 {
        // SAFETY: see above.
        unsafe { shfl_idx(super::FULL_MASK, v, b, 0x1f) }
    }
    #[inline(always)]
    pub fn any(p: bool) -> u32 {
        // SAFETY: see above.
        unsafe { vote_any(super::FULL_MASK, p) as u32 }
    }
    #[inline(always)]
    pub fn all(p: bool) -> u32 {
        // SAFETY: see above.
        unsafe { vote_all(super::FULL_MASK, p) as u32 }
    }
    #[inline(always)]
    pub fn ballot(p: bool) -> u32 {
        // SAFETY: see above.
        unsafe { vote_ballot(super::FULL_MASK, p) }
    }
}

#[cfg(not(target_arch = "nvptx64"))]
mod imp {
    use crate::emu::{warp_exchange, WarpOp};

    fn shfl(v: u32, src: impl Fn(u32) -> Option<u32>) -> u32 {
        let lane = crate::thread::lane_id();
        warp_exchange(WarpOp::Shuffle, u64::from(v), |get| {
            src(lane).and_then(get).map_or(v, |x| x as u32)
        })
    }
    pub fn down(v: u32, b: u32) -> u32 {
        shfl(v, |l| l.checked_add(b).filter(|&s| s < 32))
    }
    pub fn up(v: u32, b: u32) -> u32 {
        shfl(v, |l| l.checked_sub(b))
    }
    pub fn bfly(v: u32, b: u32) -> u32 {
        shfl(v, |l| Some(l ^ b).filter(|&s| s < 32))
    }
    pub fn idx(v: u32, b: u32) -> u32 {
        shfl(v, |_| Some(b & 31))
    }
    fn vote(p: bool, f: impl Fn(u32, u32) -> u32) -> u32 {
        warp_exchange(WarpOp::Vote, u64::from(p), |get| {
            let mut bits = 0u32;
            let mut lanes = 0;
            for l in 0..32 {
                if let Some(x) = get(l) {
                    lanes += 1;
                    bits |= (x as u32 & 1) << l;
                }
            }
            f(bits, lanes)
        })
    }
    pub fn any(p: bool) -> u32 {
        vote(p, |bits, _| (bits != 0) as u32)
    }
    pub fn all(p: bool) -> u32 {
        vote(p, |bits, lanes| (bits.count_ones() == lanes) as u32)
    }
    pub fn ballot(p: bool) -> u32 {
        vote(p, |bits, _| bits)
    }
}

#[inline(always)]
fn shfl<T: Plain>(v: T, b: u32, f: fn(u32, u32) -> u32) -> T {
    let bits = v.to_bits();
    if T::BYTES == 4 {
        T::from_bits(u64::from(f(bits as u32, b)))
    } else {
        let lo = f(bits as u32, b);
        let hi = f((bits >> 32) as u32, b);
        T::from_bits(u64::from(lo) | (u64::from(hi) << 32))
    }
}

/// The value of lane `lane_id() + delta` (`shfl.sync.down`); past lane 31,
/// the caller's own. `delta < 32`.
#[inline(always)]
pub fn shfl_down<T: Plain>(v: T, delta: u32) -> T {
    shfl(v, delta, imp::down)
}

/// The value of lane `lane_id() - delta` (`shfl.sync.up`); before lane 0,
/// the caller's own. `delta < 32`.
#[inline(always)]
pub fn shfl_up<T: Plain>(v: T, delta: u32) -> T {
    shfl(v, delta, imp::up)
}

/// The value of lane `lane_id() ^ lane_mask` (`shfl.sync.bfly`): the
/// butterfly exchange. `lane_mask < 32`.
#[inline(always)]
pub fn shfl_xor<T: Plain>(v: T, lane_mask: u32) -> T {
    shfl(v, lane_mask, imp::bfly)
}

/// The value of lane `src_lane % 32` (`shfl.sync.idx`): a broadcast when
/// every lane passes the same `src_lane`.
#[inline(always)]
pub fn shfl_idx<T: Plain>(v: T, src_lane: u32) -> T {
    shfl(v, src_lane, imp::idx)
}

/// Whether `p` holds in any lane of the warp (`vote.sync.any`).
#[inline(always)]
pub fn any(p: bool) -> bool {
    imp::any(p) != 0
}

/// Whether `p` holds in every (existing) lane of the warp (`vote.sync.all`).
#[inline(always)]
pub fn all(p: bool) -> bool {
    imp::all(p) != 0
}

/// Bit `l` set where `p` holds in lane `l` (`vote.sync.ballot.b32`).
#[inline(always)]
pub fn ballot(p: bool) -> u32 {
    imp::ballot(p)
}

/// The combination of every lane's `v` by `op`, in lane 0 only (the tree
/// of [`reduce`] without its broadcast); other lanes get partial values.
#[inline(always)]
pub(crate) fn reduce_to_lane0<T: Plain>(v: T, width: u32, op: impl Fn(T, T) -> T) -> T {
    let lane = lane_id();
    let mut v = v;
    let mut off = 16;
    while off > 0 {
        let o = shfl_down(v, off);
        if lane + off < width {
            v = op(v, o);
        }
        off /= 2;
    }
    v
}

/// The combination of every lane's `v` by `op` (associative, and
/// commutative where the tree's order matters to you), valid in every
/// lane. Order: see the module docs.
#[inline(always)]
pub fn reduce<T: Plain>(v: T, op: impl Fn(T, T) -> T) -> T {
    shfl_idx(reduce_to_lane0(v, lanes_in_warp(), op), 0)
}

/// The warp's sum (wrapping for integers), valid in every lane.
#[inline(always)]
pub fn reduce_sum<T: Arith>(v: T) -> T {
    reduce(v, T::add)
}

/// The warp's maximum, valid in every lane.
#[inline(always)]
pub fn reduce_max<T: Arith>(v: T) -> T {
    reduce(v, T::max)
}

/// The warp's minimum, valid in every lane.
#[inline(always)]
pub fn reduce_min<T: Arith>(v: T) -> T {
    reduce(v, T::min)
}

/// Lane `l` gets `op` over lanes `0..=l` (Kogge-Stone; order: see the
/// module docs).
#[inline(always)]
pub fn inclusive_scan<T: Plain>(v: T, op: impl Fn(T, T) -> T) -> T {
    let lane = lane_id();
    let mut v = v;
    let mut off = 1;
    while off < WARP_SIZE {
        let o = shfl_up(v, off);
        if lane >= off {
            v = op(o, v);
        }
        off *= 2;
    }
    v
}

/// Lane `l` gets the sum of lanes `0..=l`.
#[inline(always)]
pub fn inclusive_scan_sum<T: Arith>(v: T) -> T {
    inclusive_scan(v, T::add)
}

/// Lane `l` gets the sum of lanes `0..l` (0 in lane 0): the inclusive
/// scan moved up one lane.
#[inline(always)]
pub fn exclusive_scan_sum<T: Arith>(v: T) -> T {
    let inc = inclusive_scan_sum(v);
    let e = shfl_up(inc, 1);
    if lane_id() == 0 {
        T::ZERO
    } else {
        e
    }
}
