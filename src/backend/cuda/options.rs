//! The options a CUDA device is opened with: how its watcher threads wait,
//! how its device memory is allocated.

/// How watcher threads wait for GPU completion.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceOptions, WaitMode};
/// // Watchers that sleep until the GPU interrupts, leaving every core to the
/// // program (CUDA; the CPU emulation has no watchers and ignores it).
/// let opts = DeviceOptions { wait_mode: WaitMode::Blocking, ..DeviceOptions::from_env()? };
/// let device = Device::open(opts)?; // CUDA when present, else the CPU emulation
/// assert!(device.broken().is_none());
/// assert_eq!(WaitMode::default(), WaitMode::Spin);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "lowercase"))]
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
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Device, DeviceMemory, DeviceOptions};
/// let opts = DeviceOptions { device_memory: DeviceMemory::Plain, ..DeviceOptions::from_env()? };
/// let device = Device::open(opts)?; // CUDA when present, else the CPU emulation
/// // `cuMemAlloc` / `cuMemFree` on CUDA; never stream-ordered on the emulation.
/// assert!(!device.info().stream_ordered_memory);
/// assert_eq!(DeviceMemory::default(), DeviceMemory::StreamOrdered);
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
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
