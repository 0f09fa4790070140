//! Global-memory loads with cache hints, on [`Slice`] (and a streaming
//! store on [`SliceMut`]):
//! - [`Slice::load`]: an ordinary load;
//! - [`Slice::load_nc`]: through the read-only (texture) cache,
//!   `ld.global.nc` (the data must not change during the kernel: a
//!   [`Slice`]'s contract);
//! - [`Slice::load_cs`]: streaming, `ld.global.cs` (evict first: data read
//!   once);
//! - [`Slice::load4_nc`]: four 4-byte elements in one 16-byte
//!   `ld.global.nc.v4` (the sum's and softmax's vector loads).
//!
//! Each is checked (past the end or, for the vector form, misaligned: a
//! trap on the GPU, a typed fault on the CPU emulation) and has an
//! `_unchecked` `unsafe` form for hot loops. On the emulation they are
//! plain reads.

use crate::elem::Plain;
use crate::{Slice, SliceMut};

/// An index past a slice's end: a trap on the GPU, the typed
/// `SliceOutOfBounds` fault on the CPU emulation (loads, atomics, `cp.async`).
#[cold]
#[inline(never)]
pub(crate) fn slice_oob(index: usize, len: usize) -> ! {
    #[cfg(target_arch = "nvptx64")]
    {
        let _ = (index, len);
        crate::thread::trap()
    }
    #[cfg(not(target_arch = "nvptx64"))]
    crate::emu::raise(crate::thread::FaultKind::SliceOutOfBounds { index, len })
}

/// A vector access off its alignment: a trap / the typed `Misaligned` fault.
#[cold]
#[inline(never)]
pub(crate) fn misaligned() -> ! {
    #[cfg(target_arch = "nvptx64")]
    crate::thread::trap();
    #[cfg(not(target_arch = "nvptx64"))]
    crate::emu::raise(crate::thread::FaultKind::Misaligned)
}

#[cfg(target_arch = "nvptx64")]
macro_rules! ld_hint {
    ($p:expr, $t:ty, $hint:literal) => {{
        let p = $p;
        if <$t as Plain>::BYTES == 4 {
            let v: u32;
            // SAFETY: the caller's contract: `p` is valid global memory.
            unsafe {
                core::arch::asm!(
                    "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
                    concat!("ld.global.", $hint, ".b32 {v}, [%ka_g];"), "}}",
                    v = out(reg32) v, p = in(reg64) p, options(readonly, nostack, pure))
            };
            <$t as Plain>::from_bits(v as u64)
        } else {
            let v: u64;
            // SAFETY: as above.
            unsafe {
                core::arch::asm!(
                    "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
                    concat!("ld.global.", $hint, ".b64 {v}, [%ka_g];"), "}}",
                    v = out(reg64) v, p = in(reg64) p, options(readonly, nostack, pure))
            };
            <$t as Plain>::from_bits(v)
        }
    }};
}

impl<T: Plain> Slice<T> {
    #[inline(always)]
    fn check(&self, i: usize) {
        if i >= self.len() {
            slice_oob(i, self.len())
        }
    }

    /// Element `i` (an ordinary load); past the end, a trap / a fault.
    #[inline(always)]
    pub fn load(&self, i: usize) -> T {
        self.check(i);
        // SAFETY: i < len; the slice's contract.
        unsafe { self.as_ptr().add(i).read() }
    }

    /// Element `i` through the read-only cache (`ld.global.nc`); past the
    /// end, a trap / a fault.
    #[inline(always)]
    pub fn load_nc(&self, i: usize) -> T {
        self.check(i);
        // SAFETY: checked just above.
        unsafe { self.load_nc_unchecked(i) }
    }

    /// Element `i`, streaming (`ld.global.cs`); past the end, a trap / a fault.
    #[inline(always)]
    pub fn load_cs(&self, i: usize) -> T {
        self.check(i);
        // SAFETY: checked just above.
        unsafe { self.load_cs_unchecked(i) }
    }

    /// Element `i` through the read-only cache, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn load_nc_unchecked(&self, i: usize) -> T {
        // SAFETY: the caller's contract and the slice's.
        let p = unsafe { self.as_ptr().add(i) };
        #[cfg(target_arch = "nvptx64")]
        {
            ld_hint!(p, T, "nc")
        }
        #[cfg(not(target_arch = "nvptx64"))]
        // SAFETY: as above.
        unsafe {
            p.read()
        }
    }

    /// Element `i`, streaming, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn load_cs_unchecked(&self, i: usize) -> T {
        // SAFETY: the caller's contract and the slice's.
        let p = unsafe { self.as_ptr().add(i) };
        #[cfg(target_arch = "nvptx64")]
        {
            ld_hint!(p, T, "cs")
        }
        #[cfg(not(target_arch = "nvptx64"))]
        // SAFETY: as above.
        unsafe {
            p.read()
        }
    }

    /// Elements `i..i + 4` of a 4-byte type in one 16-byte load through the
    /// read-only cache (`ld.global.nc.v4.b32`). Element `i` must be 16-byte
    /// aligned; misaligned, or past the end: a trap / a fault.
    #[inline(always)]
    pub fn load4_nc(&self, i: usize) -> [T; 4] {
        if i >= self.len() || self.len() - i < 4 {
            slice_oob(i, self.len())
        }
        if T::BYTES != 4 || !(self.as_ptr() as usize + i * T::BYTES).is_multiple_of(16) {
            misaligned()
        }
        // SAFETY: checked just above.
        unsafe { self.load4_nc_unchecked(i) }
    }

    /// Elements `i..i + 4` in one 16-byte load, unchecked.
    ///
    /// # Safety
    /// `T` is 4 bytes, `i + 4 <= self.len()`, element `i` 16-byte aligned.
    #[inline(always)]
    pub unsafe fn load4_nc_unchecked(&self, i: usize) -> [T; 4] {
        // SAFETY: the caller's contract and the slice's.
        let p = unsafe { self.as_ptr().add(i) };
        #[cfg(target_arch = "nvptx64")]
        {
            let (x, y, z, w): (u32, u32, u32, u32);
            // SAFETY: 16 aligned bytes of global memory (the caller's contract).
            unsafe {
                core::arch::asm!(
                    "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
                    "ld.global.nc.v4.b32 {{{x}, {y}, {z}, {w}}}, [%ka_g];", "}}",
                    x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                    p = in(reg64) p, options(readonly, nostack, pure))
            };
            [x, y, z, w].map(|b| T::from_bits(b as u64))
        }
        #[cfg(not(target_arch = "nvptx64"))]
        // SAFETY: as above.
        core::array::from_fn(|k| unsafe { p.add(k).read() })
    }
}

impl<T: Plain> SliceMut<T> {
    /// Stores `v` at element `i` with the streaming hint (`st.global.cs`:
    /// data written once); past the end, a trap / a fault.
    ///
    /// # Safety
    /// No other thread reads or writes element `i` meanwhile.
    #[inline(always)]
    pub unsafe fn store_cs(&self, i: usize, v: T) {
        if i >= self.len() {
            slice_oob(i, self.len())
        }
        // SAFETY: i < len; the caller's contract.
        let p = unsafe { self.as_mut_ptr().add(i) };
        #[cfg(target_arch = "nvptx64")]
        {
            if T::BYTES == 4 {
                // SAFETY: `p` is valid global memory (the slice's contract).
                unsafe {
                    core::arch::asm!(
                        "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
                        "st.global.cs.b32 [%ka_g], {v};", "}}",
                        v = in(reg32) v.to_bits() as u32, p = in(reg64) p, options(nostack))
                };
            } else {
                // SAFETY: as above.
                unsafe {
                    core::arch::asm!(
                        "{{", ".reg .u64 %ka_g;", "cvta.to.global.u64 %ka_g, {p};",
                        "st.global.cs.b64 [%ka_g], {v};", "}}",
                        v = in(reg64) v.to_bits(), p = in(reg64) p, options(nostack))
                };
            }
        }
        #[cfg(not(target_arch = "nvptx64"))]
        // SAFETY: as above.
        unsafe {
            p.write(v)
        }
    }
}
