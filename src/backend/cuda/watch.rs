//! The watcher thread of a stream: completes each recorded point, in order,
//! waiting the way [`WaitMode`](super::WaitMode) says.

use super::event::EventHandle;
use super::options::{WaitMode, POLL_INTERVAL};
use super::shared::Shared;
use crate::base::completion::Completion;
use crate::base::error::Result;
use cudarc::driver::sys::{self, CUresult};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

/// Lowers the calling thread's timer slack to 1 us (Linux's default, 50 us,
/// would stretch every short sleep by that much).
pub(super) fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument and affects only
    // the calling thread; it cannot fail in a way that matters here (the
    // sleeps would only be longer).
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong);
    }
}

/// Waits for `ev` by polling it every [`POLL_INTERVAL`].
pub(super) fn poll_event(shared: &Shared, ev: sys::CUevent) -> Result<()> {
    loop {
        // SAFETY: the event is alive (the caller holds it) and was recorded.
        let r = unsafe { sys::cuEventQuery(ev) };
        if r != CUresult::CUDA_ERROR_NOT_READY {
            return shared.check("cuEventQuery", r);
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// What a stream sends its watcher: an event recorded on it and the completion it ends.
pub(super) type WatchTx = mpsc::Sender<(Arc<EventHandle>, Completion)>;
pub(super) type WatchRx = mpsc::Receiver<(Arc<EventHandle>, Completion)>;

/// The watcher: completes each recorded point of one stream, in order.
/// `sent` counts the points sent on `rx`.
pub(super) fn watch(shared: Arc<Shared>, rx: WatchRx, sent: &AtomicUsize) {
    crate::base::completion::mark_completion_thread();
    let bound = shared.bind();
    let poll = shared.wait_mode == WaitMode::Poll;
    if poll {
        tight_timer_slack();
    }
    let spin = shared.wait_mode == WaitMode::Spin;
    let mut taken = 0usize;
    while let Some((event, completion)) = next_point(&rx, spin, sent, &mut taken) {
        let result = match (bound.clone(), shared.usable()) {
            (Err(e), _) | (_, Err(e)) => Err(e),
            _ if poll => poll_event(&shared, event.ev),
            // SAFETY: the event is alive (we hold it) and was recorded on our stream.
            _ => shared.check("cuEventSynchronize", unsafe {
                sys::cuEventSynchronize(event.ev)
            }),
        };
        // Wake first: recycling the event is not on the waiter's path.
        completion.complete(result);
        drop(event);
    }
}

/// How long a spinning watcher keeps looking for the next point after its
/// queue runs dry, before it sleeps in the channel: back-to-back jobs (a
/// task awaiting one copy after another) then find it awake, and their
/// sender wakes no thread.
pub(super) const IDLE_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// The next point recorded on the watcher's stream, in order; `None` once
/// the stream is gone. With `spin`, the count of points sent (`sent`, of
/// which `taken` were received) is watched for [`IDLE_SPIN`] before the
/// thread blocks in the channel.
pub(super) fn next_point(
    rx: &WatchRx,
    spin: bool,
    sent: &AtomicUsize,
    taken: &mut usize,
) -> Option<(Arc<EventHandle>, Completion)> {
    if spin {
        let start = std::time::Instant::now();
        while sent.load(Ordering::Acquire) == *taken && start.elapsed() < IDLE_SPIN {
            std::hint::spin_loop();
        }
        // Counted after the send: a count ahead of `taken` means a point
        // waits in the channel (or the count is stale: the blocking receive
        // below then waits for it).
        match rx.try_recv() {
            Ok(point) => {
                *taken += 1;
                return Some(point);
            }
            Err(mpsc::TryRecvError::Disconnected) => return None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
    }
    let point = rx.recv().ok()?;
    *taken += 1;
    Some(point)
}
