//! DLPack: exporting our buffers as capsules (legacy `dltensor` and
//! versioned `dltensor_versioned`), importing CUDA tensors of others.

use crate::dtype::{DType, ALL};
use crate::foreign::{check_c_contiguous, Imported};
use crate::{convert::buffer_error, convert::IntoPy};
use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

const READ_ONLY: u64 = 1;
const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// What an export describes.
pub struct Spec {
    pub data: *mut c_void,
    pub device: (i32, i32),
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub readonly: bool,
}

/// What keeps an export's memory valid until the consumer calls the deleter.
pub enum Keep {
    /// A memoryview of a `PinnedBuffer` (a counted export).
    Host(#[allow(dead_code)] Py<PyAny>),
    /// A `DeviceArray` and its count of DLPack exports.
    Device(DeviceKeep),
}

/// Which stream the consumer of a device export works on: the release
/// waits for it.
#[derive(Clone, Copy, Debug)]
pub enum Consumer {
    /// A stream handle (1: the legacy default stream) that stays valid in
    /// the device's primary context while the consumer uses the tensor.
    Stream(u64),
    /// Unknown (`stream=-1`, or the per-thread default stream of a thread
    /// the release may not run on): the release waits for the whole device.
    Unknown,
}

/// Releases of a `DeviceArray`'s DLPack exports whose consumers' streams
/// may not be past them yet: every later use or free of the array waits
/// for them (GIL released).
#[derive(Default)]
pub struct Releases(std::sync::Mutex<Vec<gpufeed::interop::ReleasePoint>>);

impl Releases {
    /// Notes a release.
    pub fn push(&self, point: gpufeed::interop::ReleasePoint) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|p| !p.is_done());
        v.push(point);
    }

    /// The releases not passed yet.
    pub fn pending(&self) -> Vec<gpufeed::interop::ReleasePoint> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        v.retain(|p| !p.is_done());
        v.clone()
    }

    /// Waits (GIL released) until every release noted so far has passed.
    pub fn settle(&self) {
        let pending = self.pending();
        if pending.is_empty() {
            return;
        }
        Python::attach(|py| {
            py.detach(|| {
                for p in pending {
                    // An error is a broken context: the consumer's work is over.
                    let _ = p.block();
                }
            })
        });
    }
}

/// A device export's hold on its `DeviceArray`: on release (the consumer's
/// deleter, or an unconsumed capsule's destructor), the export stops
/// counting at once (with the release noted in the array's `releases`,
/// which every later use and free of the array waits for), but the array
/// itself (so its memory) is let go only once the consumer's stream, as
/// given at export, is past the point of release: the consumer's queued
/// kernels may still read it.
pub struct DeviceKeep {
    pub array: Option<Py<PyAny>>,
    pub exports: Arc<AtomicUsize>,
    pub releases: Arc<Releases>,
    pub device: gpufeed::Device,
    pub consumer: Consumer,
}

impl Drop for DeviceKeep {
    fn drop(&mut self) {
        let point = match self.consumer {
            // SAFETY: the handle the consumer gave `__dlpack__(stream=...)`
            // for its use of the tensor, which it is still using until this
            // release (DLPack: the consumer keeps the stream alive while it
            // uses the tensor); 1 is the legacy default stream. If recording
            // fails anyway, the point is a device-wide synchronize.
            Consumer::Stream(h) => unsafe {
                gpufeed::interop::release_after_foreign_stream(&self.device, h)
            },
            Consumer::Unknown => gpufeed::interop::release_after_device_idle(&self.device),
        };
        // Noted before the count drops: whoever sees no export sees the release.
        self.releases.push(point.clone());
        self.exports.fetch_sub(1, Ordering::SeqCst);
        // Dropping a `Py` without the GIL (on the release thread) defers the
        // decref: the array is freed later, on a thread holding the GIL.
        let array = self.array.take();
        point.defer(move || drop(array));
    }
}

/// The managed tensor and everything it points to, in one allocation.
#[repr(C)]
struct Legacy {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    _keep: Keep,
}

#[repr(C)]
struct Versioned {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    _keep: Keep,
}

unsafe extern "C" fn legacy_deleter(m: *mut DLManagedTensor) {
    if !m.is_null() {
        // SAFETY: `m` is the first field of a `Legacy` boxed by `export`
        // (repr(C)), and DLPack calls the deleter once. Dropping a `Py`
        // without the GIL defers the decref, so any thread may call this.
        drop(unsafe { Box::from_raw(m.cast::<Legacy>()) });
    }
}

unsafe extern "C" fn versioned_deleter(m: *mut DLManagedTensorVersioned) {
    if !m.is_null() {
        // SAFETY: as in `legacy_deleter`, for a `Versioned`.
        drop(unsafe { Box::from_raw(m.cast::<Versioned>()) });
    }
}

/// The capsule destructor: runs the deleter if no consumer took the tensor
/// (a consumer renames the capsule to `used_dltensor[_versioned]`).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by the interpreter with a live capsule and the GIL.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        } else if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(d) = p.as_ref().and_then(|m| m.deleter) {
                d(p);
            }
        }
    }
}

fn tensor(spec: &Spec, shape: *mut i64) -> DLTensor {
    let (code, bits) = spec.dtype.dlpack();
    DLTensor {
        data: spec.data,
        device: DLDevice {
            device_type: spec.device.0,
            device_id: spec.device.1,
        },
        ndim: spec.shape.len() as i32,
        dtype: DLDataType {
            code,
            bits,
            lanes: 1,
        },
        shape,
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// A DLPack capsule for `spec`, keeping `keep` until the consumer is done:
/// versioned (1.0) when the consumer's `max_version` allows, else legacy.
pub fn export(
    py: Python<'_>,
    spec: Spec,
    keep: Keep,
    max_version: Option<(u32, u32)>,
) -> PyResult<Bound<'_, PyAny>> {
    let (ptr, name): (*mut c_void, &'static CStr) = if max_version.is_some_and(|v| v.0 >= 1) {
        let mut b = Box::new(Versioned {
            managed: DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(versioned_deleter),
                flags: if spec.readonly { READ_ONLY } else { 0 },
                dl_tensor: tensor(&spec, std::ptr::null_mut()),
            },
            shape: spec.shape.clone(),
            _keep: keep,
        });
        b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
        let raw = Box::into_raw(b);
        // SAFETY: raw is a live, exclusively owned allocation.
        unsafe { (*raw).managed.manager_ctx = raw.cast() };
        (raw.cast(), VERSIONED)
    } else {
        let mut b = Box::new(Legacy {
            managed: DLManagedTensor {
                dl_tensor: tensor(&spec, std::ptr::null_mut()),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(legacy_deleter),
            },
            shape: spec.shape.clone(),
            _keep: keep,
        });
        b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
        let raw = Box::into_raw(b);
        // SAFETY: raw is a live, exclusively owned allocation.
        unsafe { (*raw).managed.manager_ctx = raw.cast() };
        (raw.cast(), LEGACY)
    };
    // SAFETY: ptr is non-null; the name is static; the destructor handles an
    // unconsumed capsule.
    let cap = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor)) };
    if cap.is_null() {
        // SAFETY: the capsule was not made: nobody else owns `ptr`.
        unsafe {
            if name == VERSIONED {
                versioned_deleter(ptr.cast());
            } else {
                legacy_deleter(ptr.cast());
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference returned by PyCapsule_New.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}

fn dtype_of(code: u8, bits: u8, lanes: u16) -> PyResult<DType> {
    ALL.into_iter()
        .find(|d| d.dlpack() == (code, bits) && lanes == 1)
        .ok_or_else(|| {
            PyTypeError::new_err(format!(
                "unsupported DLPack dtype (code {code}, bits {bits}, lanes {lanes})"
            ))
        })
}

/// Imports a CUDA tensor through `__dlpack__`: the producer makes a stream
/// of ours wait for its pending work, which we wait for; the capsule is kept
/// (unconsumed: its destructor releases the tensor) as the owner.
pub fn import_cuda(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    device: &gpufeed::Device,
) -> PyResult<Imported> {
    let hs = gpufeed::interop::HandshakeStream::new(device).py()?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("stream", hs.handle())?;
    let cap = obj.call_method("__dlpack__", (), Some(&kwargs))?;
    py.detach(|| hs.synchronize()).py()?;
    // SAFETY: a live object; IsValid only checks the type and name.
    if unsafe { ffi::PyCapsule_IsValid(cap.as_ptr(), LEGACY.as_ptr()) } != 1 {
        return Err(PyTypeError::new_err(
            "__dlpack__ did not return a \"dltensor\" capsule",
        ));
    }
    // SAFETY: a valid capsule of that name.
    let m = unsafe { ffi::PyCapsule_GetPointer(cap.as_ptr(), LEGACY.as_ptr()) }
        .cast::<DLManagedTensor>();
    // SAFETY: a non-null managed tensor the capsule owns, alive while `cap` is.
    let t = match unsafe { m.as_ref() } {
        Some(m) => &m.dl_tensor,
        None => return Err(PyErr::fetch(py)),
    };
    let ordinal = device.info().ordinal as i32;
    if t.device.device_type != 2 || t.device.device_id != ordinal {
        return Err(buffer_error(format!(
            "the tensor is on DLPack device ({}, {}), not (kDLCUDA=2, {ordinal})",
            t.device.device_type, t.device.device_id
        )));
    }
    let dtype = dtype_of(t.dtype.code, t.dtype.bits, t.dtype.lanes)?;
    let ndim = t.ndim.max(0) as usize;
    let shape: Vec<usize> = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack: `shape` holds `ndim` values, alive with the tensor.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
            .iter()
            .map(|&d| d.max(0) as usize)
            .collect()
    };
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: as for shape; strides in elements.
        let strides: Vec<isize> = unsafe { std::slice::from_raw_parts(t.strides, ndim) }
            .iter()
            .map(|&s| s as isize * dtype.size() as isize)
            .collect();
        check_c_contiguous(&shape, &strides, dtype.size())?;
    }
    Ok(Imported {
        addr: t.data as u64 + t.byte_offset,
        shape,
        dtype,
        owner: cap.unbind(),
    })
}
