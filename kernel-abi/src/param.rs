//! Kernel parameters: what may cross from the host to a kernel, by value.

use core::ffi::c_void;
use core::marker::PhantomData;

/// A type that may be a kernel parameter: passed by value, bit for bit, with
/// the same layout on the host and the device.
///
/// # Safety
/// `Copy`, `#[repr(C)]` (or a primitive), no padding the kernel reads, no
/// references, no host pointers: every bit pattern the host passes must be
/// meaningful on the device. Raw device pointers only inside [`Slice`] /
/// [`SliceMut`], which the host library builds from checked views.
pub unsafe trait Param: Copy + 'static {}

macro_rules! scalar_params {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive of the same size and layout on both sides.
        unsafe impl Param for $t {}
    )* };
}
scalar_params!(u8, i8, u16, i16, u32, i32, u64, i64, usize, isize, f32, f64);

/// A device range a kernel reads: pointer and length, `#[repr(C)]`.
/// Built by the host library from a view borrowed from a job's bundle.
#[repr(C)]
pub struct Slice<T> {
    ptr: *const T,
    len: usize,
    _t: PhantomData<*const T>,
}

/// A device range a kernel writes (and may read): pointer and length.
#[repr(C)]
pub struct SliceMut<T> {
    ptr: *mut T,
    len: usize,
    _t: PhantomData<*mut T>,
}

impl<T> Clone for Slice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Slice<T> {}
impl<T> Clone for SliceMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SliceMut<T> {}

// SAFETY: a range of `T`s shared by the threads of a launch, as `&[T]`:
// reads are safe (in bounds, by the `from_raw_parts` contract, nobody
// writes), writes are `unsafe` methods whose callers exclude races, and
// the atomic methods are atomic.
unsafe impl<T: Send + Sync> Send for Slice<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Slice<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Send for SliceMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for SliceMut<T> {}

// SAFETY: a device pointer and a length, `#[repr(C)]`; built only through
// `from_raw_parts`, whose caller vouches for the range.
unsafe impl<T: 'static> Param for Slice<T> {}
// SAFETY: as for Slice.
unsafe impl<T: 'static> Param for SliceMut<T> {}

impl<T> Slice<T> {
    /// A range of `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` is device memory of initialised `T` that stays valid,
    /// and unwritten by anyone else, while a kernel given this slice runs.
    pub unsafe fn from_raw_parts(ptr: *const T, len: usize) -> Self {
        Slice {
            ptr,
            len,
            _t: PhantomData,
        }
    }
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
    /// The device address of the first element.
    #[inline(always)]
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }
    /// Element `i`.
    ///
    /// # Safety
    /// `i < len`.
    #[inline(always)]
    pub unsafe fn read(&self, i: usize) -> T
    where
        T: Copy,
    {
        check_index(i, self.len);
        // SAFETY: the caller's contract and `from_raw_parts`'.
        unsafe { self.ptr.add(i).read() }
    }
}

/// An index past a slice's end: a fault on the CPU emulation always
/// (`FaultKind::SliceOutOfBounds`: it breaks the emulated context,
/// `Error::ContextBroken`, as a GPU fault would), so a kernel's
/// out-of-bounds access shows in its CPU tests; on the GPU only in debug
/// builds (the caller's contract, unchecked for speed).
#[inline(always)]
#[track_caller]
fn check_index(i: usize, len: usize) {
    #[cfg(not(target_arch = "nvptx64"))]
    if i >= len {
        crate::emu::raise(crate::thread::FaultKind::SliceOutOfBounds { index: i, len });
    }
    #[cfg(target_arch = "nvptx64")]
    debug_assert!(i < len);
}

impl<T> SliceMut<T> {
    /// A range of `len` elements at device address `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` is device memory of initialised `T` that stays valid,
    /// and untouched by anyone else, while a kernel given this slice runs.
    pub unsafe fn from_raw_parts(ptr: *mut T, len: usize) -> Self {
        SliceMut {
            ptr,
            len,
            _t: PhantomData,
        }
    }
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
    /// The device address of the first element.
    #[inline(always)]
    pub fn as_mut_ptr(&self) -> *mut T {
        self.ptr
    }
    /// Element `i`.
    ///
    /// # Safety
    /// `i < len`, and no other thread writes element `i` meanwhile.
    #[inline(always)]
    pub unsafe fn read(&self, i: usize) -> T
    where
        T: Copy,
    {
        check_index(i, self.len);
        // SAFETY: the caller's contract and `from_raw_parts`'.
        unsafe { self.ptr.add(i).read() }
    }
    /// Writes element `i`.
    ///
    /// # Safety
    /// `i < len`, and no other thread reads or writes element `i` meanwhile.
    #[inline(always)]
    pub unsafe fn write(&self, i: usize, v: T) {
        check_index(i, self.len);
        // SAFETY: the caller's contract and `from_raw_parts`'.
        unsafe { self.ptr.add(i).write(v) }
    }
}

/// A kernel's parameter list: a tuple of [`Param`]s, laid out for
/// `cuLaunchKernel` (one pointer to each parameter, in order).
///
/// # Safety
/// `pointers` returns one pointer per tuple field, in order, each to that
/// field inside `self`.
pub unsafe trait Params: Copy + 'static {
    /// Number of parameters.
    const COUNT: usize;
    /// Each parameter's size in bytes, in order (what the PTX entry's
    /// parameter list must match).
    const SIZES: &'static [usize];
    /// Calls `f` with a pointer to each parameter, in order.
    fn pointers(&mut self, f: &mut dyn FnMut(*mut c_void));
}

macro_rules! tuple_params {
    ($n:expr; $($t:ident $i:tt),*) => {
        // SAFETY: one pointer per field, in order, into self.
        unsafe impl<$($t: Param),*> Params for ($($t,)*) {
            const COUNT: usize = $n;
            const SIZES: &'static [usize] = &[$(core::mem::size_of::<$t>()),*];
            #[allow(unused_variables)]
            fn pointers(&mut self, f: &mut dyn FnMut(*mut c_void)) {
                $( f((&mut self.$i as *mut $t).cast()); )*
            }
        }
    };
}
tuple_params!(0;);
tuple_params!(1; A 0);
tuple_params!(2; A 0, B 1);
tuple_params!(3; A 0, B 1, C 2);
tuple_params!(4; A 0, B 1, C 2, D 3);
tuple_params!(5; A 0, B 1, C 2, D 3, E 4);
tuple_params!(6; A 0, B 1, C 2, D 3, E 4, F 5);
tuple_params!(7; A 0, B 1, C 2, D 3, E 4, F 5, G 6);
tuple_params!(8; A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7);
