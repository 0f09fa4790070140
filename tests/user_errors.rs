//! What a new user runs into: out of memory as its own error, absurd stream
//! counts, a pool cache that follows the working set, plans that say what
//! ran, and messages in the right units.

use gpufeed::testing::serial;
use gpufeed::Error;

gpufeed::backend_tests!(out_of_memory_is_its_own_error);
fn out_of_memory_is_its_own_error(device: gpufeed::Device) {
    let _serial = serial();
    // 2^60 bytes of device memory: refused with an error, not an abort.
    match gpufeed::DeviceBuffer::<u8>::new(&device, 1 << 60) {
        Err(Error::OutOfMemory { what, bytes }) => {
            assert_eq!(bytes, 1 << 60);
            assert!(what.contains("device memory"), "{what}");
            let text = Error::OutOfMemory { what, bytes }.to_string();
            assert!(text.contains("out of memory"), "{text}");
            let backend = if device.kind() == gpufeed::BackendKind::Cpu {
                "CPU emulation"
            } else {
                "CUDA"
            };
            assert!(text.contains(backend), "{text}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // The same for pinned host memory, from the pool and directly.
    let pool = gpufeed::PinnedPool::new(&device);
    match pool.alloc::<u8>(1 << 60) {
        Err(Error::OutOfMemory { what, .. }) => {
            assert!(what.contains("host memory"), "{what}")
        }
        other => panic!("expected OutOfMemory, got {:?}", other.map(|b| b.len())),
    }
    match gpufeed::PinnedBuffer::<u8>::new(&device, 1 << 60) {
        Err(Error::OutOfMemory { .. }) => {}
        other => panic!("expected OutOfMemory, got {:?}", other.map(|b| b.len())),
    }
    // The device is still usable.
    assert_eq!(
        gpufeed::DeviceBuffer::<f32>::new(&device, 16)
            .unwrap()
            .len(),
        16
    );
}

#[test]
fn absurd_stream_counts_are_refused() {
    let device = gpufeed::Device::cpu();
    for streams in [gpufeed::MAX_STREAMS + 1, 1 << 40, usize::MAX] {
        match gpufeed::Pipeline::new(&device, streams) {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains("streams"), "{msg}");
                assert!(msg.contains(&gpufeed::MAX_STREAMS.to_string()), "{msg}");
            }
            Err(other) => panic!("{streams} streams: expected InvalidArgument, got {other:?}"),
            Ok(_) => panic!("{streams} streams: accepted"),
        }
    }
    let p = gpufeed::Pipeline::new(&device, gpufeed::MAX_STREAMS).unwrap();
    assert_eq!(p.streams().len(), gpufeed::MAX_STREAMS);
}

#[test]
fn the_pool_cache_follows_the_working_set() {
    let _serial = serial();
    let device = gpufeed::Device::cpu();
    let pool = gpufeed::PinnedPool::new(&device);
    let mib = 1usize << 20;
    // The cache fills with idle big blocks (the peak, so the default cap).
    let big: Vec<_> = (0..8)
        .map(|_| pool.alloc::<u8>(16 * mib).unwrap())
        .collect();
    drop(big);
    let s = pool.stats();
    assert_eq!(
        s.cached_bytes, s.max_cached_bytes,
        "the cache is full: {s:?}"
    );
    // Then the program moves on to another size.
    let before = pool.stats();
    for _ in 0..200 {
        drop(pool.alloc::<u8>(mib + 12345).unwrap());
    }
    let s = pool.stats();
    let hits = s.hits - before.hits;
    assert!(hits >= 190, "{hits} hits of 200: {s:?}");
    assert!(s.cached_bytes <= s.max_cached_bytes, "{s:?}");
}

#[test]
fn run_info_reports_the_chunks_that_ran() {
    let _serial = serial();
    let device = gpufeed::Device::cpu();
    let pipe = gpufeed::Pipeline::new(&device, 4).unwrap();
    // 100 elements in chunks of whole 64-element multiples: 8 asked, 2 run.
    for (n, asked, ran) in [(100, 8, 2), (1, 3, 1), (0, 3, 0), (4096, 8, 8)] {
        let x = gpufeed::PinnedBuffer::<f32>::new(&device, n).unwrap();
        let y = gpufeed::PinnedBuffer::<f32>::new(&device, n).unwrap();
        let job = pipe.run(
            x,
            y,
            gpufeed::Kernel::Scale { s: 2.0 },
            gpufeed::Plan::uniform(asked, 4),
            gpufeed::Timeline::Off,
        );
        let (_, info) =
            gpufeed::block_on(job).unwrap_or_else(|e| panic!("n={n}, {asked} chunks: {e}"));
        assert_eq!(info.chunks, ran, "n={n}, {asked} chunks asked");
        assert_eq!(info.plan.chunks, asked);
    }
}
