//! The atomics on the GPU: `core::sync::atomic` for integers on global
//! memory, inline PTX (`atom.shared.*`, `atom.add.f32`) for the rest, with
//! fences for orderings stronger than relaxed.

use super::{load_order, Atomic, Ordering, Rmw};
use crate::elem::Arith;
use crate::shared::SharedArray;
use core::arch::asm;
use core::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

#[inline(always)]
fn before(order: Ordering, fence: fn()) {
    if matches!(
        order,
        Ordering::Release | Ordering::AcqRel | Ordering::SeqCst
    ) {
        fence()
    }
}

#[inline(always)]
fn after(order: Ordering, fence: fn()) {
    if matches!(
        order,
        Ordering::Acquire | Ordering::AcqRel | Ordering::SeqCst
    ) {
        fence()
    }
}

macro_rules! core_global {
    ($t:ty, $a:ty) => {
        #[inline(always)]
        unsafe fn rmw_core(p: *mut $t, op: Rmw<$t>, order: Ordering) -> $t {
            // SAFETY: the caller's contract: valid, aligned device memory.
            let a = unsafe { <$a>::from_ptr(p) };
            match op {
                Rmw::Add(v) => a.fetch_add(v, order),
                Rmw::Min(v) => a.fetch_min(v, order),
                Rmw::Max(v) => a.fetch_max(v, order),
                Rmw::Exchange(v) => a.swap(v, order),
                Rmw::Cas(c, n) => a
                    .compare_exchange(c, n, order, load_order(order))
                    .unwrap_or_else(|e| e),
            }
        }
    };
}

/// One `atom.shared` instruction with one operand: `$ins` like `add.u32`.
macro_rules! atom1 {
    ($reg:ident, $ins:literal, $addr:expr, $v:expr) => {{
        let o;
        // SAFETY: `$addr` is an element of a shared array (callers check
        // the index); one atomic instruction.
        unsafe {
            asm!(concat!("atom.shared.", $ins, " {o}, [{a}], {v};"),
                o = out($reg) o, a = in(reg32) $addr, v = in($reg) $v, options(nostack))
        };
        o
    }};
}

/// `atom.shared.cas`.
macro_rules! cas {
    ($reg:ident, $ins:literal, $addr:expr, $c:expr, $n:expr) => {{
        let o;
        // SAFETY: as for atom1.
        unsafe {
            asm!(concat!("atom.shared.", $ins, " {o}, [{a}], {c}, {n};"),
                o = out($reg) o, a = in(reg32) $addr, c = in($reg) $c, n = in($reg) $n, options(nostack))
        };
        o
    }};
}

macro_rules! int_atomic {
    ($t:ty, $a:ty, $reg:ident, $add:literal, $min:literal, $max:literal, $exch:literal, $cas:literal) => {
        impl Atomic for $t {
            #[inline(always)]
            unsafe fn __rmw_global(p: *mut Self, op: Rmw<Self>, order: Ordering) -> Self {
                core_global!($t, $a);
                // SAFETY: the caller's contract.
                unsafe { rmw_core(p, op, order) }
            }
            #[inline(always)]
            unsafe fn __load_global(p: *const Self, order: Ordering) -> Self {
                // SAFETY: the caller's contract.
                unsafe { <$a>::from_ptr(p as *mut $t) }.load(order)
            }
            #[inline(always)]
            unsafe fn __store_global(p: *mut Self, v: Self, order: Ordering) {
                // SAFETY: the caller's contract.
                unsafe { <$a>::from_ptr(p) }.store(v, order)
            }
            #[inline(always)]
            unsafe fn __rmw_shared(
                s: &SharedArray<Self>,
                i: usize,
                op: Rmw<Self>,
                order: Ordering,
            ) -> Self {
                let a = s.shared_addr(i);
                before(order, crate::thread::fence_block);
                let r: $t = match op {
                    Rmw::Add(v) => atom1!($reg, $add, a, v),
                    Rmw::Min(v) => atom1!($reg, $min, a, v),
                    Rmw::Max(v) => atom1!($reg, $max, a, v),
                    Rmw::Exchange(v) => atom1!($reg, $exch, a, v),
                    Rmw::Cas(c, n) => cas!($reg, $cas, a, c, n),
                };
                after(order, crate::thread::fence_block);
                r
            }
        }
    };
}

int_atomic!(u32, AtomicU32, reg32, "add.u32", "min.u32", "max.u32", "exch.b32", "cas.b32");
int_atomic!(i32, AtomicI32, reg32, "add.s32", "min.s32", "max.s32", "exch.b32", "cas.b32");
int_atomic!(u64, AtomicU64, reg64, "add.u64", "min.u64", "max.u64", "exch.b64", "cas.b64");

/// An `f32` min/max by compare-and-swap: `cas(old, new) -> observed`.
#[inline(always)]
fn cas_loop(first: u32, f: impl Fn(f32) -> f32, cas: impl Fn(u32, u32) -> u32) -> f32 {
    let mut old = first;
    loop {
        let new = f(f32::from_bits(old)).to_bits();
        if new == old {
            return f32::from_bits(old);
        }
        let seen = cas(old, new);
        if seen == old {
            return f32::from_bits(old);
        }
        old = seen;
    }
}

impl Atomic for f32 {
    #[inline(always)]
    unsafe fn __rmw_global(p: *mut Self, op: Rmw<Self>, order: Ordering) -> Self {
        let pu = p.cast::<u32>();
        // SAFETY: the caller's contract; an f32 is aligned as a u32.
        let a = unsafe { AtomicU32::from_ptr(pu) };
        match op {
            Rmw::Add(v) => {
                before(order, crate::thread::fence_device);
                let o: f32;
                // SAFETY: the caller's contract: valid device memory.
                unsafe {
                    asm!("atom.add.f32 {o}, [{p}], {v};", o = out(reg32) o, p = in(reg64) p, v = in(reg32) v, options(nostack))
                };
                after(order, crate::thread::fence_device);
                o
            }
            Rmw::Min(v) => cas_loop(
                a.load(Ordering::Relaxed),
                |x| f32::min(x, v),
                |c, n| {
                    a.compare_exchange(c, n, order, load_order(order))
                        .unwrap_or_else(|e| e)
                },
            ),
            Rmw::Max(v) => cas_loop(
                a.load(Ordering::Relaxed),
                |x| f32::max(x, v),
                |c, n| {
                    a.compare_exchange(c, n, order, load_order(order))
                        .unwrap_or_else(|e| e)
                },
            ),
            Rmw::Exchange(v) => f32::from_bits(a.swap(v.to_bits(), order)),
            Rmw::Cas(c, n) => f32::from_bits(
                a.compare_exchange(c.to_bits(), n.to_bits(), order, load_order(order))
                    .unwrap_or_else(|e| e),
            ),
        }
    }
    #[inline(always)]
    unsafe fn __load_global(p: *const Self, order: Ordering) -> Self {
        // SAFETY: the caller's contract.
        f32::from_bits(unsafe { AtomicU32::from_ptr(p as *mut u32) }.load(order))
    }
    #[inline(always)]
    unsafe fn __store_global(p: *mut Self, v: Self, order: Ordering) {
        // SAFETY: the caller's contract.
        unsafe { AtomicU32::from_ptr(p.cast()) }.store(v.to_bits(), order)
    }
    #[inline(always)]
    unsafe fn __rmw_shared(
        s: &SharedArray<Self>,
        i: usize,
        op: Rmw<Self>,
        order: Ordering,
    ) -> Self {
        let a = s.shared_addr(i);
        before(order, crate::thread::fence_block);
        let cas32 = |c: u32, n: u32| -> u32 { cas!(reg32, "cas.b32", a, c, n) };
        let r = match op {
            Rmw::Add(v) => atom1!(reg32, "add.f32", a, v),
            Rmw::Min(v) => {
                // SAFETY: i < len (the caller's contract).
                let first = unsafe { s.get_unchecked(i) }.to_bits();
                cas_loop(first, |x| <f32 as Arith>::min(x, v), cas32)
            }
            Rmw::Max(v) => {
                // SAFETY: i < len (the caller's contract).
                let first = unsafe { s.get_unchecked(i) }.to_bits();
                cas_loop(first, |x| <f32 as Arith>::max(x, v), cas32)
            }
            Rmw::Exchange(v) => f32::from_bits(atom1!(reg32, "exch.b32", a, v.to_bits())),
            Rmw::Cas(c, n) => f32::from_bits(cas32(c.to_bits(), n.to_bits())),
        };
        after(order, crate::thread::fence_block);
        r
    }
}
