//! A worker of the CPU emulation and its helper threads: the worker takes
//! blocks off the launch's counter and runs each block's threads, first
//! one after another on itself, then (once a thread reaches a barrier or a
//! warp operation) the rest on helpers: helper `j` runs emulated thread `j`
//! of each concurrent block, started on first need, joined when the worker
//! ends.

use super::block::BlockState;
use super::{enter, fault_of, leave, LaunchShared};
use crate::thread::Dim3;
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;

/// The stack of a helper thread (an emulated GPU thread: kernels keep
/// little on their stacks).
const HELPER_STACK: usize = 512 * 1024;

#[derive(Default)]
struct Job {
    gen: u64,
    from: u32,
    to: u32,
    quit: bool,
}

/// The helper threads of one worker.
#[derive(Default)]
pub(crate) struct Helpers {
    job: Mutex<Job>,
    cv: Condvar,
    /// Helper `j` (emulated thread `j >= 1`) at `j - 1`.
    handles: Mutex<Vec<JoinHandle<()>>>,
}

struct StatePtr(*const BlockState);
// SAFETY: the block state is `Sync`, and outlives the helper (the worker
// joins its helpers before it drops the state: `Joiner`).
unsafe impl Send for StatePtr {}

impl Helpers {
    /// Starts emulated threads `from..to` of the worker's current block on
    /// helpers (starting the helpers that don't exist yet).
    pub(crate) fn dispatch(&self, state: &BlockState, from: u32, to: u32) -> Result<(), String> {
        let mut handles = self.handles.lock().unwrap_or_else(|p| p.into_inner());
        let seen = self.job.lock().unwrap_or_else(|p| p.into_inner()).gen;
        while (handles.len() as u32) + 1 < to {
            let j = handles.len() as u32 + 1;
            let p = StatePtr(state);
            let b = std::thread::Builder::new()
                .name(format!("emulated-thread-{j}"))
                .stack_size(HELPER_STACK);
            // SAFETY: the closure borrows the block state (through `p`),
            // which outlives the thread: the worker joins every helper
            // (`Joiner`, dropped before the state) before the state goes.
            let h = unsafe { b.spawn_unchecked(move || helper(p, j, seen)) };
            handles.push(
                h.map_err(|e| format!("could not start a thread for emulated thread {j}: {e}"))?,
            );
        }
        drop(handles);
        let mut job = self.job.lock().unwrap_or_else(|p| p.into_inner());
        job.gen += 1;
        job.from = from;
        job.to = to;
        self.cv.notify_all();
        Ok(())
    }

    fn shutdown(&self) {
        self.job.lock().unwrap_or_else(|p| p.into_inner()).quit = true;
        self.cv.notify_all();
        let handles = std::mem::take(&mut *self.handles.lock().unwrap_or_else(|p| p.into_inner()));
        for h in handles {
            let _ = h.join();
        }
    }
}

fn helper(state: StatePtr, j: u32, mut seen: u64) {
    // SAFETY: see `StatePtr`.
    let state = unsafe { &*state.0 };
    let helpers = &state.helpers;
    loop {
        let (from, to) = {
            let mut job = helpers.job.lock().unwrap_or_else(|p| p.into_inner());
            while job.gen == seen && !job.quit {
                job = helpers.cv.wait(job).unwrap_or_else(|p| p.into_inner());
            }
            if job.quit {
                return;
            }
            seen = job.gen;
            (job.from, job.to)
        };
        if (from..to).contains(&j) {
            run_thread(state, state.block(), j);
        }
    }
}

/// Joins the worker's helpers when dropped (also on unwinding).
struct Joiner<'a>(&'a Helpers);
impl Drop for Joiner<'_> {
    fn drop(&mut self) {
        self.0.shutdown()
    }
}

/// Runs emulated thread `linear` of `block` on the calling OS thread.
fn run_thread(state: &BlockState, block: Dim3, linear: u32) {
    let shared = state.launch();
    enter(shared, state, block, linear);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(shared.body));
    leave();
    let normally = match r {
        Ok(()) => true,
        Err(p) => {
            if let Some(kind) = fault_of(p) {
                let thread = shared.launch.block.unlinear(u64::from(linear));
                shared.record(block, thread, kind);
            }
            false
        }
    };
    state.finish(linear, normally);
}

/// One worker: runs blocks until none is left (or a fault stops the launch).
pub(crate) fn worker(shared: &LaunchShared<'_>) {
    let state = BlockState::new(shared);
    let _joiner = Joiner(&state.helpers);
    while let Some(b) = shared.next_block() {
        let block = shared.launch.grid.unlinear(b);
        state.reset(block);
        for t in 0..state.threads() {
            if !state.start_sequential() {
                break;
            }
            run_thread(&state, block, t);
        }
        state.wait_finished();
    }
}
