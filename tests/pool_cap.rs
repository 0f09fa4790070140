//! The pinned pool's default cap on cached bytes: the cache never holds more
//! than the larger of `DEFAULT_CACHE_FLOOR` and the peak in use, so a program
//! whose sizes keep changing does not pin ever more memory; a fixed cap
//! replaces it; `is_locked` says what the memory is.

use gpufeed::testing::serial;
use gpufeed::{PinnedPool, DEFAULT_CACHE_FLOOR};

gpufeed::backend_tests!(the_default_cap_keeps_the_cache_within_the_peak_in_use);
fn the_default_cap_keeps_the_cache_within_the_peak_in_use(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let mib = 1usize << 20;
    // Peak: 80 MiB in use at once.
    let a = pool.alloc::<u8>(40 * mib).unwrap();
    let b = pool.alloc::<u8>(40 * mib).unwrap();
    assert!(a.is_locked() || device.kind() == gpufeed::BackendKind::Cpu);
    let peak = pool.stats().peak_in_use_bytes;
    assert!(peak >= (80 * mib) as u64);
    drop((a, b));
    assert_eq!(
        pool.stats().max_cached_bytes,
        peak.max(DEFAULT_CACHE_FLOOR as u64)
    );
    // One buffer at a time, each of a size class the cache does not hold:
    // without the cap every one would stay cached (over 300 MiB).
    for size in [51, 63, 77, 93, 111] {
        let buf = pool.alloc::<u8>(size * mib).unwrap();
        assert_eq!(buf.len(), size * mib);
        drop(buf);
        let s = pool.stats();
        assert!(
            s.cached_bytes <= s.max_cached_bytes,
            "{} cached over a cap of {}",
            s.cached_bytes,
            s.max_cached_bytes
        );
    }
    let s = pool.stats();
    // The peak grew with the 111 MiB buffer: the cap followed it.
    assert_eq!(s.max_cached_bytes, s.peak_in_use_bytes);
    assert!(s.driver_frees > 0, "nothing was freed: {s:?}");
    // A fixed cap replaces the default one and trims at once.
    pool.set_max_cached_bytes(8 * mib);
    let s = pool.stats();
    assert_eq!(s.max_cached_bytes, (8 * mib) as u64);
    assert!(s.cached_bytes <= (8 * mib) as u64);
    pool.set_max_cached_bytes(usize::MAX);
    drop(pool.alloc::<u8>(51 * mib).unwrap());
    drop(pool.alloc::<u8>(63 * mib).unwrap());
    assert!(
        pool.stats().cached_bytes >= (114 * mib) as u64,
        "no cap: all kept"
    );
    pool.empty_cache();
    assert_eq!(pool.stats().cached_bytes, 0);
}
