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
//! stream-ordered memory pool), `module.rs` (loaded modules and functions).

mod backend;
mod event;
mod module;
mod ordered;
mod shared;
mod stream;
mod watch;

pub(crate) use backend::CudaBackend;
use event::EventHandle;
use module::{FunctionHandle, ModuleHandle};
use ordered::OrderedMem;
use shared::{on_watcher, ParkedFree, RawCuEvent, Shared, EVENT_POOL_CAP};
use stream::{CudaStream, StreamHandle};
use watch::WatchTx;

use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};

/// How watcher threads wait for GPU completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WaitMode {
    /// `cuEventSynchronize` spins (the context's automatic scheduling):
    /// lowest latency; a core is busy while a stream has pending work, and
    /// for 50 µs after (the watcher looks for the next point before it
    /// sleeps).
    #[default]
    Spin,
    /// Events carry `CU_EVENT_BLOCKING_SYNC`: the watcher sleeps until the
    /// GPU interrupts; no busy core, but the interrupt path is slow (on the
    /// H200: wake median about 65 us, p99 about 300 us).
    Blocking,
    /// The watcher asks the driver whether the event is done
    /// (`cuEventQuery`) and sleeps [`POLL_INTERVAL`] between asks, with its
    /// thread's timer slack lowered to 1 us so the sleeps are that short: no
    /// busy core (a few percent of one while work is pending; the latency
    /// part measures it), wake latency about the interval.
    Poll,
}

/// How device memory is allocated and freed on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DeviceMemory {
    /// Stream-ordered (`cuMemAllocFromPoolAsync` / `cuMemFreeAsync`, a
    /// memory pool of the device handle's own) where the driver supports
    /// memory pools, else [`DeviceMemory::Plain`]: a free never waits for
    /// the device, and a cancelled job's buffers are freed the moment its
    /// work is done. Freed memory stays in the pool for reuse until the
    /// device handle goes.
    #[default]
    StreamOrdered,
    /// `cuMemAlloc` / `cuMemFree`, which wait while any kernel of the device
    /// runs; frees asked for on a completion thread are deferred to the next
    /// allocation, free or synchronize on another thread.
    Plain,
}

/// How long a [`WaitMode::Poll`] watcher sleeps between two queries.
pub const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_micros(20);

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; no other precondition.
    unsafe { sys::is_culib_present() }
}

/// How many CUDA devices the driver reports (0 without a driver).
///
/// # Errors
/// The driver's error from `cuInit` or `cuDeviceGetCount`.
pub(crate) fn device_count() -> Result<usize> {
    if !driver_present() {
        return Ok(0);
    }
    let drv = |call: &'static str| {
        move |e: cudarc::driver::DriverError| Error::Driver {
            call,
            code: code_name(e.0),
        }
    };
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Errors after which the context cannot be used again.
fn is_sticky(code: CUresult) -> bool {
    use CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

fn code_name(code: CUresult) -> String {
    let err = cudarc::driver::DriverError(code);
    match err.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{code:?}"),
    }
}
