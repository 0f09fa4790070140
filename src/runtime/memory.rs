//! Host and device memory: pinned buffers, pin-in-place registration,
//! device buffers, a device-mapped flag, and the borrowed slices that stream
//! commands take.

use crate::backend::{HostAlloc, HostFlags, DEVICE_ALIGN};
use crate::base::error::{byte_size, Error, Result};
use crate::runtime::device::Device;
use bytemuck::Pod;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

/// Largest alignment a pinned allocation guarantees (page alignment).
pub const MAX_HOST_ALIGN: usize = 4096;

/// Page-locked host memory holding `len` values of `T`, freed on drop.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, PinnedBuffer};
/// let device = Device::cpu();
/// let mut buf = PinnedBuffer::<f32>::new(&device, 4)?;
/// assert_eq!(buf.as_slice(), &[0.0; 4]); // contents start zeroed
/// buf.as_mut_slice().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
/// assert_eq!((buf.len(), buf.byte_len()), (4, 16));
/// let copy = PinnedBuffer::from_slice(&device, buf.as_slice())?;
/// assert_eq!(copy.as_slice(), buf.as_slice());
/// # Ok(()) }
/// ```
///
/// Allocated by the driver (`cuMemHostAlloc`) with explicit [`HostFlags`]
/// (portable by default, never write-combined unless asked: write-combined
/// memory makes CPU reads very slow). The DMA engines copy to and from it
/// directly, which is what makes copies fast and asynchronous. Contents start
/// zeroed.
pub struct PinnedBuffer<T: Pod> {
    alloc: HostAlloc,
    len: usize,
    flags: HostFlags,
    device: Device,
    _t: PhantomData<T>,
}

// SAFETY: the buffer owns its memory exclusively; T: Pod is Send + Sync.
unsafe impl<T: Pod> Send for PinnedBuffer<T> {}
// SAFETY: shared access only reads; mutation needs &mut.
unsafe impl<T: Pod> Sync for PinnedBuffer<T> {}

impl<T: Pod> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("locked", &self.alloc.locked)
            .finish()
    }
}

/// Refuses element types aligned beyond [`DEVICE_ALIGN`] for device memory.
pub(crate) fn check_device_align<T>() -> Result<()> {
    if std::mem::align_of::<T>() > DEVICE_ALIGN {
        return Err(Error::InvalidArgument(format!(
            "alignment {} of the element type exceeds device memory's {DEVICE_ALIGN}",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

pub(crate) fn check_align<T>() -> Result<()> {
    if std::mem::align_of::<T>() > MAX_HOST_ALIGN {
        return Err(Error::InvalidArgument(format!(
            "alignment {} of the element type exceeds the page alignment {MAX_HOST_ALIGN}",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

impl<T: Pod> PinnedBuffer<T> {
    /// `len` zeroed values in portable pinned memory.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        Self::with_flags(device, len, HostFlags::DEFAULT)
    }

    /// `len` zeroed values with explicit flags.
    pub fn with_flags(device: &Device, len: usize, flags: HostFlags) -> Result<Self> {
        check_align::<T>()?;
        let bytes = byte_size::<T>(len)?;
        // Pinned allocation: page-locks physical memory so the GPU's DMA engines
        // can reach it without a staging copy. Slow (tens to hundreds of ms per
        // GiB): allocate once, or take buffers from a `PinnedPool`.
        let alloc = if bytes == 0 {
            // Nothing to lock (backends only see non-empty ranges); refused on a
            // broken context all the same, like any allocation.
            usable(device)?;
            HostAlloc {
                ptr: std::ptr::null_mut(),
                bytes: 0,
                locked: true,
                placed: false,
            }
        } else {
            let alloc = device.backend.alloc_host(bytes, flags, None)?;
            // SAFETY: a fresh allocation of `bytes` writable bytes.
            unsafe { std::ptr::write_bytes(alloc.ptr, 0, bytes) };
            alloc
        };
        Ok(PinnedBuffer {
            alloc,
            len,
            flags,
            device: device.clone(),
            _t: PhantomData,
        })
    }

    /// A pinned copy of `data`.
    pub fn from_slice(device: &Device, data: &[T]) -> Result<Self> {
        let mut b = Self::new(device, data.len())?;
        b.as_mut_slice().copy_from_slice(data);
        Ok(b)
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.alloc.bytes
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> HostFlags {
        self.flags
    }

    /// False only on the CPU backend when locking was refused and the policy
    /// allowed unlocked memory.
    pub fn is_locked(&self) -> bool {
        self.alloc.locked
    }

    /// The contents (the seed's `get_array`).
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: len values, initialised at allocation, owned by self.
        unsafe { raw_slice(self.alloc.ptr.cast(), self.len) }
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above; &mut self gives exclusive access.
        unsafe { raw_slice_mut(self.alloc.ptr.cast(), self.len) }
    }

    /// The device this memory is pinned for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn raw_ptr(&self) -> *mut T {
        self.alloc.ptr.cast()
    }
}

impl<T: Pod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.alloc.bytes == 0 {
            return;
        }
        // SAFETY: our allocation; the safe API never lets the GPU hold it past
        // the owner (in-flight buffers are owned by their job until completion).
        if let Err(e) = unsafe { self.device.backend.free_host(&self.alloc) } {
            let failures = self.device.backend.release_failures();
            failures.note("freeing pinned memory", &e);
        }
    }
}

/// A `Vec` pinned in place (`cuMemHostRegister`) for as long as this guard
/// lives; dropping the guard unregisters it, [`Registered::into_inner`] (or
/// [`Registered::try_into_inner`], which returns the unregistration's error)
/// gives the `Vec` back. The guard owns the vector, so the memory can be
/// neither freed nor moved (no push, no reallocation) while registered, and a
/// job that holds the guard keeps it registered until the GPU is done.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Registered, Stream};
/// let device = Device::cpu();
/// let stream = Stream::new(&device)?;
/// let data = Registered::new(&device, vec![1.5f32; 1024])?; // pinned where it is
/// let dev = DeviceBuffer::<f32>::new(&device, 1024)?;
/// let ((data, mut dev), ()) = block_on(stream.copy_h2d(data, dev))?;
/// let v: Vec<f32> = data.into_inner(); // unregistered: the `Vec` back
/// let mut back = vec![0f32; 1024];
/// dev.copy_to_host_sync(&mut back)?;
/// assert_eq!(back, v);
/// # Ok(()) }
/// ```
///
/// A failed unregistration on drop (or in `into_inner`) has nobody to
/// return its error to: it is counted in
/// [`Device::release_failures`](crate::Device::release_failures) and logged.
pub struct Registered<T: Pod> {
    data: Option<Vec<T>>,
    device: Device,
    locked: bool,
}

impl<T: Pod> std::fmt::Debug for Registered<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("len", &self.len())
            .field("locked", &self.locked)
            .finish()
    }
}

impl<T: Pod> Registered<T> {
    /// Registers the vector's memory with the driver.
    pub fn new(device: &Device, mut data: Vec<T>) -> Result<Self> {
        let bytes = std::mem::size_of_val(data.as_slice());
        let locked = if bytes == 0 {
            usable(device)?;
            true // nothing to lock
        } else {
            // SAFETY: the range is valid and stays put: the guard owns the Vec
            // and never grows it.
            unsafe {
                device
                    .backend
                    .register_host(data.as_mut_ptr().cast(), bytes)?
            }
        };
        Ok(Registered {
            data: Some(data),
            device: device.clone(),
            locked,
        })
    }

    /// Whether the vector's pages are locked: always on CUDA; false only
    /// on the CPU emulation when locking was refused (the memlock limit) and
    /// the device's [`LockPolicy`](crate::LockPolicy) allowed unlocked
    /// memory.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Unregisters and returns the vector. A failed unregistration is
    /// counted ([`Device::release_failures`](crate::Device::release_failures))
    /// and logged; [`Registered::try_into_inner`] returns it instead.
    pub fn into_inner(self) -> Vec<T> {
        match self.try_into_inner() {
            Ok(v) => v,
            Err((_, v)) => v, // counted and logged by try_into_inner
        }
    }

    /// Unregisters and returns the vector, or the unregistration's error
    /// with the vector (which stays valid: only the driver's record of it
    /// may remain). The failure is counted in
    /// [`Device::release_failures`](crate::Device::release_failures) too.
    ///
    /// # Errors
    /// The backend's error from unregistering the memory.
    #[allow(clippy::result_large_err)] // the vector comes back either way
    pub fn try_into_inner(mut self) -> std::result::Result<Vec<T>, (Error, Vec<T>)> {
        let r = self.unregister();
        let v = self.data.take().unwrap_or_default();
        match r {
            Ok(()) => Ok(v),
            Err(e) => Err((e, v)),
        }
    }

    /// Unregisters the vector (which the caller then takes out of `data`,
    /// so the drop does not unregister it again); a failure is counted.
    fn unregister(&mut self) -> Result<()> {
        let Some(v) = self.data.as_mut() else {
            return Ok(());
        };
        let bytes = std::mem::size_of_val(v.as_slice());
        if bytes == 0 {
            return Ok(()); // never registered (see `new`)
        }
        // SAFETY: registered in `new`; a job holding this guard drops it only
        // at completion, so no transfer uses the memory any more.
        let r = unsafe {
            self.device
                .backend
                .unregister_host(v.as_mut_ptr().cast(), bytes)
        };
        if let Err(e) = &r {
            let failures = self.device.backend.release_failures();
            failures.note("unregistering host memory", e);
        }
        r
    }

    /// Element count.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The contents.
    pub fn as_slice(&self) -> &[T] {
        self.data.as_deref().unwrap_or(&[])
    }

    /// The contents, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.data.as_deref_mut().unwrap_or(&mut [])
    }

    /// The device it is registered with.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl<T: Pod> Drop for Registered<T> {
    fn drop(&mut self) {
        let Some(v) = self.data.take() else { return };
        if std::mem::size_of_val(v.as_slice()) == 0 {
            return; // never registered (see `new`)
        }
        let Ok(layout) = std::alloc::Layout::array::<T>(v.capacity()) else {
            // Not possible for a live Vec; unregister here (a failure is
            // counted) and let it drop.
            self.data = Some(v);
            let _ = self.unregister();
            return;
        };
        // The Vec's buffer goes with the unregistration, which the backend
        // may do later on another thread (CUDA, when this runs on a
        // completion thread). T is Pod: its elements need no drop.
        let mut v = std::mem::ManuallyDrop::new(v);
        let bytes = std::mem::size_of_val(v.as_slice());
        let ptr = v.as_mut_ptr().cast::<u8>();
        let buffer = VecBuffer { ptr, layout };
        // SAFETY: registered in `new`; a job holding this guard drops it only
        // at completion, so no transfer uses the memory any more; `buffer` is
        // the Vec's own allocation, freed once, after the unregistration.
        let r = unsafe {
            self.device
                .backend
                .unregister_host_then(ptr, bytes, Box::new(move || buffer.free()))
        };
        if let Err(e) = r {
            let failures = self.device.backend.release_failures();
            failures.note("unregistering host memory", &e);
        }
    }
}

/// A `Vec`'s heap buffer taken out of the `Vec` (elements need no drop).
struct VecBuffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: an allocation owned by nobody else; freeing it from another thread
// is allowed.
unsafe impl Send for VecBuffer {}

impl VecBuffer {
    fn free(self) {
        if self.layout.size() != 0 {
            // SAFETY: a Vec allocates its buffer from the global allocator
            // with `Layout::array::<T>(capacity)`, the layout kept here, and
            // this is its only free.
            unsafe { std::alloc::dealloc(self.ptr, self.layout) };
        }
    }
}

/// Device memory for `len` values of `T`, freed on drop. Contents start
/// unspecified on CUDA (zeroed on the CPU backend).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceBuffer};
/// let device = Device::cpu();
/// let mut dev = DeviceBuffer::<u32>::new(&device, 3)?;
/// dev.copy_from_host_sync(&[1, 2, 3])?; // from any host slice, synchronously
/// let mut back = [0u32; 3];
/// dev.copy_to_host_sync(&mut back)?;
/// assert_eq!(back, [1, 2, 3]);
/// let err = dev.copy_from_host_sync(&[1, 2]).unwrap_err();
/// assert!(matches!(err, gpufeed::Error::LengthMismatch { expected: 3, got: 2, .. }));
/// # Ok(()) }
/// ```
pub struct DeviceBuffer<T: Pod> {
    ptr: u64,
    len: usize,
    device: Device,
    /// Completions of staged DMAs that may still read or write this buffer
    /// after the staged copy that issued them was dropped or forgotten
    /// ([`crate::Staging`]): every later use waits for them and the free
    /// is deferred past them.
    in_flight: InFlight,
    _t: PhantomData<T>,
}

/// The completions of staged DMAs on a device buffer (see
/// [`DeviceBuffer`]): usually empty; pruned of finished ones as it grows.
#[derive(Default)]
pub(crate) struct InFlight(std::sync::Mutex<Vec<crate::base::completion::Completion>>);

impl InFlight {
    /// Notes a DMA on the buffer that ends with `done`.
    pub(crate) fn push(&self, done: crate::base::completion::Completion) {
        let mut v = crate::base::completion::lock(&self.0);
        v.retain(|c| !c.is_done());
        v.push(done);
    }

    /// The completions still pending, taken out.
    fn take_pending(&self) -> Vec<crate::base::completion::Completion> {
        let mut v = crate::base::completion::lock(&self.0);
        v.retain(|c| !c.is_done());
        std::mem::take(&mut *v)
    }

    /// Blocks until every noted DMA is done. Only a staged copy that was
    /// dropped (or forgotten) mid-way leaves any: this is then the wait for
    /// at most its ring of blocks. On a completion thread (where blocking
    /// would wait for itself) the remaining completions are kept and the
    /// use goes ahead, ordered on the GPU only by the device.
    fn settle(&self) {
        let pending = self.take_pending();
        if pending.is_empty() {
            return;
        }
        if crate::base::completion::on_completion_thread() {
            let mut v = crate::base::completion::lock(&self.0);
            v.extend(pending);
            return;
        }
        for c in pending {
            // The DMA's own fault, if any, belongs to the staged copy that
            // issued it (and breaks the context for every later use).
            let _ = c.block();
        }
    }
}

// SAFETY: an owned device address; the host never dereferences it. Pod data has no thread affinity.
unsafe impl<T: Pod> Send for DeviceBuffer<T> {}
// SAFETY: shared access only creates views for stream-ordered commands.
unsafe impl<T: Pod> Sync for DeviceBuffer<T> {}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Allocates `len` values on the device.
    ///
    /// # Errors
    /// `InvalidArgument` for an element type aligned beyond 256 bytes (what
    /// device allocations guarantee); `SizeOverflow`; the backend's
    /// allocation error.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        check_device_align::<T>()?;
        let bytes = byte_size::<T>(len)?;
        let ptr = device.backend.alloc_device(bytes)?;
        device
            .live_buffers
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(DeviceBuffer {
            ptr,
            len,
            device: device.clone(),
            in_flight: InFlight::default(),
            _t: PhantomData,
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

    /// A read view of the whole buffer for stream commands (a source).
    /// Shared: a buffer behind an `Arc` in several jobs can be read by all.
    pub fn view(&self) -> DeviceSlice<'_, T> {
        self.in_flight.settle();
        DeviceSlice {
            addr: self.ptr,
            len: self.len,
            device_id: self.device.id(),
            _p: PhantomData,
        }
    }

    /// A write view of the whole buffer for stream commands (a destination,
    /// or a kernel's in-place operand). It borrows the buffer exclusively, so
    /// no other job can hold it meanwhile; inside one batch it is `Copy` and
    /// serves several commands, which the stream runs in order. Take it once
    /// (`let d = d.view_mut();`) and reuse it.
    pub fn view_mut(&mut self) -> DeviceSliceMut<'_, T> {
        self.in_flight.settle();
        DeviceSliceMut {
            addr: self.ptr,
            len: self.len,
            device_id: self.device.id(),
            _p: PhantomData,
        }
    }

    /// The device address and device identity, for the crate's own commands.
    pub(crate) fn raw_parts(&self) -> (u64, usize) {
        self.in_flight.settle();
        (self.ptr, self.device.id())
    }

    /// The device, the address and the in-flight record, for staged
    /// copies (which note their DMAs there as they issue them).
    pub(crate) fn staging_parts(&self) -> (&Device, u64, &InFlight) {
        self.in_flight.settle();
        (&self.device, self.ptr, &self.in_flight)
    }

    /// Synchronous copy from any host slice (pageable memory's path): returns
    /// when the data is on the device. `&mut self` proves no job uses the buffer.
    pub fn copy_from_host_sync(&mut self, src: &[T]) -> Result<()> {
        self.in_flight.settle();
        check_len("copy_from_host_sync", self.len, src.len())?;
        // SAFETY: both ranges valid for the byte count; synchronous.
        unsafe {
            self.device.backend.copy_h2d_sync(
                self.ptr,
                src.as_ptr().cast(),
                std::mem::size_of_val(src),
            )
        }
    }

    /// Synchronous copy into any host slice.
    pub fn copy_to_host_sync(&mut self, dst: &mut [T]) -> Result<()> {
        self.in_flight.settle();
        check_len("copy_to_host_sync", self.len, dst.len())?;
        // SAFETY: both ranges valid for the byte count; synchronous.
        unsafe {
            self.device.backend.copy_d2h_sync(
                dst.as_mut_ptr().cast(),
                self.ptr,
                std::mem::size_of_val(dst),
            )
        }
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let (device, ptr) = (self.device.clone(), self.ptr);
        let free = move || {
            // SAFETY: our allocation; jobs own buffers until completion, and
            // staged DMAs noted in `in_flight` are done when this runs.
            if let Err(e) = unsafe { device.backend.free_device(ptr) } {
                let failures = device.backend.release_failures();
                failures.note("freeing device memory", &e);
            }
            device
                .live_buffers
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        };
        // A staged copy dropped mid-way may have left DMAs on this buffer:
        // the free waits for the last of them, without blocking here.
        let pending = self.in_flight.take_pending();
        if pending.is_empty() {
            free();
            return;
        }
        let left = Arc::new(std::sync::atomic::AtomicUsize::new(pending.len()));
        let free = Arc::new(std::sync::Mutex::new(Some(free)));
        for c in pending {
            let (left, free) = (left.clone(), free.clone());
            c.defer(move || {
                if left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                    if let Some(free) = crate::base::completion::lock(&free).take() {
                        free();
                    }
                }
            });
        }
    }
}

/// A `u32` in device-mapped pinned memory: the host sets it, kernels read it
/// (the GPU-side gate tests use it to hold work without timers; a test hook).
#[cfg(feature = "hooks")]
pub struct MappedFlag {
    buf: PinnedBuffer<u32>,
    device_addr: u64,
}

#[cfg(feature = "hooks")]
impl MappedFlag {
    /// A cleared flag.
    pub fn new(device: &Device) -> Result<Self> {
        let flags = HostFlags {
            device_mapped: true,
            ..HostFlags::DEFAULT
        };
        let buf = PinnedBuffer::<u32>::with_flags(device, 1, flags)?;
        // SAFETY: the allocation is device-mapped.
        let device_addr = unsafe { device.backend.mapped_device_ptr(buf.raw_ptr().cast())? };
        Ok(MappedFlag { buf, device_addr })
    }

    fn atomic(&self) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: a live, aligned u32 that outlives the borrow; the GPU only reads it.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.buf.raw_ptr()) }
    }

    /// Sets the flag (opens the gate).
    pub fn set(&self, v: u32) {
        self.atomic().store(v, std::sync::atomic::Ordering::Release);
    }

    /// The current value.
    pub fn get(&self) -> u32 {
        self.atomic().load(std::sync::atomic::Ordering::Acquire)
    }

    /// The flag as a one-element device view (its mapped address).
    pub(crate) fn view(&self) -> DeviceSlice<'_, u32> {
        DeviceSlice {
            addr: self.device_addr,
            len: 1,
            device_id: self.buf.device.id(),
            _p: PhantomData,
        }
    }
}

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
    /// The host-memory domain ([`Device::host_domain`]): any device of the
    /// backend that pinned it may copy from it.
    pub(crate) device_id: usize,
    _p: PhantomData<&'a [T]>,
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
    _p: PhantomData<&'a mut [T]>,
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
    _p: PhantomData<&'a T>,
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
    _p: PhantomData<Invariant<'a, T>>,
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

impl<T: Pod> PinnedHost<T> for PinnedBuffer<T> {
    fn host(&self) -> HostSlice<'_, T> {
        host_slice(self.raw_ptr(), self.len, self.device.host_domain())
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        host_slice_mut(self.raw_ptr(), self.len, self.device.host_domain())
    }
}

impl<T: Pod> PinnedHost<T> for Registered<T> {
    fn host(&self) -> HostSlice<'_, T> {
        host_slice(
            self.as_slice().as_ptr(),
            self.len(),
            self.device.host_domain(),
        )
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        let id = self.device.host_domain();
        let s = self.as_mut_slice();
        host_slice_mut(s.as_mut_ptr(), s.len(), id)
    }
}

/// Fails at once when the device's context is broken.
fn usable(device: &Device) -> Result<()> {
    device.broken().map_or(Ok(()), Err)
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(Error::LengthMismatch {
            what,
            expected,
            got,
        });
    }
    Ok(())
}

/// # Safety
/// `ptr` valid for reads of `len` initialised `T` for `'a` (any pointer when `len == 0`).
pub(crate) unsafe fn raw_slice<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if len == 0 || std::mem::size_of::<T>() == 0 {
        // No bytes to read (an empty range, or a zero-sized type, whose
        // buffers have no allocation): a dangling, aligned pointer is valid.
        // SAFETY: as said; `len` zero-sized values need no memory.
        return unsafe {
            std::slice::from_raw_parts(std::ptr::NonNull::<T>::dangling().as_ptr(), len)
        };
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// # Safety
/// `ptr` valid for reads and writes of `len` initialised `T`, unaliased for `'a`.
pub(crate) unsafe fn raw_slice_mut<'a, T>(ptr: *mut T, len: usize) -> &'a mut [T] {
    if len == 0 || std::mem::size_of::<T>() == 0 {
        // SAFETY: as in `raw_slice`.
        return unsafe {
            std::slice::from_raw_parts_mut(std::ptr::NonNull::<T>::dangling().as_ptr(), len)
        };
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}
