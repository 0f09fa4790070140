//! Waiting for a future on the calling thread: [`block_on`].
//!
//! Any executor runs this crate's futures (they are runtime-agnostic).
//! `block_on` is for synchronous code (a command-line tool, a Python call)
//! that wants one result now and as soon as possible: it polls the future
//! on the calling thread and, between polls, watches for the wake-up in a
//! spin of at most [`SPIN`] before it parks the thread, as
//! `cuStreamSynchronize` spins under the driver's default scheduling. A
//! wake-up within the spin costs the thread no trip through the scheduler;
//! a parked thread's wake-up does, and on the H200 machine (a VM) that is
//! usually 5 to 20 µs but in about one wait in five 100 to 200 µs: a 10^7
//! float pipeline (0.91 ms) awaited with `futures::executor::block_on`
//! took 0.93 ms at the median and 1.10 ms in a slow tenth of its runs,
//! with `block_on` 0.91 ms every time (`results/`). Past [`SPIN`] the
//! thread parks: a late wake-up then costs under 2% of the wait. After its
//! first 50 µs the spin yields the core between looks (`sched_yield`), so
//! a thread with work to do on it runs at once, but an otherwise idle core
//! stays busy for at most [`SPIN`] per wait; [`block_on_spinning`] with
//! zero parks at once.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU8, Ordering};
#[cfg(loom)]
use loom::thread::{self, Thread};
use std::future::Future;
use std::pin::pin;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU8, Ordering};
// The waker's own reference count is not what is model-checked: std's Arc
// also under loom (`Waker::from` needs it).
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
#[cfg(not(loom))]
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

/// How long [`block_on`] spins for a wake-up before it parks the thread.
pub const SPIN: Duration = Duration::from_millis(10);

/// How long the spin looks without yielding the core.
const CLOSE_SPIN: Duration = Duration::from_micros(50);

/// Fewest cores on which [`block_on`] spins.
pub const SPIN_MIN_CORES: usize = 4;

/// Nothing happened since the last poll.
const IDLE: u8 = 0;
/// Woken: poll again.
const NOTIFIED: u8 = 1;
/// The waiting thread is parked (or about to): a wake must unpark it.
const PARKED: u8 = 2;

/// The waker of one `block_on` call.
struct Signal {
    state: AtomicU8,
    thread: Thread,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // AcqRel: what the waker's thread did before waking is visible to
        // the polling thread, which swaps the state back with Acquire.
        if self.state.swap(NOTIFIED, Ordering::AcqRel) == PARKED {
            self.thread.unpark();
        }
    }
}

/// Runs `future` to completion on the calling thread and returns its
/// output, spinning up to [`SPIN`] for each wake-up before parking, on a
/// machine of at least [`SPIN_MIN_CORES`] cores (on fewer, the spin would
/// take a core the work itself needs: it parks at once).
///
/// Not for use inside an async runtime's worker (it blocks that thread);
/// there, `.await` the future.
///
/// ```
/// let device = gpufeed::Device::cpu();
/// let stream = gpufeed::Stream::new(&device)?;
/// let data = gpufeed::PinnedBuffer::from_slice(&device, &[1.0f32, 2.0])?;
/// let dev = gpufeed::DeviceBuffer::<f32>::new(&device, 2)?;
/// let ((data, _dev), ()) = gpufeed::block_on(stream.copy_h2d(data, dev))?;
/// assert_eq!(data.as_slice(), &[1.0, 2.0]);
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn block_on<F: Future>(future: F) -> F::Output {
    block_on_spinning(future, spin_here())
}

/// The spin [`block_on`] uses on this machine: [`SPIN`] on one of at least
/// [`SPIN_MIN_CORES`] cores, else zero.
pub fn spin_here() -> Duration {
    static SPIN_HERE: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN_HERE.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores >= SPIN_MIN_CORES {
            SPIN
        } else {
            Duration::ZERO
        }
    })
}

/// [`block_on`] with a spin of `spin` (zero: park at once).
pub fn block_on_spinning<F: Future>(future: F, spin: Duration) -> F::Output {
    // On a completion thread, our futures then refuse to be waited for
    // (they would wait for this very thread) instead of hanging it.
    #[cfg(not(loom))]
    let _blocking = crate::base::completion::BlockingHere::enter();
    let signal = Arc::new(Signal {
        state: AtomicU8::new(IDLE),
        thread: thread::current(),
    });
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        wait(&signal, spin);
    }
}

/// [`block_on`] for at most about `timeout`: polls `future` on the calling
/// thread until it is ready (`Some`) or `timeout` has passed (`None`; the
/// future is left as it was, to be polled again or dropped). For a caller
/// that must look up between waits: Python's signal handlers (Ctrl-C)
/// while a long operation runs, say.
#[cfg(not(loom))]
pub fn block_on_for<F: Future + Unpin>(future: &mut F, timeout: Duration) -> Option<F::Output> {
    let _blocking = crate::base::completion::BlockingHere::enter();
    let deadline = Instant::now() + timeout;
    let signal = Arc::new(Signal {
        state: AtomicU8::new(IDLE),
        thread: thread::current(),
    });
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = std::pin::Pin::new(&mut *future).poll(&mut cx) {
            return Some(out);
        }
        let spin = spin_here().min(deadline.saturating_duration_since(Instant::now()));
        if !wait_until(&signal, spin, deadline) {
            return None;
        }
    }
}

/// [`wait`] that gives up at `deadline`: whether `signal` was notified.
/// A wake-up lost to the give-up is harmless: the caller polls the future
/// again before it next waits.
#[cfg(not(loom))]
fn wait_until(signal: &Signal, spin: Duration, deadline: Instant) -> bool {
    let start = Instant::now();
    while start.elapsed() < spin {
        if signal
            .state
            .compare_exchange(NOTIFIED, IDLE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
        thread::yield_now();
    }
    if signal
        .state
        .compare_exchange(IDLE, PARKED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        signal.state.store(IDLE, Ordering::Relaxed);
        return true;
    }
    loop {
        let now = Instant::now();
        if now >= deadline {
            return signal.state.swap(IDLE, Ordering::Acquire) == NOTIFIED;
        }
        thread::park_timeout(deadline - now);
        if signal
            .state
            .compare_exchange(NOTIFIED, IDLE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
    }
}

/// Returns once `signal` was notified (and resets it to idle).
fn wait(signal: &Signal, spin: Duration) {
    let start = Instant::now();
    loop {
        if signal
            .state
            .compare_exchange(NOTIFIED, IDLE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        if start.elapsed() >= spin {
            break;
        }
        // A short wait (a small copy's) is watched closely; past
        // `CLOSE_SPIN` the core is yielded between looks, so a thread that
        // has work on it (a CPU-emulation stream worker, the watcher) gets
        // it at once.
        if start.elapsed() < CLOSE_SPIN {
            std::hint::spin_loop();
        } else {
            thread::yield_now();
        }
    }
    // Park: announce it first, so that a wake from now on unparks us.
    if signal
        .state
        .compare_exchange(IDLE, PARKED, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // Notified in between.
        signal.state.store(IDLE, Ordering::Relaxed);
        return;
    }
    loop {
        thread::park();
        if signal
            .state
            .compare_exchange(NOTIFIED, IDLE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return;
        }
        // A spurious unpark: still PARKED, park again.
    }
}

/// Model checks: loom runs each body under every interleaving of its
/// threads (`RUSTFLAGS="--cfg loom" cargo test -p host --lib --release
/// loom_tests`); a lost wake-up shows as a deadlock (the waiter parked for
/// good).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    fn signal() -> Arc<Signal> {
        Arc::new(Signal {
            state: AtomicU8::new(IDLE),
            thread: thread::current(),
        })
    }

    #[test]
    fn a_wake_racing_the_park_is_never_lost() {
        loom::model(|| {
            let s = signal();
            let waker = s.clone();
            let t = thread::spawn(move || waker.wake_by_ref());
            wait(&s, Duration::ZERO);
            t.join().unwrap();
        });
    }

    #[test]
    fn two_wakes_and_two_waits_end_with_the_signal_idle_or_notified() {
        loom::model(|| {
            let s = signal();
            let waker = s.clone();
            let t = thread::spawn(move || {
                waker.wake_by_ref();
                waker.wake_by_ref();
            });
            wait(&s, Duration::ZERO);
            t.join().unwrap();
            // Both wakes are in: one wait consumed at least one; a second
            // wait returns at once or after the pending notification.
            let st = s.state.load(Ordering::Acquire);
            assert!(st == IDLE || st == NOTIFIED, "state {st}");
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Ready after `n` polls; wakes itself from another thread after `delay`.
    struct Later {
        polls: usize,
        n: usize,
        delay: Duration,
        done: Arc<AtomicBool>,
    }

    impl Future for Later {
        type Output = usize;
        fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.polls > self.n {
                return Poll::Ready(self.polls);
            }
            let waker = cx.waker().clone();
            let delay = self.delay;
            let done = self.done.clone();
            thread::spawn(move || {
                thread::sleep(delay);
                done.store(true, Ordering::SeqCst);
                waker.wake();
            });
            Poll::Pending
        }
    }

    fn later(n: usize, delay: Duration) -> Later {
        Later {
            polls: 0,
            n,
            delay,
            done: Arc::new(AtomicBool::new(false)),
        }
    }

    #[test]
    fn a_bounded_wait_gives_up_at_its_timeout_and_finishes_on_a_later_call() {
        // Woken only after 300 ms: two 100 ms waits give up, within their
        // time, leaving the future to be polled again.
        let mut f = later(3, Duration::from_millis(300));
        for _ in 0..2 {
            let t0 = Instant::now();
            assert_eq!(block_on_for(&mut f, Duration::from_millis(100)), None);
            let took = t0.elapsed();
            assert!(
                took >= Duration::from_millis(100),
                "gave up early: {took:?}"
            );
            assert!(took < Duration::from_secs(2), "gave up late: {took:?}");
        }
        // Each give-up polled once more (spawning another waker thread);
        // the next call finishes once a wake arrives.
        let got = block_on_for(&mut f, Duration::from_secs(5));
        assert!(got.is_some());
        // Ready at once: no wait at all.
        let mut ready = later(0, Duration::ZERO);
        assert_eq!(block_on_for(&mut ready, Duration::ZERO), Some(1));
    }

    #[test]
    fn a_wake_within_the_spin_and_one_after_it_both_complete_the_future() {
        // 1 µs: within the spin; 2 ms: after it, so the thread has parked.
        assert_eq!(block_on(later(3, Duration::from_micros(1))), 4);
        assert_eq!(block_on(later(3, Duration::from_millis(2))), 4);
        assert_eq!(
            block_on_spinning(later(2, Duration::from_millis(1)), Duration::ZERO),
            3
        );
    }

    #[test]
    fn a_future_woken_before_it_returns_pending_is_polled_again() {
        struct SelfWake(bool);
        impl Future for SelfWake {
            type Output = ();
            fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
                if self.0 {
                    return Poll::Ready(());
                }
                self.0 = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
        block_on_spinning(SelfWake(false), Duration::ZERO);
        block_on(SelfWake(false));
    }
}
