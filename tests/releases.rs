//! What happens when memory is given back: failed frees and unregistrations
//! are counted ([`Device::release_failures`], [`gpufeed::PoolStats::failed_frees`]),
//! logged with the `log` crate, and returned by the explicit forms
//! (`try_into_inner`, `try_into_owner`); registrations say whether they
//! locked; and on the CPU emulation, unpinning one array leaves its page
//! neighbour's registration locked (`munlock` is not counted by the kernel,
//! so the emulation counts the locked ranges itself).
//!
//! Failures are planted in the CPU emulation through a test hook
//! (`Device::plant_release_failures`). Every test runs under
//! [`serial`]: the page test reads the process's memory map, which another
//! test's registration of a neighbouring page would change.

use gpufeed::interop::RegisteredRaw;
use gpufeed::testing::serial;
use gpufeed::{Device, PinnedBuffer, PinnedPool, Registered};
use std::sync::Mutex;

/// The messages logged through the `log` crate in this process.
static LOGGED: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {}: {}", record.level(), record.target(), record.args());
        LOGGED.lock().unwrap_or_else(|p| p.into_inner()).push(line);
    }
    fn flush(&self) {}
}

/// Installs the capturing logger (once) and clears what it holds.
fn capture_log() {
    static LOGGER: Capture = Capture;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Trace);
    LOGGED.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// The logged lines that contain `text`.
fn logged(text: &str) -> Vec<String> {
    let lines = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
    lines.iter().filter(|l| l.contains(text)).cloned().collect()
}

#[test]
fn a_failed_free_of_a_pinned_buffer_is_counted_on_its_device_and_logged() {
    let _serial = serial();
    capture_log();
    let device = Device::cpu();
    let other = Device::cpu();
    let buffer = PinnedBuffer::<f32>::new(&device, 1000).unwrap();
    assert_eq!(device.release_failures(), 0);
    device.plant_release_failures(1);
    drop(buffer);
    assert_eq!(device.release_failures(), 1);
    assert_eq!(other.release_failures(), 0, "counted per device");
    let lines = logged("freeing pinned memory failed");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("WARN gpufeed::release"), "{lines:?}");

    // A clone of the device shares its count; a free that works adds none.
    let clone = device.clone();
    drop(PinnedBuffer::<f32>::new(&clone, 1000).unwrap());
    assert_eq!(clone.release_failures(), 1);
}

#[test]
fn a_pool_counts_a_failed_free_as_failed_not_as_a_free() {
    let _serial = serial();
    capture_log();
    let device = Device::cpu();
    let pool = PinnedPool::new(&device);
    let (a, b) = (
        pool.alloc::<u8>(1 << 16).unwrap(),
        pool.alloc::<u8>(1 << 16).unwrap(),
    );
    drop((a, b));
    device.plant_release_failures(1);
    pool.empty_cache(); // two driver frees, the first fails
    let s = pool.stats();
    assert_eq!(s.driver_allocs, 2);
    assert_eq!(s.failed_frees, 1, "{s:?}");
    assert_eq!(s.driver_frees, 1, "a failed free is not a free: {s:?}");
    assert_eq!(s.cached_bytes, 0);
    assert_eq!(device.release_failures(), 1);
    assert_eq!(logged("freeing a pooled pinned block failed").len(), 1);
}

#[test]
fn try_into_inner_returns_a_failed_unregistration_with_the_vector() {
    let _serial = serial();
    capture_log();
    let device = Device::cpu();
    let data: Vec<u32> = (0..10_000).collect();

    // Works: the vector back, nothing counted.
    let reg = Registered::new(&device, data.clone()).unwrap();
    assert!(reg.is_locked());
    let back = reg.try_into_inner().unwrap();
    assert_eq!(back, data);
    assert_eq!(device.release_failures(), 0);

    // Fails: the error, and the vector intact.
    let reg = Registered::new(&device, data.clone()).unwrap();
    device.plant_release_failures(1);
    let (err, back) = reg.try_into_inner().unwrap_err();
    assert!(err.to_string().contains("planted"), "{err}");
    assert_eq!(back, data);
    assert_eq!(device.release_failures(), 1);

    // `into_inner` gives the vector back and counts the failure.
    let reg = Registered::new(&device, data.clone()).unwrap();
    device.plant_release_failures(1);
    assert_eq!(reg.into_inner(), data);
    assert_eq!(device.release_failures(), 2);

    // So does the drop.
    let reg = Registered::new(&device, data.clone()).unwrap();
    device.plant_release_failures(1);
    drop(reg);
    assert_eq!(device.release_failures(), 3);
    assert_eq!(logged("unregistering host memory failed").len(), 3);
}

#[test]
fn try_into_owner_returns_a_failed_unregistration_with_the_owner() {
    let _serial = serial();
    capture_log();
    let device = Device::cpu();
    let register = |v: Vec<u8>| {
        let mut v = Box::new(v);
        let (ptr, bytes) = (v.as_mut_ptr(), v.len());
        // SAFETY: the Vec's heap buffer is valid, stays put while the boxed
        // Vec (the owner) lives, is touched by nothing else, and is not
        // registered yet.
        unsafe { RegisteredRaw::new(&device, ptr, bytes, v) }.unwrap()
    };
    let reg = register(vec![7; 5000]);
    assert!(reg.is_locked());
    assert!(reg.try_into_owner().is_ok());
    assert_eq!(device.release_failures(), 0);

    let reg = register(vec![7; 5000]);
    device.plant_release_failures(1);
    let Err((err, _owner)) = reg.try_into_owner() else {
        panic!("the planted failure was not returned");
    };
    assert!(err.to_string().contains("planted"), "{err}");
    assert_eq!(device.release_failures(), 1);

    let reg = register(vec![7; 5000]);
    device.plant_release_failures(1);
    let _owner = reg.into_owner();
    assert_eq!(device.release_failures(), 2);

    let reg = register(vec![7; 5000]);
    device.plant_release_failures(1);
    drop(reg);
    assert_eq!(device.release_failures(), 3);
    assert_eq!(logged("unregistering host memory failed").len(), 3);
}

/// `Size:` and `Locked:` (kB) of the mapping of this process that holds `addr`.
fn size_and_locked_kb(addr: usize) -> (u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let (mut size, mut locked) = (None, None);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                if inside {
                    break; // the next mapping
                }
                inside = a <= addr && addr < b;
                continue;
            }
        }
        if inside {
            let kb = || {
                line.split_whitespace()
                    .nth(1)
                    .and_then(|v| v.parse::<u64>().ok())
            };
            if line.starts_with("Size:") {
                size = kb();
            } else if line.starts_with("Locked:") {
                locked = kb();
            }
        }
    }
    match (size, locked) {
        (Some(s), Some(l)) => (s, l),
        _ => panic!("no mapping with Size and Locked holds {addr:#x}"),
    }
}

/// Whether the page holding `addr` is locked: its mapping (mlock splits a
/// mapping at locked pages) is locked whole.
fn page_locked(addr: usize) -> bool {
    let (size, locked) = size_and_locked_kb(addr);
    assert!(
        locked == 0 || locked == size,
        "a mapping partly locked: {locked} of {size} kB"
    );
    locked == size
}

#[test]
fn unpinning_one_vector_leaves_its_page_neighbour_locked() {
    let _serial = serial();
    let device = Device::cpu();
    let page = 4096.max(
        // SAFETY: sysconf has no preconditions.
        unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize,
    );
    let page_of = |v: &Vec<u8>| v.as_ptr() as usize / page;
    let within_one_page = |v: &Vec<u8>| page_of(v) == (v.as_ptr() as usize + v.len() - 1) / page;
    // Small vectors until two of them lie in one page.
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let (a, b) = loop {
        assert!(kept.len() < 10_000, "no two small vectors share a page");
        let v = vec![1u8; 48];
        if !within_one_page(&v) {
            kept.push(v);
            continue;
        }
        if let Some(i) = kept
            .iter()
            .position(|k| within_one_page(k) && page_of(k) == page_of(&v))
        {
            break (kept.swap_remove(i), v);
        }
        kept.push(v);
    };
    assert_eq!(page_of(&a), page_of(&b), "the two vectors share a page");
    let addr = b.as_ptr() as usize;
    assert!(!page_locked(addr), "the page starts unlocked");

    let ra = Registered::new(&device, a).unwrap();
    let rb = Registered::new(&device, b).unwrap();
    assert!(ra.is_locked() && rb.is_locked());
    assert!(page_locked(addr));

    // Unpinning one: the other's page stays locked.
    let a = ra.try_into_inner().unwrap();
    assert!(
        page_locked(addr),
        "unregistering one vector unlocked its neighbour's page, still registered"
    );
    assert_eq!(rb.as_slice(), &[1u8; 48]);

    // Unpinning both: the page is unlocked.
    let b = rb.try_into_inner().unwrap();
    assert!(!page_locked(addr), "the page stays locked after both went");
    assert_eq!(device.release_failures(), 0);

    // The same through a drop, the other order.
    let rb = Registered::new(&device, b).unwrap();
    let ra = Registered::new(&device, a).unwrap();
    drop(rb);
    assert!(
        page_locked(addr),
        "dropping one unlocked its neighbour's page"
    );
    drop(ra);
    assert!(!page_locked(addr));
    drop(kept);
}

fn registrations_say_that_they_locked(device: Device) {
    let mut v = vec![3u8; 1 << 16];
    let reg = Registered::new(&device, v.clone()).unwrap();
    assert!(reg.is_locked(), "{reg:?}");
    drop(reg);
    let (ptr, bytes) = (v.as_mut_ptr(), v.len());
    // SAFETY: the Vec's buffer is valid and stays put until the guard and
    // its owner (a unit: `v` outlives the guard) are gone; nothing else
    // touches it meanwhile; it is not registered.
    let raw = unsafe { RegisteredRaw::new(&device, ptr, bytes, Box::new(())) }.unwrap();
    assert!(raw.is_locked(), "{raw:?}");
    assert!(raw.try_into_owner().is_ok());
    assert_eq!(device.release_failures(), 0);
    // Nothing to lock: locked all the same.
    assert!(Registered::<u8>::new(&device, Vec::new())
        .unwrap()
        .is_locked());
    drop(v);
}

gpufeed::backend_tests!(registrations_say_that_they_locked);
