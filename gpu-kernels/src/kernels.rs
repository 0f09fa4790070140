//! The kernels, each declared once with [`kernel_abi::kernels!`]: built for
//! `nvptx64` they are the PTX entry points, built for the host they are the
//! types the host library launches (and the CPU emulation runs). Each is a
//! few lines: indices in, per-thread body out.

use crate::thread;
use kernel_abi::atomic::Ordering::Relaxed;
use kernel_abi::thread::{global_id, grid_stride, spin_hint, trap as device_trap};
use kernel_abi::{block, shared_array, thread as abi, warp};
use kernel_abi::{kernels, Slice, SliceMut};

kernels! {
    /// `x[i] *= s` for every element.
    ///
    /// # Safety
    /// `x` is valid device memory for its length (the host library builds it
    /// from a checked view).
    pub unsafe fn scale(x: SliceMut<f32>, s: f32) {
        // SAFETY: the contract above; every thread uses the same x, n, stride.
        unsafe { thread::scale(x.as_mut_ptr(), x.len(), s, global_id(), grid_stride()) }
    }

    /// `y[i] = a * x[i] + y[i]`, fused (one rounding: [`kernel_abi::fma`],
    /// not the two of `a * x[i] + y[i]` written out), over the shorter of
    /// the two.
    ///
    /// # Safety
    /// `x` and `y` are valid device memory for their lengths; `x` is `y` or
    /// disjoint from it.
    pub unsafe fn saxpy(a: f32, x: Slice<f32>, y: SliceMut<f32>) {
        let n = if x.len() < y.len() { x.len() } else { y.len() };
        // SAFETY: the contract above; every thread uses the same arguments.
        unsafe { thread::saxpy(a, x.as_ptr(), y.as_mut_ptr(), n, global_id(), grid_stride()) }
    }

    /// `k` dependent FMAs on each `x[i]`: arithmetic intensity `2k / 8` flop per byte.
    ///
    /// # Safety
    /// `x` is valid device memory for its length.
    pub unsafe fn intensity(x: SliceMut<f32>, k: u32) {
        // SAFETY: the contract above; every thread uses the same arguments.
        unsafe { thread::intensity(x.as_mut_ptr(), x.len(), k, global_id(), grid_stride()) }
    }

    /// A GPU-side gate: thread 0 spins until the host writes a non-zero value
    /// to `flag[0]` (device-mapped pinned host memory). Work queued behind it
    /// on the stream is held until then; tests use it instead of timers.
    ///
    /// # Safety
    /// `flag` is device-visible memory of at least one `u32` that the host
    /// will set.
    pub unsafe fn gate_wait(flag: Slice<u32>) {
        if global_id() == 0 && !flag.is_empty() {
            // SAFETY: the contract above; volatile loads re-read system memory.
            while unsafe { flag.as_ptr().read_volatile() } == 0 {
                spin_hint();
            }
        }
    }

    /// `dst` row `r` = `src` row `idx[r]` (`row_bytes` bytes a row) for
    /// every row of `dst`; indices past `src`'s rows leave theirs
    /// unwritten. `src` may be host memory the device can read (pinned in
    /// place and mapped): the loader gathers batches with it.
    ///
    /// # Safety
    /// `src` is device-readable memory for its length, `idx` and `dst`
    /// valid device memory for theirs, `dst` disjoint from both;
    /// `dst.len() >= idx.len() * row_bytes`.
    pub unsafe fn gather_rows(src: Slice<u8>, idx: Slice<u64>, row_bytes: u64, dst: SliceMut<u8>) {
        let rb = row_bytes as usize;
        let rows = if rb == 0 { 0 } else if idx.len() < dst.len() / rb { idx.len() } else { dst.len() / rb };
        // SAFETY: the contract above; every thread uses the same arguments.
        unsafe {
            thread::gather_rows(
                src.as_ptr(),
                src.len(),
                idx.as_ptr(),
                rows,
                rb,
                dst.as_mut_ptr(),
                global_id(),
                grid_stride(),
            )
        }
    }

    /// A demonstration of block-level programming (not a tuned kernel):
    /// `total[0] += sum(x)` (warp shuffles, a static shared array, a
    /// barrier, one `f32` atomic per block) and `block_max[b]` = the maximum
    /// of the elements block `b`'s threads read (a block reduction).
    ///
    /// # Safety
    /// `x` and `block_max` are valid device memory for their lengths; `total`
    /// has at least one element; the block size is a multiple of 32.
    pub unsafe fn block_sum_demo(x: Slice<f32>, total: SliceMut<f32>, block_max: SliceMut<f32>) {
        let partial = shared_array!(f32, 32);
        let (mut sum, mut max) = (0.0f32, f32::NEG_INFINITY);
        let mut i = global_id();
        while i < x.len() {
            let v = x.load_nc(i);
            sum += v;
            max = max.max(v);
            i += grid_stride();
        }
        let s = warp::reduce_sum(sum);
        if warp::lane_id() == 0 {
            partial.set(abi::warp_id() as usize, s);
        }
        abi::sync_threads();
        if abi::warp_id() == 0 {
            let n = abi::warps_per_block() as usize;
            let lane = warp::lane_id() as usize;
            let s = warp::reduce_sum(if lane < n { partial.get(lane) } else { 0.0 });
            if lane == 0 {
                total.atomic_add(0, s, Relaxed);
            }
        }
        let m = block::reduce_max(max);
        let b = abi::block_idx() as usize;
        if abi::thread_idx() == 0 && b < block_max.len() {
            // SAFETY: one thread per block writes its own element.
            unsafe { block_max.write(b, m) };
        }
    }

    /// Traps: used by the fault tests to break a context on purpose.
    ///
    /// # Safety
    /// Always faults; the context is unusable afterwards.
    pub unsafe fn trap() {
        device_trap()
    }
}
