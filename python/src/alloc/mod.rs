//! Pinned host memory for Python: `PinnedAllocator` (the seed's API over the
//! stream-aware pool), `PinnedBuffer` (NumPy views through the buffer
//! protocol, counted), and `pin` (pin-in-place of an existing array).
//!
//! The module's files, by job: `host_mem` the pinned memory a buffer
//! holds (and its typed form); `allocator` the `PinnedAllocator`;
//! `buffer` the `PinnedBuffer`, its checks before an operation takes
//! it, and the counted views NumPy arrays keep; `methods` its Python
//! methods; `taken` what is taken from Python once; `in_place`
//! pin-in-place of an existing array.

mod allocator;
mod buffer;
mod host_mem;
mod in_place;
mod methods;
mod taken;

pub use allocator::PinnedAllocator;
pub use buffer::{PinnedBuffer, PinnedView};
pub use host_mem::{HostMem, Typed};
pub use in_place::pin;
pub(crate) use taken::Taken;
