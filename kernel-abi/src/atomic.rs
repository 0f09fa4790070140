//! Atomics on global memory ([`SliceMut`] methods) and on shared memory
//! ([`SharedArray`] methods): add, min, max, exchange, compare-and-swap,
//! load and store, for [`Atomic`] types (`u32`, `i32`, `u64`, `f32`), each
//! with a [`Ordering`] as in `core::sync::atomic`.
//!
//! Every method checks its index: past the end is a trap on the GPU and a
//! typed fault on the CPU emulation
//! ([`FaultKind::SliceOutOfBounds`](crate::thread::FaultKind::SliceOutOfBounds),
//! [`FaultKind::SharedOutOfBounds`](crate::thread::FaultKind::SharedOutOfBounds)).
//!
//! On the GPU: integer atomics on global memory are `core::sync::atomic`
//! operations (`atom.global.add.u32`, `atom.global.min.s32`, ...); shared
//! memory's are `atom.shared.*` (inline PTX); `f32` add is `atom.add.f32`;
//! `f32` min and max are compare-and-swap loops. Orderings stronger than
//! `Relaxed` on the inline-PTX paths are fences around a relaxed atomic
//! (`fence.acq_rel.gpu` for global memory, `.cta` for shared). On the CPU
//! emulation: `std` atomics (`f32` through its bits, shared memory's 4-byte
//! elements as halves of 64-bit words, by compare-and-swap).
//!
//! An ordering a load can't have (`Release`, `AcqRel`) is weakened to
//! `Relaxed`/`Acquire`, a store's (`Acquire`, `AcqRel`) to
//! `Relaxed`/`Release`, instead of panicking as `std` does.
//!
//! ```
//! use core::sync::atomic::Ordering::Relaxed;
//! use kernel_abi::{shared_array, thread, SliceMut};
//! let mut hist = vec![0u32; 4];
//! // SAFETY: `hist` outlives the launch.
//! let h = unsafe { SliceMut::from_raw_parts(hist.as_mut_ptr(), 4) };
//! thread::emulate(8, 64, 2, &|| {
//!     let local = shared_array!(u32, 4);
//!     if thread::thread_idx() < 4 {
//!         local.set(thread::thread_idx() as usize, 0);
//!     }
//!     thread::sync_threads();
//!     local.atomic_add(thread::thread_idx() as usize % 4, 1, Relaxed);
//!     thread::sync_threads();
//!     if thread::thread_idx() < 4 {
//!         let i = thread::thread_idx() as usize;
//!         h.atomic_add(i, local.get(i), Relaxed);
//!     }
//! })
//! .unwrap();
//! assert_eq!(hist, [128; 4]);
//! ```

pub use core::sync::atomic::Ordering;

use crate::elem::Arith;
use crate::load::slice_oob;
use crate::shared::SharedArray;
use crate::SliceMut;

/// A read-modify-write operation.
#[derive(Clone, Copy)]
#[doc(hidden)]
pub enum Rmw<T> {
    Add(T),
    Min(T),
    Max(T),
    Exchange(T),
    /// Compare (bits) and swap: `(current, new)`.
    Cas(T, T),
}

impl<T: Arith> Rmw<T> {
    /// The new value from the old, or `None` (a compare-and-swap that fails).
    #[inline(always)]
    #[cfg_attr(target_arch = "nvptx64", allow(dead_code))]
    fn apply(self, old: T) -> Option<T> {
        match self {
            Rmw::Add(v) => Some(T::add(old, v)),
            Rmw::Min(v) => Some(T::min(old, v)),
            Rmw::Max(v) => Some(T::max(old, v)),
            Rmw::Exchange(v) => Some(v),
            Rmw::Cas(c, n) => (old.to_bits() == c.to_bits()).then_some(n),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type with atomic operations on global and shared memory: `u32`,
/// `i32`, `u64`, `f32`.
pub trait Atomic: Arith + sealed::Sealed {
    #[doc(hidden)]
    /// # Safety
    /// `p` is valid, aligned device memory for a `Self`.
    unsafe fn __rmw_global(p: *mut Self, op: Rmw<Self>, order: Ordering) -> Self;
    #[doc(hidden)]
    /// # Safety
    /// As `__rmw_global`.
    unsafe fn __load_global(p: *const Self, order: Ordering) -> Self;
    #[doc(hidden)]
    /// # Safety
    /// As `__rmw_global`.
    unsafe fn __store_global(p: *mut Self, v: Self, order: Ordering);
    #[doc(hidden)]
    /// # Safety
    /// `i < s.len()`.
    unsafe fn __rmw_shared(s: &SharedArray<Self>, i: usize, op: Rmw<Self>, order: Ordering)
        -> Self;
}

/// The ordering a load can have.
#[inline(always)]
pub(crate) fn load_order(o: Ordering) -> Ordering {
    match o {
        Ordering::Release => Ordering::Relaxed,
        Ordering::AcqRel => Ordering::Acquire,
        o => o,
    }
}

/// The ordering a store can have.
#[inline(always)]
pub(crate) fn store_order(o: Ordering) -> Ordering {
    match o {
        Ordering::Acquire => Ordering::Relaxed,
        Ordering::AcqRel => Ordering::Release,
        o => o,
    }
}

#[cfg(not(target_arch = "nvptx64"))]
#[path = "atomic/host.rs"]
mod imp;
#[cfg(target_arch = "nvptx64")]
#[path = "atomic/ptx.rs"]
mod imp;

impl sealed::Sealed for u32 {}
impl sealed::Sealed for i32 {}
impl sealed::Sealed for u64 {}
impl sealed::Sealed for f32 {}

macro_rules! atomic_methods {
    ($check:ident, $rmw:expr) => {
        /// Adds `v` to element `i` (wrapping for integers, IEEE for `f32`);
        /// returns the old value.
        #[inline(always)]
        pub fn atomic_add(&self, i: usize, v: T, order: Ordering) -> T {
            self.$check(i);
            #[allow(clippy::redundant_closure_call)]
            ($rmw)(self, i, Rmw::Add(v), order)
        }
        /// Stores `min(old, v)` at element `i`; returns the old value.
        #[inline(always)]
        pub fn atomic_min(&self, i: usize, v: T, order: Ordering) -> T {
            self.$check(i);
            #[allow(clippy::redundant_closure_call)]
            ($rmw)(self, i, Rmw::Min(v), order)
        }
        /// Stores `max(old, v)` at element `i`; returns the old value.
        #[inline(always)]
        pub fn atomic_max(&self, i: usize, v: T, order: Ordering) -> T {
            self.$check(i);
            #[allow(clippy::redundant_closure_call)]
            ($rmw)(self, i, Rmw::Max(v), order)
        }
        /// Stores `v` at element `i`; returns the old value.
        #[inline(always)]
        pub fn atomic_exchange(&self, i: usize, v: T, order: Ordering) -> T {
            self.$check(i);
            #[allow(clippy::redundant_closure_call)]
            ($rmw)(self, i, Rmw::Exchange(v), order)
        }
        /// Stores `new` at element `i` if it holds `current` (compared as
        /// bits, also for `f32`): `Ok(old)` if it did, `Err(old)` if not.
        #[inline(always)]
        pub fn atomic_compare_exchange(
            &self,
            i: usize,
            current: T,
            new: T,
            order: Ordering,
        ) -> Result<T, T> {
            self.$check(i);
            #[allow(clippy::redundant_closure_call)]
            let old: T = ($rmw)(self, i, Rmw::Cas(current, new), order);
            if old.to_bits() == current.to_bits() {
                Ok(old)
            } else {
                Err(old)
            }
        }
    };
}

impl<T: Atomic> SliceMut<T> {
    #[inline(always)]
    fn check_atomic(&self, i: usize) {
        if i >= self.len() {
            slice_oob(i, self.len())
        }
    }

    atomic_methods!(check_atomic, |s: &Self, i: usize, op, order| {
        // SAFETY: i < len (checked); the slice's contract makes the element
        // valid, aligned device memory.
        unsafe { T::__rmw_global(s.as_mut_ptr().add(i), op, order) }
    });

    /// Element `i`, read atomically (e.g. a flag another block publishes).
    #[inline(always)]
    pub fn atomic_load(&self, i: usize, order: Ordering) -> T {
        self.check_atomic(i);
        // SAFETY: as for the read-modify-writes.
        unsafe { T::__load_global(self.as_mut_ptr().add(i), load_order(order)) }
    }

    /// Stores `v` at element `i` atomically.
    #[inline(always)]
    pub fn atomic_store(&self, i: usize, v: T, order: Ordering) {
        self.check_atomic(i);
        // SAFETY: as for the read-modify-writes.
        unsafe { T::__store_global(self.as_mut_ptr().add(i), v, store_order(order)) }
    }
}

impl<T: Atomic> SharedArray<T> {
    #[inline(always)]
    fn check_atomic(&self, i: usize) {
        if i >= self.len() {
            crate::shared::out_of_bounds(i, self.len())
        }
    }

    atomic_methods!(check_atomic, |s: &Self, i: usize, op, order| {
        // SAFETY: i < len (checked).
        unsafe { T::__rmw_shared(s, i, op, order) }
    });
}
