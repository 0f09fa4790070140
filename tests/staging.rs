//! Staged copies of ordinary host memory (`Staging`): every byte lands,
//! both ways, by every route, at offsets and lengths that are multiples of
//! nothing; the ring stays within its bound under 64 concurrent copies;
//! dropping a copy at any point leaves the host memory free at once and
//! the device buffer safe to use or free; a worker's panic is an error;
//! bad arguments are typed errors. Each check compares with a plain loop
//! over fresh random data, written into outputs poisoned beforehand.

use futures::task::noop_waker;
use gpufeed::{DeviceBuffer, Error, FileIo, PinnedPool, Route, Staging, StagingConfig, Stream};
use std::future::Future;
use std::pin::Pin;
use std::task::Context;

const POISON: u32 = 0xDEAD_BEEF;

/// Fresh random words, never the poison.
fn random(n: usize, rng: &mut fastrand::Rng) -> Vec<u32> {
    (0..n)
        .map(|_| loop {
            let v = rng.u32(..);
            if v != POISON {
                break v;
            }
        })
        .collect()
}

/// A small ring, so that a copy of a few hundred KiB crosses many blocks
/// (block of 64 KiB + 4 bytes: a multiple of nothing).
fn small(device: &gpufeed::Device, route: Route, threads: usize) -> Staging {
    let config = StagingConfig {
        block_bytes: (64 << 10) + 4,
        blocks: 3,
        threads,
        route,
        direct_h2d_below: 1 << 20,
        direct_d2h_below: 1 << 20,
    };
    Staging::with_config(device, config).unwrap()
}

/// The device buffer's contents, read back by the driver's own copy.
fn read(dev: &mut DeviceBuffer<u32>) -> Vec<u32> {
    let mut out = vec![0u32; dev.len()];
    dev.copy_to_host_sync(&mut out).unwrap();
    out
}

fn poisoned(device: &gpufeed::Device, n: usize) -> DeviceBuffer<u32> {
    let mut dev = DeviceBuffer::<u32>::new(device, n).unwrap();
    dev.copy_from_host_sync(&vec![POISON; n]).unwrap();
    dev
}

/// The most pinned memory the ring may hold: its blocks, each rounded up
/// to the pool's size class (the tests' 64 KiB + 4 bytes: 72 KiB), written
/// out here rather than taken from the engine's own `total_bytes`.
fn ring_bound(staging: &Staging) -> u64 {
    let c = staging.config();
    let class = if c.block_bytes == (64 << 10) + 4 {
        72 << 10
    } else {
        assert!(c.block_bytes.is_power_of_two(), "{c:?}");
        c.block_bytes
    };
    let bound = class as u64 * c.blocks as u64;
    assert_eq!(c.total_bytes() as u64, bound, "the engine's own bound");
    bound
}

/// Index of the first element that differs, with both values.
fn first_diff(got: &[u32], want: &[u32]) -> Option<(usize, u32, u32)> {
    assert_eq!(got.len(), want.len());
    (0..got.len())
        .find(|&i| got[i] != want[i])
        .map(|i| (i, got[i], want[i]))
}

gpufeed::backend_tests!(every_byte_lands_both_ways_by_every_route_at_any_offset);
fn every_byte_lands_both_ways_by_every_route_at_any_offset(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0x57a9);
    let n = 300_007;
    for route in [Route::Staged, Route::Direct, Route::Auto] {
        for threads in [1, 3] {
            let staging = small(&device, route, threads);
            // Lengths: zero, one element, inside one block, across many
            // blocks, the whole buffer; offsets odd.
            for (at, len) in [(0, 0), (5, 1), (17, 1000), (3, 200_001), (0, n)] {
                let data = random(len, &mut rng);
                let mut dev = poisoned(&device, n);
                futures::executor::block_on(staging.h2d_at(&data, &mut dev, at)).unwrap();
                // Plain loop: the range holds the data, the rest the poison.
                let got = read(&mut dev);
                let mut want = vec![POISON; n];
                want[at..at + len].copy_from_slice(&data);
                assert_eq!(
                    first_diff(&got, &want),
                    None,
                    "h2d {route:?} {threads} threads at {at} len {len}"
                );

                // And back, into a poisoned host slice.
                let mut back = vec![POISON; len + 2];
                futures::executor::block_on(staging.d2h_at(&dev, at, &mut back[1..len + 1]))
                    .unwrap();
                assert_eq!(back[0], POISON, "d2h wrote before its slice");
                assert_eq!(back[len + 1], POISON, "d2h wrote past its slice");
                assert_eq!(
                    first_diff(&back[1..len + 1], &data),
                    None,
                    "d2h {route:?} at {at} len {len}"
                );
            }
            assert!(staging.pool_stats().peak_in_use_bytes <= ring_bound(&staging));
        }
    }
}

gpufeed::backend_tests!(the_default_engine_copies_whole_buffers_of_other_types);
fn the_default_engine_copies_whole_buffers_of_other_types(device: gpufeed::Device) {
    let staging = Staging::new(&device).unwrap();
    let c = staging.config();
    assert!(
        c.threads >= 1 && c.blocks * c.block_bytes <= 64 << 20,
        "{c:?}"
    );
    let mut rng = fastrand::Rng::with_seed(7);
    // 40 MiB of f64: crosses the default 16 MiB blocks.
    let data: Vec<f64> = (0..5 << 20).map(|_| rng.f64() - 0.5).collect();
    let mut dev = DeviceBuffer::<f64>::new(&device, data.len()).unwrap();
    staging.h2d_blocking(&data, &mut dev).unwrap();
    let mut back = vec![f64::NAN; data.len()];
    staging.d2h_blocking(&dev, &mut back).unwrap();
    assert!(back
        .iter()
        .zip(&data)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

gpufeed::backend_tests!(copies_in_ramped_pieces_land_every_byte_at_odd_offsets);
/// The default blocks (8 MiB): a copy's first pieces (host to device) and
/// last ones (device to host) are smaller than a block; lengths around
/// those pieces' edges, at odd offsets, both ways.
fn copies_in_ramped_pieces_land_every_byte_at_odd_offsets(device: gpufeed::Device) {
    let mut config = StagingConfig::for_device(&device);
    config.route = Route::Staged;
    let staging = Staging::with_config(&device, config).unwrap();
    let mut rng = fastrand::Rng::with_seed(0x7a3f);
    const M: usize = 1 << 20; // elements of 4 bytes: 4 MiB
    let n = 5 * M + 11;
    let mut dev = DeviceBuffer::<u32>::new(&device, n).unwrap();
    for (at, len) in [
        (3, M / 4 - 1),
        (1, M / 4 + 1),
        (7, 3 * M / 4 + 5),
        (9, 5 * M),
    ] {
        let data = random(len, &mut rng);
        dev.copy_from_host_sync(&vec![POISON; n]).unwrap();
        futures::executor::block_on(staging.h2d_at(&data, &mut dev, at)).unwrap();
        let got = read(&mut dev);
        let mut want = vec![POISON; n];
        want[at..at + len].copy_from_slice(&data);
        assert_eq!(first_diff(&got, &want), None, "h2d at {at} len {len}");
        let mut back = vec![POISON; len + 2];
        futures::executor::block_on(staging.d2h_at(&dev, at, &mut back[1..len + 1])).unwrap();
        assert_eq!(
            (back[0], back[len + 1]),
            (POISON, POISON),
            "d2h wrote outside its slice"
        );
        assert_eq!(
            first_diff(&back[1..len + 1], &data),
            None,
            "d2h at {at} len {len}"
        );
    }
}

gpufeed::backend_tests!(sources_already_pinned_or_registered_copy_the_same);
fn sources_already_pinned_or_registered_copy_the_same(device: gpufeed::Device) {
    let staging = small(&device, Route::Staged, 2);
    let mut rng = fastrand::Rng::with_seed(99);
    let n = 150_001;
    let data = random(n, &mut rng);
    let pool = PinnedPool::new(&device);
    let mut pinned = pool.alloc::<u32>(n).unwrap();
    pinned.as_mut_slice().copy_from_slice(&data);
    let registered = gpufeed::Registered::new(&device, data.clone()).unwrap();
    for src in [pinned.as_slice(), registered.as_slice()] {
        let mut dev = poisoned(&device, n);
        staging.h2d_blocking(src, &mut dev).unwrap();
        assert_eq!(first_diff(&read(&mut dev), &data), None);
        let mut back = pool.alloc::<u32>(n).unwrap();
        back.as_mut_slice().fill(POISON);
        staging.d2h_blocking(&dev, back.as_mut_slice()).unwrap();
        assert_eq!(first_diff(back.as_slice(), &data), None);
    }
}

gpufeed::backend_tests!(sixty_four_concurrent_copies_share_the_bounded_ring);
fn sixty_four_concurrent_copies_share_the_bounded_ring(device: gpufeed::Device) {
    let staging = small(&device, Route::Staged, 2);
    let bound = staging.config().total_bytes() as u64;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    let mut handles = Vec::new();
    for task in 0..64u64 {
        let (staging, device) = (staging.clone(), device.clone());
        handles.push(rt.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(task);
            let n = 20_000 + rng.usize(..50_000);
            let data = random(n, &mut rng);
            let mut dev = poisoned(&device, n);
            staging.h2d(&data, &mut dev).await.unwrap();
            let mut back = vec![POISON; n];
            staging.d2h(&dev, &mut back).await.unwrap();
            first_diff(&back, &data)
        }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(rt.block_on(h).unwrap(), None, "task {i}");
    }
    let stats = staging.pool_stats();
    assert!(
        stats.peak_in_use_bytes <= ring_bound(&staging),
        "staging held {} bytes, bound {bound}",
        stats.peak_in_use_bytes
    );
    assert!(stats.peak_in_use_bytes > 0);
}

/// Polls `fut` `polls` times with a waker that does nothing.
fn poll_n<F: Future + Unpin>(fut: &mut F, polls: usize) -> bool {
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    (0..polls).any(|_| Pin::new(&mut *fut).poll(&mut cx).is_ready())
}

gpufeed::backend_tests!(a_copy_dropped_at_any_point_frees_the_host_memory_at_once);
fn a_copy_dropped_at_any_point_frees_the_host_memory_at_once(device: gpufeed::Device) {
    let staging = small(&device, Route::Staged, 2);
    let mut rng = fastrand::Rng::with_seed(0xcafe);
    let n = 200_000;
    for polls in 0..8 {
        let mut data = random(n, &mut rng);
        let mut dev = poisoned(&device, n);
        {
            let mut copy = staging.h2d(&data, &mut dev);
            poll_n(&mut copy, polls);
        }
        // The source is ours again at once: overwrite it (a thread still
        // reading it would race with this; valgrind and the sanitizer check).
        data.fill(1);
        // The device buffer's next use waits for the DMAs left running.
        let fresh = random(n, &mut rng);
        staging.h2d_blocking(&fresh, &mut dev).unwrap();
        assert_eq!(first_diff(&read(&mut dev), &fresh), None);

        let mut back = vec![POISON; n];
        {
            let mut copy = staging.d2h(&dev, &mut back);
            poll_n(&mut copy, polls);
        }
        back.fill(2);
        staging.d2h_blocking(&dev, &mut back).unwrap();
        assert_eq!(first_diff(&back, &fresh), None);
    }
}

/// Forgetting a copy (`mem::forget`) mid-way: the device buffer's free waits
/// for the DMAs left running (valgrind would see an emulated DMA write freed
/// memory), and the source is free at once. The forgotten copy's blocks are
/// leaked with it, so the engine is not used again (a CUDA run would report
/// them as leaks: the emulation only).
#[test]
fn a_forgotten_copy_leaves_its_device_buffer_safe_to_free() {
    let device = gpufeed::Device::cpu();
    let staging = small(&device, Route::Staged, 2);
    let mut rng = fastrand::Rng::with_seed(0xf0);
    let n = 200_000;
    for polls in 1..4 {
        let mut data = random(n, &mut rng);
        let mut dev = poisoned(&device, n);
        let mut copy = staging.h2d(&data, &mut dev);
        poll_n(&mut copy, polls);
        std::mem::forget(copy);
        data.fill(0);
        drop(dev);
        drop(data);
    }
    device.synchronize().unwrap();
}

gpufeed::backend_tests!(a_panic_in_a_worker_is_an_error_and_nothing_is_lost);
fn a_panic_in_a_worker_is_an_error_and_nothing_is_lost(device: gpufeed::Device) {
    let _serial = gpufeed::testing::serial();
    let staging = small(&device, Route::Staged, 3);
    let mut rng = fastrand::Rng::with_seed(3);
    let n = 100_000;
    let data = random(n, &mut rng);
    let mut dev = poisoned(&device, n);
    staging.plant_worker_panic();
    let err = staging.h2d_blocking(&data, &mut dev).unwrap_err();
    assert!(matches!(err, Error::WorkerPanicked(_)), "{err:?}");
    // The data is still ours and the engine still works, both ways.
    staging.h2d_blocking(&data, &mut dev).unwrap();
    let mut back = vec![POISON; n];
    staging.plant_worker_panic();
    let err = staging.d2h_blocking(&dev, &mut back).unwrap_err();
    assert!(matches!(err, Error::WorkerPanicked(_)), "{err:?}");
    staging.d2h_blocking(&dev, &mut back).unwrap();
    assert_eq!(first_diff(&back, &data), None);
}

gpufeed::backend_tests!(bad_arguments_are_typed_errors_and_touch_nothing);
fn bad_arguments_are_typed_errors_and_touch_nothing(device: gpufeed::Device) {
    let staging = small(&device, Route::Staged, 1);
    let mut dev = poisoned(&device, 100);
    let data = vec![7u32; 101];
    let err = staging.h2d_blocking(&data, &mut dev).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { .. }), "{err:?}");
    let err = futures::executor::block_on(staging.h2d_at(&data[..10], &mut dev, 95)).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err:?}");
    let err =
        futures::executor::block_on(staging.h2d_at(&data[..10], &mut dev, usize::MAX)).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err:?}");
    let mut out = vec![POISON; 101];
    let err = staging.d2h_blocking(&dev, &mut out).unwrap_err();
    assert!(matches!(err, Error::LengthMismatch { .. }), "{err:?}");
    assert!(out.iter().all(|&v| v == POISON));
    assert_eq!(read(&mut dev), vec![POISON; 100]);
    // A buffer of another device.
    let other = gpufeed::Device::cpu();
    let mut foreign = DeviceBuffer::<u32>::new(&other, 4).unwrap();
    let err = staging
        .h2d_blocking(&[1, 2, 3, 4], &mut foreign)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    // Configurations out of range.
    for bad in [
        StagingConfig {
            threads: 0,
            ..staging.config()
        },
        StagingConfig {
            blocks: 0,
            ..staging.config()
        },
        StagingConfig {
            block_bytes: 100,
            ..staging.config()
        },
        StagingConfig {
            threads: gpufeed::MAX_STAGING_THREADS + 1,
            ..staging.config()
        },
        StagingConfig {
            blocks: usize::MAX,
            block_bytes: 1 << 20,
            ..staging.config()
        },
    ] {
        let err = Staging::with_config(&device, bad).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_) | Error::SizeOverflow { .. }),
            "{err:?}"
        );
    }
    // Nothing to do for an empty copy, whatever the route.
    let mut empty = DeviceBuffer::<u32>::new(&device, 0).unwrap();
    staging.h2d_blocking(&[], &mut empty).unwrap();
    staging.d2h_blocking(&empty, &mut []).unwrap();
    let _ = Stream::new(&device).unwrap();
}

gpufeed::backend_tests!(the_blocking_forms_refuse_mismatched_lengths_on_every_route);
fn the_blocking_forms_refuse_mismatched_lengths_on_every_route(device: gpufeed::Device) {
    // The blocking forms call the driver themselves on the direct route
    // (`Route::Direct`, and `Route::Auto` below its thresholds: 400 bytes
    // are): their own length check, not the staged copy's, guards it. A
    // shorter host slice first (with the check missing, that copy stays
    // inside both buffers and returns Ok), then a longer one.
    for route in [Route::Direct, Route::Auto, Route::Staged] {
        let staging = small(&device, route, 1);
        let mut dev = poisoned(&device, 100);
        for n in [99, 101] {
            let data = vec![7u32; n];
            let err = staging.h2d_blocking(&data, &mut dev).unwrap_err();
            assert!(
                matches!(err, Error::LengthMismatch { .. }),
                "{route:?}, h2d of {n}: {err:?}"
            );
            assert_eq!(read(&mut dev), vec![POISON; 100], "{route:?}, h2d of {n}");
            let mut out = vec![POISON; n];
            let err = staging.d2h_blocking(&dev, &mut out).unwrap_err();
            assert!(
                matches!(err, Error::LengthMismatch { .. }),
                "{route:?}, d2h of {n}: {err:?}"
            );
            assert_eq!(out, vec![POISON; n], "{route:?}, d2h of {n}");
        }
        // The same copies with matching lengths go through.
        let data: Vec<u32> = (0..100).collect();
        staging.h2d_blocking(&data, &mut dev).unwrap();
        let mut out = vec![POISON; 100];
        staging.d2h_blocking(&dev, &mut out).unwrap();
        assert_eq!(out, data, "{route:?}");
    }
}

gpufeed::backend_tests!(the_automatic_route_copies_small_arrays_directly_and_large_ones_staged);
fn the_automatic_route_copies_small_arrays_directly_and_large_ones_staged(device: gpufeed::Device) {
    let staging = Staging::new(&device).unwrap();
    let c = staging.config();
    assert_eq!(c.route, Route::Auto);
    let mut rng = fastrand::Rng::with_seed(21);
    // Just below each direction's threshold: no staging block is taken.
    let n = c.direct_h2d_below.min(c.direct_d2h_below) / 4 - 1;
    let data = random(n, &mut rng);
    let mut dev = poisoned(&device, n);
    staging.h2d_blocking(&data, &mut dev).unwrap();
    let mut back = vec![POISON; n];
    staging.d2h_blocking(&dev, &mut back).unwrap();
    assert_eq!(first_diff(&back, &data), None);
    // The same awaited (the blocking forms call the driver themselves).
    let other = random(n, &mut rng);
    futures::executor::block_on(staging.h2d(&other, &mut dev)).unwrap();
    let mut back = vec![POISON; n];
    futures::executor::block_on(staging.d2h(&dev, &mut back)).unwrap();
    assert_eq!(first_diff(&back, &other), None);
    assert_eq!(
        staging.pool_stats().peak_in_use_bytes,
        0,
        "a small copy went through the ring"
    );
    // At each threshold: staged.
    for (bytes, h2d) in [(c.direct_h2d_below, true), (c.direct_d2h_below, false)] {
        let fresh = Staging::new(&device).unwrap();
        let n = bytes / 4;
        let data = random(n, &mut rng);
        let mut dev = poisoned(&device, n);
        if h2d {
            fresh.h2d_blocking(&data, &mut dev).unwrap();
            assert_eq!(first_diff(&read(&mut dev), &data), None);
        } else {
            dev.copy_from_host_sync(&data).unwrap();
            let mut back = vec![POISON; n];
            fresh.d2h_blocking(&dev, &mut back).unwrap();
            assert_eq!(first_diff(&back, &data), None);
        }
        assert!(
            fresh.pool_stats().peak_in_use_bytes > 0,
            "{bytes} bytes did not go through the ring"
        );
    }
}

/// Raw bytes of `words`, little-endian (the order the device keeps them in).
fn bytes_of(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

gpufeed::backend_tests!(a_file_reaches_the_device_and_comes_back_byte_for_byte);
fn a_file_reaches_the_device_and_comes_back_byte_for_byte(device: gpufeed::Device) {
    let staging = small(&device, Route::Auto, 2);
    let mut rng = fastrand::Rng::with_seed(0xf11e);
    let dir = std::env::temp_dir().join(format!(
        "host-staging-{}-{:?}",
        std::process::id(),
        device.kind()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("data.bin");
    let n = 300_011;
    let words = random(n, &mut rng);
    // 13 bytes of header first: reads start at an odd offset.
    let mut file_bytes = vec![7u8; 13];
    file_bytes.extend(bytes_of(&words));
    std::fs::write(&path, &file_bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    for (at_word, len) in [(0, n), (5, 1), (1000, 200_000), (n, 0)] {
        let mut dev = poisoned(&device, len);
        staging
            .read_file_blocking(&file, 13 + 4 * at_word as u64, &mut dev)
            .unwrap();
        assert_eq!(
            first_diff(&read(&mut dev), &words[at_word..at_word + len]),
            None
        );
    }
    // Written back, then compared with the file's bytes by a plain read.
    let mut dev = poisoned(&device, n);
    dev.copy_from_host_sync(&words).unwrap();
    let out = dir.join("out.bin");
    let f = std::fs::File::create(&out).unwrap();
    staging.write_file_blocking(&dev, &f, 3).unwrap();
    drop(f);
    let got = std::fs::read(&out).unwrap();
    assert_eq!(got.len(), 3 + 4 * n);
    assert!(got[3..] == bytes_of(&words)[..], "written file differs");
    std::fs::remove_dir_all(&dir).unwrap();
}

gpufeed::backend_tests!(bad_files_are_typed_errors);
fn bad_files_are_typed_errors(device: gpufeed::Device) {
    let staging = small(&device, Route::Auto, 2);
    let dir = std::env::temp_dir().join(format!(
        "host-staging-bad-{}-{:?}",
        std::process::id(),
        device.kind()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    // Truncated: the file ends before the buffer is full.
    let path = dir.join("short.bin");
    std::fs::write(&path, vec![1u8; 4 * 1000 - 2]).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut dev = poisoned(&device, 1000);
    let err = staging.read_file_blocking(&file, 0, &mut dev).unwrap_err();
    assert!(
        matches!(&err, Error::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof),
        "{err:?}"
    );
    // A large truncated file (several blocks: the error comes from a worker).
    std::fs::write(&path, vec![1u8; 500_000]).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let mut dev = poisoned(&device, 200_000);
    let err = staging.read_file_blocking(&file, 0, &mut dev).unwrap_err();
    assert!(
        matches!(&err, Error::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof),
        "{err:?}"
    );
    // A directory.
    let d = std::fs::File::open(&dir).unwrap();
    let err = staging.read_file_blocking(&d, 0, &mut dev).unwrap_err();
    assert!(matches!(&err, Error::Io(_)), "{err:?}");
    // Writing to a file opened read-only.
    let err = staging.write_file_blocking(&dev, &file, 0).unwrap_err();
    assert!(matches!(&err, Error::Io(_)), "{err:?}");
    // A write whose end lies past u64::MAX: refused before any byte is
    // written (the workers' offsets would wrap to the file's start).
    let path = dir.join("zeros.bin");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let err = staging
        .write_file_blocking(&dev, &rw, u64::MAX - 3)
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("past u64::MAX")),
        "{err:?}"
    );
    let err = staging
        .write_file_with_blocking(&dev, 10..20, &rw, u64::MAX - 39)
        .unwrap_err();
    assert!(matches!(&err, Error::InvalidArgument(_)), "{err:?}");
    assert!(
        std::fs::read(&path).unwrap().iter().all(|&b| b == 0),
        "a refused write wrote"
    );
    // The same write ending exactly at u64::MAX is not refused as past it.
    let err = staging
        .write_file_with_blocking(&dev, 10..20, &rw, u64::MAX - 40)
        .unwrap_err();
    assert!(!matches!(&err, Error::InvalidArgument(_)), "{err:?}");
    // The device buffer is still usable.
    dev.copy_from_host_sync(&vec![9; 200_000]).unwrap();
    assert_eq!(read(&mut dev), vec![9; 200_000]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reads `len` words of `path` from byte `at` the way `io` says; the way
/// taken and the words, or the error.
fn read_words(
    staging: &Staging,
    file: &std::fs::File,
    at: u64,
    len: usize,
    io: FileIo,
) -> Result<(Option<FileIo>, Vec<u32>), Error> {
    let device = staging_device(staging);
    let mut dev = poisoned(&device, len + 2);
    let copy = staging.read_file_with(file, at, &mut dev, 1..len + 1, io);
    let way = copy.file_io();
    gpufeed::block_on(copy)?;
    let got = read(&mut dev);
    assert_eq!(got[0], POISON, "a byte before the range was written");
    assert_eq!(got[len + 1], POISON, "a byte after the range was written");
    Ok((way, got[1..len + 1].to_vec()))
}

fn staging_device(staging: &Staging) -> gpufeed::Device {
    staging.device().clone()
}
/// Drops the file's pages from the page cache (clean pages: after fsync).
fn evict(file: &std::fs::File) {
    use std::os::unix::io::AsRawFd;
    file.sync_all().unwrap();
    // SAFETY: advice on our own open descriptor.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

gpufeed::backend_tests!(direct_and_buffered_reads_give_the_same_bytes_at_any_offset);
fn direct_and_buffered_reads_give_the_same_bytes_at_any_offset(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0xd1ec7);
    // /tmp, and the working directory (a real disk where /tmp is tmpfs;
    // found at run time: the test may run on another machine than it was
    // built on).
    let dirs = [std::env::temp_dir(), std::env::current_dir().unwrap()];
    for (d, base) in dirs.iter().enumerate() {
        let dir = base.join(format!(
            "host-direct-{}-{:?}-{d}",
            std::process::id(),
            device.kind()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data.bin");
        let n = 1_500_007;
        let words = random(n, &mut rng);
        let mut bytes = vec![3u8; 4093];
        bytes.extend(bytes_of(&words));
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // Blocks of 64 KiB + 4 (skews change from block to block) and of
        // 1 MiB; 1 worker and 3.
        for (block_bytes, threads) in [((64 << 10) + 4, 3), (1 << 20, 1)] {
            let staging = Staging::with_config(
                &device,
                StagingConfig {
                    block_bytes,
                    blocks: 3,
                    threads,
                    ..StagingConfig::for_device(&device)
                },
            )
            .unwrap();
            for _ in 0..6 {
                let first = rng.usize(..n - 1);
                let len = rng.usize(1..=(n - first).min(700_000));
                // Words start at byte 4093: every offset is unaligned but
                // the one landing on a page.
                let at = 4093 + 4 * first as u64;
                let want = &words[first..first + len];
                let (way, got) = read_words(&staging, &file, at, len, FileIo::Buffered).unwrap();
                assert_eq!(way, Some(FileIo::Buffered));
                assert_eq!(first_diff(&got, want), None, "buffered at {at} len {len}");
                match read_words(&staging, &file, at, len, FileIo::Direct) {
                    Ok((way, got)) => {
                        assert_eq!(way, Some(FileIo::Direct));
                        assert_eq!(first_diff(&got, want), None, "direct at {at} len {len}");
                    }
                    Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
                        eprintln!("{}: O_DIRECT refused ({e})", dir.display());
                    }
                    Err(e) => panic!("direct read at {at} len {len}: {e:?}"),
                }
            }
            // Auto: buffered, cached or evicted (tests/file_pieces.rs checks
            // that the read leaves an evicted file cached).
            assert_eq!(std::fs::read(&path).unwrap(), bytes);
            let (way, got) = read_words(&staging, &file, 4093, n, FileIo::Auto).unwrap();
            assert_eq!(first_diff(&got, &words), None);
            assert_eq!(way, Some(FileIo::Buffered), "a cached file read direct");
            evict(&file);
            let (way, got) = read_words(&staging, &file, 4093, n, FileIo::Auto).unwrap();
            assert_eq!(first_diff(&got, &words), None);
            assert_eq!(way, Some(FileIo::Buffered), "an evicted file");
        }
        // A file that ends inside the aligned middle, read direct: the
        // error of a truncated file.
        std::fs::write(&path, &bytes[..100_000]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let staging = small(&device, Route::Auto, 2);
        match read_words(&staging, &file, 4093, 200_000, FileIo::Direct) {
            Err(Error::Io(e)) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::Unsupported
                ),
                "{e:?}"
            ),
            other => panic!("a truncated file read direct: {:?}", other.map(|r| r.0)),
        }
        // A descriptor opened for writing only: direct refused, typed.
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let err = read_words(&staging, &w, 0, 1000, FileIo::Direct).unwrap_err();
        assert!(
            matches!(&err, Error::Io(e) if e.kind() == std::io::ErrorKind::Unsupported),
            "{err:?}"
        );
        // A range the wrong way round.
        let mut dev = poisoned(&device, 10);
        let (start, end) = (5, 3);
        let err = staging
            .read_file_with_blocking(&file, 0, &mut dev, start..end, FileIo::Auto)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfBounds {
                    start: 5,
                    end: 3,
                    len: 10
                }
            ),
            "{err:?}"
        );
        // Ranges whose byte counts overflow: refused, typed (no overflow
        // panic in a debug build), both ways, nothing written.
        let err = staging
            .read_file_with_blocking(&file, 0, &mut dev, 1..usize::MAX, FileIo::Auto)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err:?}");
        let out_path = dir.join("out.bin");
        let out = std::fs::File::create(&out_path).unwrap();
        let err =
            futures::executor::block_on(staging.write_file_with(&dev, 1..usize::MAX, &out, 0))
                .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{err:?}");
        assert_eq!(std::fs::metadata(&out_path).unwrap().len(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Random floats in [-500, 500) (finite, never NaN).
fn random_floats(n: usize, rng: &mut fastrand::Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * 1000.0 - 500.0).collect()
}

/// `y = 3 x` in a pipeline run over ordinary slices.
fn triple<'p>(
    pipe: &'p gpufeed::Pipeline,
    staging: &'p Staging,
    x: &'p [f32],
    y: &'p mut [f32],
) -> impl Future<Output = gpufeed::Result<()>> + 'p {
    pipe.run_slices(staging, x, y, |c, chunk| {
        c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)?;
        c.kernel(gpufeed::Kernel::Scale { s: 3.0 }, chunk.output::<f32>(0)?)
    })
}

/// Index of the first float whose bits differ from a plain loop's `3 x`.
fn first_wrong_triple(x: &[f32], y: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(x.len(), y.len());
    (0..x.len())
        .find(|&i| y[i].to_bits() != (x[i] * 3.0).to_bits())
        .map(|i| (i, y[i], x[i] * 3.0))
}

gpufeed::backend_tests!(a_pipeline_over_ordinary_slices_computes_every_element);
fn a_pipeline_over_ordinary_slices_computes_every_element(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0x511c);
    let staging = small(&device, Route::Auto, 2);
    let pipe = gpufeed::Pipeline::new(&device, 3).unwrap();
    // Windows are the engine's blocks (64 KiB + 4: 16,385 floats): none,
    // one element, one partial window, and many with a ragged last one.
    for n in [0, 1, 1000, 16_385 * 7 + 123] {
        let x = random_floats(n, &mut rng);
        let mut y = vec![f32::NAN; n];
        futures::executor::block_on(triple(&pipe, &staging, &x, &mut y)).unwrap();
        assert_eq!(first_wrong_triple(&x, &y), None, "n = {n}");
    }
}

gpufeed::backend_tests!(a_pipeline_over_slices_dropped_at_any_point_frees_them_at_once);
fn a_pipeline_over_slices_dropped_at_any_point_frees_them_at_once(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0x5117);
    let staging = small(&device, Route::Auto, 2);
    let pipe = gpufeed::Pipeline::new(&device, 2).unwrap();
    let n = 16_385 * 9 + 7;
    for polls in [0, 1, 2, 5] {
        let mut x = random_floats(n, &mut rng);
        let mut y = vec![f32::NAN; n];
        {
            let mut run = Box::pin(triple(&pipe, &staging, &x, &mut y));
            poll_n(&mut run, polls);
        }
        // Both slices are ours again at once (a thread still touching them
        // would race with this; valgrind and the sanitizer check).
        x.fill(1.0);
        y.fill(2.0);
        // The pipeline and the engine still work, and the next run is right.
        let x = random_floats(n, &mut rng);
        futures::executor::block_on(triple(&pipe, &staging, &x, &mut y)).unwrap();
        assert_eq!(
            first_wrong_triple(&x, &y),
            None,
            "after dropping at poll {polls}"
        );
    }
}

gpufeed::backend_tests!(a_pipeline_over_slices_refuses_bad_arguments_and_reports_stage_errors);
fn a_pipeline_over_slices_refuses_bad_arguments_and_reports_stage_errors(device: gpufeed::Device) {
    let staging = small(&device, Route::Auto, 1);
    let pipe = gpufeed::Pipeline::new(&device, 2).unwrap();
    let x = vec![1.0f32; 100];
    let mut y = vec![f32::NAN; 99];
    let r = futures::executor::block_on(triple(&pipe, &staging, &x, &mut y));
    assert!(matches!(r, Err(Error::LengthMismatch { .. })), "{r:?}");
    assert!(
        y.iter().all(|v| v.is_nan()),
        "a refused run wrote the output"
    );

    let mut y = vec![f32::NAN; 100];
    let r = futures::executor::block_on(pipe.run_slices(&staging, &x, &mut y, |_, chunk| {
        chunk.output::<u64>(0).map(drop)
    }));
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");

    let other = gpufeed::Device::cpu();
    if device.kind() != gpufeed::BackendKind::Cpu {
        let foreign = small(&other, Route::Auto, 1);
        let r = futures::executor::block_on(triple(&pipe, &foreign, &x, &mut y));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }
}

gpufeed::backend_tests!(a_write_to_a_full_disk_is_a_storage_full_error_and_the_buffer_stays_usable);
fn a_write_to_a_full_disk_is_a_storage_full_error_and_the_buffer_stays_usable(
    device: gpufeed::Device,
) {
    // /dev/full refuses every write with ENOSPC, as a full file system does.
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        panic!("/dev/full is missing: this test needs a Linux /dev");
    };
    let staging = small(&device, Route::Auto, 2);
    let words: Vec<u32> = (0..300_000u32)
        .map(|i| i.wrapping_mul(2654435761))
        .collect();
    let mut dev = DeviceBuffer::<u32>::new(&device, words.len()).unwrap();
    staging.h2d_blocking(&words, &mut dev).unwrap();
    match staging.write_file_blocking(&dev, &full, 0) {
        Err(Error::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::StorageFull, "{e:?}"),
        other => panic!("a write to a full disk gave {other:?}"),
    }
    // Nothing lost: the device buffer is intact and usable.
    let mut back = vec![0xDEAD_BEEFu32; words.len()];
    staging.d2h_blocking(&dev, &mut back).unwrap();
    assert_eq!(back, words);
}
