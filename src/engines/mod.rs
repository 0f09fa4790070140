//! The engines built on the safe types: staging of ordinary memory and files
//! through a pinned ring, sliced copies, the overlap pipeline over one or
//! several devices, the batch loader, and model weights (checkpoints of
//! safetensors shards in and out).

pub(crate) mod loader;
pub(crate) mod multi;
pub(crate) mod pipeline;
pub(crate) mod sliced;
pub(crate) mod staging;
pub mod weights;
