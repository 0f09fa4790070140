//! "More pinned memory than the machine will lock": the CPU emulation's
//! page-locking is refused by the memlock limit, and the caller gets a typed
//! error while the pool stays usable; under the lenient policy, buffers and
//! registrations (pin in place) say they are not locked. Its own test binary: it lowers the
//! process's `RLIMIT_MEMLOCK`.
//!
//! As root, `mlock` ignores the limit (`CAP_IPC_LOCK`), so the test drops that
//! capability from its own thread first (capabilities are per thread on
//! Linux); a requested size far over the limit is then refused by the kernel
//! at once, without touching the pages (no memory pressure on the machine).

use gpufeed::interop::RegisteredRaw;
use gpufeed::{
    BackendChoice, Device, DeviceOptions, LockPolicy, PinnedBuffer, PinnedPool, Registered,
};

const LIMIT: u64 = 4 << 20;

/// Clears `CAP_IPC_LOCK` from this thread's effective and permitted sets.
fn drop_ipc_lock_capability() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut hdr = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes a header and two data structs of these layouts
    // (linux/capability.h, version 3).
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut hdr, data.as_mut_ptr()) };
    assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    data[0].permitted &= !(1 << CAP_IPC_LOCK);
    // SAFETY: as above; dropping a capability is always permitted.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr, data.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
}

fn set_soft_memlock(bytes: u64) -> libc::rlimit {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: writes one rlimit struct.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) };
    assert_eq!(r, 0);
    let new = libc::rlimit {
        rlim_cur: bytes.min(old.rlim_max),
        rlim_max: old.rlim_max,
    };
    // SAFETY: reads one rlimit struct; lowering the soft limit is permitted.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &new) };
    assert_eq!(r, 0);
    old
}

#[test]
fn pinned_memory_beyond_the_memlock_limit_is_a_typed_error_and_the_pool_stays_usable() {
    drop_ipc_lock_capability();
    let old = set_soft_memlock(LIMIT);
    let open = |lock_policy| {
        Device::open(DeviceOptions {
            backend: BackendChoice::Cpu,
            lock_policy,
            ..Default::default()
        })
        .unwrap()
    };
    let device = open(LockPolicy::Require);
    let too_much = 64 * LIMIT as usize / 4; // floats: 64x the limit in bytes

    // A buffer: refused, typed, naming the size.
    match PinnedBuffer::<f32>::new(&device, too_much) {
        Err(gpufeed::Error::LockFailed { bytes, reason }) => {
            assert_eq!(bytes, too_much * 4);
            assert!(reason.contains("RLIMIT_MEMLOCK"), "{reason}");
        }
        other => panic!("expected LockFailed, got {:?}", other.map(|b| b.len())),
    }

    // The pool: refused, nothing counted as in use or cached, still usable.
    let pool = PinnedPool::new(&device);
    let before = pool.stats();
    match pool.alloc::<f32>(too_much) {
        Err(gpufeed::Error::LockFailed { .. }) => {}
        other => panic!("expected LockFailed, got {:?}", other.map(|b| b.len())),
    }
    let after = pool.stats();
    assert_eq!(after.in_use_bytes, before.in_use_bytes);
    assert_eq!(after.cached_bytes, before.cached_bytes);
    let mut small = pool.alloc::<f32>(1024).unwrap();
    small.as_mut_slice().fill(2.5);
    assert!(small.as_slice().iter().all(|&v| v == 2.5));
    drop(small);

    // Best effort: the same request succeeds with unlocked memory, reported.
    let lenient = open(LockPolicy::BestEffort);
    let mut b = PinnedBuffer::<f32>::new(&lenient, 2 * LIMIT as usize / 4).unwrap();
    assert!(!b.is_locked());
    b.as_mut_slice()[0] = 1.0;

    // Pinning in place beyond the limit: refused under `Require`; under
    // best effort registered unlocked, and said so.
    let big = vec![1.5f32; 2 * LIMIT as usize / 4];
    match Registered::new(&device, big.clone()) {
        Err(gpufeed::Error::LockFailed { reason, .. }) => {
            assert!(reason.contains("RLIMIT_MEMLOCK"), "{reason}")
        }
        other => panic!("expected LockFailed, got {other:?}"),
    }
    let reg = Registered::new(&lenient, big).unwrap();
    assert!(!reg.is_locked(), "{reg:?}");
    let back = reg.try_into_inner().unwrap();
    let mut owner = Box::new(back);
    let (ptr, bytes) = (owner.as_mut_ptr().cast::<u8>(), owner.len() * 4);
    // SAFETY: the boxed Vec's buffer is valid and stays put while the owner
    // lives, nothing else touches it, and it is not registered.
    let raw = unsafe { RegisteredRaw::new(&lenient, ptr, bytes, owner) }.unwrap();
    assert!(!raw.is_locked(), "{raw:?}");
    assert!(raw.try_into_owner().is_ok());
    // Within the limit: locked, and said so.
    let small = Registered::new(&lenient, vec![0u8; 4096]).unwrap();
    assert!(small.is_locked(), "{small:?}");
    drop(small);
    assert_eq!(lenient.release_failures(), 0);

    // SAFETY: restores the struct read before.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) };
    assert_eq!(r, 0);
}
