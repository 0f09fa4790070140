//! Every test body runs as one test per backend (`gpufeed::backend_tests!`):
//! `name::cpu` on the CPU emulation, `name::cuda` on a GPU (ignored when the
//! build saw none; required with REQUIRE_GPU=1).

use futures::executor::block_on;
use gpufeed::testing::{serial, watchdog};
use gpufeed::{
    DeviceBuffer, HostFlags, Kernel, MappedFlag, PinnedBuffer, PinnedHost, PinnedPool, Registered,
    Stream,
};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n)
        .map(|_| rng.f32() * 2.0 - 1.0)
        .map(|v| if v == 0.0 { 0.25 } else { v })
        .collect()
}

gpufeed::backend_tests!(pinned_round_trip_on_random_data_with_every_flag);
fn pinned_round_trip_on_random_data_with_every_flag(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    for flags in [
        HostFlags::DEFAULT,
        HostFlags {
            write_combined: true,
            ..HostFlags::DEFAULT
        },
        HostFlags {
            device_mapped: true,
            ..HostFlags::DEFAULT
        },
        HostFlags {
            portable: false,
            ..HostFlags::DEFAULT
        },
    ] {
        for n in [0usize, 1, 5, 1023, (1 << 20) + 3] {
            let data = random(n, n as u64);
            let mut src = PinnedBuffer::<f32>::with_flags(&device, n, flags).unwrap();
            assert!(
                src.as_slice().iter().all(|v| *v == 0.0),
                "fresh pinned memory is zeroed"
            );
            src.as_mut_slice().copy_from_slice(&data);
            assert_eq!(src.byte_len(), n * 4);
            assert_eq!(src.flags(), flags);
            let dst = PinnedBuffer::<f32>::new(&device, n).unwrap();
            let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
            let ((src, _dev, dst), ()) = block_on(stream.run((src, dev, dst), |c, (s, d, o)| {
                let d = d.view_mut();
                c.copy_h2d(s.host(), d)?;
                c.copy_d2h(d, o.host_mut())
            }))
            .unwrap();
            assert_eq!(
                dst.as_slice(),
                &data[..],
                "{:?} n={n} flags={flags:?}",
                device.kind()
            );
            assert_eq!(src.as_slice(), &data[..]);
        }
    }
}

gpufeed::backend_tests!(element_types_keep_their_alignment);
fn element_types_keep_their_alignment(device: gpufeed::Device) {
    let _serial = serial();
    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable, PartialEq, Debug)]
    #[repr(C, align(64))]
    struct Wide([u8; 64]);
    let mut b = PinnedBuffer::<Wide>::new(&device, 3).unwrap();
    assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
    b.as_mut_slice()[2] = Wide([7; 64]);
    let pool = PinnedPool::new(&device);
    let p = pool.alloc::<u64>(9).unwrap();
    assert_eq!(p.as_slice().as_ptr() as usize % 8, 0);
    let b16 = PinnedBuffer::<u16>::from_slice(&device, &[1, 2, 3]).unwrap();
    assert_eq!(b16.as_slice(), &[1, 2, 3]);
}

gpufeed::backend_tests!(kernels_on_device_match_the_cpu_bit_for_bit);
fn kernels_on_device_match_the_cpu_bit_for_bit(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    // The largest size many blocks of the grid on a GPU; on the CPU
    // emulation (under valgrind in CI) a sixteenth of it, still 257 blocks.
    let large = match device.kind() {
        gpufeed::BackendKind::Cpu => (1 << 16) + 3,
        _ => (1 << 20) + 3,
    };
    for kernel in [Kernel::Scale { s: -2.5 }, Kernel::Intensity { k: 33 }] {
        for n in [1usize, 3, 4, 5, 1023, large] {
            let x = random(n, 99 + n as u64);
            let input = PinnedBuffer::from_slice(&device, &x).unwrap();
            let out = PinnedBuffer::<f32>::new(&device, n).unwrap();
            let dev = DeviceBuffer::<f32>::new(&device, n + 3).unwrap();
            // Work on a sub-range that starts 1..3 floats into the device buffer.
            for off in 0..4 {
                let ((i, d, o), ()) = block_on(stream.run(
                    (
                        input.clone_pinned(&device),
                        dev_clone(&device, n + 3),
                        PinnedBuffer::<f32>::new(&device, n).unwrap(),
                    ),
                    |c, (i, d, o)| {
                        let sub = d.view_mut().range(off..off + n)?;
                        c.copy_h2d(i.host(), sub)?;
                        c.kernel(kernel, sub)?;
                        c.copy_d2h(sub, o.host_mut())
                    },
                ))
                .unwrap();
                for (j, (g, v)) in o.as_slice().iter().zip(&x).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        gpufeed::testing::expected(kernel, *v).to_bits(),
                        "{:?} {kernel:?} n={n} off={off} j={j}",
                        device.kind()
                    );
                }
                drop((i, d));
            }
            drop((input, out, dev));
        }
    }
}

trait ClonePinned {
    fn clone_pinned(&self, device: &gpufeed::Device) -> Self;
}
impl ClonePinned for PinnedBuffer<f32> {
    fn clone_pinned(&self, device: &gpufeed::Device) -> Self {
        PinnedBuffer::from_slice(device, self.as_slice()).unwrap()
    }
}
fn dev_clone(device: &gpufeed::Device, n: usize) -> DeviceBuffer<f32> {
    DeviceBuffer::new(device, n).unwrap()
}

gpufeed::backend_tests!(registered_memory_round_trips_and_unregisters);
fn registered_memory_round_trips_and_unregisters(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let data = random(100_003, 5);
    let reg_in = Registered::new(&device, data.clone()).unwrap();
    let reg_out = Registered::new(&device, vec![0f32; data.len()]).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, data.len()).unwrap();
    let ((reg_in, _d, reg_out), ()) =
        block_on(stream.run((reg_in, dev, reg_out), |c, (i, d, o)| {
            let d = d.view_mut();
            c.copy_h2d(i.host(), d)?;
            c.kernel(Kernel::Scale { s: 2.0 }, d)?;
            c.copy_d2h(d, o.host_mut())
        }))
        .unwrap();
    assert_eq!(reg_in.as_slice(), &data[..]);
    let out = reg_out.into_inner(); // unregisters
    for (o, d) in out.iter().zip(&data) {
        assert_eq!(*o, d * 2.0);
    }
    // Registering the same memory again works: the guard unregistered it.
    let again = Registered::new(&device, out).unwrap();
    assert_eq!(again.len(), data.len());
}

gpufeed::backend_tests!(pageable_memory_has_a_synchronous_path);
fn pageable_memory_has_a_synchronous_path(device: gpufeed::Device) {
    let _serial = serial();
    let data = random(4097, 11);
    let mut dev = DeviceBuffer::<f32>::new(&device, data.len()).unwrap();
    dev.copy_from_host_sync(&data).unwrap();
    let mut back = vec![0f32; data.len()];
    dev.copy_to_host_sync(&mut back).unwrap();
    assert_eq!(back, data);
    assert!(matches!(
        dev.copy_to_host_sync(&mut back[..3]),
        Err(gpufeed::Error::LengthMismatch { .. })
    ));
}

gpufeed::backend_tests!(run_sync_hands_the_bundle_back_after_the_gpu_is_done);
fn run_sync_hands_the_bundle_back_after_the_gpu_is_done(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let pool = PinnedPool::new(&device);
    let data = random(100_003, 12);
    let mut input = pool.alloc::<f32>(data.len()).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(data.len()).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, data.len()).unwrap();
    let kernel = Kernel::Scale { s: -1.5 };
    let ((input, output, dev), n) = stream
        .run_sync((input, output, dev), |c, (i, o, d)| {
            let d = d.view_mut();
            c.copy_h2d(i.host(), d)?;
            c.kernel(kernel, d)?;
            c.copy_d2h(d, o.host_mut())?;
            Ok(d.len())
        })
        .unwrap();
    assert_eq!(n, data.len());
    assert_eq!(input.as_slice(), &data[..], "the input is untouched");
    for (k, (&x, &y)) in data.iter().zip(output.as_slice()).enumerate() {
        assert_eq!(
            y.to_bits(),
            gpufeed::testing::expected(kernel, x).to_bits(),
            "element {k}"
        );
    }
    // A command that fails after one was enqueued: the typed error comes
    // back once that one has finished, and the stream is usable after.
    let short = DeviceBuffer::<f32>::new(&device, 3).unwrap();
    let r = stream.run_sync((input, dev, short), |c, (i, d, s)| {
        c.copy_h2d(i.host(), d.view_mut())?;
        c.copy_h2d(i.host(), s.view_mut())
    });
    assert!(
        matches!(&r, Err(e) if matches!(e.error, gpufeed::Error::LengthMismatch { .. })),
        "{:?}",
        r.as_ref().err()
    );
    // The error hands the bundle back, and only once the copy enqueued
    // before the failing command has finished: its data is on the device.
    let (input, mut landed, short) = r
        .err()
        .and_then(|e| e.bundle)
        .expect("the bundle is handed back with the error");
    assert_eq!(input.as_slice(), &data[..], "the input is untouched");
    assert_eq!(short.len(), 3);
    let mut back = vec![0f32; data.len()];
    landed.copy_to_host_sync(&mut back).unwrap();
    assert_eq!(
        back, data,
        "the first copy finished before the error came back"
    );
    drop((input, landed, short));
    let dev = DeviceBuffer::<f32>::new(&device, data.len()).unwrap();
    let mut fresh = pool.alloc::<f32>(data.len()).unwrap();
    fresh.as_mut_slice().copy_from_slice(&data);
    let ((_, dev), ()) = stream
        .run_sync((fresh, dev), |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()))
        .unwrap();
    let ((_, output), ()) = block_on(stream.copy_d2h(dev, output)).unwrap();
    assert_eq!(output.as_slice(), &data[..]);
}

gpufeed::backend_tests!(bad_lengths_and_ranges_get_typed_errors);
fn bad_lengths_and_ranges_get_typed_errors(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let a = PinnedBuffer::<f32>::new(&device, 10).unwrap();
    let d = DeviceBuffer::<f32>::new(&device, 11).unwrap();
    let r = block_on(stream.run((a, d), |c, (a, d)| c.copy_h2d(a.host(), d.view_mut())));
    assert!(
        matches!(
            &r,
            Err(e) if matches!(
                e.error,
                gpufeed::Error::LengthMismatch {
                    expected: 10,
                    got: 11,
                    ..
                }
            )
        ),
        "{r:?}"
    );
    assert!(
        r.is_err_and(|e| e.bundle.is_some()),
        "the buffers come back with the error"
    );
    let mut d = DeviceBuffer::<f32>::new(&device, 4).unwrap();
    assert!(matches!(
        d.view().range(2..9),
        Err(gpufeed::Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        d.view_mut().range(2..9),
        Err(gpufeed::Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        PinnedBuffer::<f32>::new(&device, usize::MAX / 2),
        Err(gpufeed::Error::SizeOverflow { .. })
    ));
    // The stream is still usable.
    stream.synchronize().unwrap();
}

#[test]
fn device_buffers_of_another_device_are_rejected_and_pinned_memory_is_shared() {
    let _serial = serial();
    let cpu_a = gpufeed::Device::cpu();
    let cpu_b = gpufeed::Device::cpu();
    let stream = Stream::new(&cpu_a).unwrap();
    // Device memory of b on a's stream: refused, everything handed back.
    let h = PinnedBuffer::<f32>::from_slice(&cpu_a, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    let foreign = DeviceBuffer::<f32>::new(&cpu_b, 4).unwrap();
    let r = block_on(stream.run((h, foreign), |c, (h, d)| c.copy_h2d(h.host(), d.view_mut())));
    assert!(
        matches!(&r, Err(e) if matches!(e.error, gpufeed::Error::InvalidArgument(_))),
        "{r:?}"
    );
    assert!(
        r.is_err_and(|e| e.bundle.is_some()),
        "the buffers come back with the error"
    );
    // Pinned memory of b with a's device memory: the same backend's host
    // memory (portable pinned memory on CUDA), accepted both ways.
    let src = PinnedBuffer::<f32>::from_slice(&cpu_b, &[5.0, 6.0, 7.0, 8.0]).unwrap();
    let dst = PinnedBuffer::<f32>::new(&cpu_b, 4).unwrap();
    let d = DeviceBuffer::<f32>::new(&cpu_a, 4).unwrap();
    let ((_, _, dst), ()) = block_on(stream.run((src, d, dst), |c, (s, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(s.host(), d)?;
        c.copy_d2h(d, o.host_mut())
    }))
    .unwrap();
    assert_eq!(dst.as_slice(), &[5.0, 6.0, 7.0, 8.0]);
}

gpufeed::backend_tests!(pool_reuses_blocks_and_returns_to_baseline);
fn pool_reuses_blocks_and_returns_to_baseline(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let base = pool.stats();
    let a = pool.alloc::<f32>(1000).unwrap();
    let pa = a.as_ptr();
    assert_eq!(a.block_bytes(), 4096);
    drop(a);
    let b = pool.alloc::<f32>(900).unwrap(); // same size class
    assert_eq!(b.as_ptr(), pa, "a block of the same class is reused");
    let s = pool.stats();
    assert_eq!((s.hits, s.misses), (base.hits + 1, base.misses + 1));
    assert_eq!(s.in_use_bytes, 4096);
    drop(b);
    let s = pool.stats();
    assert_eq!(
        (s.in_use_bytes, s.cached_bytes, s.blocks_in_use),
        (0, 4096, 0)
    );
    pool.empty_cache();
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.cached_bytes), (0, 0));
    assert_eq!(s.driver_allocs, s.driver_frees);
    // A cap frees blocks beyond it on return.
    pool.set_max_cached_bytes(8192);
    let bufs: Vec<_> = (0..4).map(|_| pool.alloc::<u8>(4096).unwrap()).collect();
    drop(bufs);
    assert_eq!(pool.stats().cached_bytes, 8192);
    pool.empty_cache();
    assert_eq!(pool.stats().cached_bytes, 0);
}

gpufeed::backend_tests!(pool_is_safe_from_many_threads);
fn pool_is_safe_from_many_threads(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let pool = pool.clone();
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for _ in 0..500 {
                    let n = rng.usize(1..20_000);
                    let mut b = pool.alloc::<u32>(n).unwrap();
                    b.as_mut_slice().fill(t as u32);
                    assert!(
                        b.as_slice().iter().all(|v| *v == t as u32),
                        "no two threads share a block"
                    );
                }
            });
        }
    });
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.blocks_in_use), (0, 0));
    assert_eq!(s.hits + s.misses, 8 * 500);
    assert!(
        s.hits > s.misses,
        "most allocations are served from the cache: {s:?}"
    );
}

gpufeed::backend_tests!(pool_reuse_is_held_back_while_gpu_work_is_in_flight);
fn pool_reuse_is_held_back_while_gpu_work_is_in_flight(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let stream = Stream::new(&device).unwrap();
    let gate = std::sync::Arc::new(MappedFlag::new(&device).unwrap());
    let _watchdog = watchdog(&gate);
    let n = 1 << 16;
    let mut staging = pool.alloc::<f32>(n).unwrap();
    staging.as_mut_slice().copy_from_slice(&random(n, 3));
    let first = staging.as_ptr();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    // Hold the stream on the gate, then queue a copy from the pool buffer.
    let g = gate.clone();
    let job = stream.run((g, staging, dev), |c, (g, s, d)| {
        c.gate(g)?;
        c.copy_h2d(s.host(), d.view_mut())
    });
    drop(job); // cancelled while held: the buffer must not return yet
    let other = pool.alloc::<f32>(n).unwrap();
    assert_ne!(
        other.as_ptr(),
        first,
        "a block still in flight was handed out again"
    );
    assert_eq!(pool.stats().blocks_in_use, 2);
    drop(other);
    gate.set(1);
    stream.synchronize().unwrap();
    // The completion source released the job's bundle: the block is back.
    // (The class's free list holds it and `other`; two allocations take both.)
    let again: Vec<_> = (0..2).map(|_| pool.alloc::<f32>(n).unwrap()).collect();
    assert!(
        again.iter().any(|b| b.as_ptr() == first),
        "the block returned to the pool after the GPU finished"
    );
    assert_eq!(pool.stats().misses, 2, "both allocations were cache hits");
    drop(again);
    let s = pool.stats();
    assert_eq!((s.in_use_bytes, s.blocks_in_use), (0, 0), "{s:?}");
}

gpufeed::backend_tests!(events_order_work_across_streams);
fn events_order_work_across_streams(device: gpufeed::Device) {
    let _serial = serial();
    let (s1, s2) = (Stream::new(&device).unwrap(), Stream::new(&device).unwrap());
    let gate = std::sync::Arc::new(MappedFlag::new(&device).unwrap());
    let _watchdog = watchdog(&gate);
    let n = 1 << 18;
    let x = random(n, 21);
    // Device memory shared by jobs is read-only now, so the two streams no
    // longer hand data to each other through one buffer: s1 uploads into a
    // buffer of its own, and s2 reads a shared buffer filled beforehand.
    // Everything is allocated before the gate closes.
    let filled = PinnedBuffer::from_slice(&device, &x).unwrap();
    let shared = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let ((_, shared), ()) = block_on(s2.copy_h2d(filled, shared)).unwrap();
    let shared = std::sync::Arc::new(shared);
    let dev1 = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let dev2 = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let input = PinnedBuffer::from_slice(&device, &x).unwrap();
    let out = PinnedBuffer::<f32>::new(&device, n).unwrap();
    // s1: gate, then upload. s2 waits for s1's event, then copies the
    // shared buffer, scales and downloads.
    let g = gate.clone();
    let upload = s1.run((g, input, dev1), |c, (g, i, d)| {
        c.gate(g)?;
        c.copy_h2d(i.host(), d.view_mut())
    });
    let uploaded = s1.record().unwrap();
    s2.wait_event(&uploaded).unwrap();
    let compute = s2.run((shared.clone(), dev2, out), |c, (s, d, o)| {
        let d = d.view_mut();
        c.copy_d2d(s.view(), d)?;
        c.kernel(Kernel::Scale { s: 3.0 }, d)?;
        c.copy_d2h(d, o.host_mut())
    });
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(!uploaded.is_done(), "s1 is held on its gate");
    assert!(!compute.is_done(), "s2 must wait for s1's gated upload");
    gate.set(1);
    let ((_, _, mut dev1), ()) = block_on(upload).unwrap();
    let mut uploaded_data = vec![0f32; n];
    dev1.copy_to_host_sync(&mut uploaded_data).unwrap();
    assert_eq!(uploaded_data, x, "s1's upload landed");
    let ((_, _, out), ()) = block_on(compute).unwrap();
    for (o, v) in out.as_slice().iter().zip(&x) {
        assert_eq!(*o, v * 3.0);
    }
}

gpufeed::backend_tests!(futures_work_under_tokio_too);
fn futures_work_under_tokio_too(device: gpufeed::Device) {
    let _serial = serial();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let x = random(50_000, 8);
    let got = rt.block_on(async {
        let stream = Stream::new(&device).unwrap();
        let pool = PinnedPool::new(&device);
        let mut i = pool.alloc::<f32>(x.len()).unwrap();
        i.as_mut_slice().copy_from_slice(&x);
        let o = pool.alloc::<f32>(x.len()).unwrap();
        let d = DeviceBuffer::<f32>::new(&device, x.len()).unwrap();
        let ((_, _, o), ()) = stream
            .run((i, d, o), |c, (i, d, o)| {
                let d = d.view_mut();
                c.copy_h2d(i.host(), d)?;
                c.kernel(Kernel::Scale { s: 0.5 }, d)?;
                c.copy_d2h(d, o.host_mut())
            })
            .await
            .unwrap();
        o.as_slice().to_vec()
    });
    assert!(got.iter().zip(&x).all(|(g, v)| *g == v * 0.5));
}

gpufeed::backend_tests!(the_cpu_thread_is_free_while_a_large_copy_is_in_flight);
fn the_cpu_thread_is_free_while_a_large_copy_is_in_flight(device: gpufeed::Device) {
    let _serial = serial();
    let n = if device.kind() == gpufeed::BackendKind::Cuda {
        1 << 28
    } else {
        1 << 24
    }; // 1 GiB on the GPU
    let stream = Stream::new(&device).unwrap();
    let src = PinnedBuffer::<f32>::from_slice(&device, &random(n, 1)).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    // The CPU emulation copies on another CPU thread, which a busy machine
    // may finish before this thread first looks (seen in CI): there the
    // stream is held on a gate first, opened after the first spins, so the
    // copy is in flight for certain while this thread works.
    let gate = (device.kind() == gpufeed::BackendKind::Cpu)
        .then(|| std::sync::Arc::new(MappedFlag::new(&device).unwrap()));
    let _watchdog = gate.as_ref().map(watchdog);
    let held = gate
        .as_ref()
        .map(|g| stream.run(g.clone(), |c, g| c.gate(g)));
    let t0 = std::time::Instant::now();
    let job = stream.copy_h2d(src, dev);
    let enqueue = t0.elapsed();
    // The call returned with the copy not done (held on the CPU emulation,
    // a GiB still crossing the link on the GPU): a copy made synchronous
    // would be done here.
    let in_flight = !job.is_done();
    // Work on the CPU while the copy runs.
    let mut spins = 0u64;
    while !job.is_done() {
        spins += 1;
        std::hint::black_box(spins);
        if let (Some(g), 10_000) = (&gate, spins) {
            assert!(!job.is_done(), "done before the gate opened");
            g.set(1);
        }
    }
    let total = t0.elapsed();
    block_on(job).unwrap();
    if let Some(held) = held {
        block_on(held).unwrap();
    }
    // Enqueueing returned while the copy was still running, and the thread
    // then did work of its own until the copy finished.
    assert!(in_flight, "the copy was done when copy_h2d returned");
    assert!(spins > 0, "the CPU did work while the copy was in flight");
    // The copy went on for longer after the call returned than the call took.
    assert!(
        enqueue < total - enqueue,
        "enqueueing took {enqueue:?} of the copy's {total:?}"
    );
}

gpufeed::backend_tests!(pool_serves_a_request_from_a_slightly_larger_cached_block);
fn pool_serves_a_request_from_a_slightly_larger_cached_block(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let big = pool.alloc::<u8>(1 << 20).unwrap(); // class 1 MiB
    let p = big.as_ptr();
    drop(big);
    // 1 MiB - 100 KiB rounds to a class one step below: the 1 MiB block
    // (under 1/4 larger) serves it.
    let near = pool.alloc::<u8>((1 << 20) - 100 * 1024).unwrap();
    assert_eq!(near.as_ptr(), p);
    assert_eq!(near.block_bytes(), 1 << 20);
    assert_eq!(pool.stats().in_use_bytes, 1 << 20);
    drop(near);
    // Half the size is too far below: a new block, not 2x waste.
    let small = pool.alloc::<u8>(1 << 19).unwrap();
    assert_ne!(small.as_ptr(), p);
    drop(small);
    let s = pool.stats();
    assert_eq!((s.hits, s.misses, s.in_use_bytes), (1, 2, 0));
}

#[test]
fn a_device_that_does_not_exist_gets_a_typed_error() {
    let _serial = serial();
    let opts = gpufeed::DeviceOptions {
        backend: gpufeed::BackendChoice::Cuda,
        ordinal: 1000,
        ..Default::default()
    };
    match gpufeed::Device::open(opts) {
        // With a driver: the ordinal is checked against the device count.
        Err(gpufeed::Error::NoSuchDevice { index, count }) => {
            assert_eq!(index, 1000);
            assert!(count < 1000);
        }
        // Without a driver, or a driver without a GPU (cuInit fails): forcing
        // CUDA says so instead of falling back silently.
        Err(gpufeed::Error::BackendUnavailable(_)) | Err(gpufeed::Error::Driver { .. }) => {
            assert!(
                !gpufeed::testing::gpu_required(),
                "REQUIRE_GPU=1 but CUDA did not open"
            )
        }
        other => panic!("expected a typed error, got {other:?}"),
    }
    assert!("gpu0".parse::<gpufeed::BackendChoice>().is_err());
}

gpufeed::backend_tests!(back_to_back_pipeline_runs_of_mixed_layouts_share_scratch_safely);
fn back_to_back_pipeline_runs_of_mixed_layouts_share_scratch_safely(device: gpufeed::Device) {
    // Runs issued without waiting in between: each may start while the one
    // before still drains, on buffers the two share; every output must match.
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = gpufeed::Pipeline::new(&device, 4).unwrap();
    let n = 300_000;
    let plans = [
        gpufeed::Plan::uniform(8, 4),
        gpufeed::Plan::engines(8, 3),
        gpufeed::Plan::engines(5, 2),
        gpufeed::Plan::uniform(3, 2),
        gpufeed::Plan {
            ramp: true,
            ..gpufeed::Plan::engines(16, 4)
        },
        gpufeed::Plan::engines(7, 1),
        gpufeed::Plan::auto(n),
        gpufeed::Plan::uniform(6, 3),
    ];
    let mut jobs = Vec::new();
    for (k, plan) in plans.into_iter().cycle().take(4 * plans.len()).enumerate() {
        let mut input = pool.alloc::<f32>(n).unwrap();
        input
            .as_mut_slice()
            .copy_from_slice(&random(n, 100 + k as u64));
        let output = pool.alloc::<f32>(n).unwrap();
        let kernel = Kernel::Intensity {
            k: 1 + k as u32 % 8,
        };
        jobs.push((
            kernel,
            plan,
            pipe.run(input, output, kernel, plan, gpufeed::Timeline::Off),
        ));
    }
    for (kernel, plan, job) in jobs {
        let ((i, o), info) = block_on(job).unwrap();
        assert_eq!(info.plan, plan);
        let (checked, bad) = gpufeed::testing::verify(kernel, i.as_slice(), o.as_slice());
        assert_eq!((checked, bad), (n, 0), "{plan}");
    }
    assert_eq!(pool.stats().in_use_bytes, 0);
}

gpufeed::backend_tests!(zero_length_work_and_mismatched_kernel_arguments);
fn zero_length_work_and_mismatched_kernel_arguments(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let pool = PinnedPool::new(&device);
    // Zero-length copies and kernels: accepted, nothing to do, buffers back.
    let (h, d, o) = (
        pool.alloc::<f32>(0).unwrap(),
        DeviceBuffer::<f32>::new(&device, 0).unwrap(),
        pool.alloc::<f32>(0).unwrap(),
    );
    let ((h, d, o), ()) = block_on(stream.run((h, d, o), |c, (h, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(h.host(), d)?;
        c.kernel(Kernel::Scale { s: 2.0 }, d)?;
        c.copy_d2h(d, o.host_mut())
    }))
    .unwrap();
    assert_eq!((h.len(), d.len(), o.len()), (0, 0, 0));
    drop((h, o));
    // Empty pinned and registered buffers: nothing to lock, usable as any other.
    let (p, r) = (
        PinnedBuffer::<f32>::new(&device, 0).unwrap(),
        Registered::new(&device, Vec::<f32>::new()).unwrap(),
    );
    let d = DeviceBuffer::<f32>::new(&device, 0).unwrap();
    let ((p, _d, r), ()) = block_on(stream.run((p, d, r), |c, (p, d, r)| {
        let d = d.view_mut();
        c.copy_h2d(p.host(), d)?;
        c.copy_d2h(d, r.host_mut())
    }))
    .unwrap();
    assert_eq!((p.len(), r.into_inner().len()), (0, 0));
    // A zero-length pipeline run: accepted, nothing to do.
    let pipe = gpufeed::Pipeline::new(&device, 3).unwrap();
    let (i, o) = (pool.alloc::<f32>(0).unwrap(), pool.alloc::<f32>(0).unwrap());
    let run = pipe.run(
        i,
        o,
        Kernel::Scale { s: 2.0 },
        gpufeed::Plan::auto(0),
        gpufeed::Timeline::Off,
    );
    assert!(block_on(run).is_ok());
    // Kernel arguments that don't fit: saxpy over x and y of different lengths.
    let (x, y) = (
        DeviceBuffer::<f32>::new(&device, 8).unwrap(),
        DeviceBuffer::<f32>::new(&device, 7).unwrap(),
    );
    let r = block_on(stream.run((x, y), |c, (x, y)| c.saxpy(2.0, x.view(), y.view_mut())));
    assert!(
        matches!(
            &r,
            Err(e) if matches!(
                e.error,
                gpufeed::Error::LengthMismatch {
                    expected: 8,
                    got: 7,
                    ..
                }
            )
        ),
        "{r:?}"
    );
    assert!(
        r.is_err_and(|e| e.bundle.is_some()),
        "the buffers come back with the error"
    );
    // An engines plan on a pipeline of too few streams.
    let small = gpufeed::Pipeline::new(&device, 2).unwrap();
    let (mut i, mut o) = (
        pool.alloc::<f32>(64).unwrap(),
        pool.alloc::<f32>(64).unwrap(),
    );
    let data = random(64, 64);
    i.as_mut_slice().copy_from_slice(&data);
    o.as_mut_slice().fill(-7.0);
    let r = block_on(small.run(
        i,
        o,
        Kernel::Scale { s: 2.0 },
        gpufeed::Plan::engines(2, 2),
        gpufeed::Timeline::Off,
    ));
    assert!(
        matches!(&r, Err(e) if matches!(e.error, gpufeed::Error::InvalidArgument(_))),
        "{:?}",
        r.as_ref().err()
    );
    // Refused before anything was enqueued: both buffers come back untouched.
    let (i, o) = r
        .err()
        .and_then(|e| e.bundle)
        .expect("a refused run hands its buffers back");
    assert_eq!(i.as_slice(), &data[..]);
    assert!(o.as_slice().iter().all(|&v| v == -7.0));
    drop((i, o));
    // Everything still works, and nothing is held.
    stream.synchronize().unwrap();
    assert_eq!(pool.stats().in_use_bytes, 0);
}
