//! Where a thread is: its indices in its block and its block's in the grid
//! (1-D, as `threadIdx.x`, and 3-D as [`Dim3`]), its lane and warp, plus
//! the block barrier ([`sync_threads`]), memory fences and [`trap`].
//!
//! On the GPU these read the special registers (`%tid`, `%ctaid`, `%ntid`,
//! `%nctaid`, `%laneid`); on the host, the emulated launch's values, set by
//! [`emulate_launch`] (or the 1-D [`emulate`]) for each emulated thread.
//!
//! ```
//! use kernel_abi::thread::{self, Dim3, Launch};
//!
//! let launch = Launch { grid: Dim3::new(2, 3, 1), block: Dim3::new(4, 2, 2), dynamic_shared_bytes: 0 };
//! let seen = std::sync::atomic::AtomicU64::new(0);
//! thread::emulate_launch("indices", &launch, 2, &|| {
//!     let (t, b) = (thread::thread_idx3(), thread::block_idx3());
//!     assert!(t.x < 4 && t.y < 2 && t.z < 2 && b.x < 2 && b.y < 3 && b.z == 0);
//!     assert_eq!(thread::linear_thread_idx(), t.x + 4 * (t.y + 2 * t.z));
//!     seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
//! })
//! .unwrap();
//! assert_eq!(seen.into_inner(), 6 * 16);
//! ```

#[cfg(not(target_arch = "nvptx64"))]
pub use crate::emu::{emulate, emulate_launch, EmulationError, FaultKind, Launch};

/// A 3-D extent or index (`dim3`, `uint3`): `x` varies fastest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dim3 {
    /// The fastest-varying coordinate.
    pub x: u32,
    /// The middle coordinate.
    pub y: u32,
    /// The slowest-varying coordinate.
    pub z: u32,
}

impl Dim3 {
    /// `(x, y, z)`.
    pub const fn new(x: u32, y: u32, z: u32) -> Self {
        Dim3 { x, y, z }
    }
    /// A 1-D extent: `(x, 1, 1)`.
    pub const fn x(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
    /// `x * y * z`, in 64 bits (no overflow).
    pub const fn volume(self) -> u64 {
        self.x as u64 * self.y as u64 * self.z as u64
    }
    /// The index of linear position `i` in an extent `self` (`x` fastest);
    /// the inverse of [`Dim3::linear`].
    pub const fn unlinear(self, i: u64) -> Dim3 {
        let x = if self.x == 0 { 1 } else { self.x as u64 };
        let y = if self.y == 0 { 1 } else { self.y as u64 };
        Dim3 {
            x: (i % x) as u32,
            y: ((i / x) % y) as u32,
            z: (i / (x * y)) as u32,
        }
    }
    /// The linear position of index `idx` in an extent `self`:
    /// `idx.x + self.x * (idx.y + self.y * idx.z)`.
    pub const fn linear(self, idx: Dim3) -> u64 {
        idx.x as u64 + self.x as u64 * (idx.y as u64 + self.y as u64 * idx.z as u64)
    }
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3::x(x)
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3 { x, y, z }
    }
}

impl core::fmt::Display for Dim3 {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "({}, {}, {})", self.x, self.y, self.z)
    }
}

/// Threads in a warp: 32 on every NVIDIA GPU.
pub const WARP_SIZE: u32 = 32;

#[cfg(target_arch = "nvptx64")]
mod imp {
    use super::Dim3;
    use core::arch::nvptx;

    macro_rules! sreg {
        ($name:ident, $x:ident, $y:ident, $z:ident) => {
            #[inline(always)]
            pub fn $name() -> Dim3 {
                // SAFETY: reading special registers has no preconditions in a kernel.
                unsafe {
                    Dim3 {
                        x: nvptx::$x() as u32,
                        y: nvptx::$y() as u32,
                        z: nvptx::$z() as u32,
                    }
                }
            }
        };
    }
    sreg!(thread_idx3, _thread_idx_x, _thread_idx_y, _thread_idx_z);
    sreg!(block_idx3, _block_idx_x, _block_idx_y, _block_idx_z);
    sreg!(block_dim3, _block_dim_x, _block_dim_y, _block_dim_z);
    sreg!(grid_dim3, _grid_dim_x, _grid_dim_y, _grid_dim_z);

    #[inline(always)]
    pub fn thread_idx() -> u32 {
        // SAFETY: reading special registers has no preconditions in a kernel.
        unsafe { nvptx::_thread_idx_x() as u32 }
    }
    #[inline(always)]
    pub fn block_idx() -> u32 {
        // SAFETY: as above.
        unsafe { nvptx::_block_idx_x() as u32 }
    }
    #[inline(always)]
    pub fn block_dim() -> u32 {
        // SAFETY: as above.
        unsafe { nvptx::_block_dim_x() as u32 }
    }
    #[inline(always)]
    pub fn grid_dim() -> u32 {
        // SAFETY: as above.
        unsafe { nvptx::_grid_dim_x() as u32 }
    }
    #[inline(always)]
    pub fn lane_id() -> u32 {
        let r: u32;
        // SAFETY: reads a special register into `r`; no memory, no effect.
        unsafe {
            core::arch::asm!("mov.u32 {r}, %laneid;", r = out(reg32) r, options(pure, nomem, nostack))
        };
        r
    }
    #[inline(always)]
    pub fn trap() -> ! {
        // SAFETY: `trap` has no preconditions; it ends the kernel.
        unsafe { nvptx::trap() }
    }
    #[inline(always)]
    pub fn spin_hint() {}
    #[inline(always)]
    pub fn sync_threads() {
        // SAFETY: `bar.sync 0`; the caller's block reaches it uniformly (see
        // `sync_threads`' docs: a divergent barrier is the kernel's bug,
        // not memory unsafety; the GPU hangs or goes on).
        unsafe { nvptx::_syncthreads() }
    }
    macro_rules! fence {
        ($name:ident, $new:literal, $old:literal) => {
            #[inline(always)]
            pub fn $name() {
                // SAFETY: a fence orders this thread's memory accesses; it
                // reads and writes nothing itself.
                unsafe {
                    #[cfg(target_feature = "sm_70")]
                    core::arch::asm!($new, options(nostack));
                    #[cfg(not(target_feature = "sm_70"))]
                    core::arch::asm!($old, options(nostack));
                }
            }
        };
    }
    fence!(fence_block, "fence.acq_rel.cta;", "membar.cta;");
    fence!(fence_device, "fence.acq_rel.gpu;", "membar.gl;");
    fence!(fence_system, "fence.acq_rel.sys;", "membar.sys;");
}

#[cfg(not(target_arch = "nvptx64"))]
mod imp {
    use super::Dim3;
    use crate::emu::ctx;
    use std::sync::atomic::{fence, Ordering};

    pub fn thread_idx3() -> Dim3 {
        ctx().thread
    }
    pub fn block_idx3() -> Dim3 {
        ctx().block
    }
    pub fn block_dim3() -> Dim3 {
        ctx().block_dim
    }
    pub fn grid_dim3() -> Dim3 {
        ctx().grid_dim
    }
    pub fn thread_idx() -> u32 {
        ctx().thread.x
    }
    pub fn block_idx() -> u32 {
        ctx().block.x
    }
    pub fn block_dim() -> u32 {
        ctx().block_dim.x
    }
    pub fn grid_dim() -> u32 {
        ctx().grid_dim.x
    }
    pub fn lane_id() -> u32 {
        ctx().linear % super::WARP_SIZE
    }
    pub fn trap() -> ! {
        std::panic::panic_any(super::Trap)
    }
    pub fn spin_hint() {
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    pub fn sync_threads() {
        crate::emu::barrier()
    }
    pub fn fence_block() {
        fence(Ordering::SeqCst)
    }
    pub fn fence_device() {
        fence(Ordering::SeqCst)
    }
    pub fn fence_system() {
        fence(Ordering::SeqCst)
    }
}

/// Index of this thread in its block (`threadIdx.x`).
#[inline(always)]
pub fn thread_idx() -> u32 {
    imp::thread_idx()
}

/// Index of this thread's block in the grid (`blockIdx.x`).
#[inline(always)]
pub fn block_idx() -> u32 {
    imp::block_idx()
}

/// Threads per block (`blockDim.x`).
#[inline(always)]
pub fn block_dim() -> u32 {
    imp::block_dim()
}

/// Blocks in the grid (`gridDim.x`).
#[inline(always)]
pub fn grid_dim() -> u32 {
    imp::grid_dim()
}

/// This thread's 3-D index in its block (`threadIdx`).
#[inline(always)]
pub fn thread_idx3() -> Dim3 {
    imp::thread_idx3()
}

/// This thread's block's 3-D index in the grid (`blockIdx`).
#[inline(always)]
pub fn block_idx3() -> Dim3 {
    imp::block_idx3()
}

/// The block's 3-D extent (`blockDim`).
#[inline(always)]
pub fn block_dim3() -> Dim3 {
    imp::block_dim3()
}

/// The grid's 3-D extent in blocks (`gridDim`).
#[inline(always)]
pub fn grid_dim3() -> Dim3 {
    imp::grid_dim3()
}

/// This thread's linear index in its block: `x + dim.x * (y + dim.y * z)`
/// (the order the hardware packs threads into warps).
#[inline(always)]
pub fn linear_thread_idx() -> u32 {
    let (t, d) = (thread_idx3(), block_dim3());
    t.x + d.x * (t.y + d.y * t.z)
}

/// Threads in the block: `blockDim.x * blockDim.y * blockDim.z` (at most 1024).
#[inline(always)]
pub fn block_threads() -> u32 {
    let d = block_dim3();
    d.x * d.y * d.z
}

/// This thread's lane in its warp, `0..32` (`%laneid`: the linear thread
/// index modulo 32).
#[inline(always)]
pub fn lane_id() -> u32 {
    imp::lane_id()
}

/// This thread's warp in its block: the linear thread index / 32.
#[inline(always)]
pub fn warp_id() -> u32 {
    linear_thread_idx() / WARP_SIZE
}

/// Warps in the block: `ceil(block_threads / 32)`; the last may be partial.
#[inline(always)]
pub fn warps_per_block() -> u32 {
    block_threads().div_ceil(WARP_SIZE)
}

/// Global index of this thread in a 1-D launch.
#[inline(always)]
pub fn global_id() -> usize {
    block_idx() as usize * block_dim() as usize + thread_idx() as usize
}

/// Total threads in a 1-D launch: the step of a grid-stride loop.
#[inline(always)]
pub fn grid_stride() -> usize {
    grid_dim() as usize * block_dim() as usize
}

/// Waits until every thread of the block reaches this barrier, and makes
/// the shared- and global-memory writes each did before it visible to all
/// of them after it (`__syncthreads()`, `bar.sync 0`).
///
/// Every thread of the block must reach the same number of barriers: a
/// thread that returns early while others wait, or a barrier inside a
/// branch some threads skip, is a bug. The GPU hangs or goes on with wrong
/// data; the CPU emulation reports [`FaultKind::DivergentBarrier`] naming
/// the kernel, block and thread. (Stricter than the hardware, which counts
/// exited threads as arrived: write `if i < n { ... }` around the work, not
/// an early `return` before a barrier.)
#[inline(always)]
pub fn sync_threads() {
    imp::sync_threads()
}

/// Orders this thread's memory accesses as seen by the threads of its
/// block (`fence.acq_rel.cta`; `membar.cta` before sm_70).
#[inline(always)]
pub fn fence_block() {
    imp::fence_block()
}

/// Orders this thread's memory accesses as seen by every thread of the
/// device (`fence.acq_rel.gpu`; `membar.gl` before sm_70): the fence between
/// writing a block's result and publishing it with an atomic flag.
#[inline(always)]
pub fn fence_device() {
    imp::fence_device()
}

/// Orders this thread's memory accesses as seen by the host and other
/// devices too (`fence.acq_rel.sys`; `membar.sys` before sm_70).
#[inline(always)]
pub fn fence_system() {
    imp::fence_system()
}

/// Aborts the kernel: on the GPU the context is broken for good (a launch
/// failure); on the CPU emulation the launch reports the same
/// ([`FaultKind::Trap`]).
#[inline(always)]
pub fn trap() -> ! {
    imp::trap()
}

/// Inside a spin-wait loop: nothing on the GPU; a short sleep on the CPU
/// emulation, which runs such a thread on a worker it shares.
#[inline(always)]
pub fn spin_hint() {
    imp::spin_hint()
}

/// The panic payload of [`trap`] on the host.
#[derive(Debug, Clone, Copy)]
pub struct Trap;
