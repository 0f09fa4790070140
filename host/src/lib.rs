//! # host — feed a GPU from the host, fast and hard to get wrong
//!
//! - [`PinnedBuffer`], [`Registered`], [`PinnedPool`]: page-locked host
//!   memory, allocated, pinned in place, or on loan from a stream-aware cache.
//! - [`Stream`], [`Event`], [`Job`]: device work as runtime-agnostic futures.
//!   Jobs own their buffers until the GPU is done, so memory in flight can't
//!   be touched or freed; dropping a job defers the release to completion.
//! - [`pipeline`]: chunked H2D → kernel → D2H over several streams, and
//!   [`pipeline::compare_sync_async`].
//! - Two backends behind one API ([`Device`]): the CUDA driver (loaded at
//!   run time through cudarc) and a CPU emulation for machines without a GPU.
//!
//! The kernels are Rust (`gpu-kernels`), compiled to PTX by `build.rs`; see [`ptx`].
//!
//! ```no_run
//! # async fn demo() -> host::Result<()> {
//! use host::{Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Stream};
//! let device = Device::from_env()?;
//! let pool = PinnedPool::new(&device);
//! let stream = Stream::new(&device)?;
//! let mut input = pool.alloc::<f32>(1 << 20)?;
//! input.as_mut_slice().fill(2.0);
//! let output = pool.alloc::<f32>(1 << 20)?;
//! let dev = DeviceBuffer::<f32>::new(&device, 1 << 20)?;
//! // One batch: copy in, scale, copy out. The job owns the buffers until done.
//! let ((input, dev, output), ()) = stream
//!     .run((input, dev, output), |c, (i, d, o)| {
//!         c.copy_h2d(i.host(), d.view())?;
//!         c.kernel(Kernel::Scale { s: 3.0 }, d.view())?;
//!         c.copy_d2h(d.view(), o.host_mut())
//!     })
//!     .await?;
//! assert_eq!(output.as_slice()[0], 6.0);
//! # drop((input, dev)); Ok(()) }
//! ```

pub mod backend;
pub mod compare;
pub mod completion;
mod cpu;
mod cuda;
pub mod device;
pub mod error;
pub mod kernel;
pub mod memory;
pub mod pipeline;
pub mod pool;
pub mod ptx;
pub mod stream;

pub use backend::{BackendKind, DeviceInfo, HostFlags};
pub use compare::{compare_sync_async, Comparison};
pub use cpu::{memlock_limit, LockPolicy};
pub use cuda::{driver_present, WaitMode};
pub use device::{BackendChoice, Device, DeviceOptions};
pub use error::{Error, Result};
pub use kernel::Kernel;
pub use memory::{
    DeviceBuffer, DeviceSlice, HostSlice, HostSliceMut, MappedFlag, PinnedBuffer, PinnedHost,
    Registered,
};
pub use pipeline::{Pipeline, Plan};
pub use pool::{PinnedPool, PoolStats, PooledBuffer};
pub use stream::{Commands, Event, Job, Stream};
