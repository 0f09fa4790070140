//! Stream-ordered device memory: a memory pool of the backend's own and the
//! internal stream its frees are enqueued on.

use super::driver::StreamHandle;
use cudarc::driver::sys::{self, CUresult};

/// Stream-ordered device memory (`cuMemAllocFromPoolAsync` /
/// `cuMemFreeAsync`) from a memory pool of our own, through an internal
/// stream that carries nothing else. A free is enqueued there: it waits for
/// nothing (the memory's users have finished: the caller's guarantee), so a
/// watcher releasing a cancelled job's buffers frees at once instead of
/// parking a `cuMemFree`, which would wait for the whole device. The pool
/// keeps freed memory for reuse (release threshold: all of it) until the
/// device handle goes, like the pinned pool.
pub(super) struct OrderedMem {
    pub(super) stream: StreamHandle,
    pub(super) pool: PoolHandle,
}

pub(super) struct PoolHandle(pub(super) sys::CUmemoryPool);
// SAFETY: CUmemoryPool is an opaque driver handle usable from any thread.
unsafe impl Send for PoolHandle {}
// SAFETY: as above.
unsafe impl Sync for PoolHandle {}

impl OrderedMem {
    /// A pool on `device` (`ordinal`) and its stream; the context is current.
    pub(super) fn new(
        device: sys::CUdevice,
        ordinal: usize,
    ) -> std::result::Result<OrderedMem, CUresult> {
        // SAFETY: a plain C struct; all-zero is its documented default
        // (no handle types, no size limit) before the fields set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ordinal as i32;
        let _ = device;
        let mut pool = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; props is initialised.
        let r = unsafe { sys::cuMemPoolCreate(&mut pool, &props) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(r);
        }
        let mut keep_all: u64 = u64::MAX;
        // SAFETY: the attribute takes a u64, written from a local.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep_all as *mut u64).cast(),
            )
        };
        let mut s = std::ptr::null_mut();
        let r = if r == CUresult::CUDA_SUCCESS {
            // SAFETY: out-pointer to a local.
            unsafe {
                sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            }
        } else {
            r
        };
        if r != CUresult::CUDA_SUCCESS {
            // SAFETY: our pool, with nothing allocated from it.
            unsafe { sys::cuMemPoolDestroy(pool) };
            return Err(r);
        }
        Ok(OrderedMem {
            stream: StreamHandle(s),
            pool: PoolHandle(pool),
        })
    }

    /// Bytes allocated from the pool and not yet freed (a test hook).
    #[cfg_attr(not(feature = "hooks"), allow(dead_code))]
    pub(super) fn used_bytes(&self) -> Option<u64> {
        let mut used: u64 = 0;
        // SAFETY: the attribute is a u64, written to a local; the pool is alive.
        let r = unsafe {
            sys::cuMemPoolGetAttribute(
                self.pool.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                (&mut used as *mut u64).cast(),
            )
        };
        (r == CUresult::CUDA_SUCCESS).then_some(used)
    }
}

impl Drop for OrderedMem {
    fn drop(&mut self) {
        // SAFETY: our stream and pool; every buffer from the pool holds the
        // backend (and so this), so none is outstanding; a pool with frees
        // still pending is released by the driver once they complete.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream.0);
            sys::cuMemPoolDestroy(self.pool.0);
        }
    }
}
