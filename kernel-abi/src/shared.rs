//! Shared memory: per-block arrays every thread of a block sees.
//!
//! - **Static arrays**, sized at compile time: [`shared_array!`](crate::shared_array)`(f32, 256)`
//!   gives a [`SharedArray<f32>`] of 256 elements; each use is a `.shared`
//!   symbol of its own in the PTX.
//! - **The dynamic area**, sized by the launch's dynamic shared bytes:
//!   [`dynamic::<T>()`] views it as `T`s (length: bytes / `size_of::<T>()`),
//!   [`dynamic_at`] from a byte offset (to put several arrays in it).
//!
//! Elements are [`Plain`]: `u32`, `i32`, `f32`, `u64`, `i64`, `f64`.
//! Access is safe: [`SharedArray::get`] and [`SharedArray::set`] check the
//! index (past the end: a trap on the GPU, [`FaultKind::SharedOutOfBounds`]
//! naming the kernel, block and thread on the CPU emulation);
//! [`SharedArray::get_unchecked`] and [`SharedArray::set_unchecked`] are the
//! hot-loop forms. Threads that read what others wrote need a barrier in
//! between ([`crate::thread::sync_threads`]); without one the value is
//! racy (old or new), as on the GPU, but never undefined behaviour: the
//! GPU accesses are `ld.shared`/`st.shared` instructions, the emulation's
//! are relaxed atomics.
//!
//! The tile pattern, with [`SharedArray::fill_and_sync`]: every thread
//! stores its share, a barrier, then any thread reads any element.
//!
//! ```
//! use kernel_abi::{shared_array, thread, SliceMut};
//! use kernel_abi::thread::{emulate_launch, Launch};
//!
//! // Reverses each block of 64 elements through shared memory.
//! fn reverse_block(x: SliceMut<u32>) {
//!     let tile = shared_array!(u32, 64);
//!     let (t, base) = (thread::thread_idx() as usize, thread::block_idx() as usize * 64);
//!     // SAFETY: each thread reads and writes only its own element of x.
//!     tile.fill_and_sync(|i| unsafe { x.read(base + i) });
//!     // SAFETY: as above.
//!     unsafe { x.write(base + t, tile.get(63 - t)) };
//! }
//!
//! let mut v: Vec<u32> = (0..128).collect();
//! // SAFETY: `v` outlives the launch.
//! let x = unsafe { SliceMut::from_raw_parts(v.as_mut_ptr(), v.len()) };
//! emulate_launch("reverse", &Launch::linear(2, 64), 2, &|| reverse_block(x)).unwrap();
//! assert_eq!(v[0], 63);
//! assert_eq!(v[64], 127);
//! ```
//!
//! On the GPU a kernel crate that uses [`shared_array!`](crate::shared_array) enables
//! `#![feature(asm_experimental_arch)]` (the nested kernel build's usual
//! features: `abi_ptx, stdarch_nvptx, asm_experimental_arch`): the macro
//! expands to `global_asm!` in the kernel crate.
//!
//! [`FaultKind::SharedOutOfBounds`]: crate::thread::FaultKind::SharedOutOfBounds

use crate::elem::Plain;
use core::marker::PhantomData;

/// A view of shared memory: `len` elements of `T` in the block's shared
/// memory. `Copy`; valid for the whole launch, in every thread of the
/// block (each block has its own memory behind the same view).
pub struct SharedArray<T: Plain> {
    /// The shared-window address of element 0.
    #[cfg(target_arch = "nvptx64")]
    addr: u32,
    /// The emulated block's words.
    #[cfg(not(target_arch = "nvptx64"))]
    words: *const core::sync::atomic::AtomicU64,
    /// Element 0's position, in units of `T` from the first word.
    #[cfg(not(target_arch = "nvptx64"))]
    first: usize,
    len: usize,
    _t: PhantomData<*const T>,
}

impl<T: Plain> Clone for SharedArray<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Plain> Copy for SharedArray<T> {}

impl<T: Plain> core::fmt::Debug for SharedArray<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "SharedArray({} x {} bytes)", self.len, T::BYTES)
    }
}

/// A shared-memory index past the end: a trap on the GPU, a typed fault on
/// the emulation.
#[cold]
#[inline(never)]
pub(crate) fn out_of_bounds(index: usize, len: usize) -> ! {
    #[cfg(target_arch = "nvptx64")]
    {
        let _ = (index, len);
        crate::thread::trap()
    }
    #[cfg(not(target_arch = "nvptx64"))]
    crate::emu::raise(crate::thread::FaultKind::SharedOutOfBounds { index, len })
}

/// A misuse of shared memory (a view at a bad offset).
#[cold]
#[inline(never)]
pub(crate) fn misuse(what: &'static str) -> ! {
    #[cfg(target_arch = "nvptx64")]
    {
        let _ = what;
        crate::thread::trap()
    }
    #[cfg(not(target_arch = "nvptx64"))]
    crate::emu::raise(crate::thread::FaultKind::SharedMisuse(what))
}

impl<T: Plain> SharedArray<T> {
    /// Element count.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element `i`; past the end, a trap (GPU) or
    /// [`crate::thread::FaultKind::SharedOutOfBounds`] (emulation).
    #[inline(always)]
    pub fn get(&self, i: usize) -> T {
        if i >= self.len {
            out_of_bounds(i, self.len)
        }
        // SAFETY: checked just above.
        unsafe { self.get_unchecked(i) }
    }

    /// Stores `v` at element `i`; past the end, as [`SharedArray::get`].
    #[inline(always)]
    pub fn set(&self, i: usize, v: T) {
        if i >= self.len {
            out_of_bounds(i, self.len)
        }
        // SAFETY: checked just above.
        unsafe { self.set_unchecked(i, v) }
    }

    /// Elements `i..i + 4` in one 16-byte access (`ld.shared.v4.b32`), for
    /// 4-byte `T`; `i` a multiple of 4 (16-byte aligned: every array starts
    /// 16-byte aligned). Past the end or misaligned: a trap / a fault.
    #[inline(always)]
    pub fn get4(&self, i: usize) -> [T; 4] {
        self.check4(i);
        // SAFETY: checked just above.
        unsafe { self.get4_unchecked(i) }
    }

    /// Stores elements `i..i + 4` in one 16-byte access, as [`SharedArray::get4`].
    #[inline(always)]
    pub fn set4(&self, i: usize, v: [T; 4]) {
        self.check4(i);
        // SAFETY: checked just above.
        unsafe { self.set4_unchecked(i, v) }
    }

    #[inline(always)]
    fn check4(&self, i: usize) {
        if T::BYTES != 4 {
            misuse("get4/set4 on 8-byte elements");
        }
        if i >= self.len || self.len - i < 4 {
            out_of_bounds(i, self.len)
        }
        if !(self.position(i)).is_multiple_of(4) {
            misuse("get4/set4 at an index that is not 16-byte aligned");
        }
    }

    /// Element `i`'s position from the allocation's start, in units of `T`.
    #[inline(always)]
    pub(crate) fn position(&self, i: usize) -> usize {
        #[cfg(target_arch = "nvptx64")]
        {
            self.addr as usize / T::BYTES + i
        }
        #[cfg(not(target_arch = "nvptx64"))]
        {
            self.first + i
        }
    }

    /// The `len` elements from `start`: a view of part of this one (e.g. to
    /// split the dynamic area). Past the end: a trap / a fault.
    #[inline(always)]
    pub fn slice(&self, start: usize, len: usize) -> SharedArray<T> {
        if start > self.len || self.len - start < len {
            out_of_bounds(start.saturating_add(len), self.len)
        }
        SharedArray {
            #[cfg(target_arch = "nvptx64")]
            addr: self.addr + (start * T::BYTES) as u32,
            #[cfg(not(target_arch = "nvptx64"))]
            words: self.words,
            #[cfg(not(target_arch = "nvptx64"))]
            first: self.first + start,
            len,
            _t: PhantomData,
        }
    }

    /// The tile pattern: this thread stores `f(i)` at every index `i` of
    /// its share (`i = linear_thread_idx() + k * block_threads()`), then
    /// waits at a barrier ([`crate::thread::sync_threads`]): afterwards
    /// every element is written and any thread may read any of them. Every
    /// thread of the block must call it (it has a barrier).
    #[inline(always)]
    pub fn fill_and_sync(&self, mut f: impl FnMut(usize) -> T) {
        let step = crate::thread::block_threads() as usize;
        let mut i = crate::thread::linear_thread_idx() as usize;
        while i < self.len {
            // SAFETY: i < len.
            unsafe { self.set_unchecked(i, f(i)) };
            i += step;
        }
        crate::thread::sync_threads();
    }
}

#[cfg(target_arch = "nvptx64")]
impl<T: Plain> SharedArray<T> {
    #[doc(hidden)]
    /// # Safety
    /// `addr..addr + len * size_of::<T>()` is `.shared` memory, aligned for `T`.
    #[inline(always)]
    pub unsafe fn __from_shared_addr(addr: u32, len: usize) -> Self {
        SharedArray {
            addr,
            len,
            _t: PhantomData,
        }
    }

    /// The shared-window address of element `i` (for inline PTX: an
    /// operand of `ld.shared`, `cp.async`, `ldmatrix`).
    #[inline(always)]
    pub fn shared_addr(&self, i: usize) -> u32 {
        self.addr + (i * T::BYTES) as u32
    }

    /// Element `i`, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn get_unchecked(&self, i: usize) -> T {
        let a = self.shared_addr(i);
        if T::BYTES == 4 {
            let v: u32;
            // SAFETY: `a` is inside this array's shared memory (caller).
            unsafe {
                core::arch::asm!("ld.shared.b32 {v}, [{a}];", v = out(reg32) v, a = in(reg32) a, options(pure, readonly, nostack))
            };
            T::from_bits(v as u64)
        } else {
            let v: u64;
            // SAFETY: as above.
            unsafe {
                core::arch::asm!("ld.shared.b64 {v}, [{a}];", v = out(reg64) v, a = in(reg32) a, options(pure, readonly, nostack))
            };
            T::from_bits(v)
        }
    }

    /// Stores `v` at element `i`, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn set_unchecked(&self, i: usize, v: T) {
        let a = self.shared_addr(i);
        if T::BYTES == 4 {
            // SAFETY: `a` is inside this array's shared memory (caller).
            unsafe {
                core::arch::asm!("st.shared.b32 [{a}], {v};", v = in(reg32) v.to_bits() as u32, a = in(reg32) a, options(nostack))
            };
        } else {
            // SAFETY: as above.
            unsafe {
                core::arch::asm!("st.shared.b64 [{a}], {v};", v = in(reg64) v.to_bits(), a = in(reg32) a, options(nostack))
            };
        }
    }

    /// Elements `i..i + 4`, unchecked (`ld.shared.v4.b32`).
    ///
    /// # Safety
    /// `T` is 4 bytes, `i + 4 <= self.len()`, element `i` 16-byte aligned.
    #[inline(always)]
    pub unsafe fn get4_unchecked(&self, i: usize) -> [T; 4] {
        let a = self.shared_addr(i);
        let (x, y, z, w): (u32, u32, u32, u32);
        // SAFETY: 16 aligned bytes inside this array (caller).
        unsafe {
            core::arch::asm!(
                "ld.shared.v4.b32 {{{x}, {y}, {z}, {w}}}, [{a}];",
                x = out(reg32) x, y = out(reg32) y, z = out(reg32) z, w = out(reg32) w,
                a = in(reg32) a, options(pure, readonly, nostack)
            )
        };
        [x, y, z, w].map(|b| T::from_bits(b as u64))
    }

    /// Stores elements `i..i + 4`, unchecked (`st.shared.v4.b32`).
    ///
    /// # Safety
    /// As [`SharedArray::get4_unchecked`].
    #[inline(always)]
    pub unsafe fn set4_unchecked(&self, i: usize, v: [T; 4]) {
        let a = self.shared_addr(i);
        let [x, y, z, w] = v.map(|e| e.to_bits() as u32);
        // SAFETY: 16 aligned bytes inside this array (caller).
        unsafe {
            core::arch::asm!(
                "st.shared.v4.b32 [{a}], {{{x}, {y}, {z}, {w}}};",
                x = in(reg32) x, y = in(reg32) y, z = in(reg32) z, w = in(reg32) w,
                a = in(reg32) a, options(nostack)
            )
        };
    }
}

#[cfg(not(target_arch = "nvptx64"))]
impl<T: Plain> SharedArray<T> {
    #[doc(hidden)]
    pub fn __static(id: u64, len: usize) -> Self {
        let words = crate::emu::static_shared(id, len * T::BYTES);
        SharedArray {
            words: words.as_ptr(),
            first: 0,
            len,
            _t: PhantomData,
        }
    }

    /// The words pointer and element 0's position (for the emulation of
    /// warp-wide shared loads).
    pub(crate) fn raw_parts(&self) -> (*const core::sync::atomic::AtomicU64, usize) {
        (self.words, self.first)
    }

    /// A view from its raw parts.
    ///
    /// # Safety
    /// From [`SharedArray::raw_parts`] of a view of the running block, and
    /// `first + len` within that view's allocation.
    pub(crate) unsafe fn from_raw_parts(
        words: *const core::sync::atomic::AtomicU64,
        first: usize,
        len: usize,
    ) -> Self {
        SharedArray {
            words,
            first,
            len,
            _t: PhantomData,
        }
    }

    /// The word holding element `i`, and the element's bit shift in it.
    #[inline(always)]
    pub(crate) fn word(&self, i: usize) -> (&core::sync::atomic::AtomicU64, u32) {
        let p = self.first + i;
        let (w, shift) = if T::BYTES == 4 {
            (p / 2, (p % 2) as u32 * 32)
        } else {
            (p, 0)
        };
        // SAFETY: callers pass i < len; the view lies inside its block's
        // words (built by `__static`, `dynamic_at` or `slice`), which live
        // as long as the emulated launch.
        (unsafe { &*self.words.add(w) }, shift)
    }

    /// Element `i`, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn get_unchecked(&self, i: usize) -> T {
        let (w, shift) = self.word(i);
        T::from_bits(w.load(core::sync::atomic::Ordering::Relaxed) >> shift)
    }

    /// Stores `v` at element `i`, unchecked.
    ///
    /// # Safety
    /// `i < self.len()`.
    #[inline(always)]
    pub unsafe fn set_unchecked(&self, i: usize, v: T) {
        use core::sync::atomic::Ordering::Relaxed;
        let (w, shift) = self.word(i);
        if T::BYTES == 8 {
            w.store(v.to_bits(), Relaxed);
        } else {
            let mask = 0xffff_ffffu64 << shift;
            let bits = v.to_bits() << shift;
            let _ = w.fetch_update(Relaxed, Relaxed, |old| Some((old & !mask) | bits));
        }
    }

    /// Elements `i..i + 4`, unchecked.
    ///
    /// # Safety
    /// `T` is 4 bytes, `i + 4 <= self.len()`, element `i` 16-byte aligned.
    #[inline(always)]
    pub unsafe fn get4_unchecked(&self, i: usize) -> [T; 4] {
        // SAFETY: the caller's contract covers each element.
        core::array::from_fn(|k| unsafe { self.get_unchecked(i + k) })
    }

    /// Stores elements `i..i + 4`, unchecked.
    ///
    /// # Safety
    /// As [`SharedArray::get4_unchecked`].
    #[inline(always)]
    pub unsafe fn set4_unchecked(&self, i: usize, v: [T; 4]) {
        for (k, e) in v.into_iter().enumerate() {
            // SAFETY: the caller's contract covers each element.
            unsafe { self.set_unchecked(i + k, e) };
        }
    }
}

#[cfg(target_arch = "nvptx64")]
core::arch::global_asm!(".extern .shared .align 16 .b8 __ka_dynamic_smem[];");

/// Bytes of dynamic shared memory the launch gave each block
/// (`%dynamic_smem_size`).
#[inline(always)]
pub fn dynamic_bytes() -> usize {
    #[cfg(target_arch = "nvptx64")]
    {
        let n: u32;
        // SAFETY: reads a special register; no memory, no effect.
        unsafe {
            core::arch::asm!("mov.u32 {n}, %dynamic_smem_size;", n = out(reg32) n, options(pure, nomem, nostack))
        };
        n as usize
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        crate::emu::dynamic_shared().1
    }
}

/// The launch's dynamic shared memory as `T`s: [`dynamic_bytes`] /
/// `size_of::<T>()` elements (the area starts 16-byte aligned).
#[inline(always)]
pub fn dynamic<T: Plain>() -> SharedArray<T> {
    dynamic_at::<T>(0)
}

/// The launch's dynamic shared memory from `byte_offset` on, as `T`s:
/// (bytes - offset) / `size_of::<T>()` elements. `byte_offset` is a
/// multiple of `size_of::<T>()` and at most the area's size; otherwise a
/// trap / [`crate::thread::FaultKind::SharedMisuse`].
#[inline(always)]
pub fn dynamic_at<T: Plain>(byte_offset: usize) -> SharedArray<T> {
    let bytes = dynamic_bytes();
    if byte_offset > bytes || !byte_offset.is_multiple_of(T::BYTES) {
        misuse("a dynamic shared view at an offset past the area or not aligned for its type");
    }
    let len = (bytes - byte_offset) / T::BYTES;
    #[cfg(target_arch = "nvptx64")]
    {
        let a: u32;
        // SAFETY: takes the address of the dynamic area; no memory access.
        unsafe {
            core::arch::asm!("mov.u32 {a}, __ka_dynamic_smem;", a = out(reg32) a, options(pure, nomem, nostack))
        };
        // SAFETY: the launch's dynamic area is `bytes` long, 16-byte aligned.
        unsafe { SharedArray::__from_shared_addr(a + byte_offset as u32, len) }
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let (words, _) = crate::emu::dynamic_shared();
        SharedArray {
            words: words.as_ptr(),
            first: byte_offset / T::BYTES,
            len,
            _t: PhantomData,
        }
    }
}

/// A 64-bit FNV-1a hash of a `shared_array!` use's place: the number in
/// its `.shared` symbol's name.
#[doc(hidden)]
pub const fn __site_id(module: &str, file: &str, line: u32, column: u32, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let parts: [&[u8]; 3] = [module.as_bytes(), file.as_bytes(), name.as_bytes()];
    let mut p = 0;
    while p < parts.len() {
        let s = parts[p];
        let mut i = 0;
        while i < s.len() {
            h = (h ^ s[i] as u64).wrapping_mul(0x0100_0000_01b3);
            i += 1;
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
        p += 1;
    }
    let nums = [line, column];
    let mut k = 0;
    while k < 2 {
        let mut b = 0;
        while b < 4 {
            h = (h ^ ((nums[k] >> (8 * b)) & 0xff) as u64).wrapping_mul(0x0100_0000_01b3);
            b += 1;
        }
        k += 1;
    }
    h
}

/// A static shared-memory array of `$n` elements of `$t` (a [`Plain`]
/// type) as a [`SharedArray`]. The type and the length are resolved in the
/// enclosing *module* (a literal, a `const` item of the module, an
/// expression of those): not a generic parameter, nor a `const` declared
/// inside the function. Each use is a `.shared` array of its own, named
/// `__ka_smem_<hash of its module, file, line and column>`; inside a
/// macro of your own, where several uses share one line and column, name
/// each: `shared_array!(f32, 256; tile_a)`.
///
/// One symbol per use in the source, as CUDA's `__shared__` in a device
/// function: a helper function holding a `shared_array!` that a kernel
/// calls twice uses the same memory both times.
///
/// On the CPU emulation each block gets its own, poisoned (every byte
/// `0xff`) at the block's start. On the GPU the kernel crate enables
/// `#![feature(asm_experimental_arch)]` (see [`crate::shared`]).
///
/// ```
/// use kernel_abi::{shared_array, thread};
/// thread::emulate(1, 32, 1, &|| {
///     let s = shared_array!(f32, 32);
///     s.set(thread::thread_idx() as usize, 1.5);
///     thread::sync_threads();
///     assert_eq!(s.get(31 - thread::thread_idx() as usize), 1.5);
/// })
/// .unwrap();
/// ```
#[macro_export]
macro_rules! shared_array {
    ($t:ty, $n:expr) => {
        $crate::__shared_array_impl!($t, $n, "")
    };
    ($t:ty, $n:expr; $name:ident) => {
        $crate::__shared_array_impl!($t, $n, stringify!($name))
    };
}

#[cfg(target_arch = "nvptx64")]
#[doc(hidden)]
#[macro_export]
macro_rules! __shared_array_impl {
    ($t:ty, $n:expr, $name:expr) => {{
        // An item scope for `global_asm!`; the type and the length are
        // resolved in the enclosing module.
        #[allow(unused_imports, non_snake_case)]
        mod __ka_shared {
            use super::*;
            pub const LEN: usize = $n;
            pub const ID: u64 =
                $crate::shared::__site_id(module_path!(), file!(), line!(), column!(), $name);
            ::core::arch::global_asm!(
                ".shared .align 16 .b8 __ka_smem_{id}[{bytes}];",
                id = const ID,
                bytes = const {
                    let b = LEN * ::core::mem::size_of::<$t>();
                    if b == 0 { 16 } else { b }
                },
            );
        }
        let addr: u32;
        // SAFETY: takes the array's shared-window address; no memory access.
        unsafe {
            ::core::arch::asm!(
                "mov.u32 {a}, __ka_smem_{id};",
                a = out(reg32) addr,
                id = const __ka_shared::ID,
                options(pure, nomem, nostack),
            )
        };
        // SAFETY: the symbol is a 16-byte aligned `.shared` array of `LEN` `$t`s.
        unsafe { $crate::shared::SharedArray::<$t>::__from_shared_addr(addr, __ka_shared::LEN) }
    }};
}

#[cfg(not(target_arch = "nvptx64"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __shared_array_impl {
    ($t:ty, $n:expr, $name:expr) => {{
        // As on the GPU: the type and the length resolved in the enclosing
        // module, not the function.
        #[allow(unused_imports, non_snake_case)]
        mod __ka_shared {
            use super::*;
            pub const LEN: usize = $n;
            pub const ID: u64 =
                $crate::shared::__site_id(module_path!(), file!(), line!(), column!(), $name);
        }
        $crate::shared::SharedArray::<$t>::__static(__ka_shared::ID, __ka_shared::LEN)
    }};
}
