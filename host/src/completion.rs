//! The completion core: a one-shot "this point of GPU work has finished"
//! signal that futures can await. Free of CUDA, so it is tested anywhere.
//!
//! A backend's completion source (the CUDA event watcher, or the CPU stream
//! worker) calls [`Completion::complete`] exactly when the work before a
//! recorded point has finished; the awaiting task then runs.
//!
//! Protocol and memory ordering:
//! - `complete` writes the result into a `OnceLock`, then sets `done` with
//!   `Release` *while holding* the waiters lock, then wakes the waiters it
//!   took. A waiter checks `done` with `Acquire` first (fast path), and
//!   otherwise registers its waker under the same lock after re-checking
//!   `done`: register-then-recheck, so a completion that races with
//!   registration is never missed.
//! - Deferred actions (dropping buffers whose owner gave up waiting) run once,
//!   after `done` is set, on the completing thread; an action deferred after
//!   completion runs at once. This is what makes dropping an unfinished future
//!   safe: memory is released at completion, never earlier, and `drop` never
//!   blocks.
//!
//! No lock is held across a wake, a deferred action or a driver call.

use crate::error::{Error, Result};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

type Deferred = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Waiters {
    wakers: Vec<Waker>,
    deferred: Vec<Deferred>,
}

struct Inner {
    done: AtomicBool,
    result: OnceLock<Result<()>>,
    waiters: Mutex<Waiters>,
}

/// A shareable one-shot completion signal carrying `Result<(), Error>`.
#[derive(Clone)]
pub struct Completion {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("done", &self.is_done())
            .finish()
    }
}

impl Default for Completion {
    fn default() -> Self {
        Self::new()
    }
}

impl Completion {
    /// A pending completion.
    pub fn new() -> Self {
        Completion {
            inner: Arc::new(Inner {
                done: AtomicBool::new(false),
                result: OnceLock::new(),
                waiters: Mutex::new(Waiters::default()),
            }),
        }
    }

    /// An already finished completion.
    pub fn ready(result: Result<()>) -> Self {
        let c = Self::new();
        c.complete(result);
        c
    }

    /// Marks the completion finished with `result`, wakes every waiter and runs
    /// deferred actions. Only the first call has an effect.
    pub fn complete(&self, result: Result<()>) {
        if self.inner.result.set(result).is_err() {
            return; // already completed
        }
        let taken = {
            let mut w = lock(&self.inner.waiters);
            self.inner.done.store(true, Ordering::Release);
            std::mem::take(&mut *w)
        };
        for waker in taken.wakers {
            waker.wake();
        }
        for action in taken.deferred {
            action();
        }
    }

    /// Whether the completion has finished.
    pub fn is_done(&self) -> bool {
        self.inner.done.load(Ordering::Acquire)
    }

    /// The result, once finished.
    pub fn result(&self) -> Option<Result<()>> {
        if self.is_done() {
            self.inner.result.get().cloned()
        } else {
            None
        }
    }

    /// Runs `action` once the completion has finished (at once if it has).
    pub fn defer(&self, action: impl FnOnce() + Send + 'static) {
        {
            let mut w = lock(&self.inner.waiters);
            if !self.inner.done.load(Ordering::Acquire) {
                w.deferred.push(Box::new(action));
                return;
            }
        }
        action();
    }

    /// Polls for completion, registering `cx`'s waker if still pending.
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(r) = self.result() {
            return Poll::Ready(r);
        }
        {
            let mut w = lock(&self.inner.waiters);
            if !self.inner.done.load(Ordering::Acquire) {
                // Replace our previous waker rather than growing the list on every poll.
                if let Some(slot) = w.wakers.iter_mut().find(|k| k.will_wake(cx.waker())) {
                    slot.clone_from(cx.waker());
                } else {
                    w.wakers.push(cx.waker().clone());
                }
                return Poll::Pending;
            }
        }
        Poll::Ready(self.inner.result.get().cloned().unwrap_or(Ok(())))
    }

    /// A future that resolves when the completion finishes.
    pub fn wait(&self) -> Wait {
        Wait { c: self.clone() }
    }

    /// Blocks the calling thread until finished (for synchronous paths and the
    /// CPU backend's workers; never called from an executor by this crate).
    pub fn block(&self) -> Result<()> {
        futures::executor::block_on(self.wait())
    }
}

/// Future returned by [`Completion::wait`].
#[derive(Debug)]
#[must_use = "futures do nothing unless awaited"]
pub struct Wait {
    c: Completion,
}

impl Future for Wait {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.c.poll_done(cx)
    }
}

/// Locks, ignoring poisoning: the protected data stays consistent because no
/// code path panics while holding these locks.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Completes with the first error of `parts`, once all of them are done.
pub fn join(parts: &[Completion]) -> Completion {
    let all = Completion::new();
    let remaining = Arc::new(std::sync::atomic::AtomicUsize::new(parts.len()));
    let first_err: Arc<OnceLock<Error>> = Arc::new(OnceLock::new());
    if parts.is_empty() {
        all.complete(Ok(()));
    }
    for p in parts {
        let (all, remaining, first_err, p2) =
            (all.clone(), remaining.clone(), first_err.clone(), p.clone());
        p.defer(move || {
            if let Some(Err(e)) = p2.result() {
                let _ = first_err.set(e);
            }
            if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                all.complete(first_err.get().cloned().map_or(Ok(()), Err));
            }
        });
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn completes_once_and_wakes_every_waiter() {
        let c = Completion::new();
        let hits = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (c, hits) = (c.clone(), hits.clone());
                std::thread::spawn(move || {
                    c.block().unwrap();
                    hits.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        c.complete(Ok(()));
        c.complete(Err(Error::InvalidArgument("second".into())));
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(hits.load(Ordering::SeqCst), 8);
        assert!(c.result().unwrap().is_ok(), "the first result wins");
    }

    #[test]
    fn deferred_actions_run_at_completion_or_at_once() {
        let c = Completion::new();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        c.defer(move || {
            h.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        c.complete(Ok(()));
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        let h = hits.clone();
        c.defer(move || {
            h.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn errors_reach_every_waiter_and_join() {
        let (a, b) = (Completion::new(), Completion::new());
        let j = join(&[a.clone(), b.clone()]);
        a.complete(Err(Error::ContextBroken("trap".into())));
        assert!(!j.is_done());
        b.complete(Ok(()));
        assert!(matches!(j.block(), Err(Error::ContextBroken(_))));
        assert!(matches!(a.block(), Err(Error::ContextBroken(_))));
        assert!(join(&[]).block().is_ok());
    }

    #[test]
    fn racing_completion_and_registration_never_loses_a_wake() {
        for _ in 0..if cfg!(miri) { 20 } else { 2000 } {
            let c = Completion::new();
            let c2 = c.clone();
            let t = std::thread::spawn(move || c2.complete(Ok(())));
            assert!(c.block().is_ok());
            t.join().unwrap();
        }
    }
}
