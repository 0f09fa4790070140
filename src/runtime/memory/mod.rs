//! Host and device memory: pinned buffers, pin-in-place registration,
//! device buffers, a device-mapped flag, and the borrowed slices that stream
//! commands take.
//!
//! The module's files, by job: [`checks`] the checks every kind shares
//! (alignment, length, a usable context) and slices from raw parts;
//! [`pinned`] pinned buffers (and the device-mapped flag); [`registered`]
//! memory pinned in place; [`device_buffer`] device buffers; [`views`] the
//! borrowed slices and the [`PinnedHost`] trait.

mod checks;
mod device_buffer;
mod pinned;
mod registered;
mod views;

pub use checks::MAX_HOST_ALIGN;
pub(crate) use checks::{check_align, check_device_align, check_len, raw_slice, raw_slice_mut};
pub use device_buffer::DeviceBuffer;
pub(crate) use device_buffer::InFlight;
#[cfg(feature = "hooks")]
pub use pinned::MappedFlag;
pub use pinned::PinnedBuffer;
pub use registered::Registered;
pub(crate) use views::{device_slice_mut, host_slice, host_slice_mut, overlaps};
pub use views::{DeviceSlice, DeviceSliceMut, HostSlice, HostSliceMut, PinnedHost};
