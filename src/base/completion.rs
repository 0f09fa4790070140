//! The completion core: a one-shot "this point of GPU work has finished"
//! signal that futures can await. Free of CUDA, so it is tested anywhere.
//!
//! A backend's completion source (the CUDA event watcher, or the CPU stream
//! worker) calls [`Completion::complete`] exactly when the work before a
//! recorded point has finished; the awaiting task then runs.
//!
//! Protocol and memory ordering:
//! - `complete` stores the result and sets `done` (`Release`) *while holding*
//!   the state lock, takes the wakers and deferred actions, and wakes them
//!   after unlocking. A waiter checks `done` with `Acquire` first (fast path),
//!   and otherwise, under the same lock, re-checks the result and registers
//!   its waker: register-then-recheck, so a completion that races with
//!   registration is never missed (the lock orders the two).
//! - Deferred actions (dropping buffers whose owner gave up waiting) run once,
//!   after `done` is set, on the completing thread; an action deferred after
//!   completion runs at once. This is what makes dropping an unfinished future
//!   safe: memory is released at completion, never earlier, and `drop` never
//!   blocks.
//!
//! No lock is held across a wake, a deferred action or a driver call.
//!
//! Checked by Miri (CI) and by loom, which explores the interleavings of
//! completion against registration and deferral
//! (`RUSTFLAGS="--cfg loom" cargo test -p host --lib --release loom`).

#[cfg(test)]
use crate::base::error::Error;
use crate::base::error::Result;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

#[cfg(all(test, loom))]
use loom::sync::atomic::AtomicUsize;
#[cfg(loom)]
use loom::sync::{atomic::AtomicBool, Arc, Mutex, MutexGuard};
#[cfg(all(test, not(loom)))]
use std::sync::atomic::AtomicUsize;
#[cfg(not(loom))]
use std::sync::{atomic::AtomicBool, Arc, Mutex, MutexGuard};

type Deferred = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    result: Option<Result<()>>,
    wakers: Vec<Waker>,
    deferred: Vec<Deferred>,
}

struct Inner {
    /// Set once `state.result` is; lets the fast path skip the lock.
    done: AtomicBool,
    state: Mutex<State>,
    /// The process it was made in: in a `fork()` child nothing completes it.
    generation: crate::base::fork::Generation,
}

/// Locks the state, ignoring poisoning (no code path panics holding it).
fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
                state: Mutex::new(State::default()),
                generation: crate::base::fork::Generation::now(),
            }),
        }
    }

    /// Marks the completion finished with `result`, wakes every waiter and runs
    /// deferred actions. Only the first call has an effect.
    pub fn complete(&self, result: Result<()>) {
        let (wakers, deferred) = {
            let mut s = locked(&self.inner.state);
            if s.result.is_some() {
                return; // already completed
            }
            s.result = Some(result);
            self.inner.done.store(true, Ordering::Release);
            (
                std::mem::take(&mut s.wakers),
                std::mem::take(&mut s.deferred),
            )
        };
        // A waker or a deferred action is user code (a bundle's `Drop`): a
        // panic in one must not end the completion source's thread, whose
        // queue holds other points (and their cancelled jobs' buffers, still
        // in use by the GPU). It is reported and the rest run.
        for waker in wakers {
            contain("a waker", move || waker.wake());
        }
        for action in deferred {
            contain("the release of a cancelled job's buffers", action);
        }
    }

    /// Whether the completion has finished.
    pub fn is_done(&self) -> bool {
        self.inner.done.load(Ordering::Acquire)
    }

    /// The result, once finished.
    pub fn result(&self) -> Option<Result<()>> {
        if self.is_done() {
            locked(&self.inner.state).result.clone()
        } else {
            None
        }
    }

    /// Runs `action` once the completion has finished (at once if it has).
    pub fn defer(&self, action: impl FnOnce() + Send + 'static) {
        {
            let mut s = locked(&self.inner.state);
            if s.result.is_none() {
                s.deferred.push(Box::new(action));
                return;
            }
        }
        action();
    }

    /// Whether waiting for it here could never end: it is pending and this
    /// is a `fork()` child of the process that made it (nothing will
    /// complete it), or `gpufeed::block_on` blocks on it on a completion thread.
    /// The error to resolve to instead.
    pub(crate) fn refuse_wait(&self, what: &str) -> Option<crate::base::error::Error> {
        if self.is_done() {
            return None;
        }
        if !self.inner.generation.is_current() {
            return self.inner.generation.check(what).err();
        }
        blocking_on_completion_thread().then(|| refused_wait(what))
    }

    /// Polls for completion, registering `cx`'s waker if still pending.
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut s = locked(&self.inner.state);
        if let Some(r) = &s.result {
            return Poll::Ready(r.clone());
        }
        // Replace our previous waker rather than growing the list on every poll.
        if let Some(slot) = s.wakers.iter_mut().find(|k| k.will_wake(cx.waker())) {
            slot.clone_from(cx.waker());
        } else {
            s.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// A future that resolves when the completion finishes.
    pub fn wait(&self) -> Wait {
        Wait { c: self.clone() }
    }

    /// Blocks the calling thread until finished (for synchronous paths and the
    /// CPU backend's workers). Parks the thread between looks; it is no
    /// executor, so it works inside one too (`futures::executor::block_on`
    /// refuses to run inside another executor: a panic in a synchronous wait
    /// like `run_sync`'s, with work still queued on the bundle).
    pub fn block(&self) -> Result<()> {
        /// Unparks the waiting thread.
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.unpark();
            }
            fn wake_by_ref(self: &std::sync::Arc<Self>) {
                self.0.unpark();
            }
        }
        if !self.is_done() && !self.inner.generation.is_current() {
            return self.inner.generation.check("work");
        }
        let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            // Registers the waker before the last look (see `poll_done`), so
            // a completion between the look and the park unparks it: a park
            // after an unpark returns at once.
            if let Poll::Ready(r) = self.poll_done(&mut cx) {
                return r;
            }
            std::thread::park();
        }
    }
}

/// Future returned by [`Event::wait`](crate::Event::wait).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, Kernel, Stream, Wait};
/// let device = Device::cpu();
/// let stream = Stream::new(&device)?;
/// let job = stream.launch(Kernel::Scale { s: 2.0 }, DeviceBuffer::new(&device, 1024)?);
/// let event = stream.record()?;
/// let wait: Wait = event.wait(); // dropping it would change nothing
/// block_on(wait)?; // `event.wait().await?` in async code
/// assert!(event.is_done() && job.is_done());
/// # drop(job); Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "futures do nothing unless awaited"]
pub struct Wait {
    c: Completion,
}

impl Future for Wait {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(e) = self.c.refuse_wait("an event") {
            return Poll::Ready(Err(e));
        }
        self.c.poll_done(cx)
    }
}

/// Runs `f`, reporting a panic in it on stderr instead of passing it on.
fn contain(what: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        eprintln!("host: {what} panicked at a completion; the panic was contained so later completions are still delivered");
    }
}

thread_local! {
    /// Set on the threads that complete completions (CUDA watchers, CPU
    /// stream workers): deferred releases, and so the `Drop` of a cancelled
    /// job's bundle, run there.
    static ON_COMPLETION_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as a completion source's thread.
pub(crate) fn mark_completion_thread() {
    ON_COMPLETION_THREAD.with(|w| w.set(true));
}

/// Whether the calling thread is a completion source's thread.
pub(crate) fn on_completion_thread() -> bool {
    ON_COMPLETION_THREAD.with(|w| w.get())
}

thread_local! {
    /// Set while [`crate::block_on`] runs on a completion thread.
    static BLOCKING_ON_COMPLETION_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as blocking in `gpufeed::block_on` while the guard
/// lives, if it is a completion thread; restores the mark on drop.
pub(crate) struct BlockingHere(Option<bool>);

impl BlockingHere {
    pub(crate) fn enter() -> BlockingHere {
        if !on_completion_thread() {
            return BlockingHere(None);
        }
        BlockingHere(Some(
            BLOCKING_ON_COMPLETION_THREAD.with(|b| b.replace(true)),
        ))
    }
}

impl Drop for BlockingHere {
    fn drop(&mut self) {
        if let Some(before) = self.0 {
            BLOCKING_ON_COMPLETION_THREAD.with(|b| b.set(before));
        }
    }
}

/// Whether a pending future of ours polled now is being blocked on by
/// `gpufeed::block_on` on a completion thread: its wake could only come from
/// this thread, so it would never come. (A poll from any other executor,
/// even on a completion thread, is an ordinary poll.)
pub(crate) fn blocking_on_completion_thread() -> bool {
    BLOCKING_ON_COMPLETION_THREAD.with(|b| b.get())
}

/// The error of a wait refused by [`blocking_on_completion_thread`].
pub(crate) fn refused_wait(what: &str) -> crate::base::error::Error {
    crate::base::error::Error::Internal(format!(
        "{what} awaited with gpufeed::block_on on one of the library's completion threads (in the \
         Drop of a cancelled job's bundle?) would wait for itself"
    ))
}

/// Refuses a blocking wait on a completion thread: the thread would wait for
/// completions only it can deliver (a hang). Reached when a `Drop` of a
/// cancelled job's bundle blocks on GPU work.
pub(crate) fn refuse_blocking_on_completion_thread(what: &str) -> Result<()> {
    if on_completion_thread() {
        return Err(crate::base::error::Error::Internal(format!(
            "{what} called on a completion thread (from the drop of a cancelled job's \
             bundle?): it would wait for itself"
        )));
    }
    Ok(())
}

/// Locks, ignoring poisoning: the protected data stays consistent because no
/// code path panics while holding these locks.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Model checks: loom runs each body under every interleaving of its threads
/// (up to its preemption bound) and fails on a deadlock, i.e. a lost wake-up.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::future::block_on;
    use loom::thread;

    #[test]
    fn completion_racing_registration_always_wakes_the_waiter() {
        loom::model(|| {
            let c = Completion::new();
            let c2 = c.clone();
            let t = thread::spawn(move || c2.complete(Ok(())));
            assert!(block_on(c.wait()).is_ok());
            t.join().unwrap();
        });
    }

    #[test]
    fn a_deferred_action_runs_exactly_once_whoever_wins() {
        loom::model(|| {
            let c = Completion::new();
            let runs = Arc::new(AtomicUsize::new(0));
            let (c2, r2) = (c.clone(), runs.clone());
            let t = thread::spawn(move || {
                c2.defer(move || {
                    r2.fetch_add(1, Ordering::SeqCst);
                })
            });
            c.complete(Ok(()));
            t.join().unwrap();
            assert_eq!(runs.load(Ordering::SeqCst), 1);
        });
    }

    #[test]
    fn only_the_first_result_counts_and_every_waiter_sees_it() {
        loom::model(|| {
            let c = Completion::new();
            let (a, b) = (c.clone(), c.clone());
            let ta = thread::spawn(move || a.complete(Err(Error::ContextBroken("a".into()))));
            let tb = thread::spawn(move || b.complete(Ok(())));
            let seen = block_on(c.wait());
            ta.join().unwrap();
            tb.join().unwrap();
            // Whichever completed first, later readers agree with the waiter.
            assert_eq!(seen.is_ok(), c.result().map(|r| r.is_ok()) == Some(true));
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

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
    fn a_panicking_deferred_action_or_waker_is_contained_and_the_rest_still_run() {
        struct Bomb;
        impl std::task::Wake for Bomb {
            fn wake(self: Arc<Self>) {
                panic!("a user's waker panics");
            }
        }
        let c = Completion::new();
        let hits = Arc::new(AtomicUsize::new(0));
        c.defer(|| panic!("a bundle's Drop panics"));
        let h = hits.clone();
        c.defer(move || {
            h.fetch_add(1, Ordering::SeqCst);
        });
        let waker = Waker::from(Arc::new(Bomb));
        let mut cx = Context::from_waker(&waker);
        assert!(c.poll_done(&mut cx).is_pending());
        c.complete(Ok(())); // returns: nothing escapes to the completing thread
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert!(c.result().unwrap().is_ok());
    }

    #[test]
    fn errors_reach_every_waiter() {
        let c = Completion::new();
        let w = c.clone();
        c.complete(Err(Error::ContextBroken("trap".into())));
        assert!(matches!(w.block(), Err(Error::ContextBroken(_))));
        assert!(matches!(c.result(), Some(Err(Error::ContextBroken(_)))));
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
