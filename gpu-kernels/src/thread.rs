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
