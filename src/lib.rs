//! # gpufeed — feed a GPU from the host, fast and hard to get wrong
//!
//! - [`PinnedBuffer`], [`Registered`], [`PinnedPool`]: page-locked host
//!   memory, allocated, pinned in place, or on loan from a stream-aware cache.
//! - [`Stream`], [`Event`], [`Job`]: device work as runtime-agnostic futures.
//!   Jobs own their buffers until the GPU is done, so memory in flight can't
//!   be touched or freed; dropping a job defers the release to completion.
//! - [`Pipeline`]: chunked H2D → kernel → D2H over several streams, so the
//!   copy engines and the SMs work at once.
//! - [`Loader`]: batches of rows gathered by index into pinned blocks and
//!   sent ahead of their use, as a `Stream` (a training loop's feeder).
//! - Two backends behind one API ([`Device`]): the CUDA driver (loaded at
//!   run time through cudarc) and a CPU emulation for machines without a GPU.
//!
//! - [`kernels`]: the block-level kernel set (sum and max, an inclusive
//!   scan, a row softmax, a 256-bin histogram, SGEMM, a bf16 tensor-core
//!   GEMM) as commands of a batch, bit-identical on the GPU and the CPU
//!   emulation where the order is fixed.
//!
//! The kernels are Rust (`gpu-kernels`), compiled to PTX by `build.rs`; see [`ptx`].
//!
//! # Floors
//! One folder a floor; a module uses its own floor and those below it,
//! never one above, and never an item through this root (`.ci/imports.py`
//! checks both). Lowest first:
//! 1. `ptx`: the embedded PTX text;
//! 2. `base/`: the completion core, `block_on`, the worker pool, claims,
//!    fork detection, NUMA placement, the error type;
//! 3. `backend/`: the one interface both backends implement, `cpu.rs`
//!    (the emulation) and `cuda/` (the driver through cudarc);
//! 4. `runtime/`: the safe types: device, memory, pool, streams, events,
//!    jobs and their commands, modules and launches, backend choice;
//! 5. `kernels/`: the block-level kernel set as commands of a job;
//! 6. `io/`: `O_DIRECT` files and the GPUDirect Storage probe;
//! 7. `interop`: memory and streams shared with other libraries;
//! 8. `engines/`: staging, sliced copies, the pipeline, several devices,
//!    the loader, model weights;
//! 9. `guarantees` and `testing`: documents and test hooks.
//!
//! ```rust
//! # fn main() -> gpufeed::Result<()> { gpufeed::block_on(async {
//! use gpufeed::{Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Stream};
//! let device = Device::from_env()?;
//! let pool = PinnedPool::new(&device);
//! let stream = Stream::new(&device)?;
//! let mut input = pool.alloc::<f32>(1 << 20)?;
//! input.as_mut_slice().fill(2.0);
//! let output = pool.alloc::<f32>(1 << 20)?;
//! let dev = DeviceBuffer::<f32>::new(&device, 1 << 20)?;
//! // One batch: copy in, scale, copy out. The job owns the buffers until done;
//! // every view a command takes is borrowed from the bundle.
//! let ((input, dev, output), ()) = stream
//!     .run((input, dev, output), |c, (i, d, o)| {
//!         let d = d.view_mut();
//!         c.copy_h2d(i.host(), d)?;
//!         c.kernel(Kernel::Scale { s: 3.0 }, d)?;
//!         c.copy_d2h(d, o.host_mut())
//!     })
//!     .await?;
//! assert_eq!(output.as_slice()[0], 6.0);
//! # drop((input, dev)); Ok(()) }) }
//! ```

#![deny(missing_docs)]
// The floors: see the crate docs (alphabetical here, as rustfmt orders them).
mod backend;
mod base;
mod engines;
pub mod guarantees;
pub mod interop;
mod io;
pub mod kernels;
pub mod ptx;
mod runtime;
#[cfg(feature = "hooks")]
#[doc(hidden)]
pub mod testing;

pub use backend::cpu::{memlock_limit, LockPolicy, MemlockLimit};
pub use backend::cuda::{driver_present, DeviceMemory, WaitMode, POLL_INTERVAL};
pub use backend::{BackendKind, DeviceInfo, HostFlags, LaunchLimits};
#[cfg(not(loom))]
pub use base::block::block_on_for;
pub use base::block::{block_on, block_on_spinning, spin_here, SPIN, SPIN_MIN_CORES};
pub use base::completion::Wait;
pub use base::error::{Error, JobError, Result};
pub use base::numa::online_nodes;
pub use engines::loader::{
    batches_per_epoch, epoch_indices, permutation, Batch, Gather, Loader, LoaderConfig,
    LoaderStats, RowSource, MAX_WORLD_SIZE,
};
pub use engines::multi::{MultiJob, MultiPipeline};
pub use engines::pipeline::{
    Arrays, Chunk, ChunkEvents, KeepAlive, Layout, PinnedArray, Pipeline, Plan, RunInfo, Timeline,
    AUTO_CHUNK_COST_BYTES, MAX_STREAMS,
};
pub use engines::staging::{
    cached_share, FileIo, FilePiece, FileRange, ReadTarget, Route, StagedCopy, Staging,
    StagingConfig, DEFAULT_BLOCKS, DEFAULT_BLOCK_BYTES, DEFAULT_DIRECT_D2H_BELOW,
    DEFAULT_DIRECT_H2D_BELOW, DEFAULT_MAX_THREADS, DIRECT_IO_ALIGN, MAX_STAGING_THREADS,
    PROBE_SAMPLES,
};
/// Model weights: checkpoints of safetensors shards in and out (see the module).
pub use engines::weights;
pub use io::gds::{gds_status, GdsStatus};
/// Kernel declarations: the macro, the parameter types, the thread indices.
pub use kernel_abi;
pub use runtime::device::Device;
pub use runtime::kernel::{Arg, Args, ByValue, Function, Kernel, LaunchConfig, Module};
#[cfg(feature = "hooks")]
#[doc(hidden)]
pub use runtime::memory::MappedFlag;
pub use runtime::memory::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, HostSlice, HostSliceMut, PinnedBuffer, PinnedHost,
    Registered, MAX_HOST_ALIGN,
};
pub use runtime::open::{BackendChoice, DeviceOptions, BACKEND_ENV, CPU_DEVICES_ENV};
pub use runtime::pool::{PinnedPool, PoolStats, PooledBuffer, DEFAULT_CACHE_FLOOR, MIN_BLOCK};
pub use runtime::stream::{Commands, Event, Job, Mark, Stream};
pub use runtime::transfer::Transfer;
