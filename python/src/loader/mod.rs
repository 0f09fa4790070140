//! `Loader`: a training loop's feeder. Batches of rows of a NumPy array, a
//! memory map, `.npy` files or a safetensors file (or a dict of those) are
//! gathered by index in native threads straight into pinned blocks and
//! sent to the device on the loader's own stream, `prefetch` batches ahead
//! (the `host` crate's [`gpufeed::Loader`]); they come out as torch tensors,
//! CuPy arrays or `DeviceArray`s without a copy.
//!
//! Threads: a producer thread of the loader's own runs the epoch (the
//! gathers, on it and the staging workers, and the waits for the DMAs),
//! without the GIL, while Python runs; `next()` takes the batches it has
//! finished (waiting with the GIL released, in slices that let Ctrl-C
//! through). So the gather of the next batch overlaps both the last one's
//! DMA and the training step's Python. The source's memory is kept alive
//! by buffer exports for the loader's life; replacing it under them (NumPy
//! allows `ndarray.__setstate__` and `resize(refcheck=False)` on an array
//! with exports) while a loader reads it is not allowed (see the README's
//! "Not guaranteed").
//!
//! Device memory: every batch is a fresh allocation. A batch handed to
//! torch or CuPy is kept by the loader until the consumer's tensor is gone
//! (its DLPack export released) and an event recorded then on the
//! consumer's current stream has completed: only then is its memory freed
//! for reuse, so a later batch never lands in memory a queued kernel still
//! reads.
//!
//! The module's files, by job: `fields` the source read into fields (an
//! array, `.npy` files, a safetensors file, a dict) and their row sources;
//! `setup` the rank, device and framework a loader is made for;
//! `producer` the thread that runs the epochs; `handle` the [`Loader`]
//! and its iterator (batches received, converted, freed); `methods` the
//! Python methods of the `Loader`.

mod fields;
mod handle;
mod methods;
mod producer;
mod setup;

pub use handle::{Loader, LoaderIterator};
pub(crate) use setup::distributed;
