//! A trap in the middle of running pipelines: every task awaiting a run gets
//! the typed error, within a bounded time, and every pool buffer comes back.
//! Its own test binary: a trap breaks the whole CUDA context of the process.

use gpufeed::testing::{random_floats, verify};
use gpufeed::{Kernel, PinnedPool, Pipeline, Plan};
use std::sync::Arc;
use std::time::{Duration, Instant};

gpufeed::backend_tests!(a_trap_mid_pipeline_fails_every_awaiting_task_and_releases_everything);
fn a_trap_mid_pipeline_fails_every_awaiting_task_and_releases_everything(device: gpufeed::Device) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let pool = PinnedPool::new(&device);
    let pipe = Arc::new(Pipeline::new(&device, 4).unwrap());
    let t0 = Instant::now();
    let outcome = rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let (pool, pipe) = (pool.clone(), pipe.clone());
            tasks.push(tokio::spawn(async move {
                let mut ok_runs = 0u32;
                loop {
                    let n = 50_000 + t as usize * 1000;
                    let mut input = pool.alloc::<f32>(n)?;
                    random_floats(input.as_mut_slice(), t);
                    let output = pool.alloc::<f32>(n)?;
                    match pipe
                        .run(
                            input,
                            output,
                            Kernel::Intensity { k: 8 },
                            if t % 2 == 0 {
                                Plan::uniform(8, 4)
                            } else {
                                Plan::engines(8, 3)
                            },
                            gpufeed::Timeline::Off,
                        )
                        .await
                    {
                        Ok(((i, o), _)) => {
                            let (checked, bad) = verify(
                                Kernel::Intensity { k: 8 },
                                i.as_slice(),
                                o.as_slice(),
                            );
                            let first_bad = i.as_slice().iter().zip(o.as_slice()).position(|(x, y)| gpufeed::testing::expected(Kernel::Intensity { k: 8 }, *x).to_bits() != y.to_bits());
                            assert!(
                                checked == n && bad == 0,
                                "a run before the trap must be right: n={n} bad={bad} first={first_bad:?} out={:?}",
                                first_bad.map(|j| (i.as_slice()[j], o.as_slice()[j]))
                            );
                            ok_runs += 1;
                        }
                        // The run's buffers go back to the pool with the error.
                        Err(e) => return Ok::<_, gpufeed::Error>((ok_runs, e.error)),
                    }
                }
            }));
        }
        // Let the pipelines get going, then trap on one of their streams.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let trap = pipe.streams()[2].run((), |c, ()| c.trap());
        let trap_result = tokio::time::timeout(Duration::from_secs(120), trap).await;
        let mut errors = Vec::new();
        for task in tasks {
            let joined = tokio::time::timeout(Duration::from_secs(120), task).await;
            errors.push(
                joined
                    .expect("a task hung after the trap")
                    .expect("task panicked"),
            );
        }
        (trap_result, errors)
    });
    let (trap_result, errors) = outcome;
    assert!(
        matches!(&trap_result, Ok(Err(e)) if matches!(e.error, gpufeed::Error::ContextBroken(_))),
        "{trap_result:?}"
    );
    for e in &errors {
        match e {
            Ok((_, err)) | Err(err) => {
                assert!(matches!(err, gpufeed::Error::ContextBroken(_)), "{err:?}");
            }
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(300),
        "bounded in time (generous: CI also runs this under valgrind)"
    );
    // Every pool buffer comes back (released by the completion source).
    let t = Instant::now();
    while pool.stats().in_use_bytes != 0 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(pool.stats().in_use_bytes, 0, "{:?}", pool.stats());
    assert!(device.broken().is_some());
}
