//! The host arrays of a run: one pinned array ([`PinnedArray`]), a tuple of
//! them or [`KeepAlive`] ([`Arrays`]), and their type-erased form, which the
//! pipeline copies as bytes.

use crate::runtime::memory::{HostSlice, HostSliceMut, PinnedBuffer, PinnedHost, Registered};
use crate::runtime::pool::PooledBuffer;
use bytemuck::Pod;
use std::any::TypeId;

/// One host array of a pipeline run: pinned memory of one element type
/// ([`PinnedBuffer`], [`PooledBuffer`], [`Registered`]).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedPool, Pipeline, Plan, Registered, Timeline};
/// let device = Device::cpu();
/// // A registered `Vec` in, a pool's buffer out: both `PinnedArray`s of `u32`.
/// let input = Registered::new(&device, (0..1000u32).collect())?;
/// let output = PinnedPool::new(&device).alloc::<u32>(1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// let plan = Plan::uniform(4, 2);
/// let job = pipeline.run_stage((input,), (output,), plan, Timeline::Off, |c, chunk| {
///     c.copy_d2d(chunk.input::<u32>(0)?, chunk.output::<u32>(0)?)
/// });
/// let (((input,), (output,)), _) = block_on(job)?;
/// assert_eq!(output.as_slice(), input.as_slice());
/// # Ok(()) }
/// ```
pub trait PinnedArray: Send + 'static {
    /// The element type.
    type Elem: Pod;
    /// A source view of the whole array.
    fn source(&self) -> HostSlice<'_, Self::Elem>;
    /// A destination view of the whole array.
    fn destination(&mut self) -> HostSliceMut<'_, Self::Elem>;
}

macro_rules! pinned_array {
    ($($t:ident),*) => { $(
        impl<T: Pod + Send> PinnedArray for $t<T> {
            type Elem = T;
            fn source(&self) -> HostSlice<'_, T> {
                self.host()
            }
            fn destination(&mut self) -> HostSliceMut<'_, T> {
                self.host_mut()
            }
        }
    )* };
}
pinned_array!(PinnedBuffer, PooledBuffer, Registered);

/// A host array with its type erased (the pipeline copies bytes).
#[derive(Clone, Copy)]
pub(super) struct Erased {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    pub(super) size: usize,
    pub(super) type_id: TypeId,
    pub(super) type_name: &'static str,
    pub(super) device_id: usize,
}

fn erase_source<A: PinnedArray>(a: &A) -> Erased {
    let v = a.source();
    Erased {
        ptr: v.ptr as *mut u8,
        len: v.len,
        size: std::mem::size_of::<A::Elem>(),
        type_id: TypeId::of::<A::Elem>(),
        type_name: std::any::type_name::<A::Elem>(),
        device_id: v.device_id,
    }
}

fn erase_destination<A: PinnedArray>(a: &mut A) -> Erased {
    let v = a.destination();
    Erased {
        ptr: v.ptr.cast(),
        len: v.len,
        size: std::mem::size_of::<A::Elem>(),
        type_id: TypeId::of::<A::Elem>(),
        type_name: std::any::type_name::<A::Elem>(),
        device_id: v.device_id,
    }
}

/// The host arrays of a run: a tuple of one to four [`PinnedArray`]s,
/// whose element types may differ.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedBuffer, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[1.0f32; 1000])?;
/// let y = PinnedBuffer::from_slice(&device, &[2.0f32; 1000])?;
/// let out = PinnedBuffer::<f32>::new(&device, 1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// // Inputs `(x, y)` and outputs `(out,)`: SAXPY, out = 3 x + y, chunk by chunk.
/// let job = pipeline.run_stage((x, y), (out,), Plan::uniform(4, 2), Timeline::Off, |c, chunk| {
///     let out = chunk.output::<f32>(0)?;
///     c.copy_d2d(chunk.input::<f32>(1)?, out)?;
///     c.saxpy(3.0, chunk.input::<f32>(0)?, out)
/// });
/// let (((_x, _y), (out,)), _) = block_on(job)?;
/// assert!(out.as_slice().iter().all(|&v| v == 5.0));
/// # Ok(()) }
/// ```
///
/// Sealed: implemented by this crate only (for tuples of [`PinnedArray`]s and
/// [`KeepAlive`]), since the pipeline copies to and from the addresses these
/// report.
pub trait Arrays: Send + 'static + sealed::Sealed {
    #[doc(hidden)]
    fn sources(&self) -> Vec<ErasedArray>;
    #[doc(hidden)]
    fn destinations(&mut self) -> Vec<ErasedArray>;
}

/// A type-erased host array (opaque).
#[doc(hidden)]
#[derive(Clone, Copy)]
pub struct ErasedArray(pub(super) Erased);

mod sealed {
    /// Only this crate's [`super::Arrays`] implementations.
    pub trait Sealed {}
}

/// No host arrays, only something a run must keep alive until its work is
/// done: the outputs of a run whose stage writes device memory of its own
/// (given to the stage as views) instead of host arrays. Nothing is copied
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::interop::{device_ptr, device_slice_mut};
/// use gpufeed::{block_on, Device, DeviceBuffer, KeepAlive, Kernel, PinnedBuffer};
/// use gpufeed::{Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[2.0f32; 1000])?;
/// let out = DeviceBuffer::<f32>::new(&device, 1000)?; // the result stays on the device
/// let addr = device_ptr(&out);
/// let pipeline = Pipeline::new(&device, 2)?;
/// let plan = Plan::uniform(4, 2);
/// let job = pipeline.run_stage((x,), KeepAlive(out), plan, Timeline::Off, |c, chunk| {
///     let r = chunk.range();
///     // SAFETY: `out`, owned by the job, holds 1000 floats at `addr`; the
///     // chunks are disjoint, and nothing else uses `out` during the run.
///     let dst = unsafe { device_slice_mut::<f32>(&device, addr + 4 * r.start as u64, r.len()) };
///     c.copy_d2d(chunk.input::<f32>(0)?, dst)?;
///     c.kernel(Kernel::Scale { s: 3.0 }, dst)
/// });
/// let ((_x, KeepAlive(mut out)), _) = block_on(job)?;
/// let mut back = vec![0f32; 1000];
/// out.copy_to_host_sync(&mut back)?;
/// assert!(back.iter().all(|&v| v == 6.0));
/// # Ok(()) }
/// ```
///
/// out; the job hands `T` back with the inputs.
#[derive(Debug)]
pub struct KeepAlive<T>(pub T);

impl<T: Send + 'static> sealed::Sealed for KeepAlive<T> {}

impl<T: Send + 'static> Arrays for KeepAlive<T> {
    fn sources(&self) -> Vec<ErasedArray> {
        Vec::new()
    }
    fn destinations(&mut self) -> Vec<ErasedArray> {
        Vec::new()
    }
}

macro_rules! arrays {
    ($($t:ident $i:tt),*) => {
        impl<$($t: PinnedArray),*> sealed::Sealed for ($($t,)*) {}
        impl<$($t: PinnedArray),*> Arrays for ($($t,)*) {
            fn sources(&self) -> Vec<ErasedArray> {
                vec![$(ErasedArray(erase_source(&self.$i))),*]
            }
            fn destinations(&mut self) -> Vec<ErasedArray> {
                vec![$(ErasedArray(erase_destination(&mut self.$i))),*]
            }
        }
    };
}
arrays!(A 0);
arrays!(A 0, B 1);
arrays!(A 0, B 1, C 2);
arrays!(A 0, B 1, C 2, D 3);
