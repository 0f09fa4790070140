//! Cancellation under stress: hundreds of pipeline runs and jobs dropped at
//! seeded random points (before any poll, after a poll, after completion),
//! while the rest are awaited and verified. Nothing the GPU still uses may be
//! freed or reused early (the surviving results verify), nothing leaks (the
//! pool returns to its baseline), nothing hangs.

use futures::executor::block_on;
use futures::FutureExt;
use gpufeed::testing::{serial, verify, watchdog};
use gpufeed::{DeviceBuffer, Kernel, PinnedHost, PinnedPool, Pipeline, Plan, Stream};
use std::time::{Duration, Instant};

fn random(rng: &mut fastrand::Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.f32() * 2.0 - 1.0)
        .map(|v| if v == 0.0 { 0.5 } else { v })
        .collect()
}

/// Waits (bounded) until every deferred release has run.
fn wait_for_baseline(pool: &PinnedPool) {
    let t = Instant::now();
    while pool.stats().in_use_bytes != 0 && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let s = pool.stats();
    assert_eq!(
        (s.in_use_bytes, s.blocks_in_use),
        (0, 0),
        "leaked pool memory: {s:?}"
    );
}

gpufeed::backend_tests!(dropping_pipeline_runs_and_jobs_at_random_points_loses_nothing);
fn dropping_pipeline_runs_and_jobs_at_random_points_loses_nothing(device: gpufeed::Device) {
    let _serial = serial();
    let mut rng = fastrand::Rng::with_seed(0xD0_0D);
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 3).unwrap();
    let stream = Stream::new(&device).unwrap();
    let t0 = Instant::now();
    let (mut dropped, mut verified) = (0, 0);
    // Sizes on the CPU emulation a quarter of the GPU's: the chunking (1-8
    // chunks) and the drop points are the same, valgrind's time a quarter.
    let max_n = match device.kind() {
        gpufeed::BackendKind::Cpu => 50_000,
        _ => 200_000,
    };
    for round in 0..300 {
        let n = rng.usize(1..max_n);
        let data = random(&mut rng, n);
        let mut input = pool.alloc::<f32>(n).unwrap();
        input.as_mut_slice().copy_from_slice(&data);
        let output = pool.alloc::<f32>(n).unwrap();
        let kernel = if rng.bool() {
            Kernel::Scale { s: 1.25 }
        } else {
            Kernel::Intensity { k: 3 }
        };
        let chunks = rng.usize(1..=8).min(n);
        // Both layouts; the engines layout's ring of 1..=3 buffers.
        let plan = if rng.bool() {
            Plan::uniform(chunks, rng.usize(1..=3))
        } else {
            Plan {
                ramp: rng.bool(),
                ..Plan::engines(chunks, rng.usize(1..=3))
            }
        };
        let what = rng.u8(0..4);
        if round % 2 == 0 {
            let mut run = pipe.run(input, output, kernel, plan, gpufeed::Timeline::Off);
            match what {
                0 => drop(run), // dropped before any poll
                1 => {
                    // one poll, then dropped mid-flight (or just after finishing)
                    let _ = (&mut run).now_or_never();
                    drop(run);
                }
                _ => {
                    let ((i, o), _) = block_on(run).unwrap();
                    let (checked, bad) = verify(kernel, i.as_slice(), o.as_slice());
                    assert_eq!((checked, bad), (n, 0), "round {round}");
                    verified += 1;
                    continue;
                }
            }
        } else {
            let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
            let mut job = stream.run((input, dev, output), |c, (i, d, o)| {
                let d = d.view_mut();
                c.copy_h2d(i.host(), d)?;
                c.kernel(kernel, d)?;
                c.copy_d2h(d, o.host_mut())
            });
            match what {
                0 => drop(job),
                1 => {
                    let _ = (&mut job).now_or_never();
                    drop(job);
                }
                _ => {
                    let ((i, _d, o), ()) = block_on(job).unwrap();
                    let (checked, bad) = verify(kernel, i.as_slice(), o.as_slice());
                    assert_eq!((checked, bad), (n, 0), "round {round}");
                    verified += 1;
                    continue;
                }
            }
        }
        dropped += 1;
    }
    for s in pipe.streams().iter().chain([&stream]) {
        s.synchronize().unwrap();
    }
    wait_for_baseline(&pool);
    assert!(
        dropped >= 100 && verified >= 100,
        "dropped {dropped}, verified {verified}"
    );
    // A hang would never end; a slow machine is not a hang. Under valgrind
    // (about 20x slower) CI scales the bound with HOST_TEST_TIME_SCALE.
    let scale: u64 = std::env::var("HOST_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    assert!(
        t0.elapsed() < Duration::from_secs(120 * scale.max(1)),
        "no hang"
    );
    let s = pool.stats();
    assert_eq!(s.hits + s.misses, 600);
}

gpufeed::backend_tests!(a_dropped_pipeline_run_keeps_its_device_scratch_until_the_gpu_is_done);
fn a_dropped_pipeline_run_keeps_its_device_scratch_until_the_gpu_is_done(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let gate = std::sync::Arc::new(gpufeed::MappedFlag::new(&device).unwrap());
    let _watchdog = watchdog(&gate);
    // Hold the pipeline's first stream on a GPU-side gate.
    let held = pipe.streams()[0].run(gate.clone(), |c, g| c.gate(g));
    let n = 10_000;
    let (input, output) = (pool.alloc::<f32>(n).unwrap(), pool.alloc::<f32>(n).unwrap());
    let run = pipe.run(
        input,
        output,
        Kernel::Scale { s: 2.0 },
        Plan::uniform(4, 2),
        gpufeed::Timeline::Off,
    );
    let before = device.live_device_buffers();
    assert_eq!(before, 2, "one scratch buffer per stream");
    drop(run); // cancelled while held
               // A larger run makes the pipeline replace its scratch; the cancelled run's
               // buffers must stay alive, since its copies have not even started.
    let m = 4 * n;
    let (input, output) = (pool.alloc::<f32>(m).unwrap(), pool.alloc::<f32>(m).unwrap());
    let bigger = pipe.run(
        input,
        output,
        Kernel::Scale { s: 2.0 },
        Plan::uniform(2, 2),
        gpufeed::Timeline::Off,
    );
    assert_eq!(
        device.live_device_buffers(),
        4,
        "the cancelled run's scratch was freed early"
    );
    gate.set(1);
    block_on(held).unwrap();
    block_on(bigger).unwrap();
    for s in pipe.streams() {
        s.synchronize().unwrap();
    }
    let t = Instant::now();
    while device.live_device_buffers() != 2 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        device.live_device_buffers(),
        2,
        "the cancelled run's scratch is released at completion"
    );
    drop(pipe);
    assert_eq!(device.live_device_buffers(), 0);
    wait_for_baseline(&pool);
}

gpufeed::backend_tests!(pipeline_runs_started_from_many_tasks_at_once_all_verify);
fn pipeline_runs_started_from_many_tasks_at_once_all_verify(device: gpufeed::Device) {
    let _serial = serial();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    let pool = PinnedPool::new(&device);
    let pipe = std::sync::Arc::new(Pipeline::new(&device, 4).unwrap());
    let max_n = match device.kind() {
        gpufeed::BackendKind::Cpu => 40_000,
        _ => 120_000,
    };
    rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let (pool, pipe) = (pool.clone(), pipe.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(t);
                for round in 0..20 {
                    // Different sizes make the pipeline replace its scratch too
                    // (a third as large on the CPU emulation: valgrind's time).
                    let n = rng.usize(10_000..max_n);
                    let mut input = pool.alloc::<f32>(n).unwrap();
                    input.as_mut_slice().copy_from_slice(&random(&mut rng, n));
                    let output = pool.alloc::<f32>(n).unwrap();
                    let kernel = Kernel::Intensity { k: 1 + t as u32 };
                    // Layouts alternate, so runs of both share scratch.
                    let plan = if (t + round) % 2 == 0 {
                        Plan::uniform(8, 4)
                    } else {
                        Plan::engines(8, 3)
                    };
                    let ((i, o), _) = pipe
                        .run(input, output, kernel, plan, gpufeed::Timeline::Off)
                        .await
                        .unwrap();
                    let (checked, bad) = verify(kernel, i.as_slice(), o.as_slice());
                    assert_eq!((checked, bad), (n, 0), "task {t} round {round}");
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
    });
    wait_for_baseline(&pool);
}

gpufeed::backend_tests!(
    a_cancelled_job_does_not_hold_its_streams_later_completions_behind_other_work
);
fn a_cancelled_job_does_not_hold_its_streams_later_completions_behind_other_work(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let (a, b) = (Stream::new(&device).unwrap(), Stream::new(&device).unwrap());
    let gate = std::sync::Arc::new(gpufeed::MappedFlag::new(&device).unwrap());
    let _watchdog = watchdog(&gate);
    // Everything allocated first: on CUDA, allocating (like freeing) waits
    // while a kernel runs anywhere on the device.
    let buf = DeviceBuffer::<f32>::new(&device, 1 << 20).unwrap();
    let data = random(&mut fastrand::Rng::with_seed(5), 1 << 20);
    let registered = gpufeed::Registered::new(&device, data).unwrap();
    let target = DeviceBuffer::<f32>::new(&device, 1 << 20).unwrap();
    // Stream b is held on the GPU until this thread opens the gate; give
    // its kernel time to start.
    let held = b.run(gate.clone(), |c, g| c.gate(g));
    std::thread::sleep(Duration::from_millis(20));
    // Jobs on stream a, dropped unfinished: their device buffers and the
    // registered memory are released when a's work completes, by a's
    // completion source.
    drop(a.launch(Kernel::Scale { s: 2.0 }, buf));
    drop(a.run((registered, target), |c, (r, t)| {
        c.copy_h2d(r.host(), t.view_mut())
    }));
    // A later point on stream a must be delivered while b is still held.
    // Freeing or unregistering memory on a's completion thread (the
    // driver's calls wait for the kernel on b) would block it until the
    // gate opens, which only this thread does, after this wait.
    let t = Instant::now();
    let later = block_on(a.record().unwrap().wait());
    let waited = t.elapsed();
    gate.set(1);
    block_on(held).unwrap();
    later.unwrap();
    assert!(
        waited < Duration::from_secs(5),
        "{:?}: stream a's completion waited {waited:?} for work on stream b",
        device.kind()
    );
    assert_eq!(device.live_device_buffers(), 0, "the buffer was released");
    // Memory parked by the completion thread is freed by later calls
    // (and at the end; the GPU run's leak check covers that).
    let again = DeviceBuffer::<f32>::new(&device, 1 << 20).unwrap();
    drop(again);
}

/// Runs `f` on a thread and says whether it finished within `limit`.
fn finishes_within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let t = Instant::now();
    let h = std::thread::spawn(f);
    while !h.is_finished() {
        if t.elapsed() > limit {
            return None; // the thread is left behind: the test fails on it
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    h.join().ok()
}

gpufeed::backend_tests!(
    a_cancelled_bundle_holding_the_last_handle_of_a_waiting_stream_hangs_nothing
);
fn a_cancelled_bundle_holding_the_last_handle_of_a_waiting_stream_hangs_nothing(
    device: gpufeed::Device,
) {
    let _serial = serial();
    // X waits for Y's point; Y's cancelled job holds X's last handle, so
    // X is dropped on Y's completion thread while X's own work waits on Y.
    let x = Stream::new(&device).unwrap();
    let y = Stream::new(&device).unwrap();
    let buf = DeviceBuffer::<f32>::new(&device, 1 << 16).unwrap();
    let job = y.run((buf, x.clone()), |c, (b, _x)| {
        c.kernel(Kernel::Intensity { k: 200 }, b.view_mut())
    });
    let after = y.record().unwrap();
    x.wait_event(&after).unwrap();
    drop(x);
    drop(job);
    let waited = finishes_within(Duration::from_secs(60), move || after.synchronize());
    assert!(
        matches!(waited, Some(Ok(()))),
        "Y's point never completed: {waited:?}"
    );
    let d = device.clone();
    let synced = finishes_within(Duration::from_secs(60), move || d.synchronize());
    assert!(matches!(synced, Some(Ok(()))), "synchronize: {synced:?}");

    // Two cancelled jobs whose bundles hold each other's stream.
    let x = Stream::new(&device).unwrap();
    let y = Stream::new(&device).unwrap();
    let a = DeviceBuffer::<f32>::new(&device, 1 << 16).unwrap();
    let b = DeviceBuffer::<f32>::new(&device, 1 << 16).unwrap();
    let jx = x.run((a, y.clone()), |c, (a, _)| {
        c.kernel(Kernel::Intensity { k: 100 }, a.view_mut())
    });
    let jy = y.run((b, x.clone()), |c, (b, _)| {
        c.kernel(Kernel::Intensity { k: 100 }, b.view_mut())
    });
    let (ex, ey) = (x.record().unwrap(), y.record().unwrap());
    drop((x, y));
    drop((jx, jy));
    let waited = finishes_within(Duration::from_secs(60), move || {
        (ex.synchronize(), ey.synchronize())
    });
    assert!(
        matches!(waited, Some((Ok(()), Ok(())))),
        "the two streams' points never completed: {waited:?}"
    );
    let d = device.clone();
    assert!(matches!(
        finishes_within(Duration::from_secs(60), move || d.synchronize()),
        Some(Ok(()))
    ));
}

gpufeed::backend_tests!(synchronize_waits_for_a_stream_dropped_on_its_own_completion_thread);
fn synchronize_waits_for_a_stream_dropped_on_its_own_completion_thread(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let x = Stream::new(&device).unwrap();
    let small = DeviceBuffer::<f32>::new(&device, 64).unwrap();
    // The first job's bundle holds X's last handle once the user drops X:
    // X is dropped on its own completion thread, with the second job queued.
    let job1 = x.run((small, x.clone()), |c, (b, _)| {
        c.kernel(Kernel::Scale { s: 1.0 }, b.view_mut())
    });
    let n = 1 << 16;
    let big = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let out = pool.alloc::<f32>(n).unwrap();
    let job2 = x.run((big, out), |c, (b, o)| {
        let b = b.view_mut();
        c.kernel(Kernel::Intensity { k: 2000 }, b)?;
        c.copy_d2h(b, o.host_mut())
    });
    drop(job1);
    drop(job2);
    drop(x);
    device.synchronize().unwrap();
    // Everything queued has run and the cancelled jobs' buffers are back.
    assert_eq!(pool.stats().in_use_bytes, 0, "synchronize returned early");
}
