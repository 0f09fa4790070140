//! Page-locked host memory allocated by the driver: [`PinnedBuffer`], its
//! views, and (a test hook) a device-mapped flag.

use crate::backend::{HostAlloc, HostFlags};
use crate::base::error::{byte_size, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::checks::{check_align, raw_slice, raw_slice_mut, usable};
#[cfg(feature = "hooks")]
use crate::runtime::memory::views::DeviceSlice;
use crate::runtime::memory::views::{
    host_slice, host_slice_mut, HostSlice, HostSliceMut, PinnedHost,
};
use bytemuck::Pod;
use std::marker::PhantomData;

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

impl<T: Pod> PinnedHost<T> for PinnedBuffer<T> {
    fn host(&self) -> HostSlice<'_, T> {
        host_slice(self.raw_ptr(), self.len, self.device.host_domain())
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        host_slice_mut(self.raw_ptr(), self.len, self.device.host_domain())
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
