//! The borrowed slices stream commands take: host ranges ([`HostSlice`],
//! [`HostSliceMut`]) and device ranges ([`DeviceSlice`], [`DeviceSliceMut`]),
//! their sub-ranges, and [`PinnedHost`], the pinned memory async copies
//! accept.

use crate::base::error::{byte_size, Error, Result};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};

/// A borrowed range of pinned host memory: a source of an async copy.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, HostSlice, PinnedBuffer, PinnedHost, Stream};
/// let device = Device::cpu();
/// let src = PinnedBuffer::from_slice(&device, &[1u8, 2, 3, 4])?;
/// let view: HostSlice<'_, u8> = src.host();
/// assert_eq!(view.range(1..3)?.len(), 2);
/// assert!(matches!(view.range(2..9), Err(gpufeed::Error::OutOfBounds { .. })));
/// // In a job: the second half of `src` into a device buffer of 2.
/// let (stream, dev) = (Stream::new(&device)?, DeviceBuffer::<u8>::new(&device, 2)?);
/// let ((_, mut dev), ()) = block_on(stream.run((src, dev), |c, (s, d)| {
///     c.copy_h2d(s.host().range(2..)?, d.view_mut())
/// }))?;
/// let mut out = [0u8; 2];
/// dev.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [3, 4]);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct HostSlice<'a, T> {
    pub(crate) ptr: *const T,
    pub(crate) len: usize,
    /// The host-memory domain
    /// ([`Device::host_domain`](crate::runtime::device::Device::host_domain)):
    /// any device of the backend that pinned it may copy from it.
    pub(crate) device_id: usize,
    pub(super) _p: PhantomData<&'a [T]>,
}

/// A mutably borrowed range of pinned host memory: a destination.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, PinnedBuffer, PinnedHost, Stream};
/// let device = Device::cpu();
/// let (mut a, mut b) = (DeviceBuffer::<u16>::new(&device, 2)?, DeviceBuffer::new(&device, 2)?);
/// a.copy_from_host_sync(&[1, 2])?;
/// b.copy_from_host_sync(&[3, 4])?;
/// // The two halves of one pinned buffer, filled from two device buffers.
/// let out = PinnedBuffer::<u16>::new(&device, 4)?;
/// let stream = Stream::new(&device)?;
/// let ((_, _, out), ()) = block_on(stream.run((a, b, out), |c, (a, b, o)| {
///     let (low, high) = o.host_mut().split_at(2)?;
///     c.copy_d2h(a.view(), low)?;
///     c.copy_d2h(b.view(), high)
/// }))?;
/// assert_eq!(out.as_slice(), &[1, 2, 3, 4]);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct HostSliceMut<'a, T> {
    pub(crate) ptr: *mut T,
    pub(crate) len: usize,
    /// As [`HostSlice`]'s.
    pub(crate) device_id: usize,
    pub(super) _p: PhantomData<&'a mut [T]>,
}

/// A range of a device buffer that commands read (a copy's source, a
/// kernel's input). Obtained from `&DeviceBuffer`, so several readers may
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Stream};
/// use std::sync::Arc;
/// let device = Device::cpu();
/// let mut src = DeviceBuffer::<i32>::new(&device, 4)?;
/// src.copy_from_host_sync(&[1, 2, 3, 4])?;
/// let src = Arc::new(src); // a read view needs only `&`: several jobs may share it
/// let (stream, dst) = (Stream::new(&device)?, DeviceBuffer::<i32>::new(&device, 2)?);
/// let ((_, mut dst), ()) = block_on(stream.run((src.clone(), dst), |c, (s, d)| {
///     c.copy_d2d(s.view().range(2..4)?, d.view_mut())
/// }))?;
/// let mut out = [0; 2];
/// dst.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [3, 4]);
/// # Ok(()) }
/// ```
///
/// share a buffer; nobody can write it meanwhile.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a, T> {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) device_id: usize,
    pub(super) _p: PhantomData<&'a T>,
}

/// A range of a device buffer that commands write (a copy's destination, a
/// kernel's output or in-place operand). Obtained from `&mut DeviceBuffer`:
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Kernel, PinnedBuffer, PinnedHost, Stream};
/// let device = Device::cpu();
/// let input = PinnedBuffer::from_slice(&device, &[1.0f32, 2.0, 3.0])?;
/// let (stream, dev) = (Stream::new(&device)?, DeviceBuffer::<f32>::new(&device, 3)?);
/// let ((_, mut dev), ()) = block_on(stream.run((input, dev), |c, (i, d)| {
///     let d = d.view_mut(); // taken once, `Copy` within the batch
///     c.copy_h2d(i.host(), d)?;
///     c.kernel(Kernel::Scale { s: 10.0 }, d)?;
///     c.saxpy(1.0, d, d) // y = x + y, with x the same range as y
/// }))?;
/// let mut out = [0f32; 3];
/// dev.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [20.0, 40.0, 60.0]);
/// # Ok(()) }
/// ```
///
/// the buffer is exclusively borrowed for the whole batch. `Copy` within the
/// batch, because the commands of one batch run in stream order; commands
/// that read and write two views check at run time that they don't
/// partially overlap ([`Error::Overlap`]).
///
/// Invariant in `'a`: a batch takes only views of exactly its own borrow of
/// the bundle. A view of a longer borrow (a leaked `&'static mut
/// DeviceBuffer`'s) would otherwise pass for one, and, being `Copy`, reach
/// two batches on two streams writing one buffer at once.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSliceMut<'a, T> {
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) device_id: usize,
    pub(super) _p: PhantomData<Invariant<'a, T>>,
}

/// `&'a mut T` made invariant in `'a` (see [`DeviceSliceMut`]).
type Invariant<'a, T> = (&'a mut T, fn(&'a ()));

impl<'a, T> From<DeviceSliceMut<'a, T>> for DeviceSlice<'a, T> {
    fn from(v: DeviceSliceMut<'a, T>) -> Self {
        DeviceSlice {
            addr: v.addr,
            len: v.len,
            device_id: v.device_id,
            _p: PhantomData,
        }
    }
}

/// A device range for the crate's own commands (the pipeline's scratch).
///
/// # Safety
/// `addr..addr + len * size_of::<T>()` is device memory of `device_id` that
/// stays allocated, and is written by nothing but the commands given this
/// view, until a point recorded after them has completed.
pub(crate) unsafe fn device_slice_mut<'a, T>(
    addr: u64,
    len: usize,
    device_id: usize,
) -> DeviceSliceMut<'a, T> {
    DeviceSliceMut {
        addr,
        len,
        device_id,
        _p: PhantomData,
    }
}

/// Whether two device ranges of `T` share any byte.
pub(crate) fn overlaps<T>(a: DeviceSlice<'_, T>, b: DeviceSlice<'_, T>) -> bool {
    let size = std::mem::size_of::<T>() as u64;
    let (a0, a1) = (a.addr, a.addr + a.len as u64 * size);
    let (b0, b1) = (b.addr, b.addr + b.len as u64 * size);
    a.len > 0 && b.len > 0 && a0 < b1 && b0 < a1
}

fn bounds(r: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds { start, end, len });
    }
    Ok((start, end))
}

impl<'a, T> HostSlice<'a, T> {
    /// A sub-range.
    pub fn range(self, r: impl RangeBounds<usize>) -> Result<Self> {
        let (s, e) = bounds(r, self.len)?;
        // SAFETY: s <= len: inside the allocation.
        let ptr = unsafe { self.ptr.add(s) };
        Ok(HostSlice {
            ptr,
            len: e - s,
            ..self
        })
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a, T> HostSliceMut<'a, T> {
    /// Two disjoint destinations: `..mid` and `mid..`.
    pub fn split_at(self, mid: usize) -> Result<(Self, Self)> {
        if mid > self.len {
            return Err(Error::OutOfBounds {
                start: mid,
                end: mid,
                len: self.len,
            });
        }
        // SAFETY: mid <= len: inside the allocation; the halves are disjoint.
        let rest = unsafe { self.ptr.add(mid) };
        Ok((
            HostSliceMut {
                ptr: self.ptr,
                len: mid,
                device_id: self.device_id,
                _p: PhantomData,
            },
            HostSliceMut {
                ptr: rest,
                len: self.len - mid,
                device_id: self.device_id,
                _p: PhantomData,
            },
        ))
    }

    /// A sub-range.
    pub fn range(self, r: impl RangeBounds<usize>) -> Result<Self> {
        let (s, e) = bounds(r, self.len)?;
        // SAFETY: s <= len: inside the allocation.
        let ptr = unsafe { self.ptr.add(s) };
        Ok(HostSliceMut {
            ptr,
            len: e - s,
            ..self
        })
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a, T> DeviceSlice<'a, T> {
    /// A sub-range.
    pub fn range(self, r: impl RangeBounds<usize>) -> Result<Self> {
        let (s, e) = bounds(r, self.len)?;
        let offset = byte_size::<T>(s)? as u64;
        Ok(DeviceSlice {
            addr: self.addr + offset,
            len: e - s,
            ..self
        })
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a, T> DeviceSliceMut<'a, T> {
    /// A sub-range.
    pub fn range(self, r: impl RangeBounds<usize>) -> Result<Self> {
        let (s, e) = bounds(r, self.len)?;
        let offset = byte_size::<T>(s)? as u64;
        Ok(DeviceSliceMut {
            addr: self.addr + offset,
            len: e - s,
            ..self
        })
    }
    /// The same range as a read view.
    pub fn as_view(self) -> DeviceSlice<'a, T> {
        self.into()
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Pinned host memory that async copies may use: pinned buffers, pool
/// buffers and registered slices. Pageable memory (`Vec`, `&[T]`) does not
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, PinnedBuffer, PinnedHost, Registered, Stream};
/// // Any pinned memory: a pinned buffer, a pool's, a registered `Vec`.
/// fn upload<H: PinnedHost<f32> + Send + 'static>(
///     stream: &Stream,
///     host: H,
///     dev: DeviceBuffer<f32>,
/// ) -> gpufeed::Result<DeviceBuffer<f32>> {
///     let ((_host, dev), ()) = block_on(stream.copy_h2d(host, dev))?;
///     Ok(dev)
/// }
/// let device = Device::cpu();
/// let (stream, dev) = (Stream::new(&device)?, DeviceBuffer::<f32>::new(&device, 2)?);
/// let dev = upload(&stream, PinnedBuffer::from_slice(&device, &[1.0, 2.0])?, dev)?;
/// let mut dev = upload(&stream, Registered::new(&device, vec![3.0, 4.0])?, dev)?;
/// let mut out = [0f32; 2];
/// dev.copy_to_host_sync(&mut out)?;
/// assert_eq!(out, [3.0, 4.0]);
/// // `upload(&stream, vec![5.0f32, 6.0], dev)` does not compile: a `Vec` is pageable.
/// # Ok(()) }
/// ```
///
/// implement it, so it cannot reach an async copy.
pub trait PinnedHost<T: Pod> {
    /// A source view of the whole memory.
    fn host(&self) -> HostSlice<'_, T>;
    /// A destination view of the whole memory.
    fn host_mut(&mut self) -> HostSliceMut<'_, T>;
}

pub(crate) fn host_slice<'a, T>(ptr: *const T, len: usize, device_id: usize) -> HostSlice<'a, T> {
    HostSlice {
        ptr,
        len,
        device_id,
        _p: PhantomData,
    }
}

pub(crate) fn host_slice_mut<'a, T>(
    ptr: *mut T,
    len: usize,
    device_id: usize,
) -> HostSliceMut<'a, T> {
    HostSliceMut {
        ptr,
        len,
        device_id,
        _p: PhantomData,
    }
}
