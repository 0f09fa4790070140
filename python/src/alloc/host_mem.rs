//! The pinned host memory a `PinnedBuffer` holds (a pool's block, or an
//! array pinned in place), and that memory seen as `T` for the pipeline.

use bytemuck::Pod;
use gpufeed::interop::{cast_host, cast_host_mut, RegisteredRaw};
use gpufeed::{HostSlice, HostSliceMut, PinnedArray, PinnedHost, PooledBuffer};

/// Pinned host memory a `PinnedBuffer` holds.
pub enum HostMem {
    /// On loan from the pool; goes back to it when dropped (after the
    /// device is done, when an operation owned it).
    Pool(PooledBuffer<u8>),
    /// A foreign array's memory pinned in place; unregistered when dropped,
    /// then the array's export is released.
    Registered(RegisteredRaw),
}

impl HostMem {
    /// Whether the memory is page-locked (false only on the CPU emulation
    /// under a memlock limit its lock policy let pass).
    pub(super) fn is_locked(&self) -> bool {
        match self {
            HostMem::Pool(b) => b.is_locked(),
            HostMem::Registered(r) => r.is_locked(),
        }
    }

    pub(super) fn ptr(&mut self) -> *mut u8 {
        match self {
            HostMem::Pool(b) => b.as_mut_slice().as_mut_ptr(),
            HostMem::Registered(r) => r.as_mut_ptr(),
        }
    }
}

impl PinnedHost<u8> for HostMem {
    fn host(&self) -> HostSlice<'_, u8> {
        match self {
            HostMem::Pool(b) => b.host(),
            HostMem::Registered(r) => r.host(),
        }
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, u8> {
        match self {
            HostMem::Pool(b) => b.host_mut(),
            HostMem::Registered(r) => r.host_mut(),
        }
    }
}

/// Host memory seen as `T` (for the pipeline, whose kernels are typed).
/// Built only for memory checked to hold whole, aligned `T`s (`typed`).
pub struct Typed<T> {
    pub mem: HostMem,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: Pod> Typed<T> {
    /// `mem` as `T`, or an error (with `mem` back) when it isn't whole aligned `T`s.
    #[allow(clippy::result_large_err)]
    pub fn new(mem: HostMem) -> Result<Self, (gpufeed::Error, HostMem)> {
        if let Err(e) = cast_host::<T>(mem.host()) {
            return Err((e, mem));
        }
        Ok(Typed {
            mem,
            _t: std::marker::PhantomData,
        })
    }
}

impl<T: Pod> PinnedHost<T> for Typed<T> {
    fn host(&self) -> HostSlice<'_, T> {
        match cast_host(self.mem.host()) {
            Ok(v) => v,
            Err(_) => checked_cast_failed(),
        }
    }
    fn host_mut(&mut self) -> HostSliceMut<'_, T> {
        match cast_host_mut(self.mem.host_mut()) {
            Ok(v) => v,
            Err(_) => checked_cast_failed(),
        }
    }
}

/// `Typed::new` checked the cast on the same memory, so this is never
/// reached; abort rather than unwind across the Python boundary.
fn checked_cast_failed() -> ! {
    eprintln!("gpufeed: internal error: a typed view failed its checked cast");
    std::process::abort()
}

impl<T: Pod> PinnedArray for Typed<T> {
    type Elem = T;
    fn source(&self) -> HostSlice<'_, T> {
        self.host()
    }
    fn destination(&mut self) -> HostSliceMut<'_, T> {
        self.host_mut()
    }
}
