//! Per-thread kernel bodies: what one GPU thread does, given its global index
//! `gid` and the grid `stride` (total threads in the launch).
//!
//! Work is split into a scalar head up to the first 16-byte boundary, a body of
//! 16-byte vectors walked by a grid-stride loop, and a scalar tail, so any `n`
//! and any start address inside a buffer give the right result. Threads
//! `0..head` and `0..tail` take the scalar elements (grid-stride as well).
//!
//! These are plain Rust: the nvptx entry points call them with the hardware
//! indices, and the host tests call them for every `gid` of a simulated grid.

use crate::elementwise::{self, F32x4, Split};

/// Applies `f` to each of the `n` floats at `x`, this thread's share.
///
/// # Safety
/// `x` must be valid for reads and writes of `n` floats and 4-byte aligned.
/// Concurrent callers must all use the same `x`, `n` and `stride` with
/// distinct `gid < stride`: the split then gives each element to exactly one
/// thread, so no two threads access the same element.
#[inline(always)]
pub unsafe fn map_in_place(
    x: *mut f32,
    n: usize,
    gid: usize,
    stride: usize,
    f: impl Fn(f32) -> f32 + Copy,
) {
    let split = Split::new(x as usize, n);
    let scalar = |i: usize| {
        // SAFETY: callers pass i < n: the element is inside the buffer.
        unsafe {
            let p = x.add(i);
            p.write(f(p.read()));
        }
    };
    // Head and tail have at most 3 elements; the loops only matter for grids
    // of fewer than 3 threads.
    let mut i = gid;
    while i < split.head {
        scalar(i);
        i += stride;
    }
    // SAFETY: head <= n; the body starts on a 16-byte boundary by construction.
    let body = unsafe { x.add(split.head) }.cast::<F32x4>();
    let mut i = gid;
    while i < split.vectors {
        // SAFETY: i < vectors, so the 4 floats lie inside the buffer, aligned to 16.
        unsafe {
            let p = body.add(i);
            p.write(p.read().map(f));
        }
        i += stride;
    }
    let mut i = gid;
    while i < split.tail {
        scalar(split.tail_start() + i);
        i += stride;
    }
}

/// `x[i] *= s`.
///
/// # Safety
/// As for [`map_in_place`].
#[inline(always)]
pub unsafe fn scale(x: *mut f32, n: usize, s: f32, gid: usize, stride: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { map_in_place(x, n, gid, stride, |v| elementwise::scale(v, s)) }
}

/// `x[i] = intensity(x[i], k)`: `k` dependent FMAs per element.
///
/// # Safety
/// As for [`map_in_place`].
#[inline(always)]
pub unsafe fn intensity(x: *mut f32, n: usize, k: u32, gid: usize, stride: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { map_in_place(x, n, gid, stride, |v| elementwise::intensity(v, k)) }
}

/// `y[i] = a * x[i] + y[i]`, fused. Vectorized when `x` and `y` have the same
/// alignment modulo 16 (then one split fits both); scalar grid-stride otherwise.
///
/// # Safety
/// `x` valid for reads and `y` for reads and writes of `n` floats, both
/// 4-byte aligned; `y` must not overlap `x` unless equal. Concurrent callers as
/// for [`map_in_place`].
#[inline(always)]
pub unsafe fn saxpy(a: f32, x: *const f32, y: *mut f32, n: usize, gid: usize, stride: usize) {
    let same_alignment = (x as usize) % 16 == (y as usize) % 16;
    if !same_alignment {
        let mut i = gid;
        while i < n {
            // SAFETY: i < n; each i belongs to one thread.
            unsafe {
                y.add(i)
                    .write(elementwise::saxpy(a, x.add(i).read(), y.add(i).read()))
            };
            i += stride;
        }
        return;
    }
    let split = Split::new(y as usize, n);
    let scalar = |i: usize| {
        // SAFETY: callers pass i < n.
        unsafe {
            y.add(i)
                .write(elementwise::saxpy(a, x.add(i).read(), y.add(i).read()))
        }
    };
    let mut i = gid;
    while i < split.head {
        scalar(i);
        i += stride;
    }
    // SAFETY: head <= n; x and y share their alignment modulo 16, so both bodies are aligned.
    let (xb, yb) = unsafe {
        (
            x.add(split.head).cast::<F32x4>(),
            y.add(split.head).cast::<F32x4>(),
        )
    };
    let mut i = gid;
    while i < split.vectors {
        // SAFETY: i < vectors: inside both buffers, 16-byte aligned.
        unsafe {
            let (xv, yv) = (xb.add(i).read(), yb.add(i));
            yv.write(xv.zip(yv.read(), |xs, ys| elementwise::saxpy(a, xs, ys)));
        }
        i += stride;
    }
    let mut i = gid;
    while i < split.tail {
        scalar(split.tail_start() + i);
        i += stride;
    }
}

/// Sixteen bytes aligned to 16, copied with one vector load and store on
/// the GPU ([`kernel_abi::copy16`]).
#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Bytes16([u32; 4]);

/// A unit of a gather: copied one at a time.
trait Unit: Copy {
    /// # Safety
    /// `src` readable and `dst` writable for one unit, both aligned for it.
    unsafe fn copy(dst: *mut Self, src: *const Self);
}

impl Unit for Bytes16 {
    #[inline(always)]
    unsafe fn copy(dst: *mut Self, src: *const Self) {
        // SAFETY: the trait's contract: 16 bytes each way, aligned to 16.
        unsafe { kernel_abi::copy16(dst.cast(), src.cast()) }
    }
}

macro_rules! plain_unit {
    ($($t:ty),*) => { $(
        impl Unit for $t {
            #[inline(always)]
            unsafe fn copy(dst: *mut Self, src: *const Self) {
                // SAFETY: the trait's contract.
                unsafe { dst.write(src.read()) }
            }
        }
    )* };
}
plain_unit!(u32, u8);

/// Copies `width`-byte units (1, 4 or 16, `T` of that size and alignment)
/// of a gather, this thread's share: destination unit `i` is unit `i %
/// per_row` of source row `idx[i / per_row]`. Rows out of range are left
/// unwritten.
///
/// # Safety
/// As for [`gather_rows`], with `src` and `dst` aligned for `T` and
/// `row_bytes` a multiple of its size.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gather_units<T: Unit>(
    src: *const u8,
    src_rows: usize,
    idx: *const u64,
    rows: usize,
    row_bytes: usize,
    dst: *mut u8,
    gid: usize,
    stride: usize,
) {
    let per_row = row_bytes / core::mem::size_of::<T>();
    let (src, dst) = (src.cast::<T>(), dst.cast::<T>());
    let total = rows * per_row;
    let mut i = gid;
    while i < total {
        let r = i / per_row;
        let k = i - r * per_row;
        // SAFETY: r < rows: inside `idx`.
        let row = unsafe { idx.add(r).read() } as usize;
        if row < src_rows {
            // SAFETY: row < src_rows and k < per_row: the unit lies inside
            // `src`; `i < total` units of `dst`; each `i` has one thread.
            unsafe { T::copy(dst.add(i), src.add(row * per_row + k)) };
        }
        i += stride;
    }
}

/// Gathers rows: destination row `r` (of `rows`) is source row `idx[r]`,
/// `row_bytes` bytes each, in 16-byte units where the rows and both
/// buffers allow, else 4-byte, else single bytes. Indices at or past
/// `src_len / row_bytes` leave their destination row unwritten.
///
/// # Safety
/// `src` is readable for `src_len` bytes, `idx` for `rows` values and `dst`
/// writable for `rows × row_bytes` bytes, not overlapping the other two;
/// `row_bytes > 0`. Concurrent callers as for [`map_in_place`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn gather_rows(
    src: *const u8,
    src_len: usize,
    idx: *const u64,
    rows: usize,
    row_bytes: usize,
    dst: *mut u8,
    gid: usize,
    stride: usize,
) {
    if row_bytes == 0 {
        return;
    }
    let src_rows = src_len / row_bytes;
    let aligned = |a: usize| {
        row_bytes.is_multiple_of(a)
            && (src as usize).is_multiple_of(a)
            && (dst as usize).is_multiple_of(a)
    };
    // SAFETY: forwarded from the caller; each width is chosen only when the
    // rows and both buffers are aligned to it.
    unsafe {
        if aligned(16) {
            gather_units::<Bytes16>(src, src_rows, idx, rows, row_bytes, dst, gid, stride)
        } else if aligned(4) {
            gather_units::<u32>(src, src_rows, idx, rows, row_bytes, dst, gid, stride)
        } else {
            gather_units::<u8>(src, src_rows, idx, rows, row_bytes, dst, gid, stride)
        }
    }
}
