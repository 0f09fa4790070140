//! The device memory a `DeviceArray` holds (its own, or a foreign array's
//! wrapped in place) and the state it is in: ready, taken by an operation,
//! or freed.

use crate::convert::buffer_error;
use gpufeed::{DeviceBuffer, DeviceSliceMut};
use pyo3::prelude::*;
use std::sync::Mutex;

/// Device memory a `DeviceArray` holds.
pub enum DevMem {
    /// Ours.
    Own(DeviceBuffer<u8>),
    /// A foreign allocation (PyTorch, CuPy) used in place; `owner` (the
    /// DLPack capsule or the exporting object) keeps it allocated.
    Foreign {
        addr: u64,
        bytes: usize,
        device: gpufeed::Device,
        #[allow(dead_code)]
        owner: Py<PyAny>,
    },
}

impl DevMem {
    /// A write view of the whole memory, for a batch that owns `self`.
    pub fn view_mut(&mut self) -> DeviceSliceMut<'_, u8> {
        match self {
            DevMem::Own(b) => b.view_mut(),
            DevMem::Foreign {
                addr,
                bytes,
                device,
                ..
            } => {
                // SAFETY: `owner` keeps the allocation alive while `self` lives,
                // and the view is borrowed from `&mut self`, which a job owns
                // until its commands are done; the producer's pending writes
                // were waited for when it was wrapped (`as_device_array`).
                // What other code does with that memory meanwhile is the
                // caller's (documented) responsibility, as with any foreign
                // device pointer; the driver knew the range as this device's
                // memory when it was imported (`check_foreign_device_range`).
                unsafe { gpufeed::interop::device_slice_mut(device, *addr, *bytes) }
            }
        }
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        match self {
            DevMem::Own(b) => gpufeed::interop::device_ptr(b),
            DevMem::Foreign { addr, .. } => *addr,
        }
    }
}

/// Where a buffer object's memory is.
pub enum State<M> {
    /// Here, usable.
    Ready(M),
    /// Owned by an operation until it is waited for.
    InFlight,
    /// Gone (freed, or released by an operation dropped unwaited), with why.
    Freed(String),
}

impl<M> State<M> {
    /// The memory, or a `BufferError` saying why not.
    pub fn get(&self, what: &str) -> PyResult<&M> {
        match self {
            State::Ready(m) => Ok(m),
            State::InFlight => Err(buffer_error(format!(
                "{what} is in use by an operation: wait() for it first"
            ))),
            State::Freed(why) => Err(buffer_error(format!("{what} is gone: {why}"))),
        }
    }

    /// The memory mutably, or a `BufferError`.
    pub fn get_mut(&mut self, what: &str) -> PyResult<&mut M> {
        match self {
            State::Ready(m) => Ok(m),
            State::InFlight => Err(buffer_error(format!(
                "{what} is in use by an operation: wait() for it first"
            ))),
            State::Freed(why) => Err(buffer_error(format!("{what} is gone: {why}"))),
        }
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    pub fn name(&self) -> &'static str {
        match self {
            State::Ready(_) => "ready",
            State::InFlight => "in-flight",
            State::Freed(_) => "freed",
        }
    }
}

/// A buffer object's [`State`], changed through `&self`: the buffer classes
/// are frozen, so an operation handing its buffers back from anywhere (its
/// `Drop`, run by the garbage collector inside another method of the same
/// object) never meets a borrow flag. The lock is held for plain Rust work
/// only, never across a Python call or a GIL release, and a replaced state
/// is dropped after it is let go (dropping memory may run Python code).
pub struct StateCell<M>(Mutex<State<M>>);

impl<M> StateCell<M> {
    /// Ready with `mem`.
    pub fn ready(mem: M) -> Self {
        StateCell(Mutex::new(State::Ready(mem)))
    }

    /// The state, locked (briefly: see the type's docs).
    pub fn lock(&self) -> std::sync::MutexGuard<'_, State<M>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the state; the old one is dropped after the lock is let go.
    pub fn set(&self, state: State<M>) {
        let old = std::mem::replace(&mut *self.lock(), state);
        drop(old);
    }

    /// `"ready"`, `"in-flight"` or `"freed"`.
    pub fn name(&self) -> &'static str {
        self.lock().name()
    }

    /// Moves the memory out (state: in-flight) if ready, after `check`
    /// passes on it; the lock is held across both, so nothing changes the
    /// state in between.
    pub fn take(&self, what: &str, check: impl FnOnce(&M) -> PyResult<()>) -> PyResult<M> {
        let mut s = self.lock();
        check(s.get(what)?)?;
        match std::mem::replace(&mut *s, State::InFlight) {
            State::Ready(m) => Ok(m),
            other => {
                *s = other;
                Err(buffer_error(format!("{what} is not ready")))
            }
        }
    }
}
