//! The CUDA driver backend, over cudarc's `result`/`sys` layers (the driver is
//! loaded at run time, so one binary also runs where there is none).
//!
//! Completion source: each stream has a *watcher thread* fed, in stream order,
//! with the events recorded on it; it waits for each with `cuEventSynchronize`
//! and completes the matching [`Completion`]. Events of one stream finish in
//! order, so waiting for the oldest first is exact. The watcher also reports
//! faults: a trapped kernel makes `cuEventSynchronize` fail, and the error
//! reaches every awaiting future instead of a hang (a `cuLaunchHostFunc`
//! callback is never called once the context has failed, so it could not).
//! [`WaitMode`] picks how the watcher waits: spinning (lowest latency, one
//! busy core while work is pending), blocking-sync events (the thread
//! sleeps until the GPU interrupts) or polling with short sleeps. The
//! wake-latency benchmark measures all three.
//!
//! Watchers never free memory: a deferred release (a dropped job's buffers)
//! runs on the watcher, but `cuMemFree`/`cuMemFreeHost` may wait for the
//! whole device, which would hold the stream's later completions behind
//! unrelated work, or deadlock when that work waits for one of them (as do
//! `cuMemHostUnregister` and the allocations: all were measured waiting for
//! a kernel running on another stream). Such frees and unregistrations are
//! parked and done by the next allocation, free, (un)registration, new
//! stream or synchronize on another thread, or when the device goes.
//! Device memory is the exception where the driver has memory pools
//! ([`DeviceMemory::StreamOrdered`], the default): it comes from a pool of
//! the backend's own and is freed with `cuMemFreeAsync` on an internal
//! stream, which waits for nothing, so a watcher frees it at once.

//! Files: `backend.rs` (the device: memory, registration, modules,
//! streams), `stream.rs` (commands on a stream), `watch.rs` (the watcher
//! thread), `event.rs` (recycled events), `shared.rs` (what all of them
//! share: the context, its broken state, parked frees), `ordered.rs` (the
//! stream-ordered memory pool), `module.rs` (loaded modules and functions),
//! `options.rs` (how watchers wait, how device memory is allocated),
//! `driver.rs` (the driver's presence, device count, error codes, raw stream
//! handles).

mod backend;
mod driver;
mod event;
mod module;
mod options;
mod ordered;
mod shared;
mod stream;
mod watch;

pub(crate) use backend::CudaBackend;
pub(crate) use driver::device_count;
pub use driver::driver_present;
pub use options::{DeviceMemory, WaitMode, POLL_INTERVAL};

/// Makes the context of the device whose backend is `backend` current on
/// this thread (cuFile's calls need it).
pub(crate) fn bind(backend: &dyn crate::backend::Backend) -> crate::base::error::Result<()> {
    match backend.as_any().downcast_ref::<shared::Shared>() {
        Some(s) => s.bind(),
        None => Err(crate::base::error::Error::InvalidArgument(
            "not a CUDA device".into(),
        )),
    }
}
