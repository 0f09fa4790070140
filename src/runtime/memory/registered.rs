//! Memory pinned where it is: a `Vec` registered with the driver for as
//! long as its guard ([`Registered`]) lives, and its buffer freed after the
//! unregistration.

use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::checks::usable;
use crate::runtime::memory::views::{
    host_slice, host_slice_mut, HostSlice, HostSliceMut, PinnedHost,
};
use bytemuck::Pod;

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
