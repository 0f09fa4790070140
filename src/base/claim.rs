//! `Claims`: the pieces of one job, taken one at a time by whoever comes,
//! tagged with the job's sequence number so a latecomer only ever helps.
//!
//! The staging workers copy a block in pieces. A fixed split (piece *i* to
//! worker *i*) makes the thread driving the copy wait for the slowest
//! worker to *start*, which, for a worker parked in the kernel, is a
//! wake-up: milliseconds on a VM. With claims the driving thread starts on
//! the pieces at once; workers that wake in time take some, one that wakes
//! late finds none left (or a newer job's tag) and does nothing.
//!
//! One word holds `seq << NEXT_BITS | next`: the job's sequence number and
//! the next unclaimed piece. A claim is a compare-and-swap that keeps the
//! tag, so it fails once the owner has opened a newer job. `done` counts
//! finished pieces; the owner returns once it equals `parts`, so no claim
//! of that job can succeed afterwards (every piece is taken), and a
//! claim's work happens before the owner returns (Release on `finish`,
//! Acquire in `all_done`).
//!
//! Checked by loom (`loom_tests` below): every piece done exactly once, and
//! never after the owner has returned, with a latecomer holding a stale tag.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::atomic::Ordering;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, AtomicUsize};

/// Bits of the word for the next piece; the rest is the sequence number.
const NEXT_BITS: u32 = 24;
/// The most pieces one job may have.
pub(crate) const MAX_PARTS: usize = (1 << NEXT_BITS) - 1;
const NEXT_MASK: u64 = (1 << NEXT_BITS) - 1;

/// The claim word and the count of finished pieces of the current job.
pub(crate) struct Claims {
    word: AtomicU64,
    done: AtomicUsize,
}

impl Claims {
    pub(crate) fn new() -> Self {
        Claims {
            word: AtomicU64::new(0),
            done: AtomicUsize::new(0),
        }
    }

    /// Opens job `seq` (pieces from 0). Only the owner calls this, and only
    /// once the previous job is [`all_done`](Self::all_done).
    pub(crate) fn open(&self, seq: u64) {
        self.done.store(0, Ordering::SeqCst);
        self.word.store(tag(seq), Ordering::SeqCst);
    }

    /// Takes the next piece of job `seq` (of `parts`), if any is left and
    /// `seq` is still the open job.
    pub(crate) fn claim(&self, seq: u64, parts: usize) -> Option<usize> {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            let next = (word & NEXT_MASK) as usize;
            if word & !NEXT_MASK != tag(seq) || next >= parts {
                return None;
            }
            match self.word.compare_exchange_weak(
                word,
                word + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(next),
                Err(now) => word = now,
            }
        }
    }

    /// A claimed piece is finished (its writes happen before the owner's
    /// [`all_done`](Self::all_done) sees it).
    pub(crate) fn finish(&self) {
        self.done.fetch_add(1, Ordering::Release);
    }

    /// Whether all `parts` pieces of the open job are finished.
    pub(crate) fn all_done(&self, parts: usize) -> bool {
        self.done.load(Ordering::Acquire) >= parts
    }
}

/// The word's sequence-number part for `seq` (wrapping: a worker would
/// have to sleep through 2^40 jobs to mistake an old tag for a new one).
fn tag(seq: u64) -> u64 {
    seq << NEXT_BITS
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn claims_hand_out_each_piece_once_then_none() {
        let c = Claims::new();
        c.open(7);
        assert_eq!(c.claim(7, 3), Some(0));
        assert_eq!(c.claim(7, 3), Some(1));
        assert_eq!(c.claim(7, 3), Some(2));
        assert_eq!(c.claim(7, 3), None);
        assert!(!c.all_done(3));
        (0..3).for_each(|_| c.finish());
        assert!(c.all_done(3));
    }

    #[test]
    fn a_stale_tag_claims_nothing_of_a_newer_job() {
        let c = Claims::new();
        c.open(1);
        c.open(2);
        assert_eq!(c.claim(1, 4), None);
        assert_eq!(c.claim(2, 4), Some(0));
    }
}

/// Model checks: a latecomer with the previous job's tag and a helper of
/// the current one race the owner, who then opens the next job.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;
    use loom::thread;

    #[test]
    fn every_piece_is_done_once_and_never_after_the_owner_returned() {
        loom::model(|| {
            const PARTS: usize = 2;
            let claims = Arc::new(Claims::new());
            let returned = Arc::new(AtomicBool::new(false));
            let pieces = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
            claims.open(1);
            let helper = {
                let (claims, returned, pieces) = (claims.clone(), returned.clone(), pieces.clone());
                thread::spawn(move || {
                    // A worker that read job 1, then (maybe late) helps.
                    while let Some(i) = claims.claim(1, PARTS) {
                        assert!(!returned.load(Ordering::SeqCst), "a piece after return");
                        pieces[i].fetch_add(1, Ordering::SeqCst);
                        claims.finish();
                    }
                })
            };
            while let Some(i) = claims.claim(1, PARTS) {
                pieces[i].fetch_add(1, Ordering::SeqCst);
                claims.finish();
            }
            while !claims.all_done(PARTS) {
                thread::yield_now();
            }
            returned.store(true, Ordering::SeqCst);
            for p in pieces.iter() {
                assert_eq!(p.load(Ordering::SeqCst), 1);
            }
            // The next job: the helper, if still looking, must not take it.
            claims.open(2);
            helper.join().unwrap();
            assert_eq!(claims.claim(2, PARTS), Some(0));
        });
    }
}
