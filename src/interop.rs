//! Raw access for language bindings (the `gpufeed` Python module): the
//! pieces the safe API hides on purpose, each either a checked safe function
//! or an `unsafe fn` with its contract spelled out.
//!
//! - Reinterpreting byte views as typed views ([`cast_host`], [`cast_host_mut`],
//!   [`cast_device`], [`cast_device_mut`]): safe, checked (alignment, whole
//!   elements), because every element type is `Pod`.
//! - Pinning memory the crate does not own ([`RegisteredRaw`]): the caller
//!   promises the range stays valid, unmoved and untouched while registered,
//!   and hands over an `owner` value that keeps it so; the owner is dropped
//!   only after the range is unregistered.
//! - Foreign device memory as views ([`device_slice`], [`device_slice_mut`]):
//!   the caller promises validity and exclusivity until the commands are done.
//! - Raw handles: a device buffer's address ([`device_ptr`]), a CUDA event's
//!   handle ([`raw_event`]), a foreign CUDA stream waiting on our stream
//!   ([`foreign_stream_wait`]), and a driver stream of our own to hand to a
//!   producer's `__dlpack__(stream=...)` ([`HandshakeStream`]).
//! - Releasing memory a foreign consumer used: a [`ReleasePoint`] that passes
//!   once a consumer's stream (or the whole device) is past its work
//!   ([`release_after_foreign_stream`], [`release_after_device_idle`]).
//!
//! On the CPU emulation device addresses are host addresses, there are no
//! driver handles: [`raw_event`] returns `None`, and the CUDA-only calls
//! return [`Error::BackendUnavailable`].

use crate::backend::BackendKind;
use crate::base::completion::Completion;
use crate::base::error::{Error, Result};
use crate::runtime::device::Device;
use crate::runtime::memory::{
    device_slice_mut as raw_device_slice_mut, host_slice, host_slice_mut, DeviceBuffer,
    DeviceSlice, DeviceSliceMut, HostSlice, HostSliceMut, PinnedHost,
};
use crate::runtime::stream::{Event, Stream};
use bytemuck::Pod;

/// The device address of `buffer` (a host address on the CPU emulation).
/// Reading it is harmless; using it is the caller's business (see
/// [`device_slice_mut`] for the contract of commands on raw addresses).
pub fn device_ptr<T: Pod>(buffer: &DeviceBuffer<T>) -> u64 {
    buffer.raw_parts().0
}

/// The identity of a device (what the crate compares to refuse mixing the
/// buffers of two devices).
pub fn device_id(device: &Device) -> usize {
    device.id()
}

fn cast_len<T>(addr: usize, bytes: usize) -> Result<usize> {
    let size = std::mem::size_of::<T>();
    if size == 0 {
        return Err(Error::InvalidArgument("zero-sized element type".into()));
    }
    if !bytes.is_multiple_of(size) {
        return Err(Error::InvalidArgument(format!(
            "{bytes} bytes are not a whole number of {size}-byte elements"
        )));
    }
    if bytes > 0 && !addr.is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Error::InvalidArgument(format!(
            "address {addr:#x} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    Ok(bytes / size)
}

/// A byte source view as a view of `T`.
///
/// # Errors
/// `InvalidArgument` when the bytes are not a whole number of aligned `T`.
pub fn cast_host<T: Pod>(s: HostSlice<'_, u8>) -> Result<HostSlice<'_, T>> {
    let len = cast_len::<T>(s.ptr as usize, s.len)?;
    Ok(host_slice(s.ptr.cast(), len, s.device_id))
}

/// A byte destination view as a view of `T`.
///
/// # Errors
/// As [`cast_host`].
pub fn cast_host_mut<T: Pod>(s: HostSliceMut<'_, u8>) -> Result<HostSliceMut<'_, T>> {
    let len = cast_len::<T>(s.ptr as usize, s.len)?;
    Ok(host_slice_mut(s.ptr.cast(), len, s.device_id))
}

/// A byte device view as a view of `T`.
///
/// # Errors
/// As [`cast_host`].
pub fn cast_device<T: Pod>(s: DeviceSlice<'_, u8>) -> Result<DeviceSlice<'_, T>> {
    let len = cast_len::<T>(s.addr as usize, s.len)?;
    // SAFETY: the same range as `s`, which is borrowed for the same lifetime
    // under the same rules; only the element type changes (T: Pod).
    Ok(unsafe { raw_device_slice_mut::<T>(s.addr, len, s.device_id) }.into())
}

/// A byte device write view as a write view of `T`.
///
/// # Errors
/// As [`cast_host`].
pub fn cast_device_mut<T: Pod>(s: DeviceSliceMut<'_, u8>) -> Result<DeviceSliceMut<'_, T>> {
    let len = cast_len::<T>(s.addr as usize, s.len)?;
    // SAFETY: as for `cast_device`, keeping the exclusive borrow of `s`.
    Ok(unsafe { raw_device_slice_mut::<T>(s.addr, len, s.device_id) })
}

/// A read view of foreign device memory (a PyTorch or CuPy allocation).
///
/// # Safety
/// `addr..addr + len * size_of::<T>()` is device memory of `device`'s
/// context, that stays allocated and is written by nothing else until a
/// point recorded on the stream after the commands given this view has
/// completed.
pub unsafe fn device_slice<'a, T>(device: &Device, addr: u64, len: usize) -> DeviceSlice<'a, T> {
    // SAFETY: the caller's contract (a read view is the weaker promise).
    unsafe { raw_device_slice_mut(addr, len, device.id()) }.into()
}

/// A write view of foreign device memory (a PyTorch or CuPy allocation).
///
/// # Safety
/// As [`device_slice`], and nothing else reads or writes the range until
/// then (the commands given this view have it to themselves).
pub unsafe fn device_slice_mut<'a, T>(
    device: &Device,
    addr: u64,
    len: usize,
) -> DeviceSliceMut<'a, T> {
    // SAFETY: the caller's contract.
    unsafe { raw_device_slice_mut(addr, len, device.id()) }
}

/// What a registration lets the device do with the range.
#[derive(Clone, Copy)]
enum Access {
    ReadWrite,
    ReadOnly,
}

/// Host memory the crate does not own, pinned in place (`cuMemHostRegister`;
/// `mlock` on the CPU emulation) for as long as this guard lives. The
/// `owner` given at registration (e.g. a Python buffer export that keeps a
/// NumPy array's memory from being freed or resized) is dropped only after
/// the range has been unregistered, so a job that holds the guard keeps the
/// memory alive and registered until the GPU is done with it.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::interop::RegisteredRaw;
/// use gpufeed::{block_on, Device, DeviceBuffer, Stream};
/// let device = Device::cpu();
/// let mut bytes = vec![9u8; 4096]; // memory of someone else's (a NumPy array's, say)
/// let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
/// // SAFETY: the `Vec` moves into the owner, its heap buffer stays put, and nothing
/// // else touches it while the guard lives.
/// let guard = unsafe { RegisteredRaw::new(&device, ptr, len, Box::new(bytes))? };
/// assert_eq!(guard.byte_len(), 4096);
/// let dev = DeviceBuffer::<u8>::new(&device, 4096)?;
/// let ((guard, mut dev), ()) = block_on(Stream::new(&device)?.copy_h2d(guard, dev))?;
/// drop(guard.into_owner()); // unregistered, then the owner handed back
/// let mut out = vec![0u8; 4096];
/// dev.copy_to_host_sync(&mut out)?;
/// assert!(out.iter().all(|&b| b == 9));
/// # Ok(()) }
/// ```
///
/// A failed unregistration on drop (or in [`RegisteredRaw::into_owner`]) is
/// counted in [`Device::release_failures`] and logged;
/// [`RegisteredRaw::try_into_owner`] returns it.
pub struct RegisteredRaw {
    ptr: *mut u8,
    bytes: usize,
    device: Device,
    owner: Option<Box<dyn Send>>,
    locked: bool,
}

// SAFETY: the guard stands for exclusive use of the range (the contract of
// `new`); the owner is Send.
unsafe impl Send for RegisteredRaw {}
// SAFETY: shared access only makes read views.
unsafe impl Sync for RegisteredRaw {}

impl std::fmt::Debug for RegisteredRaw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredRaw")
            .field("bytes", &self.bytes)
            .field("locked", &self.locked)
            .finish()
    }
}

impl RegisteredRaw {
    /// Registers `ptr..ptr + bytes` with the driver.
    ///
    /// # Safety
    /// The range is valid for reads and writes, and stays allocated and
    /// unmoved while `owner` is alive; while the guard lives nothing but the
    /// guard's views reads or writes it (the caller keeps every other access
    /// out); it is not registered already.
    ///
    /// # Errors
    /// The driver's refusal (`LockFailed`, a driver error such as
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`); `owner` is dropped then.
    pub unsafe fn new(
        device: &Device,
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn Send>,
    ) -> Result<RegisteredRaw> {
        // SAFETY: the caller's contract.
        unsafe { Self::register(device, ptr, bytes, owner, Access::ReadWrite) }
    }

    /// As [`RegisteredRaw::new`], for a range the device only reads (a
    /// read-only file mapping, for one): the range need only be valid for
    /// reads, and [`RegisteredRaw::as_mut_ptr`] must not be written through.
    ///
    /// # Safety
    /// As for `new`, with the range valid for reads (not writes).
    ///
    /// # Errors
    /// As for `new`.
    pub unsafe fn new_read_only(
        device: &Device,
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn Send>,
    ) -> Result<RegisteredRaw> {
        // SAFETY: the caller's contract.
        unsafe { Self::register(device, ptr, bytes, owner, Access::ReadOnly) }
    }

    /// Registers the range for `access` (the contracts of `new` and
    /// `new_read_only`).
    unsafe fn register(
        device: &Device,
        ptr: *mut u8,
        bytes: usize,
        owner: Box<dyn Send>,
        access: Access,
    ) -> Result<RegisteredRaw> {
        if let Some(e) = device.broken() {
            return Err(e);
        }
        let locked = if bytes == 0 {
            true // nothing to lock
        } else {
            // SAFETY: the caller's contract: valid for `access` and unmoved
            // until unregistered.
            unsafe {
                match access {
                    Access::ReadWrite => device.backend.register_host(ptr, bytes)?,
                    Access::ReadOnly => device.backend.register_host_read_only(ptr, bytes)?,
                }
            }
        };
        Ok(RegisteredRaw {
            ptr,
            bytes,
            device: device.clone(),
            owner: Some(owner),
            locked,
        })
    }

    /// Whether the range's pages are locked: always on CUDA; false only on
    /// the CPU emulation when locking was refused (the memlock limit) and the
    /// device's [`LockPolicy`](crate::LockPolicy) allowed unlocked memory.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// The first byte (for a buffer-protocol export of the range; see the
    /// contract of [`RegisteredRaw::new`]: other views are the caller's to keep
    /// out while the guard is in use).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The device it is registered with.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The first byte, for reading (the contract of [`RegisteredRaw::new`]
    /// applies as to [`RegisteredRaw::as_mut_ptr`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Unregisters and gives the owner back. A failed unregistration is
    /// counted ([`Device::release_failures`]) and logged;
    /// [`RegisteredRaw::try_into_owner`] returns it instead.
    pub fn into_owner(self) -> Box<dyn Send> {
        match self.try_into_owner() {
            Ok(owner) => owner,
            Err((_, owner)) => owner, // counted and logged by try_into_owner
        }
    }

    /// Unregisters and gives the owner back, or the unregistration's error
    /// with the owner. The failure is counted in
    /// [`Device::release_failures`] too.
    ///
    /// # Errors
    /// The backend's error from unregistering the range.
    #[allow(clippy::result_large_err)] // the owner comes back either way
    pub fn try_into_owner(mut self) -> std::result::Result<Box<dyn Send>, (Error, Box<dyn Send>)> {
        let mut r = Ok(());
        if self.bytes > 0 {
            // SAFETY: registered in `new`; `self` by value: no view is alive,
            // and a job holding the guard hands it back only at completion.
            r = unsafe { self.device.backend.unregister_host(self.ptr, self.bytes) };
            if let Err(e) = &r {
                let failures = self.device.backend.release_failures();
                failures.note("unregistering host memory", e);
            }
            self.bytes = 0;
        }
        let owner = self.owner.take().unwrap_or_else(|| Box::new(()));
        match r {
            Ok(()) => Ok(owner),
            Err(e) => Err((e, owner)),
        }
    }
}

impl Drop for RegisteredRaw {
    fn drop(&mut self) {
        let owner = self.owner.take();
        if self.bytes == 0 {
            drop(owner);
            return;
        }
        // SAFETY: registered in `new`; the guard is dropped by its owner or by
        // a job's completion, when no transfer uses the range any more; the
        // owner (which keeps the memory alive) goes only after unregistering.
        let r = unsafe {
            self.device.backend.unregister_host_then(
                self.ptr,
                self.bytes,
                Box::new(move || drop(owner)),
            )
        };
        if let Err(e) = r {
            let failures = self.device.backend.release_failures();
            failures.note("unregistering host memory", &e);
        }
    }
}

impl PinnedHost<u8> for RegisteredRaw {
    fn host(&self) -> HostSlice<'_, u8> {
        host_slice(self.ptr, self.bytes, self.device.host_domain())
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, u8> {
        host_slice_mut(self.ptr, self.bytes, self.device.host_domain())
    }
}

/// The driver's handle (`CUevent`) of an event, or `None` on the CPU emulation.
/// The handle lives as long as `event`; a wait enqueued on it stays valid after.
pub fn raw_event(event: &Event) -> Option<u64> {
    event.driver_handle()
}

fn cuda_only(device: &Device, what: &str) -> Result<()> {
    if device.kind() != BackendKind::Cuda {
        return Err(Error::BackendUnavailable(format!(
            "{what} needs the CUDA backend (this device is the {})",
            device.kind()
        )));
    }
    Ok(())
}

/// Checks that `addr .. addr + bytes` is device memory of `device` (one
/// allocation, as the driver records it): what an importer of a foreign
/// array's raw address (`__cuda_array_interface__`, DLPack) does before
/// handing the range to commands, so a wrong or forged address (host memory,
/// another GPU's, past an allocation's end) is refused instead of reaching
/// the GPU.
///
/// # Errors
/// `InvalidArgument` naming what does not hold; `BackendUnavailable` on the
/// CPU emulation.
pub fn check_foreign_device_range(device: &Device, addr: u64, bytes: usize) -> Result<()> {
    use cudarc::driver::sys::{self, CUpointer_attribute as A};
    cuda_only(device, "checking foreign device memory")?;
    let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    let refuse = |why: String| {
        Err(Error::InvalidArgument(format!(
            "foreign array at {addr:#x} ({bytes} bytes): {why}"
        )))
    };
    let (mut kind, mut ordinal, mut start, mut size) = (0u32, -1i32, 0u64, 0usize);
    // SAFETY: each call writes one value of the attribute's documented type
    // (CUmemorytype as u32, int, CUdeviceptr, size_t) into a local of that
    // size; any address may be asked about (unknown ones are an error).
    let asked = unsafe {
        [
            sys::cuPointerGetAttribute(
                (&raw mut kind).cast(),
                A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            ),
            sys::cuPointerGetAttribute(
                (&raw mut ordinal).cast(),
                A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            ),
            sys::cuPointerGetAttribute(
                (&raw mut start).cast(),
                A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                addr,
            ),
            sys::cuPointerGetAttribute(
                (&raw mut size).cast(),
                A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                addr,
            ),
        ]
    };
    if let Some(r) = asked.iter().find(|r| **r != sys::CUresult::CUDA_SUCCESS) {
        return refuse(format!(
            "the driver does not know it as device memory ({r:?})"
        ));
    }
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return refuse(format!("memory type {kind}, not device memory"));
    }
    if usize::try_from(ordinal).ok() != Some(device.info().ordinal) {
        return refuse(format!(
            "memory of device {ordinal}, not of device {}",
            device.info().ordinal
        ));
    }
    let end = addr.checked_add(bytes as u64);
    if addr < start || end.is_none_or(|e| e > start.saturating_add(size as u64)) {
        return refuse(format!(
            "not inside its allocation ({start:#x}, {size} bytes)"
        ));
    }
    Ok(())
}

/// Makes the foreign CUDA stream `foreign` (a PyTorch or CuPy stream
/// handle) wait, on the GPU, for everything queued so far on `stream`:
/// records an event on `stream` and enqueues `cuStreamWaitEvent` on
/// `foreign`. The host does not wait.
///
/// # Safety
/// `foreign` is a live stream handle of the context `stream` runs in (the
/// device's primary context, the one PyTorch and CuPy use), or a default
/// stream: 0 (the NULL stream, which is the legacy default stream: what
/// PyTorch and CuPy report for their default stream), 1
/// (`CU_STREAM_LEGACY`) or 2 (`CU_STREAM_PER_THREAD`).
///
/// # Errors
/// `BackendUnavailable` on the CPU emulation; the driver's error.
pub unsafe fn foreign_stream_wait(stream: &Stream, foreign: u64) -> Result<()> {
    cuda_only(stream.device(), "making a foreign stream wait")?;
    let event = stream.record()?;
    let Some(ev) = raw_event(&event) else {
        return Err(Error::Internal("a CUDA event without a handle".into()));
    };
    let ctx = cudarc::driver::CudaContext::new(stream.device().info().ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: `ev` is alive while `event` is (a wait enqueued on it stays
    // valid after it is recycled); `foreign` per the caller's contract.
    let r = unsafe {
        cudarc::driver::sys::cuStreamWaitEvent(
            foreign as cudarc::driver::sys::CUstream,
            ev as cudarc::driver::sys::CUevent,
            0,
        )
    };
    drop(event);
    r.result().map_err(drv)
}

fn drv(e: cudarc::driver::DriverError) -> Error {
    Error::Driver {
        call: "interop",
        code: format!("{e:?}"),
    }
}

/// A driver stream of our own in the device's primary context, for the
/// DLPack handshake: pass [`HandshakeStream::handle`] as `stream=` to a
/// producer's `__dlpack__` (the producer makes it wait for its pending
/// writes), then [`HandshakeStream::synchronize`] before enqueueing work on
/// the producer's memory.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::interop::HandshakeStream;
/// use gpufeed::{Device, Error};
/// let device = Device::from_env()?; // CUDA when present, else the CPU emulation
/// match HandshakeStream::new(&device) {
///     Ok(stream) => {
///         // Pass `stream.handle()` as `__dlpack__(stream=...)`, then wait for it.
///         assert_ne!(stream.handle(), 0);
///         stream.synchronize()?;
///     }
///     Err(e) => assert!(matches!(e, Error::BackendUnavailable(_))), // the emulation
/// }
/// # Ok(()) }
/// ```
pub struct HandshakeStream {
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
}

impl std::fmt::Debug for HandshakeStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandshakeStream")
            .field("handle", &self.handle())
            .finish()
    }
}

impl HandshakeStream {
    /// A new non-blocking stream on `device`.
    ///
    /// # Errors
    /// `BackendUnavailable` on the CPU emulation; the driver's error.
    pub fn new(device: &Device) -> Result<HandshakeStream> {
        cuda_only(device, "a handshake stream")?;
        let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).map_err(drv)?;
        let stream = ctx.new_stream().map_err(drv)?;
        Ok(HandshakeStream { stream })
    }

    /// The `CUstream` handle as an integer.
    pub fn handle(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    /// Blocks until everything queued on the stream (and what it was made to
    /// wait for) has finished.
    ///
    /// # Errors
    /// The driver's error.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv)
    }
}

/// Blocks until everything queued so far on the foreign CUDA stream
/// `foreign` has finished (`cuStreamSynchronize`): what a consumer of a
/// `__cuda_array_interface__` v3 with a `stream` does before using the memory.
///
/// # Safety
/// `foreign` is a live stream handle of the device's primary context, or
/// 1 / 2 for the legacy and per-thread default streams.
///
/// # Errors
/// `BackendUnavailable` on the CPU emulation; the driver's error.
pub unsafe fn synchronize_foreign_stream(device: &Device, foreign: u64) -> Result<()> {
    cuda_only(device, "synchronizing a foreign stream")?;
    let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    // SAFETY: the caller's contract.
    unsafe { cudarc::driver::sys::cuStreamSynchronize(foreign as cudarc::driver::sys::CUstream) }
        .result()
        .map_err(drv)
}

/// A point after which device memory handed to a foreign consumer (a
/// DLPack or `__cuda_array_interface__` export) may be freed or reused: the
/// consumer's queued work on it has finished. Made by
/// [`release_after_foreign_stream`] or [`release_after_device_idle`];
/// completed by a thread of the crate's own (never the caller's), which
/// then runs the actions given to [`ReleasePoint::defer`] there.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::interop::release_after_device_idle;
/// use gpufeed::Device;
/// use std::sync::{atomic::{AtomicBool, Ordering}, Arc};
/// let device = Device::cpu();
/// let point = release_after_device_idle(&device); // passed at once on the emulation
/// let freed = Arc::new(AtomicBool::new(false));
/// let flag = freed.clone();
/// point.defer(move || flag.store(true, Ordering::SeqCst)); // e.g. drop an exported buffer
/// point.block()?; // or poll `point.is_done()`
/// assert!(point.is_done() && freed.load(Ordering::SeqCst)); // it had passed: ran at once
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ReleasePoint {
    done: Completion,
}

impl ReleasePoint {
    fn completed() -> ReleasePoint {
        let done = Completion::new();
        done.complete(Ok(()));
        ReleasePoint { done }
    }

    /// Whether the point has passed.
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// Runs `action` once the point has passed (at once if it has), on the
    /// crate's release thread: an action must not wait for the GPU.
    pub fn defer(&self, action: impl FnOnce() + Send + 'static) {
        self.done.defer(action);
    }

    /// Blocks the calling thread until the point has passed (release the
    /// GIL first).
    ///
    /// # Errors
    /// The driver's error while waiting (a broken context): the consumer's
    /// work is over either way.
    pub fn block(&self) -> Result<()> {
        self.done.block()
    }
}

/// What the release thread waits for.
enum ReleaseWait {
    /// A `CUevent` recorded on a consumer's stream (destroyed after).
    Event(u64),
    /// Everything queued on the device (`cuCtxSynchronize`).
    DeviceIdle,
}

struct ReleaseJob {
    device: Device,
    wait: ReleaseWait,
    done: Completion,
}

/// The release thread's queue, with the process that made it (a `fork()`
/// child makes its own).
static RELEASER: std::sync::Mutex<Option<(u32, std::sync::mpsc::Sender<ReleaseJob>)>> =
    std::sync::Mutex::new(None);

fn release_wait(device: &Device, wait: &ReleaseWait) -> Result<()> {
    match *wait {
        ReleaseWait::DeviceIdle => device.synchronize(),
        ReleaseWait::Event(ev) => {
            let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).map_err(drv)?;
            ctx.bind_to_thread().map_err(drv)?;
            // SAFETY: `ev` was created and recorded by
            // `release_after_foreign_stream`, and is destroyed only here,
            // once (the driver defers destroying a pending event).
            unsafe {
                let r = cudarc::driver::sys::cuEventSynchronize(ev as cudarc::driver::sys::CUevent);
                cudarc::driver::sys::cuEventDestroy_v2(ev as cudarc::driver::sys::CUevent);
                r.result().map_err(drv)
            }
        }
    }
}

/// Hands `job` to the release thread (started on first use). When no
/// thread can be started, the wait is done here (the caller's thread).
fn queue_release(job: ReleaseJob) {
    let pid = std::process::id();
    let job = {
        let mut q = crate::base::completion::lock(&RELEASER);
        if q.as_ref().is_none_or(|(p, _)| *p != pid) {
            let (tx, rx) = std::sync::mpsc::channel::<ReleaseJob>();
            let spawned = std::thread::Builder::new()
                .name("host-release".into())
                .spawn(move || {
                    // One job at a time, in order: a later one waits behind
                    // an earlier consumer's work at worst (later, never early).
                    while let Ok(job) = rx.recv() {
                        let r = release_wait(&job.device, &job.wait);
                        job.done.complete(r);
                    }
                });
            *q = spawned.ok().map(|_| (pid, tx));
        }
        match q.as_ref() {
            Some((_, tx)) => match tx.send(job) {
                Ok(()) => return,
                Err(std::sync::mpsc::SendError(job)) => job,
            },
            None => job,
        }
    };
    let r = release_wait(&job.device, &job.wait);
    job.done.complete(r);
}

/// A [`ReleasePoint`] that passes once everything queued on `device` when
/// it is made has finished (a device-wide synchronize on the release
/// thread): the choice when the consumer's stream is unknown (a
/// `__cuda_array_interface__` export, a DLPack consumer that asked for no
/// synchronization, the per-thread default stream of a thread that is not
/// the caller's). Passed at once on the CPU emulation (no streams).
pub fn release_after_device_idle(device: &Device) -> ReleasePoint {
    if device.kind() != BackendKind::Cuda {
        return ReleasePoint::completed();
    }
    let done = Completion::new();
    queue_release(ReleaseJob {
        device: device.clone(),
        wait: ReleaseWait::DeviceIdle,
        done: done.clone(),
    });
    ReleasePoint { done }
}

/// A [`ReleasePoint`] that passes once the work queued so far on the
/// foreign CUDA stream `foreign` (a consumer's stream, given to
/// `__dlpack__(stream=...)`) has finished: records an event on `foreign`
/// now, and the release thread waits for it. The caller does not wait.
/// When the event can't be recorded (the stream is gone, say), the point
/// is a device-wide synchronize instead ([`release_after_device_idle`]):
/// later, never early. Passed at once on the CPU emulation.
///
/// # Safety
/// `foreign` is a stream handle of `device`'s primary context (what PyTorch
/// and CuPy use) that is still alive, or 0 / 1 (`CU_STREAM_LEGACY`, the
/// legacy default stream) or 2 (`CU_STREAM_PER_THREAD`: the calling
/// thread's per-thread default stream).
pub unsafe fn release_after_foreign_stream(device: &Device, foreign: u64) -> ReleasePoint {
    if device.kind() != BackendKind::Cuda {
        return ReleasePoint::completed();
    }
    // SAFETY: the caller's contract.
    match unsafe { record_on_foreign_stream(device, foreign) } {
        Ok(ev) => {
            let done = Completion::new();
            queue_release(ReleaseJob {
                device: device.clone(),
                wait: ReleaseWait::Event(ev),
                done: done.clone(),
            });
            ReleasePoint { done }
        }
        Err(e) => {
            log::warn!(
                "recording on the consumer's stream {foreign:#x} failed ({e}): the release \
                 waits for the whole device instead"
            );
            release_after_device_idle(device)
        }
    }
}

/// A new (blocking-sync, untimed) `CUevent` recorded on `foreign`.
///
/// # Safety
/// As [`release_after_foreign_stream`].
unsafe fn record_on_foreign_stream(device: &Device, foreign: u64) -> Result<u64> {
    use cudarc::driver::sys;
    let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).map_err(drv)?;
    ctx.bind_to_thread().map_err(drv)?;
    let mut ev: sys::CUevent = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
    // SAFETY: an out-pointer to a local; the context is current.
    unsafe { sys::cuEventCreate(&mut ev, flags) }
        .result()
        .map_err(drv)?;
    // SAFETY: `ev` is the event just made; `foreign` per the caller's contract.
    let r = unsafe { sys::cuEventRecord(ev, foreign as sys::CUstream) };
    if let Err(e) = r.result() {
        // SAFETY: ours, never recorded: nobody else has it.
        unsafe { sys::cuEventDestroy_v2(ev) };
        return Err(drv(e));
    }
    Ok(ev as u64)
}
