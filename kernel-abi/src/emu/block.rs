//! One worker's block on the CPU emulation: the counting of barriers and
//! warp operations, the exchange slots of the warps, and the block's shared
//! memory. One `BlockState` per worker, reset for each block it runs.

use super::pool::Helpers;
use super::{raise, Abort, FaultKind, LaunchShared};
use crate::thread::{Dim3, WARP_SIZE};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex, MutexGuard};

/// 64-bit words each lane may put in one warp exchange.
pub(crate) const SLOT_WORDS: usize = 16;

/// Which warp operation a lane is at: every lane of a warp must be at the
/// same one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WarpOp {
    /// A shuffle (up, down, xor, index: the lanes may differ in which).
    Shuffle,
    /// A vote (any, all, ballot).
    Vote,
    /// `mma.sync` (emulated from every lane's fragments).
    Mma,
    /// `ldmatrix` (emulated from every lane's row addresses).
    Ldmatrix,
}

#[derive(Clone, Copy)]
struct WarpSync {
    lanes: u32,
    arrived: u32,
    exited: u32,
    gen: u64,
    op: WarpOp,
}

struct Counts {
    block: Dim3,
    concurrent: bool,
    fault: bool,
    started: u32,
    finished: u32,
    exited: u32,
    blocked: u32,
    at_barrier: u32,
    barrier_gen: u64,
    warps: Vec<WarpSync>,
}

struct StaticAlloc {
    id: u64,
    bytes: usize,
    words: Box<[AtomicU64]>,
}

/// A worker's block: see the module docs.
pub(crate) struct BlockState {
    launch: *const LaunchShared<'static>,
    threads: u32,
    counts: Mutex<Counts>,
    block_cv: Condvar,
    warp_cv: Box<[Condvar]>,
    done_cv: Condvar,
    slots: Box<[AtomicU64]>,
    statics: Mutex<Vec<StaticAlloc>>,
    dynamic: Box<[AtomicU64]>,
    dynamic_bytes: usize,
    pub(crate) helpers: Helpers,
}

// SAFETY: `launch` points to the launch's shared state, which is `Sync`
// and outlives every worker and helper (they end inside `emulate_launch`);
// everything else is `Sync` already.
unsafe impl Sync for BlockState {}
// SAFETY: as above.
unsafe impl Send for BlockState {}

const POISON: u64 = u64::MAX;

fn words(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(POISON)).collect()
}

impl BlockState {
    pub(crate) fn new(launch: &LaunchShared<'_>) -> Self {
        let threads = launch.launch.block.volume() as u32;
        let warps = threads.div_ceil(WARP_SIZE) as usize;
        let dynamic_bytes = launch.launch.dynamic_shared_bytes as usize;
        BlockState {
            launch: (launch as *const LaunchShared<'_>).cast(),
            threads,
            counts: Mutex::new(Counts {
                block: Dim3::default(),
                concurrent: false,
                fault: false,
                started: 0,
                finished: 0,
                exited: 0,
                blocked: 0,
                at_barrier: 0,
                barrier_gen: 0,
                warps: (0..warps as u32)
                    .map(|w| WarpSync {
                        lanes: (threads - w * WARP_SIZE).min(WARP_SIZE),
                        arrived: 0,
                        exited: 0,
                        gen: 0,
                        op: WarpOp::Shuffle,
                    })
                    .collect(),
            }),
            block_cv: Condvar::new(),
            warp_cv: (0..warps).map(|_| Condvar::new()).collect(),
            done_cv: Condvar::new(),
            slots: (0..warps * 2 * WARP_SIZE as usize * SLOT_WORDS)
                .map(|_| AtomicU64::new(0))
                .collect(),
            statics: Mutex::new(Vec::new()),
            dynamic: words(dynamic_bytes.div_ceil(8)),
            dynamic_bytes,
            helpers: Helpers::default(),
        }
    }

    pub(crate) fn launch(&self) -> &LaunchShared<'_> {
        // SAFETY: see the `Sync` impl: the launch outlives this state.
        unsafe { &*self.launch }
    }

    pub(crate) fn threads(&self) -> u32 {
        self.threads
    }

    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prepares for block `block`: counters cleared, shared memory poisoned.
    /// Called by the worker while no thread of the block runs.
    pub(crate) fn reset(&self, block: Dim3) {
        let mut c = self.lock();
        c.block = block;
        c.concurrent = false;
        c.fault = false;
        c.started = 0;
        c.finished = 0;
        c.exited = 0;
        c.blocked = 0;
        c.at_barrier = 0;
        for w in c.warps.iter_mut() {
            w.arrived = 0;
            w.exited = 0;
        }
        drop(c);
        for a in self
            .statics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            a.words.iter().for_each(|w| w.store(POISON, Relaxed));
        }
        self.dynamic.iter().for_each(|w| w.store(POISON, Relaxed));
    }

    pub(crate) fn block(&self) -> Dim3 {
        self.lock().block
    }

    /// Counts thread `linear` as started by the worker (sequential mode).
    /// `false` once the block turned concurrent or faulted: the worker
    /// starts no more threads itself.
    pub(crate) fn start_sequential(&self) -> bool {
        let mut c = self.lock();
        if c.concurrent || c.fault {
            return false;
        }
        c.started += 1;
        true
    }

    /// Waits until every started thread of the block has finished.
    pub(crate) fn wait_finished(&self) {
        let mut c = self.lock();
        while c.finished < c.started {
            c = self.done_cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Records `kind` for thread `linear` (if it is the launch's first
    /// fault) and releases every waiting thread of the block.
    fn fault(&self, c: &mut Counts, linear: u32, kind: FaultKind) {
        if !c.fault {
            let thread = self.launch().launch.block.unlinear(u64::from(linear));
            self.launch().record(c.block, thread, kind);
            c.fault = true;
        }
        self.block_cv.notify_all();
        self.warp_cv.iter().for_each(Condvar::notify_all);
    }

    /// Faults the calling thread with `kind` and unwinds it.
    fn fail(&self, mut c: MutexGuard<'_, Counts>, linear: u32, kind: FaultKind) -> ! {
        self.fault(&mut c, linear, kind);
        drop(c);
        std::panic::resume_unwind(Box::new(Abort))
    }

    /// After one more thread blocked or finished: a fault if every live
    /// thread is now blocked (none can release the others).
    fn check_stuck(&self, c: &mut Counts, linear: u32) {
        let running = c.started.saturating_sub(c.finished + c.blocked);
        if running == 0 && c.blocked > 0 && !c.fault {
            let kind = if c.at_barrier > 0 {
                FaultKind::DivergentBarrier
            } else {
                FaultKind::IncompleteWarp
            };
            self.fault(c, linear, kind);
        }
    }

    /// The calling thread's first barrier or warp operation in sequential
    /// mode: the rest of the block starts on helper threads.
    fn go_concurrent(&self, c: &mut Counts, linear: u32) {
        if c.concurrent {
            return;
        }
        c.concurrent = true;
        let from = linear + 1;
        if from < self.threads {
            match self.helpers.dispatch(self, from, self.threads) {
                Ok(()) => c.started += self.threads - from,
                Err(e) => self.fault(c, linear, FaultKind::Emulator(e)),
            }
        }
    }

    /// `bar.sync 0` for thread `linear`.
    pub(crate) fn barrier(&self, linear: u32) {
        let mut c = self.lock();
        self.go_concurrent(&mut c, linear);
        if c.fault {
            drop(c);
            std::panic::resume_unwind(Box::new(Abort));
        }
        if c.exited > 0 {
            self.fail(c, linear, FaultKind::DivergentBarrier);
        }
        c.at_barrier += 1;
        if c.at_barrier == self.threads {
            c.at_barrier = 0;
            c.barrier_gen += 1;
            c.blocked -= self.threads - 1;
            self.block_cv.notify_all();
            return;
        }
        let gen = c.barrier_gen;
        c.blocked += 1;
        self.check_stuck(&mut c, linear);
        while c.barrier_gen == gen && !c.fault {
            c = self.block_cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        if c.barrier_gen == gen {
            // Released by a fault: no longer blocked, unwinding.
            c.blocked -= 1;
            drop(c);
            std::panic::resume_unwind(Box::new(Abort));
        }
    }

    /// One warp operation of thread `linear`: puts `mine` in its slot,
    /// waits for every lane of its warp, and calls `read` with each lane's
    /// slot (`None` for lanes past a partial warp's end).
    pub(crate) fn warp<R>(
        &self,
        linear: u32,
        op: WarpOp,
        mine: &[u64],
        read: impl FnOnce(&dyn Fn(u32) -> Option<Vec<u64>>) -> R,
    ) -> R {
        let (w, lane) = ((linear / WARP_SIZE) as usize, linear % WARP_SIZE);
        let mut c = self.lock();
        self.go_concurrent(&mut c, linear);
        if c.fault {
            drop(c);
            std::panic::resume_unwind(Box::new(Abort));
        }
        if c.warps[w].exited > 0 {
            self.fail(c, linear, FaultKind::IncompleteWarp);
        }
        if c.warps[w].arrived > 0 && c.warps[w].op != op {
            self.fail(c, linear, FaultKind::IncompleteWarp);
        }
        let gen = c.warps[w].gen;
        let base = self.slot(w, gen, lane);
        for (i, v) in mine.iter().take(SLOT_WORDS).enumerate() {
            self.slots[base + i].store(*v, Relaxed);
        }
        c.warps[w].op = op;
        c.warps[w].arrived += 1;
        if c.warps[w].arrived == c.warps[w].lanes {
            let lanes = c.warps[w].lanes;
            c.warps[w].arrived = 0;
            c.warps[w].gen += 1;
            c.blocked -= lanes - 1;
            self.warp_cv[w].notify_all();
        } else {
            c.blocked += 1;
            self.check_stuck(&mut c, linear);
            while c.warps[w].gen == gen && !c.fault {
                c = self.warp_cv[w].wait(c).unwrap_or_else(|p| p.into_inner());
            }
            if c.warps[w].gen == gen {
                // Released by a fault: no longer blocked, unwinding.
                c.blocked -= 1;
                c.warps[w].arrived -= 1;
                drop(c);
                std::panic::resume_unwind(Box::new(Abort));
            }
        }
        let lanes = c.warps[w].lanes;
        drop(c);
        let n = mine.len().min(SLOT_WORDS);
        read(&|l: u32| {
            (l < lanes).then(|| {
                let b = self.slot(w, gen, l);
                (0..n).map(|i| self.slots[b + i].load(Relaxed)).collect()
            })
        })
    }

    fn slot(&self, warp: usize, gen: u64, lane: u32) -> usize {
        ((warp * 2 + (gen & 1) as usize) * WARP_SIZE as usize + lane as usize) * SLOT_WORDS
    }

    /// Thread `linear`'s body ended: normally (`true`) or by unwinding.
    pub(crate) fn finish(&self, linear: u32, normally: bool) {
        let mut c = self.lock();
        c.finished += 1;
        if normally {
            let w = (linear / WARP_SIZE) as usize;
            c.exited += 1;
            c.warps[w].exited += 1;
            if !c.fault {
                if c.at_barrier > 0 {
                    self.fault(&mut c, linear, FaultKind::DivergentBarrier);
                } else if c.warps[w].arrived > 0 {
                    self.fault(&mut c, linear, FaultKind::IncompleteWarp);
                }
            }
        } else if !c.fault {
            // The fault was recorded by whoever raised it; release the rest.
            c.fault = true;
            self.block_cv.notify_all();
            self.warp_cv.iter().for_each(Condvar::notify_all);
        }
        self.check_stuck(&mut c, linear);
        self.done_cv.notify_all();
    }

    /// The words of static shared array `id` (`bytes` bytes), allocated
    /// (poisoned) on the block's first use.
    pub(crate) fn static_shared(&self, id: u64, bytes: usize) -> &[AtomicU64] {
        let mut s = self.statics.lock().unwrap_or_else(|p| p.into_inner());
        let i = match s.iter().position(|a| a.id == id) {
            Some(i) => i,
            None => {
                s.push(StaticAlloc {
                    id,
                    bytes,
                    words: words(bytes.div_ceil(8)),
                });
                s.len() - 1
            }
        };
        if s[i].bytes != bytes {
            drop(s);
            raise(FaultKind::SharedMisuse(
                "two shared_array! uses with one symbol and different sizes (name them)",
            ));
        }
        let p: *const [AtomicU64] = &*s[i].words;
        drop(s);
        // SAFETY: the boxed words are never freed or moved while this state
        // lives (allocations are only added), and are atomics: shared access
        // is fine.
        unsafe { &*p }
    }

    /// The dynamic shared area and its size in bytes.
    pub(crate) fn dynamic_shared(&self) -> (&[AtomicU64], usize) {
        (&self.dynamic, self.dynamic_bytes)
    }
}

/// Exchanges one 64-bit value among the lanes of the calling thread's
/// warp: `f` gets every lane's value (`None` past a partial warp's end).
pub(crate) fn warp_exchange<R>(
    op: WarpOp,
    mine: u64,
    f: impl FnOnce(&dyn Fn(u32) -> Option<u64>) -> R,
) -> R {
    let ctx = super::ctx();
    if ctx.state.is_null() {
        // Outside an emulated launch: a warp of one lane.
        return f(&|l| (l == 0).then_some(mine));
    }
    super::block_state().warp(ctx.linear, op, &[mine], |get| f(&|l| get(l).map(|v| v[0])))
}

/// Exchanges up to [`SLOT_WORDS`] words among the lanes of the calling
/// thread's warp: `f` gets every lane's words.
pub(crate) fn warp_allgather<R>(
    op: WarpOp,
    mine: &[u64],
    f: impl FnOnce(&dyn Fn(u32) -> Option<Vec<u64>>) -> R,
) -> R {
    let ctx = super::ctx();
    if ctx.state.is_null() {
        let v = mine.to_vec();
        return f(&move |l| (l == 0).then(|| v.clone()));
    }
    super::block_state().warp(ctx.linear, op, mine, f)
}
