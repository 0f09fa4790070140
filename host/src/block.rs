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

use crate::completion::Completion;
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
/// let device = host::Device::cpu();
/// let stream = host::Stream::new(&device)?;
/// let data = host::PinnedBuffer::from_slice(&device, &[1.0f32, 2.0])?;
/// let dev = host::DeviceBuffer::<f32>::new(&device, 2)?;
/// let ((data, _dev), ()) = host::block_on(stream.copy_h2d(data, dev))?;
/// assert_eq!(data.as_slice(), &[1.0, 2.0]);
/// # Ok::<(), host::Error>(())
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
    let signal = Arc::new(Signal {
        state: AtomicU8::new(IDLE),
        thread: thread::current(),
    });
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    let _offers = Offers::open();
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        wait(&signal, spin);
    }
}

#[cfg(not(loom))]
thread_local! {
    /// Inside a `block_on` on this thread (`Some`): the completion a poll
    /// last found pending whose source can be asked directly
    /// ([`Completion::probe`]); the spin asks it between looks.
    static OFFERED: std::cell::RefCell<Option<Option<Completion>>> =
        const { std::cell::RefCell::new(None) };
}

/// Offers `c` to a `block_on` running on this thread (if any), to ask its
/// source directly while spinning. Called by a poll that found `c` pending.
pub(crate) fn offer(c: &Completion) {
    #[cfg(not(loom))]
    OFFERED.with(|o| {
        if let Ok(mut o) = o.try_borrow_mut() {
            if let Some(slot) = o.as_mut() {
                *slot = Some(c.clone());
            }
        }
    });
    #[cfg(loom)]
    let _ = c;
}

/// Whether `block_on` asks offered completions' sources directly (a
/// benchmark hook turns it off to measure what it saves).
#[cfg_attr(loom, allow(dead_code))]
static PROBES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns [`block_on`]'s direct questions to completion sources on or off
/// (benchmark hook: `host::testing::set_block_on_probes`).
#[cfg_attr(not(feature = "hooks"), allow(dead_code))]
pub(crate) fn set_probes(on: bool) {
    PROBES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Asks the offered completion's source whether it was reached (completing
/// it, which wakes this thread's `block_on`, on a yes).
fn probe_offered() {
    #[cfg(not(loom))]
    {
        if !PROBES.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let Some(c) = OFFERED.with(|o| o.try_borrow_mut().ok()?.as_mut()?.take()) else {
            return;
        };
        // No borrow is held here: completing runs wakers and deferred
        // actions, which may poll (and offer) again.
        if !c.probe() {
            OFFERED.with(|o| {
                if let Ok(mut o) = o.try_borrow_mut() {
                    if let Some(slot @ None) = o.as_mut() {
                        *slot = Some(c);
                    }
                }
            });
        }
    }
}

/// This `block_on`'s offer slot, open while it runs; an enclosing
/// `block_on`'s slot is put back when it ends (or unwinds).
struct Offers {
    #[cfg(not(loom))]
    outer: Option<Option<Completion>>,
}

impl Offers {
    fn open() -> Offers {
        Offers {
            #[cfg(not(loom))]
            outer: OFFERED.with(|o| {
                o.try_borrow_mut()
                    .map(|mut o| o.replace(None))
                    .ok()
                    .flatten()
            }),
        }
        .with_slot()
    }

    fn with_slot(self) -> Offers {
        #[cfg(not(loom))]
        OFFERED.with(|o| {
            if let Ok(mut o) = o.try_borrow_mut() {
                *o = Some(None);
            }
        });
        self
    }
}

impl Drop for Offers {
    fn drop(&mut self) {
        #[cfg(not(loom))]
        {
            let outer = self.outer.take();
            OFFERED.with(|o| {
                if let Ok(mut o) = o.try_borrow_mut() {
                    *o = outer;
                }
            });
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
        probe_offered();
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

    /// Says "reached" from its `after`-th question on; counts the questions.
    struct CountingProbe {
        asked: std::sync::atomic::AtomicUsize,
        after: usize,
    }

    impl crate::completion::Probe for CountingProbe {
        fn reached(&self) -> bool {
            self.asked.fetch_add(1, Ordering::SeqCst) + 1 >= self.after
        }
    }

    fn probed(after: usize) -> (Completion, Arc<CountingProbe>) {
        let p = Arc::new(CountingProbe {
            asked: std::sync::atomic::AtomicUsize::new(0),
            after,
        });
        (Completion::with_probe(p.clone()), p)
    }

    #[test]
    fn a_spinning_block_on_asks_the_source_directly_and_ends_the_wait_itself() {
        // Nothing else completes it: only the probe can end this wait.
        let (c, p) = probed(50);
        assert!(block_on_spinning(c.wait(), Duration::from_secs(5)).is_ok());
        assert!(c.is_done());
        assert!(p.asked.load(Ordering::SeqCst) >= 50);
    }

    #[test]
    fn a_block_on_that_does_not_spin_leaves_the_completion_to_its_source() {
        let (c, p) = probed(1);
        let source = c.clone();
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(5));
            source.complete(Err(crate::error::Error::ContextBroken("source".into())));
        });
        // The source's result arrives, not the probe's success.
        assert!(block_on_spinning(c.wait(), Duration::ZERO).is_err());
        t.join().unwrap();
        assert_eq!(p.asked.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn nested_block_ons_each_ask_their_own_completion_and_restore_the_outer() {
        let (outer, _) = probed(1_000);
        let (inner, _) = probed(10);
        let (o2, i2) = (outer.clone(), inner.clone());
        let r = block_on_spinning(
            async move {
                // The outer wait offers `outer` first (its poll is pending)...
                let mut first = true;
                futures::future::poll_fn(|cx| {
                    if first {
                        first = false;
                        let _ = o2.poll_done(cx);
                        // ...then, inside the same poll, a nested block_on ends
                        // `inner` through its probe.
                        let inner_ok = block_on_spinning(i2.wait(), Duration::from_secs(5));
                        return Poll::Ready(inner_ok);
                    }
                    Poll::Pending
                })
                .await
            },
            Duration::from_secs(5),
        );
        assert!(r.is_ok() && inner.is_done());
        assert!(
            !outer.is_done(),
            "the outer completion was never the inner wait's to end"
        );
        // The outer slot came back empty after the outer block_on ended.
        assert!(OFFERED.with(|o| o.borrow().is_none()));
    }
}
