//! The atomics on the CPU emulation: `std` atomics over the bits.

use super::{load_order, Atomic, Ordering, Rmw};
use crate::shared::SharedArray;
use core::sync::atomic::{AtomicU32, AtomicU64};

/// # Safety
/// `p` is valid and aligned for a `T`, accessed only atomically meanwhile.
#[inline(always)]
unsafe fn global_rmw<T: Atomic>(p: *mut T, op: Rmw<T>, order: Ordering) -> T {
    let fetch = load_order(order);
    if T::BYTES == 4 {
        // SAFETY: the caller's contract; `T` is 4 bytes, aligned as a u32.
        let a = unsafe { AtomicU32::from_ptr(p.cast()) };
        let r = a.fetch_update(order, fetch, |old| {
            op.apply(T::from_bits(u64::from(old)))
                .map(|n| n.to_bits() as u32)
        });
        T::from_bits(u64::from(r.unwrap_or_else(|e| e)))
    } else {
        // SAFETY: as above, 8 bytes.
        let a = unsafe { AtomicU64::from_ptr(p.cast()) };
        let r = a.fetch_update(order, fetch, |old| {
            op.apply(T::from_bits(old)).map(|n| n.to_bits())
        });
        T::from_bits(r.unwrap_or_else(|e| e))
    }
}

macro_rules! host_atomic {
    ($($t:ty),*) => { $(
        impl Atomic for $t {
            unsafe fn __rmw_global(p: *mut Self, op: Rmw<Self>, order: Ordering) -> Self {
                // SAFETY: the caller's contract.
                unsafe { global_rmw(p, op, order) }
            }
            unsafe fn __load_global(p: *const Self, order: Ordering) -> Self {
                if <Self as crate::elem::Plain>::BYTES == 4 {
                    // SAFETY: the caller's contract.
                    let a = unsafe { AtomicU32::from_ptr(p as *mut u32) };
                    <$t as crate::elem::Plain>::from_bits(u64::from(a.load(order)))
                } else {
                    // SAFETY: the caller's contract.
                    let a = unsafe { AtomicU64::from_ptr(p as *mut u64) };
                    <$t as crate::elem::Plain>::from_bits(a.load(order))
                }
            }
            unsafe fn __store_global(p: *mut Self, v: Self, order: Ordering) {
                let bits = crate::elem::Plain::to_bits(v);
                if <Self as crate::elem::Plain>::BYTES == 4 {
                    // SAFETY: the caller's contract.
                    unsafe { AtomicU32::from_ptr(p.cast()) }.store(bits as u32, order)
                } else {
                    // SAFETY: the caller's contract.
                    unsafe { AtomicU64::from_ptr(p.cast()) }.store(bits, order)
                }
            }
            unsafe fn __rmw_shared(s: &SharedArray<Self>, i: usize, op: Rmw<Self>, order: Ordering) -> Self {
                shared_rmw(s, i, op, order)
            }
        }
    )* };
}
host_atomic!(u32, i32, u64, f32);

/// A read-modify-write of element `i` (callers checked `i < len`): a
/// compare-and-swap loop on the word (half-word for 4-byte types).
#[inline(always)]
fn shared_rmw<T: Atomic>(s: &SharedArray<T>, i: usize, op: Rmw<T>, order: Ordering) -> T {
    let (w, shift) = s.word(i);
    let mask = if T::BYTES == 4 {
        0xffff_ffffu64 << shift
    } else {
        u64::MAX
    };
    let r = w.fetch_update(order, load_order(order), |old| {
        op.apply(T::from_bits((old & mask) >> shift))
            .map(|n| (old & !mask) | ((n.to_bits() << shift) & mask))
    });
    T::from_bits((r.unwrap_or_else(|e| e) & mask) >> shift)
}
