//! Device memory: [`DeviceBuffer`], its views and synchronous copies, and
//! the record of staged DMAs that may still use it (its uses and its free
//! wait for them).

use crate::base::error::{byte_size, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::checks::{check_device_align, check_len};
use crate::runtime::memory::views::{DeviceSlice, DeviceSliceMut};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::sync::Arc;

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
