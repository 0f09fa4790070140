//! The [`Device`] handle: one device and its backend, whichever it is (the
//! CUDA driver or the CPU emulation); opening one is in `open.rs`.

use crate::backend::{Backend, BackendKind, DeviceInfo, RawStream};
use crate::base::error::{Error, Result};
use std::any::Any;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The backend of every open device, by [`Device::id`]: commands that meet
/// memory of another device (peer copies) find its context here. Weak, so
/// a device closes as usual; a view of its memory keeps it open (its buffer
/// holds the device).
static OPEN: Mutex<Vec<(usize, Weak<dyn Backend>)>> = Mutex::new(Vec::new());

/// The backend of the open device `id`.
pub(crate) fn backend_by_id(id: usize) -> Option<Arc<dyn Backend>> {
    crate::base::completion::lock(&OPEN)
        .iter()
        .find(|(i, w)| *i == id && w.strong_count() > 0)
        .and_then(|(_, w)| w.upgrade())
}

/// A handle to one device and its backend; cheap to clone.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{BackendKind, Device};
/// let device = Device::cpu(); // `Device::from_env()?`: CUDA when present, else this
/// assert_eq!(device.kind(), BackendKind::Cpu);
/// println!("{}", device.banner()); // which backend runs, and why
/// let handle = device.clone(); // the same device
/// assert!(handle.same_as(&device));
/// assert!(!Device::cpu().same_as(&device)); // another emulated device
/// assert!(device.broken().is_none());
/// device.synchronize()?; // nothing queued: returns at once
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Device {
    pub(crate) backend: Arc<dyn Backend>,
    note: Arc<str>,
    /// Device buffers alive now (a leak and use-after-free check for tests).
    pub(crate) live_buffers: Arc<std::sync::atomic::AtomicUsize>,
    /// The streams opened on this device (for `synchronize`).
    streams: Arc<Mutex<Vec<Weak<dyn RawStream>>>>,
    /// The in-tree kernels, loaded at open (lazily for `Device::cpu`): the
    /// kernel layer's `Builtins`, held without naming them (kernels are
    /// built on devices, above them).
    builtins: Arc<OnceLock<Box<dyn Any + Send + Sync>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", self.info()).finish()
    }
}

impl Device {
    /// The device's ordinal among those of its backend.
    pub fn ordinal(&self) -> usize {
        self.info().ordinal
    }

    /// Whether copies between this device and `peer`
    /// ([`Commands::copy_peer`](crate::Commands::copy_peer)) go directly
    /// (peer access, over NVLink or PCIe), enabling it where the topology
    /// allows; `false` when the driver must stage them through host memory
    /// (they still work). Two emulated devices: `true`.
    ///
    /// # Errors
    /// `InvalidArgument` for devices of different backends; a driver error.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<bool> {
        if self.kind() != peer.kind() {
            return Err(Error::InvalidArgument(
                "peer access between devices of different backends".into(),
            ));
        }
        self.backend.enable_peer_access(&*peer.backend)
    }

    /// The device's PCI address (`0000:17:00.0`), for a GPU.
    pub fn pci_bus_id(&self) -> Option<String> {
        self.backend.pci_bus_id()
    }

    /// The host's NUMA node closest to the device, as the platform reports
    /// it (sysfs, the same source as `nvidia-smi topo -m`): `None` for the
    /// CPU emulation, or when the platform does not say (`-1`, as in most
    /// VMs). [`PinnedPool::near`](crate::PinnedPool::near) places memory there.
    pub fn numa_node(&self) -> Option<u32> {
        let id = self.pci_bus_id()?;
        crate::base::numa::node_of_pci_in(std::path::Path::new(crate::base::numa::SYSFS), &id)
    }

    pub(crate) fn wrap(backend: Arc<dyn Backend>, note: Arc<str>) -> Device {
        {
            let mut open = crate::base::completion::lock(&OPEN);
            open.retain(|(_, w)| w.strong_count() > 0);
            open.push((
                Arc::as_ptr(&backend) as *const () as usize,
                Arc::downgrade(&backend),
            ));
        }
        Device {
            backend,
            note,
            live_buffers: Arc::default(),
            streams: Arc::default(),
            builtins: Arc::default(),
        }
    }

    /// Name, driver, size of the device.
    pub fn info(&self) -> &DeviceInfo {
        self.backend.info()
    }

    /// The backend's kind.
    pub fn kind(&self) -> BackendKind {
        self.info().backend
    }

    /// One line saying which backend runs and why.
    pub fn banner(&self) -> String {
        let i = self.info();
        let driver = i
            .driver
            .as_deref()
            .map(|d| format!(", driver {d}"))
            .unwrap_or_default();
        format!(
            "backend: {} — {} ({} compute units, {:.1} GiB{driver}) [{}]",
            i.backend,
            i.name,
            i.compute_units,
            i.total_memory as f64 / (1u64 << 30) as f64,
            self.note
        )
    }

    /// Device buffers of this handle alive now, including those a cancelled
    /// job keeps until the GPU is done with them (a test hook).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn live_device_buffers(&self) -> usize {
        self.live_buffers.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many frees and unregistrations of this device's memory have
    /// failed (every handle of the device, and every pool, buffer and
    /// registration made on it, counts here): those on drop paths, which
    /// have no caller to return their error to, and those an explicit form
    /// returned ([`Registered::try_into_inner`](crate::Registered::try_into_inner),
    /// [`RegisteredRaw::try_into_owner`](crate::interop::RegisteredRaw::try_into_owner)).
    /// Each is also logged with the `log` crate (`warn`, target
    /// `gpufeed::release`), which the library does not install a logger for.
    /// A pool counts its own failed frees as well
    /// ([`PoolStats::failed_frees`](crate::PoolStats::failed_frees)).
    pub fn release_failures(&self) -> u64 {
        self.backend.release_failures().count()
    }

    /// A test hook: the next `n` frees or unregistrations of host memory on
    /// this device report a failure after doing their work (CPU emulation
    /// only; a no-op on CUDA).
    #[cfg(feature = "hooks")]
    #[doc(hidden)]
    pub fn plant_release_failures(&self, n: usize) {
        self.backend.plant_release_failures(n);
    }

    /// The first unrecoverable error, if the context is broken.
    pub fn broken(&self) -> Option<Error> {
        self.backend.broken()
    }

    /// Blocks the calling thread until all work queued so far on the
    /// device's streams has finished *and* its completions have been
    /// delivered: every job queued before the call is done, and the buffers
    /// of dropped (cancelled) jobs are back in their pools or freed when it
    /// returns. Synchronous code only (never on an executor thread).
    ///
    /// # Errors
    /// `Internal` on a completion thread (the `Drop` of a cancelled job's
    /// bundle), where it would wait for itself. The first fault of the work
    /// waited for ([`Error::ContextBroken`]
    /// after a trap), or a driver error.
    pub fn synchronize(&self) -> Result<()> {
        crate::base::completion::refuse_blocking_on_completion_thread("Device::synchronize")?;
        let streams: Vec<Arc<dyn RawStream>> = crate::base::completion::lock(&self.streams)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        let mut first_err = None;
        for s in &streams {
            // A point recorded now completes after everything queued before it
            // on that stream, and its completion source delivers completions
            // (and runs deferred releases) in order: once it is done, so are
            // they. Recorded even on a broken context (the CPU records
            // anyway; on CUDA the error comes back at once).
            let r = s.record(false).and_then(|ev| ev.completion.block());
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        drop(streams);
        let r = self.backend.synchronize();
        match first_err {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Remembers a stream for [`Device::synchronize`].
    pub(crate) fn register_stream(&self, raw: &Arc<dyn RawStream>) {
        let mut streams = crate::base::completion::lock(&self.streams);
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(raw));
    }

    /// The in-tree kernels of `gpu-kernels` on this device, loaded by `load`
    /// the first time (`Builtins::of`).
    pub(crate) fn builtins<T: Any + Send + Sync>(
        &self,
        load: impl FnOnce(&Device) -> Result<T>,
    ) -> Result<&T> {
        let slot = match self.builtins.get() {
            Some(b) => b,
            None => {
                let loaded = load(self)?;
                // Another thread may have won the race; either copy is the same.
                self.builtins.get_or_init(|| Box::new(loaded))
            }
        };
        slot.downcast_ref()
            .ok_or_else(|| Error::Internal("the in-tree kernels' slot holds another type".into()))
    }

    /// Identity used to reject mixing buffers of different devices.
    /// Whether `other` is a handle of this same device (buffers of one
    /// can be used with the other).
    pub fn same_as(&self, other: &Device) -> bool {
        self.id() == other.id()
    }

    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.backend) as *const () as usize
    }

    /// Identity of the host memory this device's pinned buffers are: one
    /// per backend kind, since every device of a backend can copy from any
    /// of them (portable pinned memory on CUDA; plain memory on the CPU).
    pub(crate) fn host_domain(&self) -> usize {
        match self.kind() {
            BackendKind::Cuda => 1,
            BackendKind::Cpu => 2,
        }
    }
}
