//! `CopyWorkers`: persistent threads that copy one block of bytes
//! together, each a fixed piece, with the calling thread taking the last
//! piece.
//!
//! A staged copy fills (or drains) a pinned block every few hundred
//! microseconds; waking sleeping threads for each block costs as much as
//! the copy on the H200 machine's VM (a generic thread pool reached a
//! third of the link there). So the workers spin on the job counter for
//! [`SPIN_FOR`] after their last piece, then park: while a copy streams
//! blocks they never sleep, and with no copy in flight no core stays busy.
//!
//! Orderings: the caller publishes a job (its pointers under `job`'s lock)
//! and then bumps `generation` (SeqCst); a worker that sees the new
//! generation reads the job under the same lock, copies its piece and
//! decrements `left` (AcqRel); the caller returns when `left` reaches zero
//! (Acquire), so every worker's writes happen before it. Parking is the
//! Dekker pattern on `parked` and `generation`, both SeqCst: a worker
//! counts itself parked, then looks at the generation under the lock;
//! the caller bumps the generation, then notifies if anyone is parked.

use crate::completion::lock;
use crate::error::{Error, Result};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
pub(crate) const SPIN_FOR: Duration = Duration::from_millis(2);

/// A piece is a multiple of this many bytes (a page: no two threads write
/// one cache line, and pages map whole).
const PIECE_ALIGN: usize = 4096;

/// One block to copy: `len` bytes from `src` to `dst`, in `parts` pieces.
#[derive(Clone, Copy)]
struct Job {
    src: usize,
    dst: usize,
    len: usize,
    parts: usize,
}

struct Shared {
    job: Mutex<Job>,
    generation: AtomicU64,
    /// Pieces of the current job not yet copied.
    left: AtomicUsize,
    /// A worker's panic during the current job.
    panicked: Mutex<Option<String>>,
    parked: AtomicUsize,
    wake: Condvar,
    sleep: Mutex<()>,
    stop: AtomicBool,
    /// A test hook: the next piece copied panics instead.
    plant: AtomicBool,
}

/// Persistent copy threads (see the module's notes). One job at a time:
/// callers take turns (`turn`).
pub(crate) struct CopyWorkers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    turn: Mutex<()>,
}

impl CopyWorkers {
    /// Starts `n` workers (0: the caller copies alone); each runs `init`
    /// first (placement on the GPU's NUMA node).
    ///
    /// # Errors
    /// `Internal` when a thread can't be started (those started are stopped).
    pub(crate) fn start(n: usize, init: impl Fn() + Send + Sync + Clone + 'static) -> Result<Self> {
        let shared = Arc::new(Shared {
            job: Mutex::new(Job {
                src: 0,
                dst: 0,
                len: 0,
                parts: 0,
            }),
            generation: AtomicU64::new(0),
            left: AtomicUsize::new(0),
            panicked: Mutex::new(None),
            parked: AtomicUsize::new(0),
            wake: Condvar::new(),
            sleep: Mutex::new(()),
            stop: AtomicBool::new(false),
            plant: AtomicBool::new(false),
        });
        let mut workers = CopyWorkers {
            shared: shared.clone(),
            threads: Vec::with_capacity(n),
            turn: Mutex::new(()),
        };
        for index in 0..n {
            let (shared, init) = (shared.clone(), init.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("staging-{index}"))
                .spawn(move || {
                    init();
                    work(&shared, index);
                });
            match spawned {
                Ok(h) => workers.threads.push(h),
                // Dropping `workers` stops and joins those started.
                Err(e) => {
                    return Err(Error::Internal(format!(
                        "cannot start a staging thread: {e}"
                    )))
                }
            }
        }
        Ok(workers)
    }

    /// Copies `src` into `dst` (equal lengths), the workers and the calling
    /// thread each a piece; returns when every piece is done.
    ///
    /// # Errors
    /// [`Error::WorkerPanicked`] when a piece's copy panicked (the other
    /// pieces are still done before this returns).
    pub(crate) fn copy(&self, src: &[u8], dst: &mut [u8]) -> Result<()> {
        assert_eq!(src.len(), dst.len(), "CopyWorkers::copy of unequal lengths");
        let participants = self.threads.len() + 1;
        let parts = src.len().div_ceil(PIECE_ALIGN).clamp(1, participants);
        if parts == 1 {
            return guarded(|| {
                copy_piece(
                    &self.shared,
                    src.as_ptr() as usize,
                    dst.as_mut_ptr() as usize,
                    src.len(),
                    1,
                    0,
                )
            });
        }
        let _turn = lock(&self.turn);
        let s = &*self.shared;
        *lock(&s.job) = Job {
            src: src.as_ptr() as usize,
            dst: dst.as_mut_ptr() as usize,
            len: src.len(),
            parts,
        };
        *lock(&s.panicked) = None;
        // Every worker decrements once per job, piece or not.
        s.left.store(self.threads.len(), Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep);
            s.wake.notify_all();
        }
        // The caller's own piece: the last.
        let mine = guarded(|| {
            copy_piece(
                s,
                src.as_ptr() as usize,
                dst.as_mut_ptr() as usize,
                src.len(),
                parts,
                parts - 1,
            )
        });
        let mut spins = 0u32;
        while s.left.load(Ordering::Acquire) > 0 {
            spins = spins.saturating_add(1);
            backoff(spins);
        }
        mine?;
        match lock(&s.panicked).take() {
            Some(what) => Err(Error::WorkerPanicked(what)),
            None => Ok(()),
        }
    }
}

impl CopyWorkers {
    /// A test hook: the next piece copied panics.
    #[cfg(feature = "hooks")]
    pub(crate) fn plant_panic(&self) {
        self.shared.plant.store(true, Ordering::SeqCst);
    }
}

impl Drop for CopyWorkers {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _g = lock(&s.sleep);
            s.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            // A completion thread may drop the last engine: joining threads
            // that only wait for the job counter is immediate there too.
            let _ = t.join();
        }
    }
}

/// Runs `f`, turning a panic into [`Error::WorkerPanicked`].
fn guarded(f: impl FnOnce()) -> Result<()> {
    std::panic::catch_unwind(AssertUnwindSafe(f))
        .map_err(|p| Error::WorkerPanicked(panic_text(&*p)))
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Copies piece `index` of `parts` of the `len` bytes at `src` to `dst`.
fn copy_piece(s: &Shared, src: usize, dst: usize, len: usize, parts: usize, index: usize) {
    let piece = len.div_ceil(parts).next_multiple_of(PIECE_ALIGN);
    let start = (piece * index).min(len);
    let end = (start + piece).min(len);
    if s.plant.load(Ordering::Relaxed) && s.plant.swap(false, Ordering::SeqCst) {
        panic!("planted panic in a staging worker");
    }
    if end > start {
        // SAFETY: the caller of `CopyWorkers::copy` holds `src` (shared) and
        // `dst` (exclusive) borrowed for `len` bytes until every piece is
        // done; pieces are disjoint ranges of them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (src + start) as *const u8,
                (dst + start) as *mut u8,
                end - start,
            )
        };
    }
}

/// One round of waiting on a counter: a pause instruction for the first
/// rounds, then a yield of the core (on a machine with fewer cores than
/// threads, the thread being waited for may need it).
fn backoff(spins: u32) {
    if spins < 256 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// A worker's loop: wait for a new job (spin, then park), copy its piece.
fn work(s: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let spin_until = Instant::now() + SPIN_FOR;
        let mut spins = 0u32;
        while s.generation.load(Ordering::SeqCst) == seen {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && Instant::now() >= spin_until {
                let mut g = lock(&s.sleep);
                s.parked.fetch_add(1, Ordering::SeqCst);
                while s.generation.load(Ordering::SeqCst) == seen {
                    g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                s.parked.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            backoff(spins);
        }
        seen = s.generation.load(Ordering::SeqCst);
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        let job = *lock(&s.job);
        if index + 1 < job.parts {
            if let Err(e) = guarded(|| copy_piece(s, job.src, job.dst, job.len, job.parts, index)) {
                let mut p = lock(&s.panicked);
                if p.is_none() {
                    *p = Some(match e {
                        Error::WorkerPanicked(w) => w,
                        other => other.to_string(),
                    });
                }
            }
        }
        s.left.fetch_sub(1, Ordering::AcqRel);
    }
}
