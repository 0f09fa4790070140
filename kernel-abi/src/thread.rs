//! Thread indices of a 1-D launch: the hardware's special registers on the
//! GPU, the emulated launch's on the host (set by [`emulate`]).

#[cfg(target_arch = "nvptx64")]
mod imp {
    use core::arch::nvptx;

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
    pub fn trap() -> ! {
        // SAFETY: `trap` has no preconditions; it ends the kernel.
        unsafe { nvptx::trap() }
    }
    #[inline(always)]
    pub fn spin_hint() {}
}

#[cfg(not(target_arch = "nvptx64"))]
mod imp {
    use std::cell::Cell;

    // The emulated thread's indices: `(thread, block, block_dim, grid_dim)`.
    std::thread_local! {
        pub(super) static IDX: Cell<(u32, u32, u32, u32)> = const { Cell::new((0, 0, 1, 1)) };
    }

    pub fn thread_idx() -> u32 {
        IDX.with(|c| c.get().0)
    }
    pub fn block_idx() -> u32 {
        IDX.with(|c| c.get().1)
    }
    pub fn block_dim() -> u32 {
        IDX.with(|c| c.get().2)
    }
    pub fn grid_dim() -> u32 {
        IDX.with(|c| c.get().3)
    }
    pub fn trap() -> ! {
        std::panic::panic_any(super::Trap)
    }
    pub fn spin_hint() {
        std::thread::sleep(std::time::Duration::from_micros(20));
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

/// Aborts the kernel: on the GPU the context is broken for good (a launch
/// failure); on the CPU emulation the launch reports the same.
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

/// Runs `body` for every thread of a `grid` x `block` launch on the host,
/// the blocks spread over `workers` OS threads, with the emulated indices
/// set for each call. Threads of one block run one after another.
///
/// Returns `Err` with a description when a thread panicked (a kernel's
/// trap, or a panic in its body: a GPU traps on both); the other blocks
/// still run to the end of their own bodies.
#[cfg(not(target_arch = "nvptx64"))]
pub fn emulate(
    grid: u32,
    block: u32,
    workers: usize,
    body: &(dyn Fn() + Sync),
) -> Result<(), String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    // Counted in 64 bits: taking a block number past the last can't wrap
    // round to 0 (which would run the grid again), whatever `grid` is.
    let next = AtomicU64::new(0);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let run = || loop {
        let b = next.fetch_add(1, Ordering::Relaxed);
        if b >= u64::from(grid) {
            break;
        }
        let b = b as u32; // below `grid`, a u32
        for t in 0..block {
            imp::IDX.with(|c| c.set((t, b, block, grid)));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
            if let Err(p) = r {
                let what = if p.is::<Trap>() {
                    "trap".to_string()
                } else if let Some(s) = p.downcast_ref::<&str>() {
                    format!("panic: {s}")
                } else if let Some(s) = p.downcast_ref::<String>() {
                    format!("panic: {s}")
                } else {
                    "panic".to_string()
                };
                let mut f = failure.lock().unwrap_or_else(|p| p.into_inner());
                f.get_or_insert(format!("block {b}, thread {t}: {what}"));
                return;
            }
        }
    };
    let workers = workers.clamp(1, grid.max(1) as usize);
    if workers == 1 {
        run();
    } else {
        std::thread::scope(|s| {
            // Helpers as many as the system gives (a refused thread is no
            // failure: the blocks are shared by whoever runs), and this
            // thread runs blocks too.
            for _ in 1..workers {
                if std::thread::Builder::new().spawn_scoped(s, run).is_err() {
                    break;
                }
            }
            run();
        });
    }
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
