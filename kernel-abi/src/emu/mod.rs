//! The CPU emulation of a launch (host builds only): every thread of the
//! grid runs the kernel's body with its emulated indices set, the threads of
//! a block meet at barriers and exchange values in warp operations, and each
//! block has shared memory of its own.
//!
//! # Design
//! - The blocks are spread over `workers` OS threads; a worker runs its
//!   blocks one at a time.
//! - A block starts *sequential*: the worker runs thread 0, 1, 2, ... to
//!   completion, one after another (grid-stride elementwise kernels, which
//!   never wait for each other, run at full speed this way). When a thread
//!   reaches its first barrier or warp operation the block turns
//!   *concurrent*: the remaining threads start on helper OS threads (one
//!   per emulated thread, started on first need and reused across the
//!   worker's blocks and launches' blocks, small stacks) and all of them
//!   meet at barriers for real. Threads already finished count as exited:
//!   waiting at a barrier that they never reached is, correctly, a
//!   [`FaultKind::DivergentBarrier`].
//! - Barriers and warp operations are counted under one mutex per block:
//!   each thread is running, blocked (at a barrier or a warp operation) or
//!   exited. A barrier with an exited thread, a warp operation with an
//!   exited lane, or every live thread blocked with none able to go on is a
//!   typed fault, found by counting, never by a timeout. A fault (or a
//!   panic, or a trap) wakes every waiting thread of the block, which
//!   unwinds; the launch returns the first fault.
//! - Shared memory is per block, of atomic 64-bit words (relaxed loads and
//!   stores; a 4-byte element is half a word, changed by compare-and-swap),
//!   so a racy kernel is racy here as on a GPU but never undefined
//!   behaviour in Rust. Static arrays and the dynamic area are *poisoned*
//!   at the start of each block: every byte `0xff` (an `f32` reads NaN, a
//!   `u32` `u32::MAX`, an `i32` -1). A GPU leaves them undefined.
//! - Warp shuffles and votes are real exchanges among the lanes of a warp
//!   (the same tree of operations as on the GPU, so floating-point
//!   reductions are bit-identical).

mod block;
mod pool;

use crate::thread::Dim3;
use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

pub(crate) use block::{warp_allgather, warp_exchange, WarpOp};

/// A launch's configuration: the grid in blocks, the block in threads, and
/// the bytes of dynamic shared memory each block gets
/// ([`crate::shared::dynamic`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks in the grid (each dimension at least 1).
    pub grid: Dim3,
    /// Threads in a block (each dimension at least 1, at most
    /// [`Launch::MAX_BLOCK_THREADS`] in all, `z` at most 64).
    pub block: Dim3,
    /// Dynamic shared memory per block, in bytes (at most
    /// [`Launch::MAX_DYNAMIC_SHARED_BYTES`] on the emulation).
    pub dynamic_shared_bytes: u32,
}

impl Launch {
    /// The most threads a block may have (every GPU since sm_20).
    pub const MAX_BLOCK_THREADS: u32 = 1024;
    /// The most dynamic shared memory the emulation gives a block: 227 KiB,
    /// the H100's opt-in maximum.
    pub const MAX_DYNAMIC_SHARED_BYTES: u32 = 227 * 1024;

    /// A 1-D launch of `grid` blocks of `block` threads, no dynamic shared memory.
    pub const fn linear(grid: u32, block: u32) -> Self {
        Launch {
            grid: Dim3::x(grid),
            block: Dim3::x(block),
            dynamic_shared_bytes: 0,
        }
    }

    /// Why the emulation can't run this launch, if it can't.
    pub fn check(&self) -> Result<(), &'static str> {
        let (g, b) = (self.grid, self.block);
        if g.x == 0 || g.y == 0 || g.z == 0 {
            return Err("a grid dimension is 0");
        }
        if b.x == 0 || b.y == 0 || b.z == 0 {
            return Err("a block dimension is 0");
        }
        if b.volume() > u64::from(Self::MAX_BLOCK_THREADS) {
            return Err("more than 1024 threads in a block");
        }
        if b.z > 64 {
            return Err("block z above 64");
        }
        if g.y > 65535 || g.z > 65535 {
            return Err("grid y or z above 65535");
        }
        if self.dynamic_shared_bytes > Self::MAX_DYNAMIC_SHARED_BYTES {
            return Err("more dynamic shared memory than a block can have");
        }
        Ok(())
    }
}

/// What went wrong in an emulated thread.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// The kernel called [`crate::thread::trap`].
    Trap,
    /// The kernel's body panicked (a GPU traps); the panic's message.
    Panic(String),
    /// A barrier ([`crate::thread::sync_threads`], or a block operation
    /// that has one) that not every thread of the block reaches: some
    /// returned, or wait at another barrier or a warp operation.
    DivergentBarrier,
    /// A warp operation (shuffle, vote, warp reduction) that not every lane
    /// of the warp reaches, or that lanes reach at different operations.
    IncompleteWarp,
    /// A shared-memory index past the end of its array.
    SharedOutOfBounds {
        /// The index used.
        index: usize,
        /// The array's length.
        len: usize,
    },
    /// A [`crate::Slice`]/[`crate::SliceMut`] index past its end.
    SliceOutOfBounds {
        /// The index used (for a vector access, its first element's).
        index: usize,
        /// The slice's length.
        len: usize,
    },
    /// A vector access or asynchronous copy at an address not aligned to
    /// its size.
    Misaligned,
    /// Two `shared_array!` uses with one symbol and different sizes, or a
    /// dynamic view at a bad offset: the launch's shared memory is misused.
    SharedMisuse(&'static str),
    /// The launch configuration can't run (see [`Launch::check`]).
    InvalidLaunch(&'static str),
    /// The emulator itself failed (an OS thread could not be started).
    Emulator(String),
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::Trap => write!(f, "trap"),
            FaultKind::Panic(m) => write!(f, "panic: {m}"),
            FaultKind::DivergentBarrier => write!(
                f,
                "divergent barrier: not every thread of the block reaches it"
            ),
            FaultKind::IncompleteWarp => write!(
                f,
                "incomplete warp: a warp operation not every lane of the warp reaches"
            ),
            FaultKind::SharedOutOfBounds { index, len } => {
                write!(f, "shared out of bounds: index {index}, length {len}")
            }
            FaultKind::SliceOutOfBounds { index, len } => {
                write!(f, "slice out of bounds: index {index}, length {len}")
            }
            FaultKind::Misaligned => write!(f, "misaligned vector access"),
            FaultKind::SharedMisuse(m) => write!(f, "shared memory misuse: {m}"),
            FaultKind::InvalidLaunch(m) => write!(f, "invalid launch: {m}"),
            FaultKind::Emulator(m) => write!(f, "emulator failure: {m}"),
        }
    }
}

/// A fault in an emulated launch: which kernel, which thread of which
/// block, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmulationError {
    /// The kernel's name, as given to [`emulate_launch`].
    pub kernel: String,
    /// The block's index in the grid.
    pub block: Dim3,
    /// The thread's index in its block.
    pub thread: Dim3,
    /// What happened.
    pub kind: FaultKind,
}

impl fmt::Display for EmulationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "kernel `{}`, block {}, thread {}: {}",
            self.kernel, self.block, self.thread, self.kind
        )
    }
}

impl std::error::Error for EmulationError {}

/// The emulated thread's context, per OS thread.
#[derive(Clone, Copy)]
pub(crate) struct Ctx {
    pub thread: Dim3,
    pub block: Dim3,
    pub block_dim: Dim3,
    pub grid_dim: Dim3,
    pub linear: u32,
    /// The running block, or null outside an emulated launch.
    pub state: *const block::BlockState,
}

const OUTSIDE: Ctx = Ctx {
    thread: Dim3::new(0, 0, 0),
    block: Dim3::new(0, 0, 0),
    block_dim: Dim3::new(1, 1, 1),
    grid_dim: Dim3::new(1, 1, 1),
    linear: 0,
    state: std::ptr::null(),
};

std::thread_local! {
    static CTX: Cell<Ctx> = const { Cell::new(OUTSIDE) };
}

/// The calling thread's emulated context (a 1x1 launch outside one).
pub(crate) fn ctx() -> Ctx {
    CTX.with(|c| c.get())
}

fn set_ctx(c: Ctx) {
    CTX.with(|x| x.set(c))
}

/// The panic payload of a fault raised by the library (bounds, misuse).
pub(crate) struct Fault(pub FaultKind);

/// The panic payload of a thread released by another thread's fault.
pub(crate) struct Abort;

/// Ends the calling emulated thread with `kind` (what a GPU's trap is).
pub(crate) fn raise(kind: FaultKind) -> ! {
    if ctx().state.is_null() {
        // Outside an emulated launch (a host test calling a kernel body
        // directly): an ordinary panic with the fault's description.
        panic!("{kind}");
    }
    std::panic::resume_unwind(Box::new(Fault(kind)))
}

/// The running block's state; outside an emulated launch, a fault.
pub(crate) fn block_state() -> &'static block::BlockState {
    let p = ctx().state;
    if p.is_null() {
        raise(FaultKind::Emulator(
            "a block operation outside an emulated launch".into(),
        ));
    }
    // SAFETY: `state` is set only while the block runs on this OS thread,
    // and the block state outlives every thread of the block (the worker
    // waits for all of them before it changes or drops it). The 'static is
    // never observed past that: the reference is used within the call.
    unsafe { &*p }
}

/// The block barrier.
pub(crate) fn barrier() {
    let p = ctx().state;
    if p.is_null() {
        return; // a 1-thread "launch" outside the emulation: nothing to wait for
    }
    block_state().barrier(ctx().linear)
}

/// The shared words of the static array `id` of `bytes` bytes in the
/// running block.
pub(crate) fn static_shared(id: u64, bytes: usize) -> &'static [std::sync::atomic::AtomicU64] {
    block_state().static_shared(id, bytes)
}

/// The running block's dynamic shared area, and its size in bytes.
pub(crate) fn dynamic_shared() -> (&'static [std::sync::atomic::AtomicU64], usize) {
    block_state().dynamic_shared()
}

/// Everything a launch's workers share.
pub(crate) struct LaunchShared<'a> {
    pub kernel: &'a str,
    pub launch: Launch,
    pub body: &'a (dyn Fn() + Sync),
    /// Blocks handed out so far (64 bits: can't wrap past the last).
    next: AtomicU64,
    /// Set at the first fault: no new block starts.
    pub stop: AtomicBool,
    first: Mutex<Option<EmulationError>>,
}

impl LaunchShared<'_> {
    /// Records a fault (the first one wins) and stops handing out blocks.
    pub fn record(&self, block: Dim3, thread: Dim3, kind: FaultKind) {
        let mut f = self.first.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert_with(|| EmulationError {
            kernel: self.kernel.to_string(),
            block,
            thread,
            kind,
        });
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Runs `body` for every thread of `launch` on the host, the blocks spread
/// over `workers` OS threads, each thread with its emulated indices set;
/// the threads of a block meet at barriers, exchange values in warp
/// operations and share their block's shared memory (see the module's
/// design notes).
///
/// Returns the first fault: a trap, a panic, a divergent barrier, an
/// incomplete warp operation, an out-of-bounds access; blocks already
/// running finish (or unwind), no new one starts. A launch the emulation
/// can't run ([`Launch::check`]) is [`FaultKind::InvalidLaunch`] before
/// anything runs.
pub fn emulate_launch(
    kernel: &str,
    launch: &Launch,
    workers: usize,
    body: &(dyn Fn() + Sync),
) -> Result<(), EmulationError> {
    if let Err(why) = launch.check() {
        return Err(EmulationError {
            kernel: kernel.to_string(),
            block: Dim3::default(),
            thread: Dim3::default(),
            kind: FaultKind::InvalidLaunch(why),
        });
    }
    let shared = LaunchShared {
        kernel,
        launch: *launch,
        body,
        next: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        first: Mutex::new(None),
    };
    let blocks = launch.grid.volume();
    let workers = (workers.max(1) as u64).min(blocks) as usize;
    let run = || pool::worker(&shared);
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
    match shared.first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl LaunchShared<'_> {
    /// The next block's linear index, or `None` when all are handed out
    /// (or a fault stopped the launch).
    pub fn next_block(&self) -> Option<u64> {
        if self.stop.load(Ordering::Relaxed) {
            return None;
        }
        let b = self.next.fetch_add(1, Ordering::Relaxed);
        (b < self.launch.grid.volume()).then_some(b)
    }
}

/// Runs `body` for every thread of a 1-D `grid` x `block` launch on the
/// host (the blocks spread over `workers` OS threads): [`emulate_launch`]
/// with no dynamic shared memory, its error as a description
/// (`block B, thread T: what`). A grid or block of 0 runs nothing.
pub fn emulate(
    grid: u32,
    block: u32,
    workers: usize,
    body: &(dyn Fn() + Sync),
) -> Result<(), String> {
    if grid == 0 || block == 0 {
        return Ok(());
    }
    emulate_launch("", &Launch::linear(grid, block), workers, body)
        .map_err(|e| format!("block {}, thread {}: {}", e.block.x, e.thread.x, e.kind))
}

/// Sets the context for emulated thread `linear` of block `block`.
pub(crate) fn enter(
    shared: &LaunchShared<'_>,
    state: &block::BlockState,
    block: Dim3,
    linear: u32,
) {
    set_ctx(Ctx {
        thread: shared.launch.block.unlinear(u64::from(linear)),
        block,
        block_dim: shared.launch.block,
        grid_dim: shared.launch.grid,
        linear,
        state,
    });
}

/// Clears the context after an emulated thread.
pub(crate) fn leave() {
    set_ctx(OUTSIDE)
}

/// The fault a caught panic payload stands for; `None` for [`Abort`] (a
/// thread released by another's fault, which that one recorded).
pub(crate) fn fault_of(p: Box<dyn std::any::Any + Send>) -> Option<FaultKind> {
    if p.is::<Abort>() {
        None
    } else if p.is::<crate::thread::Trap>() {
        Some(FaultKind::Trap)
    } else if let Some(Fault(k)) = p.downcast_ref::<Fault>() {
        Some(k.clone())
    } else if let Some(s) = p.downcast_ref::<&str>() {
        Some(FaultKind::Panic(s.to_string()))
    } else if let Some(s) = p.downcast_ref::<String>() {
        Some(FaultKind::Panic(s.clone()))
    } else {
        Some(FaultKind::Panic(String::new()))
    }
}
