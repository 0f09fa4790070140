//! Telling a `fork()` child: the child has none of the parent's threads
//! (stream workers, watchers), and the CUDA driver does not survive into it,
//! so the parent's streams, devices and pending work must refuse instead of
//! hanging there.

/// How many times this process is a `fork()` child of the one before (0 in
/// the process that started): counted by a `pthread_atfork` child handler,
/// so telling a stream of the parent costs an atomic load, not a `getpid`.
static FORKS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[cfg_attr(miri, allow(dead_code))]
extern "C" fn count_fork() {
    FORKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The process generation a stream or device is made in: after `fork()`
/// the child has none of the parent's threads (stream workers, watchers),
/// and the CUDA driver does not survive into it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Generation(u32);

impl Generation {
    /// This process's.
    pub fn now() -> Generation {
        // (Miri runs the completion core, and has no `pthread_atfork`.)
        #[cfg(not(miri))]
        static HANDLER: std::sync::Once = std::sync::Once::new();
        #[cfg(not(miri))]
        HANDLER.call_once(|| {
            // SAFETY: registers a child handler that only bumps an atomic
            // (async-signal-safe); no prepare or parent handler.
            unsafe { libc::pthread_atfork(None, None, Some(count_fork)) };
        });
        Generation(FORKS.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether the calling process is the one this was made in.
    pub fn is_current(&self) -> bool {
        *self == Generation::now()
    }

    /// `InvalidArgument` in a `fork()` child.
    pub fn check(&self, what: &str) -> crate::base::error::Result<()> {
        if self.is_current() {
            return Ok(());
        }
        Err(crate::base::error::Error::InvalidArgument(format!(
            "{what} of the parent process: after fork() the child has none of its threads (and \
             the CUDA driver does not survive fork); make new streams (on the CPU emulation) or \
             a new process"
        )))
    }
}
