//! Inclusive scan (prefix sum) of `u32`, `i32` (wrapping) and `f32`, in a
//! single pass: each block scans one tile of [`SCAN_TILE`] elements and
//! gets the sum of the tiles before it by a *grouped, deterministic*
//! decoupled look-back. Every result, `f32` included, is a function of the
//! input alone: bit-reproducible run to run and bit-identical on the GPU
//! and the CPU emulation.
//!
//! # Launch plan ([`scan_launch`], [`scan_scratch_len`])
//! `tiles = max(1, ceil(n / 4096))` blocks of [`SCAN_BLOCK`] = 256
//! threads, no dynamic shared memory. `scratch` is `1 + tiles` `u64`s,
//! **zeroed before every launch** (a memset on the same stream): word 0 is
//! the tile counter, word `1 + i` tile `i`'s status.
//!
//! # The algorithm
//! - **Tile ids** come from an atomic counter (`scratch[0]`), so a block
//!   only ever waits for tiles that earlier-started blocks hold: they are
//!   running or done, and the scan can't deadlock whatever the scheduling
//!   (on the emulation's few workers too).
//! - **Inside a tile** (256 threads, 4 rounds of 1024 elements): in round
//!   `r` thread `t` holds chunk `q = 256r + t`, elements `4q .. 4q + 4` of
//!   the tile (one 16-byte load), and scans them sequentially; the chunk
//!   totals go to shared memory (padded: a word skipped every 32); one
//!   barrier; warp 0 *rakes*: lane `l` folds chunks `32l .. 32l + 32` in
//!   order, the warp scans the 32 lane totals (Kogge-Stone,
//!   [`kernel_abi::warp::inclusive_scan`]), lane 31's total is the tile's
//!   aggregate `A`.
//! - **Status words** (`u64`): bit 32 = ready, bits 0..32 = the value's
//!   bits, written once with one relaxed 64-bit atomic store (flag and
//!   value travel together, no fence needed). Tiles form groups of
//!   [`SCAN_GROUP`] = 128. A tile that is not the last of its group
//!   publishes its aggregate as soon as it has it; the last tile of group
//!   `g` publishes the *inclusive* prefix of the whole input up to its end.
//! - **Look-back** (warp 0): tile `i` in group `g` waits until tile `128g -
//!   1` (the previous group's last, when `g > 0`) and tiles `128g .. i` are
//!   ready, then `E = P ⊕ S`, where `P` is that inclusive prefix and `S` the
//!   aggregates of `128g .. i` folded in a fixed order (lane `l` folds tiles
//!   `128g + l + 32k`, `k = 0..4`, ascending, then the warp's fixed tree).
//!   Only the groups' last tiles form a chain (one hop per 128 tiles, i.e.
//!   per 512 K elements); every other wait is on aggregates that don't
//!   wait on anything. Unlike the classic look-back, whose combination
//!   order depends on which predecessors happened to be done, this order
//!   is fixed: that is what makes `f32` deterministic.
//! - **Output**: warp 0 then writes each chunk's prefix `E ⊕ c` to shared
//!   memory, `c` being the fold of the tile's chunks before it (lane `l`
//!   continues from the lanes before it, chunk by chunk in order); a
//!   barrier; each element is `prefix ⊕ p_k`, `p_k` the thread's own
//!   running sum in its chunk (the prefix left out for the input's first
//!   chunk), one 16-byte store when aligned.
//!
//! # Error bound (f32)
//! Every input reaches output `j` through at most [`scan_depth`]`(j)` =
//! `90 + 2 * (j / (4096 * 128))` roundings, so `|y_j - exact_j| <=
//! scan_depth(j) * 2^-24 * sum(|x_0..=j|)` (to first order). `u32` and
//! `i32` are exact (wrapping).
//!
//! # Contract
//! `x`, `y` (at least `x.len()` elements, disjoint from `x`) and `scratch`
//! (at least `scan_scratch_len(n)` elements, zeroed) are valid device
//! memory; the launch is [`scan_launch`]`(x.len())`.

use crate::vec16::{aligned16, store4_bits, unroll};
use kernel_abi::atomic::Ordering::Relaxed;
use kernel_abi::thread::{self, sync_threads};
use kernel_abi::{kernels, shared_array, warp, Arith, Plain, Slice, SliceMut};

/// Threads per block.
pub const SCAN_BLOCK: u32 = 256;
/// Elements per tile (one block each): 4 rounds of 256 threads x 4.
pub const SCAN_TILE: usize = 4096;
/// Tiles per look-back group.
pub const SCAN_GROUP: usize = 128;
const ROUNDS: usize = 4;
const READY: u64 = 1 << 32;

/// Tiles (= blocks) for `n` elements: at least one.
pub const fn scan_tiles(n: usize) -> usize {
    let t = n.div_ceil(SCAN_TILE);
    if t == 0 {
        1
    } else {
        t
    }
}

/// The `u64` words of scratch a scan of `n` elements needs (zeroed before
/// each launch): the tile counter and one status word per tile.
pub const fn scan_scratch_len(n: usize) -> usize {
    1 + scan_tiles(n)
}

/// The most roundings an input goes through to reach `f32` output `j`
/// (the module docs' error bound).
pub const fn scan_depth(j: usize) -> usize {
    90 + 2 * (j / (SCAN_TILE * SCAN_GROUP))
}

/// The launch of a scan of `n` elements.
#[cfg(not(target_arch = "nvptx64"))]
pub fn scan_launch(n: usize) -> kernel_abi::thread::Launch {
    kernel_abi::thread::Launch::linear(scan_tiles(n) as u32, SCAN_BLOCK)
}

/// Folds `v` into `acc` (`None`: nothing yet).
#[inline(always)]
fn fold<T: Copy>(acc: Option<T>, v: T, op: impl Fn(T, T) -> T) -> Option<T> {
    Some(match acc {
        Some(a) => op(a, v),
        None => v,
    })
}

/// Tile `i`'s status word (one relaxed 64-bit atomic load: re-read from
/// memory every time).
#[inline(always)]
fn status(scratch: &SliceMut<u64>, i: usize) -> u64 {
    scratch.atomic_load(1 + i, Relaxed)
}

/// The tile's exclusive prefix (warp 0 calls it, every lane; the result is
/// valid in lane 0). `None` for tile 0.
#[inline(always)]
fn look_back<T: Arith>(
    scratch: &SliceMut<u64>,
    tile: usize,
    op: impl Fn(T, T) -> T + Copy,
) -> Option<T> {
    let lane = warp::lane_id() as usize;
    let first = tile - tile % SCAN_GROUP;
    loop {
        let mut ready = true;
        let mut acc: Option<T> = None;
        for k in 0..SCAN_GROUP / 32 {
            let j = first + lane + 32 * k;
            if j < tile {
                let s = status(scratch, j);
                ready &= s & READY != 0;
                acc = fold(acc, T::from_bits(s & 0xffff_ffff), op);
            }
        }
        let mut prev = None;
        if first > 0 && lane == 0 {
            let s = status(scratch, first - 1);
            ready &= s & READY != 0;
            prev = Some(T::from_bits(s & 0xffff_ffff));
        }
        if warp::all(ready) {
            // Lanes with no tile hold `None`: the tree treats them as absent.
            let present = first + lane < tile;
            let s = reduce_present(acc.unwrap_or(T::ZERO), present, op);
            return match (prev, first < tile) {
                (Some(p), true) => Some(op(p, s)),
                (Some(p), false) => Some(p),
                (None, true) => Some(s),
                (None, false) => None,
            };
        }
        thread::spin_hint();
    }
}

/// The warp's fixed tree (`shfl_down` 16, 8, 4, 2, 1) over the lanes where
/// `present` holds (a prefix of the lanes); lane 0 gets the result.
#[inline(always)]
fn reduce_present<T: Plain>(v: T, present: bool, op: impl Fn(T, T) -> T) -> T {
    let lanes = warp::ballot(present).count_ones();
    let lane = warp::lane_id();
    let mut v = v;
    let mut off = 16;
    while off > 0 {
        let o = warp::shfl_down(v, off);
        if lane + off < lanes {
            v = op(v, o);
        }
        off /= 2;
    }
    v
}

/// The padded shared-memory slot of chunk `q`'s value (one word skipped
/// every 32: the raking lanes' reads are free of bank conflicts).
#[inline(always)]
const fn pad(q: usize) -> usize {
    q + q / 32
}

/// Chunks (of 4 elements) in a tile.
const CHUNKS: usize = SCAN_TILE / 4;
/// The shared words: the padded chunk values, then the tile id.
const SHARED: usize = CHUNKS + CHUNKS / 32 + 1;
const TILE_ID: usize = SHARED - 1;

/// One tile of the scan.
#[inline(always)]
fn scan_tile<T: Arith>(
    x: Slice<T>,
    y: SliceMut<T>,
    scratch: SliceMut<u64>,
    op: impl Fn(T, T) -> T + Copy,
) {
    let sh = shared_array!(u32, SHARED);
    let (t, w, lane) = (
        thread::thread_idx() as usize,
        thread::warp_id() as usize,
        warp::lane_id() as usize,
    );
    if thread::block_dim() != SCAN_BLOCK || T::BYTES != 4 || y.len() < x.len() {
        thread::trap();
    }
    // The tile id, from the counter: the order blocks start in.
    if t == 0 {
        sh.set(TILE_ID, scratch.atomic_add(0, 1, Relaxed) as u32);
    }
    sync_threads();
    let tile = sh.get(TILE_ID) as usize;
    let n = x.len();
    let base = tile * SCAN_TILE;
    let vector = aligned16(x.as_ptr()) && aligned16(y.as_mut_ptr());
    // Round r, thread t: chunk q = r * 256 + t, elements base + 4q .. + 4.
    let mut v = [[T::ZERO; 4]; ROUNDS];
    unroll!(r in [0 1 2 3] {
        let i = base + 4 * (r * SCAN_BLOCK as usize + t);
        if vector && i + 4 <= n {
            // SAFETY: i + 4 <= n and the input is 16-byte aligned (i is a multiple of 4).
            v[r] = unsafe { x.load4_nc_unchecked(i) };
        } else {
            unroll!(k in [0 1 2 3] {
                if i + k < n {
                    v[r][k] = x.load_nc(i + k);
                }
            });
        }
    });
    // The thread's prefixes in each chunk; the chunks' totals to shared memory.
    unroll!(r in [0 1 2 3] {
        unroll!(k in [1 2 3] {
            v[r][k] = op(v[r][k - 1], v[r][k]);
        });
        sh.set(pad(r * SCAN_BLOCK as usize + t), v[r][3].to_bits() as u32);
    });
    sync_threads();
    if w == 0 {
        // Raking: lane l folds chunks 32l .. 32l + 32 in order.
        let chunk = |q: usize| T::from_bits(sh.get(pad(q)) as u64);
        let mut seg = chunk(32 * lane);
        for k in 1..32 {
            seg = op(seg, chunk(32 * lane + k));
        }
        let inc = warp::inclusive_scan(seg, op);
        let before = warp::shfl_up(inc, 1);
        let aggregate = warp::shfl_idx(inc, 31);
        let last_of_group = tile % SCAN_GROUP == SCAN_GROUP - 1;
        if lane == 0 && !last_of_group {
            scratch.atomic_store(1 + tile, READY | aggregate.to_bits(), Relaxed);
        }
        let e = look_back(&scratch, tile, op);
        let e = warp::shfl_idx(e.unwrap_or(T::ZERO), 0);
        if lane == 0 && last_of_group {
            let inclusive = if tile == 0 {
                aggregate
            } else {
                op(e, aggregate)
            };
            scratch.atomic_store(1 + tile, READY | inclusive.to_bits(), Relaxed);
        }
        // Each chunk's prefix: E, then the chunks before it in the tile.
        let mut running = if lane == 0 { None } else { Some(before) };
        for k in 0..32 {
            let q = 32 * lane + k;
            let c = chunk(q);
            let p = match (tile == 0, running) {
                (true, Some(r)) => r,
                (false, Some(r)) => op(e, r),
                (false, None) => e,
                (true, None) => T::ZERO,
            };
            sh.set(pad(q), p.to_bits() as u32);
            running = fold(running, c, op);
        }
    }
    sync_threads();
    unroll!(r in [0 1 2 3] {
        let q = r * SCAN_BLOCK as usize + t;
        let p = T::from_bits(sh.get(pad(q)) as u64);
        let first = tile == 0 && q == 0;
        let out = v[r].map(|c| if first { c } else { op(p, c) });
        let i = base + 4 * q;
        if vector && i + 4 <= n {
            // SAFETY: i + 4 <= n <= y.len(), aligned (i a multiple of 4, y
            // aligned); each element has one writer.
            unsafe { store4_bits(&y, i, out.map(|c| c.to_bits() as u32)) };
        } else {
            unroll!(k in [0 1 2 3] {
                if i + k < n {
                    // SAFETY: i + k < n <= y.len(); one writer per element.
                    unsafe { y.write(i + k, out[k]) };
                }
            });
        }
    });
}

fn add<T: Arith>(a: T, b: T) -> T {
    T::add(a, b)
}

kernels! {
    /// Inclusive scan of `u32` (wrapping): `y[j] = x[0] + ... + x[j]`.
    ///
    /// # Safety
    /// The module's contract.
    pub unsafe fn scan_u32(x: Slice<u32>, y: SliceMut<u32>, scratch: SliceMut<u64>) {
        scan_tile(x, y, scratch, add::<u32>)
    }

    /// Inclusive scan of `i32` (wrapping).
    ///
    /// # Safety
    /// The module's contract.
    pub unsafe fn scan_i32(x: Slice<i32>, y: SliceMut<i32>, scratch: SliceMut<u64>) {
        scan_tile(x, y, scratch, add::<i32>)
    }

    /// Inclusive scan of `f32`, deterministic (module docs: order and bound).
    ///
    /// # Safety
    /// The module's contract.
    pub unsafe fn scan_f32(x: Slice<f32>, y: SliceMut<f32>, scratch: SliceMut<u64>) {
        scan_tile(x, y, scratch, add::<f32>)
    }
}
