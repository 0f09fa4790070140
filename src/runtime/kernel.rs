//! Kernels: modules of PTX, typed function handles, launch configurations,
//! and the host arguments that become kernel parameters.
//!
//! A kernel is declared once in its crate with [`kernel_abi::kernels!`]; the
//! host names it by the type that declaration generates, loads its PTX into
//! a [`Module`], takes a [`Function`] handle (the entry point checked to be
//! there), and launches it in a batch with [`crate::Commands::launch`]. The
//! argument tuple is checked against the declared parameter list at compile
//! time (device views for `Slice` / `SliceMut`, scalars for scalars); what
//! types can't say (memory of another device, overlapping writable ranges)
//! is checked at run time.
//!
//! On the CPU emulation the same kernel runs from the host build of its
//! crate: every thread of the grid, blocks spread over the stream's worker
//! threads ([`kernel_abi::thread::emulate`]).

use crate::backend::LaunchLimits;
use crate::backend::{ErasedParams, RawFunction};
use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::{DeviceSlice, DeviceSliceMut};
use kernel_abi::thread::Dim3;
use kernel_abi::{Kernel as KernelDecl, Param, Params, Slice, SliceMut};
use std::marker::PhantomData;
use std::sync::Arc;

/// Threads per block for the elementwise kernels.
pub const BLOCK: u32 = 256;
/// Resident blocks per multiprocessor we aim for (2048 threads / 256).
pub const BLOCKS_PER_SM: u32 = 8;

/// A launch's shape: the grid in blocks and the block in threads, each in
/// up to three dimensions, and the dynamic shared memory each block gets
/// (`kernel_abi::shared::dynamic`).
///
/// Checked against the device's [`LaunchLimits`](crate::LaunchLimits)
/// ([`DeviceInfo::limits`](crate::DeviceInfo::limits)) when launched: a dimension of
/// zero or above its limit, more threads than a block may have, or more
/// shared memory than a block may have is `Error::InvalidLaunch`, before
/// anything is queued, on every backend.
///
/// ```
/// use gpufeed::LaunchConfig;
/// let cfg = LaunchConfig::new((64, 64, 1), (16, 16, 1)).with_shared_bytes(8 << 10);
/// assert_eq!(cfg.block.x * cfg.block.y, 256);
/// assert_eq!(LaunchConfig::linear(10, 128).grid.x, 10);
/// let device = gpufeed::Device::cpu();
/// // A grid-stride launch over 1000 items: 4 blocks of 256 threads.
/// assert_eq!(LaunchConfig::grid_stride(&device, 1000), LaunchConfig::linear(4, 256));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in the grid.
    pub grid: Dim3,
    /// Threads per block.
    pub block: Dim3,
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// One block of one thread.
    pub const SINGLE: LaunchConfig = LaunchConfig::linear(1, 1);

    /// A 1-D launch: `grid` blocks of `block` threads, no dynamic shared
    /// memory.
    pub const fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig {
            grid: Dim3::x(grid),
            block: Dim3::x(block),
            shared_bytes: 0,
        }
    }

    /// A launch of `grid` blocks of `block` threads (a `u32` is a 1-D
    /// extent, `(x, y, z)` a 3-D one), no dynamic shared memory.
    pub fn new(grid: impl Into<Dim3>, block: impl Into<Dim3>) -> LaunchConfig {
        LaunchConfig {
            grid: grid.into(),
            block: block.into(),
            shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory per block.
    pub const fn with_shared_bytes(self, bytes: u32) -> LaunchConfig {
        LaunchConfig {
            shared_bytes: bytes,
            ..self
        }
    }

    /// Why `device` can't run this launch of kernel `name`, if it can't.
    pub(crate) fn check(&self, name: &'static str, limits: &LaunchLimits) -> Result<()> {
        let refuse = |reason: String| {
            Err(Error::InvalidLaunch {
                kernel: name,
                reason,
            })
        };
        let (g, b) = (self.grid, self.block);
        for (axis, (got, max)) in ["x", "y", "z"]
            .iter()
            .zip([g.x, g.y, g.z].into_iter().zip(limits.max_grid_dims))
        {
            if got == 0 || got > max {
                return refuse(format!("grid {axis} of {got} blocks (1 to {max})"));
            }
        }
        for (axis, (got, max)) in ["x", "y", "z"]
            .iter()
            .zip([b.x, b.y, b.z].into_iter().zip(limits.max_block_dims))
        {
            if got == 0 || got > max {
                return refuse(format!("block {axis} of {got} threads (1 to {max})"));
            }
        }
        if b.volume() > u64::from(limits.max_threads_per_block) {
            return refuse(format!(
                "{} threads in a block (at most {})",
                b.volume(),
                limits.max_threads_per_block
            ));
        }
        if self.shared_bytes > limits.max_shared_bytes_per_block {
            return refuse(format!(
                "{} bytes of dynamic shared memory (a block may have {})",
                self.shared_bytes, limits.max_shared_bytes_per_block
            ));
        }
        Ok(())
    }

    /// The most blocks a launch may have (CUDA's grid.x limit, 2^31 - 1);
    /// more is refused with `InvalidArgument`, on every backend.
    pub const MAX_GRID: u32 = i32::MAX as u32;

    /// The most threads a block may have (CUDA's 1024); more is refused.
    pub const MAX_BLOCK: u32 = 1024;

    /// For a grid-stride kernel over `items` work items: blocks of 256
    /// threads, as many as the items need but no more than fill the device
    /// (8 blocks per multiprocessor; on the CPU emulation, per worker
    /// thread). At least one block.
    pub fn grid_stride(device: &Device, items: usize) -> LaunchConfig {
        let needed = (items as u64).div_ceil(BLOCK as u64).max(1);
        let full = (device.info().compute_units.max(1) as u64) * BLOCKS_PER_SM as u64;
        LaunchConfig::linear(needed.min(full) as u32, BLOCK)
    }
}

/// A loaded module of PTX: the kernels of one kernel crate.
///
/// ```rust
/// use gpufeed::kernel_abi::{kernels, thread, SliceMut};
/// use gpufeed::{block_on, Device, DeviceBuffer, LaunchConfig, Module, Stream};
/// kernels! {
///     /// `x[i] += 1` (declared in a kernel crate, built to PTX by its build script).
///     pub unsafe fn add_one(x: SliceMut<u32>) {
///         let mut i = thread::global_id();
///         while i < x.len() {
///             // SAFETY: i < len; one thread per index (grid stride).
///             unsafe { x.write(i, x.read(i) + 1) };
///             i += thread::grid_stride();
///         }
///     }
/// }
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::cpu();
/// # let ptx = "";
/// // SAFETY: `ptx` is what kernel-builder built from the crate declaring
/// // `add_one` (the CPU emulation loads nothing: it runs the host build).
/// let module = unsafe { Module::from_ptx(&device, ptx)? };
/// let f = module.function::<add_one>()?; // not `let add_one`: that names the type
/// let mut x = DeviceBuffer::<u32>::new(&device, 1000)?;
/// x.copy_from_host_sync(&vec![41; 1000])?;
/// let (mut x, ()) = block_on(Stream::new(&device)?.run(x, |c, x| {
///     c.launch(&f, LaunchConfig::grid_stride(c.device(), 1000), (x.view_mut(),))
/// }))?;
/// let mut out = vec![0u32; 1000];
/// x.copy_to_host_sync(&mut out)?;
/// assert!(out.iter().all(|&v| v == 42));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Module {
    raw: Arc<crate::backend::RawModule>,
    device: Device,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module").finish_non_exhaustive()
    }
}

impl Module {
    /// Loads `ptx` (the text a kernel crate's build produced, e.g. embedded
    /// with `include_str!`) on `device`. On the CPU emulation nothing is
    /// loaded: kernels run from their host build.
    ///
    /// # Safety
    /// A kernel is found in the module by its name alone, then launched
    /// with the parameters its declaration ([`kernel_abi::kernels!`]) lists:
    /// every kernel taken from this module with [`Module::function`] must be
    /// declared by the kernel crate `ptx` was built from (by
    /// `kernel-builder`, from the same source). An entry of the same name
    /// from other PTX would get parameters it does not expect (a
    /// `SliceMut<u8>` where it writes `f32`s: out of bounds). Where the
    /// PTX text lists the entry's parameters, `function` refuses an entry
    /// whose parameter sizes differ from the declaration's, but element
    /// types have no size there (a `SliceMut<u8>` and a `SliceMut<f32>` are
    /// both 16 bytes).
    ///
    /// # Errors
    /// The driver's error when the PTX does not load (`cuModuleLoadData`:
    /// a target newer than the GPU, say); `InvalidArgument` for text with a
    /// NUL byte.
    pub unsafe fn from_ptx(device: &Device, ptx: &str) -> Result<Module> {
        Ok(Module {
            raw: Arc::new(device.backend.load_module(ptx)?),
            device: device.clone(),
        })
    }

    /// The handle of kernel `K` in this module.
    ///
    /// # Errors
    /// The driver's error when the module has no entry point `K::NAME`
    /// (a module of another kernel crate, or a stale build);
    /// `InvalidArgument` when the entry's parameter sizes, as the PTX text
    /// lists them, differ from the declaration's.
    pub fn function<K: KernelDecl>(&self) -> Result<Function<K>> {
        let sizes = <K::Params as Params>::SIZES;
        Ok(Function {
            raw: Arc::new(
                self.device
                    .backend
                    .get_function(&self.raw, K::NAME, sizes)?,
            ),
            device_id: self.device.id(),
            _k: PhantomData,
        })
    }
}

/// A kernel of a loaded [`Module`], typed by its declaration.
///
/// ```rust
/// use gpufeed::kernel_abi::{kernels, thread, SliceMut};
/// use gpufeed::{block_on, Device, DeviceBuffer, Function, LaunchConfig, Module, Stream};
/// kernels! {
///     /// `x[i] = i`.
///     pub unsafe fn iota(x: SliceMut<u32>) {
///         let mut i = thread::global_id();
///         while i < x.len() {
///             // SAFETY: i < len; one thread per index (grid stride).
///             unsafe { x.write(i, i as u32) };
///             i += thread::grid_stride();
///         }
///     }
/// }
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::cpu();
/// # let ptx = "";
/// // SAFETY: `ptx` was built from the crate declaring `iota`.
/// let f: Function<iota> = unsafe { Module::from_ptx(&device, ptx)? }.function()?;
/// assert_eq!(format!("{f:?}"), r#"Function { name: "iota" }"#);
/// let x = DeviceBuffer::<u32>::new(&device, 5)?;
/// let g = f.clone(); // cheap; a batch may also take it by `move`
/// let (mut x, ()) = block_on(Stream::new(&device)?.run(x, move |c, x| {
///     c.launch(&g, LaunchConfig::grid_stride(c.device(), 5), (x.view_mut(),))
/// }))?;
/// let mut out = [9u32; 5];
/// x.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [0, 1, 2, 3, 4]);
/// # Ok(()) }
/// ```
pub struct Function<K> {
    pub(crate) raw: Arc<RawFunction>,
    pub(crate) device_id: usize,
    _k: PhantomData<fn() -> K>,
}

impl<K> Clone for Function<K> {
    fn clone(&self) -> Self {
        Function {
            raw: self.raw.clone(),
            device_id: self.device_id,
            _k: PhantomData,
        }
    }
}

impl<K: KernelDecl> std::fmt::Debug for Function<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function").field("name", &K::NAME).finish()
    }
}

/// A device range a launch reads or writes, for the overlap check.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Touch {
    pub addr: u64,
    pub bytes: u64,
    pub writes: bool,
}

mod sealed {
    pub trait Sealed {}
}

/// A host value that becomes one kernel parameter. `'a` is the batch's
///
/// ```rust
/// use gpufeed::kernel_abi::{kernels, thread, Slice, SliceMut};
/// use gpufeed::{block_on, Device, DeviceBuffer, LaunchConfig, Module, Stream};
/// kernels! {
///     /// `y = a * x + y`.
///     pub unsafe fn axpy(a: f32, x: Slice<f32>, y: SliceMut<f32>) {
///         let mut i = thread::global_id();
///         while i < x.len() && i < y.len() {
///             // SAFETY: i is in bounds; one thread per index (grid stride).
///             unsafe { y.write(i, a * x.read(i) + y.read(i)) };
///             i += thread::grid_stride();
///         }
///     }
/// }
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::cpu();
/// # let ptx = "";
/// // SAFETY: `ptx` was built from the crate declaring `axpy`.
/// let f = unsafe { Module::from_ptx(&device, ptx)? }.function::<axpy>()?;
/// let (mut x, mut y) = (DeviceBuffer::new(&device, 3)?, DeviceBuffer::new(&device, 3)?);
/// x.copy_from_host_sync(&[1.0f32, 2.0, 3.0])?;
/// y.copy_from_host_sync(&[1.0f32; 3])?;
/// // `f32` for `a`, a `DeviceSlice` for `Slice<f32>`, a `DeviceSliceMut` for `SliceMut<f32>`:
/// let ((_, mut y), ()) = block_on(Stream::new(&device)?.run((x, y), |c, (x, y)| {
///     c.launch(&f, LaunchConfig::grid_stride(c.device(), 3), (2.0f32, x.view(), y.view_mut()))
/// }))?;
/// let mut out = [0f32; 3];
/// y.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [3.0, 5.0, 7.0]);
/// # Ok(()) }
/// ```
///
/// bundle borrow: device views must come from the bundle. Implemented for
/// [`DeviceSlice`] (a `Slice<T>` parameter), [`DeviceSliceMut`]
/// (`SliceMut<T>`), the primitive scalars, and [`ByValue`] (a user's
/// `#[repr(C)]` parameter struct); sealed.
pub trait Arg<'a>: sealed::Sealed {
    /// The kernel parameter it becomes.
    type Param: Param;
    /// The parameter; `device` is the launching stream's device identity.
    #[doc(hidden)]
    fn param(self, device: usize, touches: &mut Vec<TouchOpaque>) -> Result<Self::Param>;
}

/// A device range a launch touches (opaque outside the crate).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct TouchOpaque(pub(crate) Touch);

fn check_device(view_device: usize, device: usize) -> Result<()> {
    if view_device != device {
        return Err(Error::InvalidArgument(
            "a buffer of another device (or backend) was given to this stream".into(),
        ));
    }
    Ok(())
}

impl<T> sealed::Sealed for DeviceSlice<'_, T> {}
impl<T> sealed::Sealed for DeviceSliceMut<'_, T> {}
impl<P> sealed::Sealed for ByValue<P> {}

impl<'a, T: Copy + 'static> Arg<'a> for DeviceSlice<'a, T> {
    type Param = Slice<T>;
    fn param(self, device: usize, touches: &mut Vec<TouchOpaque>) -> Result<Slice<T>> {
        check_device(self.device_id, device)?;
        touches.push(TouchOpaque(Touch {
            addr: self.addr,
            bytes: (self.len * std::mem::size_of::<T>()) as u64,
            writes: false,
        }));
        // SAFETY: a view borrowed from the job's bundle for 'a: valid device
        // memory of `len` elements until the job completes, not written by
        // anyone else (the bundle owns it; writable views are exclusive).
        Ok(unsafe { Slice::from_raw_parts(self.addr as *const T, self.len) })
    }
}

impl<'a, T: Copy + 'static> Arg<'a> for DeviceSliceMut<'a, T> {
    type Param = SliceMut<T>;
    fn param(self, device: usize, touches: &mut Vec<TouchOpaque>) -> Result<SliceMut<T>> {
        check_device(self.device_id, device)?;
        touches.push(TouchOpaque(Touch {
            addr: self.addr,
            bytes: (self.len * std::mem::size_of::<T>()) as u64,
            writes: true,
        }));
        // SAFETY: an exclusive view borrowed from the job's bundle for 'a;
        // the overlap check keeps other parameters of the launch off it.
        Ok(unsafe { SliceMut::from_raw_parts(self.addr as *mut T, self.len) })
    }
}

macro_rules! scalar_args {
    ($($t:ty),*) => { $(
        impl sealed::Sealed for $t {}
        impl<'a> Arg<'a> for $t {
            type Param = $t;
            fn param(self, _: usize, _: &mut Vec<TouchOpaque>) -> Result<$t> {
                Ok(self)
            }
        }
    )* };
}
scalar_args!(u8, i8, u16, i16, u32, i32, u64, i64, usize, isize, f32, f64);

/// A user's `#[repr(C)]` plain-data parameter (it implements
/// [`kernel_abi::Param`]), passed by value.
///
/// ```rust
/// use gpufeed::kernel_abi::{kernels, thread, Param, SliceMut};
/// use gpufeed::{block_on, ByValue, Device, DeviceBuffer, LaunchConfig, Module, Stream};
/// /// `x -> a x + b`, one kernel parameter.
/// #[repr(C)]
/// #[derive(Clone, Copy)]
/// pub struct Affine {
///     pub a: f32,
///     pub b: f32,
/// }
/// // SAFETY: `#[repr(C)]`, two `f32`s: no padding, no pointers.
/// unsafe impl Param for Affine {}
/// kernels! {
///     /// `x[i] = p.a * x[i] + p.b`.
///     pub unsafe fn affine(x: SliceMut<f32>, p: Affine) {
///         let mut i = thread::global_id();
///         while i < x.len() {
///             // SAFETY: i < len; one thread per index (grid stride).
///             unsafe { x.write(i, p.a * x.read(i) + p.b) };
///             i += thread::grid_stride();
///         }
///     }
/// }
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::cpu();
/// # let ptx = "";
/// // SAFETY: `ptx` was built from the crate declaring `affine`.
/// let f = unsafe { Module::from_ptx(&device, ptx)? }.function::<affine>()?;
/// let mut x = DeviceBuffer::<f32>::new(&device, 4)?;
/// x.copy_from_host_sync(&[1.0; 4])?;
/// let p = ByValue(Affine { a: 2.0, b: 0.5 });
/// let (mut x, ()) = block_on(Stream::new(&device)?.run(x, |c, x| {
///     c.launch(&f, LaunchConfig::grid_stride(c.device(), 4), (x.view_mut(), p))
/// }))?;
/// let mut out = [0f32; 4];
/// x.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [2.5; 4]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ByValue<P>(pub P);

impl<'a, P: Param> Arg<'a> for ByValue<P> {
    type Param = P;
    fn param(self, _: usize, _: &mut Vec<TouchOpaque>) -> Result<P> {
        Ok(self.0)
    }
}

/// A tuple of [`Arg`]s: the host side of a kernel's parameter list.
///
/// ```rust
/// use gpufeed::kernel_abi::{kernels, thread, Slice, SliceMut};
/// use gpufeed::{block_on, Device, DeviceBuffer, Error, LaunchConfig, Module, Stream};
/// kernels! {
///     /// `dst[i] = src[i]`.
///     pub unsafe fn copy(src: Slice<u8>, dst: SliceMut<u8>) {
///         let mut i = thread::global_id();
///         while i < src.len() && i < dst.len() {
///             // SAFETY: i is in bounds; one thread per index (grid stride).
///             unsafe { dst.write(i, src.read(i)) };
///             i += thread::grid_stride();
///         }
///     }
/// }
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::cpu();
/// # let ptx = "";
/// // SAFETY: `ptx` was built from the crate declaring `copy`.
/// let f = unsafe { Module::from_ptx(&device, ptx)? }.function::<copy>()?;
/// let buf = DeviceBuffer::<u8>::new(&device, 3)?;
/// // The tuple's types are checked against `(Slice<u8>, SliceMut<u8>)` at compile
/// // time; that the written range overlaps the read one, at run time.
/// let err = block_on(Stream::new(&device)?.run(buf, |c, b| {
///     let v = b.view_mut();
///     c.launch(&f, LaunchConfig::SINGLE, (v.range(0..2)?.as_view(), v.range(1..3)?))
/// }))
/// .unwrap_err();
/// assert!(matches!(err.error, Error::Overlap { what: "copy" }));
/// # Ok(()) }
/// ```
pub trait Args<'a> {
    /// The kernel's parameter tuple.
    type Params: Params;
    /// The parameters, with every device range they touch.
    #[doc(hidden)]
    fn params(self, device: usize, touches: &mut Vec<TouchOpaque>) -> Result<Self::Params>;
}

macro_rules! tuple_args {
    ($($t:ident $v:ident),*) => {
        impl<'a, $($t: Arg<'a>),*> Args<'a> for ($($t,)*) {
            type Params = ($($t::Param,)*);
            #[allow(unused_variables)]
            fn params(self, device: usize, touches: &mut Vec<TouchOpaque>) -> Result<Self::Params> {
                let ($($v,)*) = self;
                Ok(($($v.param(device, touches)?,)*))
            }
        }
    };
}
tuple_args!();
tuple_args!(A a);
tuple_args!(A a, B b);
tuple_args!(A a, B b, C c);
tuple_args!(A a, B b, C c, D d);
tuple_args!(A a, B b, C c, D d, E e);
tuple_args!(A a, B b, C c, D d, E e, F f);
tuple_args!(A a, B b, C c, D d, E e, F f, G g);
tuple_args!(A a, B b, C c, D d, E e, F f, G g, H h);

/// Refuses a launch where a writable range overlaps another range, unless
/// `same_range_ok` and the two are the same range (an elementwise kernel
/// that reads and writes one element per thread, like `saxpy(x, x)`).
pub(crate) fn check_overlaps(
    name: &'static str,
    touches: &[TouchOpaque],
    same_range_ok: bool,
) -> Result<()> {
    for (i, a) in touches.iter().enumerate() {
        for b in &touches[i + 1..] {
            let (a, b) = (a.0, b.0);
            if !(a.writes || b.writes) || a.bytes == 0 || b.bytes == 0 {
                continue;
            }
            let disjoint = a.addr + a.bytes <= b.addr || b.addr + b.bytes <= a.addr;
            let same = a.addr == b.addr && a.bytes == b.bytes;
            if !(disjoint || (same && same_range_ok)) {
                return Err(Error::Overlap { what: name });
            }
        }
    }
    Ok(())
}

/// The parameters of kernel `K`, with the knowledge of how to run it.
pub(crate) struct TypedParams<K: KernelDecl>(pub K::Params);

// SAFETY: the parameters are device ranges (raw pointers) and scalars; the
// launch contract keeps the ranges valid until the work completes, whatever
// thread runs it.
unsafe impl<K: KernelDecl> Send for TypedParams<K> {}

/// Shares the parameters with the emulation's worker threads.
struct SharedParams<P>(P);
// SAFETY: as for TypedParams; the emulated threads only copy the values.
unsafe impl<P> Sync for SharedParams<P> {}

impl<K: KernelDecl> ErasedParams for TypedParams<K> {
    fn pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        let mut v = Vec::with_capacity(<K::Params as Params>::COUNT);
        self.0.pointers(&mut |p| v.push(p));
        v
    }

    fn emulate(
        &self,
        launch: &kernel_abi::thread::Launch,
        workers: usize,
    ) -> std::result::Result<(), kernel_abi::thread::EmulationError> {
        let params = SharedParams(self.0);
        let params = &params;
        kernel_abi::thread::emulate_launch(K::NAME, launch, workers, &move || {
            // SAFETY: the kernel's contract holds: its slices come from views
            // checked by the host layer, valid until the launch completes.
            unsafe { K::thread(params.0) }
        })
    }
}

/// A kernel to apply in a pipeline or a job, without addresses: one of the
/// in-tree elementwise kernels of `gpu-kernels`, on `f32`.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Kernel, Stream};
/// let device = Device::cpu();
/// let mut x = DeviceBuffer::<f32>::new(&device, 3)?;
/// x.copy_from_host_sync(&[1.0, 2.0, 3.0])?;
/// let k = Kernel::Scale { s: 2.0 };
/// let (mut x, ()) = block_on(Stream::new(&device)?.launch(k, x))?;
/// let mut out = [0f32; 3];
/// x.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [k.reference(1.0), k.reference(2.0), k.reference(3.0)]);
/// assert_eq!(Kernel::Intensity { k: 64 }.label(), "intensity(k=64)");
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(tag = "kernel", rename_all = "lowercase"))]
pub enum Kernel {
    /// `x *= s`.
    Scale {
        /// Factor.
        s: f32,
    },
    /// `k` dependent fused multiply-adds per element (2k flop per 8 bytes
    /// moved), each rounded once ([`kernel_abi::fma`]).
    Intensity {
        /// FMAs per element.
        k: u32,
    },
}

impl Kernel {
    /// The CPU reference of one element.
    pub fn reference(&self, v: f32) -> f32 {
        match *self {
            Kernel::Scale { s } => gpu_kernels::elementwise::scale(v, s),
            Kernel::Intensity { k } => gpu_kernels::elementwise::intensity(v, k),
        }
    }

    /// A short label, e.g. `scale` or `intensity(k=64)`.
    pub fn label(&self) -> String {
        match self {
            Kernel::Scale { .. } => "scale".into(),
            Kernel::Intensity { k } => format!("intensity(k={k})"),
        }
    }
}

/// The in-tree kernels of `gpu-kernels`, loaded once per device.
pub(crate) struct Builtins {
    pub scale: Function<gpu_kernels::scale>,
    pub saxpy: Function<gpu_kernels::saxpy>,
    pub intensity: Function<gpu_kernels::intensity>,
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    pub gate_wait: Function<gpu_kernels::gate_wait>,
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    pub trap: Function<gpu_kernels::trap>,
    pub gather_rows: Function<gpu_kernels::gather_rows>,
}

impl Builtins {
    /// The in-tree kernels on `device`, loaded the first time.
    pub fn of(device: &Device) -> Result<&Builtins> {
        device.builtins(Builtins::load)
    }

    fn load(device: &Device) -> Result<Builtins> {
        // SAFETY: `ptx::PTX` is gpu-kernels' PTX, built by this crate's
        // build script from the crate that declares the kernels taken below.
        let m = unsafe { Module::from_ptx(device, crate::ptx::PTX)? };
        Ok(Builtins {
            scale: m.function()?,
            saxpy: m.function()?,
            intensity: m.function()?,
            gate_wait: m.function()?,
            trap: m.function()?,
            gather_rows: m.function()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_fills_the_device_but_no_more_than_needed() {
        let device = Device::cpu();
        let units = device.info().compute_units;
        assert_eq!(
            LaunchConfig::grid_stride(&device, 1 << 30),
            LaunchConfig::linear(units * BLOCKS_PER_SM, BLOCK)
        );
        assert_eq!(
            LaunchConfig::grid_stride(&device, 5),
            LaunchConfig::linear(1, BLOCK)
        );
        assert_eq!(LaunchConfig::grid_stride(&device, 0).grid.x, 1);
    }

    #[test]
    fn writable_ranges_may_not_overlap_others() {
        let t = |addr, bytes, writes| {
            TouchOpaque(Touch {
                addr,
                bytes,
                writes,
            })
        };
        assert!(check_overlaps("k", &[t(0, 16, false), t(0, 16, false)], false).is_ok());
        assert!(check_overlaps("k", &[t(0, 16, true), t(16, 16, true)], false).is_ok());
        assert!(check_overlaps("k", &[t(0, 16, true), t(8, 16, false)], false).is_err());
        assert!(check_overlaps("k", &[t(0, 16, true), t(0, 16, false)], false).is_err());
        assert!(check_overlaps("k", &[t(0, 16, true), t(0, 16, false)], true).is_ok());
        assert!(check_overlaps("k", &[t(0, 16, true), t(4, 16, false)], true).is_err());
        assert!(check_overlaps("k", &[t(0, 0, true), t(0, 16, true)], false).is_ok());
    }
}
