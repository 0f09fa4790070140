//! What every kind of memory checks and shares: the element type's
//! alignment (device memory's, pinned memory's), equal lengths, a usable
//! context, and slices from raw parts that allow empty and zero-sized ones.

use crate::backend::DEVICE_ALIGN;
use crate::base::error::{Error, Result};
use crate::runtime::device::Device;

/// Largest alignment a pinned allocation guarantees (page alignment).
pub const MAX_HOST_ALIGN: usize = 4096;

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

/// Fails at once when the device's context is broken.
pub(super) fn usable(device: &Device) -> Result<()> {
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
