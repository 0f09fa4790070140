//! `CopyWorkers`: persistent threads that copy one block of bytes
//! together with the calling thread, in pieces each takes as it comes
//! ([`Claims`]).
//!
//! A staged copy fills (or drains) a pinned block every few hundred
//! microseconds; waking sleeping threads for each block costs as much as
//! the copy on the H200 machine's VM (a generic thread pool reached a
//! third of the link there). So the workers spin on the job counter for
//! [`SPIN_FOR`] after their last piece, then park: while a copy streams
//! blocks they never sleep, and with no copy in flight no core stays busy.
//! The calling thread never waits for a worker to wake: it starts on the
//! pieces at once, and a worker that wakes late finds them taken.
//!
//! Orderings: the caller publishes a job (its pointers and sequence number
//! under `job`'s lock), opens its claims, then bumps `generation`
//! (SeqCst); a worker that sees the new generation reads the job under the
//! same lock and claims pieces with the job's tag, which fails once the
//! caller has moved on; the caller returns when every piece is finished,
//! so every claimed piece's writes happen before it (see `claim.rs`).
//! Parking is the Dekker pattern on `parked` and `generation`, both
//! SeqCst: a worker counts itself parked, then looks at the generation
//! under the lock; the caller bumps the generation, then notifies if anyone
//! is parked.

use crate::base::claim::{Claims, MAX_PARTS};
use crate::base::completion::lock;
use crate::base::error::{Error, Result};
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
pub(crate) const SPIN_FOR: Duration = Duration::from_millis(2);

/// A piece is a multiple of this many bytes (a page: no two threads write
/// one cache line, and pages map whole).
const PIECE_ALIGN: usize = 4096;

/// The smallest piece worth handing to another thread.
const MIN_PIECE: usize = 64 << 10;

/// Pieces per participant: enough that a worker joining late still finds
/// some, few enough that claiming costs nothing next to the copy.
const PIECES_EACH: usize = 4;

/// The smallest piece of an `O_DIRECT` read ([`What::ReadParts`]): each
/// is one request to the disk, and a disk (NVMe, virtio) reads a few large
/// requests in flight at its full rate where many small ones cost it
/// per-request time.
pub(crate) const DIRECT_PIECE_MIN: usize = 4 << 20;

/// The largest piece of an `O_DIRECT` read.
pub(crate) const DIRECT_PIECE_MAX: usize = 16 << 20;

/// One block's work: `len` bytes in `parts` pieces of `piece` bytes (the
/// last shorter), each a copy, a read from a file or a write to one; `seq`
/// tags its claims.
#[derive(Clone, Copy)]
struct Job {
    what: What,
    len: usize,
    piece: usize,
    parts: usize,
    seq: u64,
}

impl Job {
    /// `len` bytes of `what`, cut for `participants` threads.
    fn new(what: What, len: usize, participants: usize, seq: u64) -> Job {
        let piece = match what {
            // One request per participant, of 4-16 MiB each.
            What::ReadParts { .. } => len
                .div_ceil(participants)
                .clamp(DIRECT_PIECE_MIN, DIRECT_PIECE_MAX),
            _ => len.div_ceil(participants * PIECES_EACH).max(MIN_PIECE),
        }
        .next_multiple_of(PIECE_ALIGN)
        .max(len.div_ceil(MAX_PARTS));
        Job {
            what,
            len,
            piece,
            parts: len.div_ceil(piece).max(1),
            seq,
        }
    }
}

/// What a piece of a job does with its range (addresses as integers).
#[derive(Clone, Copy)]
enum What {
    /// Copies `src..src + len` to `dst`.
    Copy { src: usize, dst: usize },
    /// Reads the file (the address of a borrowed `File`) from offset `at`
    /// into `dst` (`pread`).
    Read { file: usize, at: u64, dst: usize },
    /// Reads the file (as for `Read`) into several destinations: the
    /// job's bytes are the concatenation of `count` [`ReadPart`]s (at
    /// address `parts`); a piece reads the parts of them its byte range
    /// covers.
    ReadParts {
        file: usize,
        parts: usize,
        count: usize,
    },
    /// As `ReadParts`, in the pieces of a buffered read (a copy's sizes):
    /// many small parts of a file gathered into one block.
    ReadScattered {
        file: usize,
        parts: usize,
        count: usize,
    },
    /// Writes `src` to the file (as for `Read`) at offset `at` (`pwrite`).
    Write { file: usize, at: u64, src: usize },
    /// Gathers rows into `dst`: destination row `r` is the `row_bytes`
    /// bytes at address `rows[r]` (`rows` the address of a `[usize]`).
    /// A piece copies the parts of the rows its byte range covers, so any
    /// split of `dst` works.
    Gather {
        rows: usize,
        row_bytes: usize,
        dst: usize,
    },
}

struct Shared {
    /// Read by every worker at once when a job opens: a read lock, so
    /// they never queue on it.
    job: RwLock<Job>,
    generation: AtomicU64,
    /// The current job's pieces: who takes which, how many are finished.
    claims: Claims,
    /// The sequence number of the next job (under `turn`).
    next_seq: AtomicU64,
    /// The first failure of a piece of the current job (a panic, an I/O
    /// error).
    failed: Mutex<Option<Error>>,
    parked: AtomicUsize,
    /// Times a worker came out of its wait for a job.
    #[cfg(test)]
    woke: AtomicUsize,
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
    /// The process the threads run in: a `fork()` child has none of them.
    generation: crate::base::fork::Generation,
}

impl CopyWorkers {
    /// Starts `n` workers (0: the caller copies alone); each runs `init`
    /// first (placement on the GPU's NUMA node).
    ///
    /// # Errors
    /// `Internal` when a thread can't be started (those started are stopped).
    pub(crate) fn start(n: usize, init: impl Fn() + Send + Sync + Clone + 'static) -> Result<Self> {
        let shared = Arc::new(Shared {
            job: RwLock::new(Job::new(What::Copy { src: 0, dst: 0 }, 0, 1, 0)),
            generation: AtomicU64::new(0),
            claims: Claims::new(),
            next_seq: AtomicU64::new(1),
            failed: Mutex::new(None),
            parked: AtomicUsize::new(0),
            #[cfg(test)]
            woke: AtomicUsize::new(0),
            wake: Condvar::new(),
            sleep: Mutex::new(()),
            stop: AtomicBool::new(false),
            plant: AtomicBool::new(false),
        });
        let mut workers = CopyWorkers {
            shared: shared.clone(),
            threads: Vec::with_capacity(n),
            turn: Mutex::new(()),
            generation: crate::base::fork::Generation::now(),
        };
        for index in 0..n {
            let (shared, init) = (shared.clone(), init.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("staging-{index}"))
                .spawn(move || {
                    init();
                    work(&shared);
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
        self.copy_while(src, dst, || ()).0
    }

    /// Fills `dst` from `file` at offset `at`, in parallel `pread`s.
    ///
    /// # Errors
    /// [`Error::Io`]: the system's error, or `UnexpectedEof` when the file
    /// ends before `dst` is full (a truncated file, or one that shrank).
    pub(crate) fn read(&self, file: &std::fs::File, at: u64, dst: &mut [u8]) -> Result<()> {
        let what = What::Read {
            file: file as *const std::fs::File as usize,
            at,
            dst: dst.as_mut_ptr() as usize,
        };
        // SAFETY: `dst` is borrowed exclusively for the call; the file
        // (and so its descriptor) for the call too.
        unsafe { self.run(what, dst.len()) }
    }

    /// Fills each destination of `parts` from `file` at its offset, in
    /// parallel `pread`s of 4-16 MiB ([`DIRECT_PIECE_MIN`]) taken in order
    /// over all of them (one request in flight per participant): the
    /// `O_DIRECT` reads of several blocks at once. For `O_DIRECT`, every
    /// part's offset, address and length are multiples of 4 KiB; pieces are
    /// too, so every `pread` is aligned.
    ///
    /// # Errors
    /// As [`CopyWorkers::read`].
    pub(crate) fn read_parts(
        &self,
        file: &std::fs::File,
        parts: &mut [ReadPart<'_>],
    ) -> Result<()> {
        let len = parts.iter().map(|p| p.dst.len()).sum();
        let raw: Vec<(u64, usize, usize)> = parts
            .iter_mut()
            .map(|p| (p.at, p.dst.as_mut_ptr() as usize, p.dst.len()))
            .collect();
        let what = What::ReadParts {
            file: file as *const std::fs::File as usize,
            parts: raw.as_ptr() as usize,
            count: raw.len(),
        };
        // SAFETY: every destination is borrowed exclusively (through
        // `parts`) for the call, `raw` and the file too.
        unsafe { self.run(what, len) }
    }

    /// Fills each destination of `parts` from `file` at its offset, in
    /// parallel buffered `pread`s of a copy's piece sizes taken in order
    /// over all of them (a piece reads the parts its byte range covers):
    /// the many small reads of a gathered block.
    ///
    /// # Errors
    /// As [`CopyWorkers::read`].
    pub(crate) fn read_scattered(
        &self,
        file: &std::fs::File,
        parts: &mut [ReadPart<'_>],
    ) -> Result<()> {
        let len = parts.iter().map(|p| p.dst.len()).sum();
        let raw: Vec<(u64, usize, usize)> = parts
            .iter_mut()
            .map(|p| (p.at, p.dst.as_mut_ptr() as usize, p.dst.len()))
            .collect();
        let what = What::ReadScattered {
            file: file as *const std::fs::File as usize,
            parts: raw.as_ptr() as usize,
            count: raw.len(),
        };
        // SAFETY: every destination is borrowed exclusively (through
        // `parts`) for the call, `raw` and the file too.
        unsafe { self.run(what, len) }
    }

    /// Writes `src` to `file` at offset `at`, in parallel `pwrite`s.
    ///
    /// # Errors
    /// [`Error::Io`]: the system's error (`ENOSPC` on a full disk).
    pub(crate) fn write(&self, file: &std::fs::File, at: u64, src: &[u8]) -> Result<()> {
        let what = What::Write {
            file: file as *const std::fs::File as usize,
            at,
            src: src.as_ptr() as usize,
        };
        // SAFETY: `src` is borrowed for the call; the file too.
        unsafe { self.run(what, src.len()) }
    }

    /// Fills `dst` with rows gathered from memory: destination row `r` is
    /// the `row_bytes` bytes at `rows[r]`; `dst` holds `rows.len() ×
    /// row_bytes` bytes.
    ///
    /// # Safety
    /// Every `rows[r]` is the address of `row_bytes` bytes readable, and
    /// written by no one, until this returns.
    ///
    /// # Errors
    /// As [`CopyWorkers::copy`].
    pub(crate) unsafe fn gather(
        &self,
        rows: &[usize],
        row_bytes: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        assert_eq!(
            Some(dst.len()),
            rows.len().checked_mul(row_bytes),
            "CopyWorkers::gather of a destination not rows × row_bytes"
        );
        let what = What::Gather {
            rows: rows.as_ptr() as usize,
            row_bytes,
            dst: dst.as_mut_ptr() as usize,
        };
        // SAFETY: `dst` and `rows` are borrowed for the call; the rows they
        // name are readable for the call (the caller's contract).
        unsafe { self.run(what, dst.len()) }
    }

    /// As [`CopyWorkers::copy`], and `during` runs on this thread once the
    /// workers have started on the copy, before it takes pieces too: work
    /// of its own (a DMA of the block before to issue) that then costs the
    /// copy nothing. `during` runs exactly once, whatever the copy's
    /// outcome; its result comes back beside the copy's.
    pub(crate) fn copy_while<R>(
        &self,
        src: &[u8],
        dst: &mut [u8],
        during: impl FnOnce() -> R,
    ) -> (Result<()>, R) {
        assert_eq!(src.len(), dst.len(), "CopyWorkers::copy of unequal lengths");
        let what = What::Copy {
            src: src.as_ptr() as usize,
            dst: dst.as_mut_ptr() as usize,
        };
        // SAFETY: `src` and `dst` are borrowed for the call, `len` bytes each.
        unsafe { self.run_while(what, src.len(), during) }
    }

    /// Runs one job of `len` bytes on the workers and this thread.
    ///
    /// # Safety
    /// As [`CopyWorkers::run_while`].
    unsafe fn run(&self, what: What, len: usize) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.run_while(what, len, || ()) }.0
    }

    /// Runs one job of `len` bytes on the workers and this thread, this
    /// thread first running `during` (exactly once) once the job is open.
    ///
    /// # Safety
    /// The ranges `what` names are valid (for reads, or exclusively for
    /// writes) for `len` bytes, and its descriptor open, until this returns.
    unsafe fn run_while<R>(
        &self,
        what: What,
        len: usize,
        during: impl FnOnce() -> R,
    ) -> (Result<()>, R) {
        // In a fork() child the workers don't exist: waiting for them would
        // hang.
        if let Err(e) = self.generation.check("a staging engine") {
            return (Err(e), during());
        }
        let s = &*self.shared;
        let job = Job::new(what, len, self.threads.len() + 1, 0);
        if job.parts == 1 {
            let r = during();
            return (do_piece(s, job, 0), r);
        }
        let _turn = lock(&self.turn);
        let job = Job {
            seq: s.next_seq.fetch_add(1, Ordering::Relaxed),
            ..job
        };
        *s.job.write().unwrap_or_else(|p| p.into_inner()) = job;
        *lock(&s.failed) = None;
        s.claims.open(job.seq);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.parked.load(Ordering::SeqCst) > 0 {
            let _g = lock(&s.sleep);
            s.wake.notify_all();
        }
        // The workers copy while `during` runs; a panic in it waits for
        // them (they write memory the unwinding may free) before going on.
        let during = std::panic::catch_unwind(AssertUnwindSafe(during));
        // This thread takes pieces too: it never waits for a worker to
        // wake, only for pieces already taken to finish.
        let mut mine = Ok(());
        while let Some(index) = s.claims.claim(job.seq, job.parts) {
            let done = do_piece(s, job, index);
            s.claims.finish();
            if mine.is_ok() {
                mine = done;
            }
        }
        let mut spins = 0u32;
        while !s.claims.all_done(job.parts) {
            spins = spins.saturating_add(1);
            backoff(spins);
        }
        let during = match during {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        };
        let failed = lock(&s.failed).take();
        let result = match (mine, failed) {
            (Err(e), _) | (Ok(()), Some(e)) => Err(e),
            (Ok(()), None) => Ok(()),
        };
        (result, during)
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
        if !self.generation.is_current() {
            // A fork() child: the threads are the parent's; nothing to join.
            self.threads.clear();
            return;
        }
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

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Does piece `index` of `job`; a panic becomes [`Error::WorkerPanicked`].
fn do_piece(s: &Shared, job: Job, index: usize) -> Result<()> {
    let start = (job.piece * index).min(job.len);
    let end = (start + job.piece).min(job.len);
    let run = || -> Result<()> {
        if s.plant.load(Ordering::Relaxed) && s.plant.swap(false, Ordering::SeqCst) {
            panic!("planted panic in a staging worker");
        }
        if end == start {
            return Ok(());
        }
        match job.what {
            What::Copy { src, dst } => {
                // SAFETY: the caller of `run` holds `src` (shared) and `dst`
                // (exclusive) borrowed for `len` bytes until every piece is
                // done; pieces are disjoint ranges of them.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (src + start) as *const u8,
                        (dst + start) as *mut u8,
                        end - start,
                    )
                };
                Ok(())
            }
            What::Read { file, at, dst } => {
                // SAFETY: as for a copy: `dst + start..dst + end` is this
                // piece's part of the exclusively borrowed destination; the
                // file is borrowed by the caller of `run` too.
                let (buf, file) = unsafe {
                    (
                        std::slice::from_raw_parts_mut((dst + start) as *mut u8, end - start),
                        &*(file as *const std::fs::File),
                    )
                };
                read_exact_at(file, buf, at + start as u64)
            }
            What::ReadParts { file, parts, count } | What::ReadScattered { file, parts, count } => {
                // SAFETY: the caller of `read_parts` holds the parts (raw
                // `(at, dst, len)` triples), their destinations (exclusively)
                // and the file borrowed until every piece is done; pieces are
                // disjoint ranges of the concatenated destinations.
                let (parts, file) = unsafe {
                    (
                        std::slice::from_raw_parts(parts as *const (u64, usize, usize), count),
                        &*(file as *const std::fs::File),
                    )
                };
                read_parts_range(parts, file, start, end)
            }
            What::Write { file, at, src } => {
                // SAFETY: as for a copy, the source borrowed for reads; the
                // file borrowed by the caller.
                let (buf, file) = unsafe {
                    (
                        std::slice::from_raw_parts((src + start) as *const u8, end - start),
                        &*(file as *const std::fs::File),
                    )
                };
                Ok(file.write_all_at(buf, at + start as u64)?)
            }
            What::Gather {
                rows,
                row_bytes,
                dst,
            } => {
                gather_range(rows, row_bytes, dst, start, end);
                Ok(())
            }
        }
    };
    match std::panic::catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(p) => Err(Error::WorkerPanicked(panic_text(&*p))),
    }
}

/// One destination of [`CopyWorkers::read_parts`]: `dst.len()` bytes of the
/// file from offset `at`.
pub(crate) struct ReadPart<'a> {
    pub(crate) at: u64,
    pub(crate) dst: &'a mut [u8],
}

/// Reads bytes `start..end` of the concatenated destinations of `parts`
/// (`(file offset, address, length)` each).
fn read_parts_range(
    parts: &[(u64, usize, usize)],
    file: &std::fs::File,
    start: usize,
    end: usize,
) -> Result<()> {
    let mut base = 0;
    for &(at, dst, len) in parts {
        let (lo, hi) = (start.max(base), end.min(base + len));
        if lo < hi {
            // SAFETY: `lo - base..hi - base` lies in this part's destination,
            // borrowed exclusively by the caller of `read_parts` until every
            // piece is done; pieces are disjoint.
            let buf =
                unsafe { std::slice::from_raw_parts_mut((dst + lo - base) as *mut u8, hi - lo) };
            read_exact_at(file, buf, at + (lo - base) as u64)?;
        }
        base += len;
        if base >= end {
            break;
        }
    }
    Ok(())
}

/// Copies bytes `start..end` of a gather's destination (see
/// [`What::Gather`]): the tail of the first row the range cuts, whole rows,
/// the head of the last.
fn gather_range(rows: usize, row_bytes: usize, dst: usize, start: usize, end: usize) {
    let mut at = start;
    while at < end {
        let (row, within) = (at / row_bytes, at % row_bytes);
        let n = (row_bytes - within).min(end - at);
        // SAFETY: the caller of `CopyWorkers::gather` holds `rows` (the
        // destination's row count of addresses) and `dst` borrowed until
        // every piece is done, and each `rows[row]` readable for
        // `row_bytes` bytes; `at < end <= dst's length`, so `row` is in
        // range; pieces write disjoint ranges of `dst`.
        unsafe {
            let src = *(rows as *const usize).add(row);
            std::ptr::copy_nonoverlapping((src + within) as *const u8, (dst + at) as *mut u8, n);
        }
        at += n;
    }
}

/// `pread`s `buf` from `file` at `at`, whole; a file that ends early is an
/// `UnexpectedEof` that says where (truncated, or shrinking during the read).
pub(crate) fn read_exact_at(file: &std::fs::File, buf: &mut [u8], at: u64) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    file.read_exact_at(buf, at).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            std::io::Error::new(
                e.kind(),
                format!(
                    "the file ends before offset {} (truncated, or it shrank during the read)",
                    at + buf.len() as u64
                ),
            )
        } else {
            e
        }
        .into()
    })
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
fn work(s: &Shared) {
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
        #[cfg(test)]
        s.woke.fetch_add(1, Ordering::SeqCst);
        seen = s.generation.load(Ordering::SeqCst);
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        // The job is read with its tag: if the caller has moved on, the
        // claims refuse it and this worker waits for the next.
        let job = *s.job.read().unwrap_or_else(|p| p.into_inner());
        while let Some(index) = s.claims.claim(job.seq, job.parts) {
            if let Err(e) = do_piece(s, job, index) {
                let mut f = lock(&s.failed);
                if f.is_none() {
                    *f = Some(e);
                }
            }
            s.claims.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits up to 10 s for `cond`.
    fn eventually(cond: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        cond()
    }

    #[test]
    fn every_parked_worker_wakes_for_the_next_job_and_parks_again() {
        for n in [1, 2, 3, 5, 12, 13] {
            let w = CopyWorkers::start(n, || {}).unwrap();
            let s = &*w.shared;
            for round in 0..3u8 {
                assert!(
                    eventually(|| s.parked.load(Ordering::SeqCst) == n),
                    "{n} workers: not all parked before round {round}"
                );
                let woke = s.woke.load(Ordering::SeqCst);
                let src = pattern(8 << 20, round);
                let mut dst = vec![0u8; src.len()];
                w.copy(&src, &mut dst).unwrap();
                assert!(dst == src, "{n} workers: round {round} copied wrong bytes");
                assert!(
                    eventually(|| s.woke.load(Ordering::SeqCst) >= woke + n),
                    "{n} workers: only {} of them woke for round {round}",
                    s.woke.load(Ordering::SeqCst) - woke
                );
            }
        }
    }

    fn pattern(len: usize, salt: u8) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ salt).collect()
    }

    #[test]
    fn work_done_during_a_copy_runs_once_and_the_copy_is_whole() {
        let w = CopyWorkers::start(3, || {}).unwrap();
        // One piece (the caller alone) and many.
        for len in [0, 5, 64 << 10, (16 << 20) + 3] {
            let src = pattern(len, 7);
            let mut dst = vec![0u8; len];
            let mut ran = 0;
            let (copied, got) = w.copy_while(&src, &mut dst, || {
                ran += 1;
                len * 2
            });
            copied.unwrap();
            assert_eq!((ran, got), (1, len * 2), "{len} bytes");
            assert!(dst == src, "{len} bytes: wrong bytes");
        }
    }

    #[test]
    fn work_done_during_a_copy_runs_once_when_a_piece_fails() {
        let w = CopyWorkers::start(3, || {}).unwrap();
        let src = pattern(16 << 20, 3);
        let mut dst = vec![0u8; src.len()];
        w.shared.plant.store(true, Ordering::SeqCst);
        let mut ran = 0;
        let (copied, ()) = w.copy_while(&src, &mut dst, || ran += 1);
        assert!(
            matches!(copied, Err(Error::WorkerPanicked(_))),
            "{copied:?}"
        );
        assert_eq!(ran, 1);
    }

    #[test]
    fn a_panic_during_a_copy_waits_for_every_piece_before_it_goes_on() {
        let w = CopyWorkers::start(3, || {}).unwrap();
        for salt in 0..4u8 {
            let src = pattern(64 << 20, salt);
            let mut dst = vec![0u8; src.len()];
            let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
                w.copy_while(&src, &mut dst, || panic!("planted panic during a copy"))
            }));
            assert!(unwound.is_err(), "the panic did not come through");
            // Every piece finished before the unwinding left the call: no
            // worker writes `dst` any more.
            assert!(
                dst == src,
                "round {salt}: pieces still unfinished after the panic"
            );
        }
        // The workers go on with the next job.
        let src = pattern(8 << 20, 9);
        let mut dst = vec![0u8; src.len()];
        w.copy(&src, &mut dst).unwrap();
        assert!(dst == src);
    }
}
