//! The safe types over the backends: a [`Device`](crate::Device), its memory
//! (pinned, registered, device buffers and their views), the pinned pool,
//! streams, events and jobs, kernels and launches, and backend selection.

pub(crate) mod device;
pub(crate) mod kernel;
pub(crate) mod memory;
pub(crate) mod open;
pub(crate) mod pool;
pub(crate) mod stream;
pub(crate) mod transfer;
