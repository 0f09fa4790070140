//! Regression tests for the soundness holes found by trying the API as a new
//! user would (issue "Sound by construction"), on every backend. The holes
//! the types now close are `compile_fail` tests in `src/guarantees.rs`; these
//! are the ones closed at run time:
//! - a panic inside a batch no longer frees or recycles its buffers while the
//!   commands it enqueued are queued (`run` and `run_sync`), nor does a
//!   panic in a pipeline stage (`run_stage`);
//! - a pipeline stage that starts a run of its own pipeline gets an error,
//!   not a deadlock;
//! - a kernel declaration whose parameters differ in size from the PTX
//!   entry of its name is refused when its function is taken (CUDA);
//! - buffers of a zero-sized element type read as slices of that length;
//!   element types aligned beyond device memory's 256 bytes are refused;
//! - a cancelled job's bundle whose `Drop` panics (on the completion
//!   thread) does not stop later jobs of the stream from completing;
//! - a pipeline's timeline points measure on CUDA as on the CPU;
//! - `Device::synchronize` waits for queued work and for the releases of
//!   cancelled jobs, on the CPU emulation too;
//! - partially overlapping operands are refused, the same range is computed
//!   right;
//! - timing errors are the same on both backends;
//! - an error hands the buffers back.
//!
//! GPU-side gates hold a stream without timers. On CUDA every allocation
//! waits while a kernel runs (driver 580), so each test allocates what it
//! needs before closing its gate.

use futures::executor::block_on;
use gpufeed::testing::{random_floats, serial, watchdog};
use gpufeed::{
    DeviceBuffer, Error, Event, Kernel, MappedFlag, PinnedBuffer, PinnedHost, PinnedPool, Pipeline,
    Plan, Stream,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    random_floats(&mut v, seed);
    v
}

/// Holds `stream` on a closed gate; returns the gate (open it with `set(1)`).
fn hold(stream: &Stream, device: &gpufeed::Device) -> Arc<MappedFlag> {
    let gate = Arc::new(MappedFlag::new(device).unwrap());
    let held = stream.run(gate.clone(), |c, g| c.gate(g));
    drop(held);
    gate
}

/// Queues a D2H into the bundle's pool buffer, then panics.
fn panicking_batch<'a>(
    c: &mut gpufeed::Commands<'a>,
    (d, o): &'a mut (DeviceBuffer<f32>, gpufeed::PooledBuffer<f32>),
) -> gpufeed::Result<()> {
    c.copy_d2h(d.view(), o.host_mut())?;
    panic!("a bug in the user's batch, after a command was queued")
}

gpufeed::backend_tests!(a_panic_inside_a_batch_keeps_its_buffers_until_the_queued_commands_finish);
fn a_panic_inside_a_batch_keeps_its_buffers_until_the_queued_commands_finish(
    device: gpufeed::Device,
) {
    let _serial = serial();
    for sync in [false, true] {
        let n = 4096;
        let pool = PinnedPool::new(&device);
        let stream = Stream::new(&device).unwrap();
        // Everything allocated before the gate closes (see the module docs):
        // the device data the queued D2H will write, the destination, and a
        // cached block of the same class for the allocation after the panic.
        let device_data = random(n, 11);
        let mut dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
        dev.copy_from_host_sync(&device_data).unwrap();
        let out = pool.alloc::<f32>(n).unwrap();
        drop(pool.alloc::<f32>(n).unwrap());
        let gate = hold(&stream, &device);
        let _watchdog = watchdog(&gate);
        let bundle = (dev, out);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if sync {
                // run_sync would wait after the closure; the panic comes first.
                let _ = stream.run_sync(bundle, panicking_batch);
            } else {
                drop(stream.run(bundle, panicking_batch));
            }
        }));
        assert!(panicked.is_err(), "the panic reaches the caller");
        // The program goes on and takes a buffer of the same size: it must
        // not be the one the queued D2H still writes into.
        let mine_data = random(n, 12);
        let mut mine = pool.alloc::<f32>(n).unwrap();
        mine.as_mut_slice().copy_from_slice(&mine_data);
        assert_eq!(
            pool.stats().blocks_in_use,
            2,
            "sync={sync}: the panicked batch's destination is still lent out"
        );
        gate.set(1);
        device.synchronize().unwrap();
        assert_eq!(
            mine.as_slice(),
            &mine_data[..],
            "{}, sync={sync}: the queued D2H overwrote a buffer allocated after the panic",
            device.kind()
        );
        drop(mine);
        assert_eq!(
            pool.stats().blocks_in_use,
            0,
            "sync={sync}: released once done"
        );
    }
}

gpufeed::backend_tests!(
    a_panic_in_a_pipeline_stage_keeps_the_runs_arrays_until_the_queued_work_finishes
);
fn a_panic_in_a_pipeline_stage_keeps_the_runs_arrays_until_the_queued_work_finishes(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let n = 1 << 16;
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let data = random(n, 21);
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(n).unwrap();
    drop(pool.alloc::<f32>(n).unwrap()); // a cached block of the class, for later
                                         // Chunk 0's stage holds its stream on a gate; chunk 1's stage panics.
    let gate: &'static MappedFlag = Box::leak(Box::new(MappedFlag::new(&device).unwrap()));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        drop(pipe.run_stage(
            (input,),
            (output,),
            Plan::uniform(2, 2),
            gpufeed::Timeline::Off,
            |c, chunk| {
                if chunk.index() == 1 {
                    panic!("a bug in the user's stage");
                }
                c.gate(gate)?;
                c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
            },
        ))
    }));
    assert!(panicked.is_err(), "the panic reaches the caller");
    // The run's two arrays stay lent out while chunk 0's work is queued, so
    // a new allocation of the class gets the cached block, not the output
    // chunk 0's D2H will write.
    let mine_data = random(n, 22);
    let mut mine = pool.alloc::<f32>(n).unwrap();
    mine.as_mut_slice().copy_from_slice(&mine_data);
    assert_eq!(
        pool.stats().blocks_in_use,
        3,
        "{}: a panicked stage's arrays went back to the pool under queued work",
        device.kind()
    );
    gate.set(1);
    device.synchronize().unwrap();
    assert_eq!(mine.as_slice(), &mine_data[..]);
    drop(mine);
    assert_eq!(pool.stats().blocks_in_use, 0, "released once done");
    // SAFETY: the gate was leaked above for the stage's `'static` borrow; the
    // stage is gone and every command that read the gate has finished
    // (synchronized), so nothing refers to it any more.
    drop(unsafe { Box::from_raw(std::ptr::from_ref(gate).cast_mut()) });
    // The pipeline still works afterwards (fresh scratch), results right.
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(n).unwrap();
    let k = Kernel::Scale { s: 3.0 };
    let ((input, output), _) = block_on(pipe.run(
        input,
        output,
        k,
        Plan::uniform(4, 2),
        gpufeed::Timeline::Off,
    ))
    .unwrap();
    let (checked, bad) = gpufeed::testing::verify(k, input.as_slice(), output.as_slice());
    assert!(checked > 0 && bad == 0);
}

gpufeed::backend_tests!(a_stage_that_starts_a_run_of_its_own_pipeline_gets_an_error_not_a_deadlock);
fn a_stage_that_starts_a_run_of_its_own_pipeline_gets_an_error_not_a_deadlock(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let n = 4096;
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let data = random(n, 31);
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(n).unwrap();
    let inner_errors = std::sync::Mutex::new(Vec::new());
    let job = pipe.run_stage(
        (input,),
        (output,),
        Plan::uniform(2, 2),
        gpufeed::Timeline::Off,
        |c, chunk| {
            let (a, b) = (
                PinnedBuffer::<f32>::from_slice(c.device(), &[1.0, 2.0]).unwrap(),
                PinnedBuffer::<f32>::new(c.device(), 2).unwrap(),
            );
            let inner = pipe.run(
                a,
                b,
                Kernel::Scale { s: 2.0 },
                Plan::uniform(1, 1),
                gpufeed::Timeline::Off,
            );
            let err = block_on(inner).expect_err("a run of the pipeline from its own stage");
            assert!(err.bundle.is_some(), "the inner run's arrays come back");
            inner_errors.lock().unwrap().push(err.error);
            c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
        },
    );
    let (((input,), (output,)), _) = block_on(job).expect("the outer run goes on");
    assert_eq!(input.as_slice(), &data[..]);
    assert_eq!(output.as_slice(), &data[..]);
    let errs = inner_errors.into_inner().unwrap();
    assert_eq!(errs.len(), 2);
    assert!(
        errs.iter().all(|e| matches!(e, Error::InvalidArgument(_))),
        "{errs:?}"
    );
}

gpufeed::backend_tests!(a_bundle_whose_drop_panics_on_the_completion_thread_stops_nothing);
fn a_bundle_whose_drop_panics_on_the_completion_thread_stops_nothing(device: gpufeed::Device) {
    let _serial = serial();
    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("a user's Drop panics");
        }
    }
    let n = 1 << 16;
    let pool = PinnedPool::new(&device);
    let stream = Stream::new(&device).unwrap();
    let data = random(n, 41);
    let mut h = pool.alloc::<f32>(n).unwrap();
    h.as_mut_slice().copy_from_slice(&data);
    let d = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let (d2, out) = (
        DeviceBuffer::<f32>::new(&device, n).unwrap(),
        pool.alloc::<f32>(n).unwrap(),
    );
    let gate = hold(&stream, &device);
    let _watchdog = watchdog(&gate);
    // Cancelled: its bundle (the Bomb) is dropped on the completion thread.
    drop(stream.run((Bomb, h, d), |c, (_, h, d)| {
        c.copy_h2d(h.host(), d.view_mut())
    }));
    // Cancelled after it: its bundle waits in the completion source's queue.
    drop(stream.copy_d2h(d2, out));
    gate.set(1);
    // Later jobs on the same stream still complete, with the right bytes.
    let mut h = pool.alloc::<f32>(n).unwrap();
    h.as_mut_slice().copy_from_slice(&data);
    let back = pool.alloc::<f32>(n).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let ((_h, dev), ()) =
        block_on(stream.copy_h2d(h, dev)).expect("a job after the panicking release completes");
    let ((_dev, back), ()) = block_on(stream.copy_d2h(dev, back)).expect("and the next one");
    assert_eq!(back.as_slice(), &data[..]);
    device.synchronize().unwrap();
}

mod mismatched {
    // Named like gpu-kernels' `scale(SliceMut<f32>, f32)`, with other parameters.
    gpufeed::kernel_abi::kernels! {
        /// Two parameters where the entry has two of other sizes.
        pub unsafe fn scale(x: gpufeed::kernel_abi::SliceMut<u8>, s: u8) {}
        /// No parameters where the entry has three.
        pub unsafe fn saxpy() {}
    }
}

gpufeed::backend_tests!(a_declaration_that_does_not_match_the_ptx_entry_of_its_name_is_refused);
fn a_declaration_that_does_not_match_the_ptx_entry_of_its_name_is_refused(device: gpufeed::Device) {
    // SAFETY: the contract is broken on purpose, but no function of the
    // module is launched: on CUDA the sizes are checked when the function is
    // taken, which is what this test is about.
    let m = unsafe { gpufeed::Module::from_ptx(&device, gpufeed::ptx::PTX) }.unwrap();
    let right = m.function::<gpu_kernels::scale>();
    let wrong = m.function::<mismatched::scale>().map(|_| ());
    let none = m.function::<mismatched::saxpy>().map(|_| ());
    assert!(right.is_ok(), "{:?}", right.err());
    if device.kind() == gpufeed::BackendKind::Cuda {
        assert!(matches!(wrong, Err(Error::InvalidArgument(_))), "{wrong:?}");
        assert!(matches!(none, Err(Error::InvalidArgument(_))), "{none:?}");
    } else {
        // The CPU emulation loads no PTX: it runs each declaration's own body.
        assert!(wrong.is_ok() && none.is_ok());
    }
}

gpufeed::backend_tests!(zero_sized_elements_read_as_slices_and_over_aligned_ones_are_refused);
fn zero_sized_elements_read_as_slices_and_over_aligned_ones_are_refused(device: gpufeed::Device) {
    let mut b = PinnedBuffer::<()>::new(&device, 3).unwrap();
    assert_eq!(b.as_slice().len(), 3);
    assert_eq!(b.as_mut_slice().len(), 3);
    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    #[repr(C, align(512))]
    struct Block([u8; 512]);
    let r = DeviceBuffer::<Block>::new(&device, 4);
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{:?}", r.err());
    assert!(DeviceBuffer::<[u8; 512]>::new(&device, 4).is_ok());
}

gpufeed::backend_tests!(timeline_points_of_a_pipeline_run_measure_on_every_backend);
fn timeline_points_of_a_pipeline_run_measure_on_every_backend(device: gpufeed::Device) {
    let _serial = serial();
    let n = 200_000;
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 4).unwrap();
    for plan in [Plan::uniform(4, 2), Plan::engines(5, 2)] {
        let mut input = pool.alloc::<f32>(n).unwrap();
        random_floats(input.as_mut_slice(), 3);
        let output = pool.alloc::<f32>(n).unwrap();
        let ((_, _), info) = block_on(pipe.run(
            input,
            output,
            Kernel::Scale { s: 2.0 },
            plan,
            gpufeed::Timeline::Record,
        ))
        .unwrap();
        let timeline = info.timeline.expect("asked for a timeline");
        assert_eq!(timeline.len(), plan.ranges(n).len());
        for chunk in &timeline {
            let [t0, t1, t2, t3] = &chunk.events;
            for (a, b) in [(t0, t1), (t1, t2), (t2, t3), (t0, t3)] {
                let ms = a.elapsed_ms(b).unwrap_or_else(|e| {
                    panic!("{} {plan}: chunk {}: {e}", device.kind(), chunk.chunk)
                });
                assert!(ms >= 0.0 && ms.is_finite(), "{ms}");
            }
        }
    }
}

gpufeed::backend_tests!(device_synchronize_waits_for_queued_work_and_for_cancelled_jobs_releases);
fn device_synchronize_waits_for_queued_work_and_for_cancelled_jobs_releases(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let n = 10_000;
    let pool = PinnedPool::new(&device);
    let stream = Stream::new(&device).unwrap();
    let mut input = pool.alloc::<f32>(n).unwrap();
    random_floats(input.as_mut_slice(), 5);
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let gate = hold(&stream, &device);
    let _watchdog = watchdog(&gate);
    // Queued behind the gate, then cancelled: its pool buffer comes back
    // only once the GPU is done with it.
    let job = stream.run((input, dev), |c, (i, d)| c.copy_h2d(i.host(), d.view_mut()));
    drop(job);
    assert_eq!(pool.stats().blocks_in_use, 1);
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            gate.set(1);
        })
    };
    let t = Instant::now();
    device.synchronize().unwrap();
    let waited = t.elapsed();
    opener.join().unwrap();
    assert!(
        waited >= Duration::from_millis(250),
        "{}: synchronize returned after {waited:?}, before the gated work ran",
        device.kind()
    );
    assert_eq!(
        pool.stats().blocks_in_use,
        0,
        "{}: the cancelled job's buffer is back when synchronize returns",
        device.kind()
    );
}

gpufeed::backend_tests!(
    partially_overlapping_operands_are_refused_and_the_same_range_is_computed_in_place
);
fn partially_overlapping_operands_are_refused_and_the_same_range_is_computed_in_place(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let n = 1000;
    let stream = Stream::new(&device).unwrap();
    let data = random(n, 7);
    let host_in = PinnedBuffer::from_slice(&device, &data).unwrap();
    let out = PinnedBuffer::<f32>::new(&device, n).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    // saxpy with x = y[0..500], y = y[250..750]: refused, bundle back.
    let err = block_on(stream.run((host_in, dev, out), |c, (i, d, _)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.saxpy(2.0, d.range(0..500)?, d.range(250..750)?)
    }))
    .unwrap_err();
    assert!(matches!(err.error, Error::Overlap { .. }), "{err}");
    let (host_in, dev, out) = err.bundle.expect("the buffers come back");
    assert_eq!(host_in.as_slice(), &data[..], "input untouched");
    // copy_d2d between overlapping ranges: refused.
    let err = block_on(stream.run((host_in, dev, out), |c, (_, d, _)| {
        let d = d.view_mut();
        c.copy_d2d(d.range(0..600)?, d.range(400..1000)?)
    }))
    .unwrap_err();
    assert!(matches!(err.error, Error::Overlap { .. }), "{err}");
    let (host_in, dev, out) = err.bundle.expect("the buffers come back");
    // The same range as x and y: y = a*y + y, elementwise, bit-exact.
    let ((_, _, out), ()) = block_on(stream.run((host_in, dev, out), |c, (i, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.saxpy(0.75, d, d)?;
        c.copy_d2h(d, o.host_mut())
    }))
    .unwrap();
    for (k, (&got, &x)) in out.as_slice().iter().zip(&data).enumerate() {
        let want = 0.75f32.mul_add(x, x); // SAXPY: one fused multiply-add
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{}: element {k}",
            device.kind()
        );
    }
}

gpufeed::backend_tests!(timing_errors_are_the_same_on_every_backend);
fn timing_errors_are_the_same_on_every_backend(device: gpufeed::Device) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let (a, b) = (stream.record().unwrap(), stream.record().unwrap());
    block_on(b.wait()).unwrap();
    assert!(
        matches!(a.elapsed_ms(&b), Err(Error::NotTimed)),
        "{}",
        device.kind()
    );
    let timed = stream.record_timed().unwrap();
    assert!(matches!(a.elapsed_ms(&timed), Err(Error::NotTimed)));
    let later = stream.record_timed().unwrap();
    block_on(later.wait()).unwrap();
    assert!(timed.elapsed_ms(&later).unwrap() >= 0.0);
    // Timed, but the stream has not reached the second one yet.
    let gate = hold(&stream, &device);
    let _watchdog = watchdog(&gate);
    let pending = stream.record_timed().unwrap();
    assert!(
        matches!(timed.elapsed_ms(&pending), Err(Error::NotReady)),
        "{}",
        device.kind()
    );
    gate.set(1);
    block_on(pending.wait()).unwrap();
    assert!(timed.elapsed_ms(&pending).unwrap() >= 0.0);
}

gpufeed::backend_tests!(a_validation_error_hands_the_buffers_back_intact);
fn a_validation_error_hands_the_buffers_back_intact(device: gpufeed::Device) {
    let _serial = serial();
    let n = 5000;
    let data = random(n, 9);
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let stream = Stream::new(&device).unwrap();
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let output = pool.alloc::<f32>(n).unwrap();
    // Bad plans: no chunks; more streams than the pipeline has.
    let mut bundle = (input, output);
    for plan in [
        Plan::uniform(0, 1),
        Plan::uniform(2, 3),
        Plan::engines(4, 2),
    ] {
        let err = block_on(pipe.run(
            bundle.0,
            bundle.1,
            Kernel::Scale { s: 2.0 },
            plan,
            gpufeed::Timeline::Off,
        ))
        .unwrap_err();
        assert!(
            matches!(err.error, Error::InvalidArgument(_)),
            "{plan}: {err}"
        );
        bundle = err.bundle.expect("the buffers come back");
        assert_eq!(bundle.0.as_slice(), &data[..], "{plan}: input intact");
    }
    // Unequal lengths.
    let short = pool.alloc::<f32>(n - 1).unwrap();
    let err = block_on(pipe.run(
        bundle.0,
        short,
        Kernel::Scale { s: 2.0 },
        Plan::auto(n),
        gpufeed::Timeline::Off,
    ))
    .unwrap_err();
    assert!(matches!(err.error, Error::LengthMismatch { .. }), "{err}");
    let (input, _short) = err.bundle.expect("the buffers come back");
    assert_eq!(input.as_slice(), &data[..]);
    // A batch whose command fails, sync and async.
    let dev = DeviceBuffer::<f32>::new(&device, n + 1).unwrap();
    let err = stream
        .run_sync((input, dev), |c, (i, d)| c.copy_h2d(i.host(), d.view_mut()))
        .unwrap_err();
    assert!(matches!(err.error, Error::LengthMismatch { .. }), "{err}");
    let (input, dev) = err.bundle.expect("the buffers come back");
    let err = block_on(stream.run((input, dev), |c, (i, d)| {
        c.copy_h2d(i.host(), d.view_mut().range(0..n + 2)?)
    }))
    .unwrap_err();
    assert!(matches!(err.error, Error::OutOfBounds { .. }), "{err}");
    let (input, _dev) = err.bundle.expect("the buffers come back");
    assert_eq!(input.as_slice(), &data[..]);
    // And the error converts for `?` in functions returning gpufeed::Result.
    let as_error: Error = gpufeed::JobError::<()> {
        error: Error::NotReady,
        bundle: None,
    }
    .into();
    assert!(matches!(as_error, Error::NotReady));
}

/// A bundle whose `Drop` blocks on the device: dropped by a cancelled job's
/// completion source, on its own thread.
struct BlocksOnDrop {
    device: gpufeed::Device,
    seen: Arc<std::sync::Mutex<Option<gpufeed::Result<()>>>>,
    _dev: DeviceBuffer<f32>,
}

impl Drop for BlocksOnDrop {
    fn drop(&mut self) {
        let r = self.device.synchronize();
        *self.seen.lock().unwrap() = Some(r);
    }
}

/// A bundle whose `Drop` awaits a job on a stream of the device (on the
/// completion thread that drops it).
struct AwaitsOnDrop {
    stream: Stream,
    seen: Arc<std::sync::Mutex<Option<gpufeed::Result<()>>>>,
    _dev: DeviceBuffer<f32>,
}

impl Drop for AwaitsOnDrop {
    fn drop(&mut self) {
        let job = gpufeed::block_on(self.stream.run((), |_, _| Ok(())))
            .map(drop)
            .map_err(gpufeed::Error::from);
        let event = self
            .stream
            .record()
            .and_then(|ev| gpufeed::block_on(ev.wait()));
        // Both refused; the job's error is the one kept.
        assert!(matches!(event, Err(Error::Internal(_))), "{event:?}");
        *self.seen.lock().unwrap() = Some(job);
    }
}

/// Runs a kernel job over `bundle`'s buffer while `stream` is held by a
/// GPU-side gate, drops the job (so the completion source drops the bundle,
/// on its own thread), opens the gate, synchronizes, and returns what the
/// bundle's `Drop` recorded in `seen`.
fn dropped_on_the_completion_thread<B: Send + 'static>(
    device: &gpufeed::Device,
    stream: &Stream,
    bundle: B,
    seen: &Seen,
    dev: fn(&mut B) -> &mut DeviceBuffer<f32>,
) -> Option<gpufeed::Result<()>> {
    let gate = hold(stream, device);
    let _watchdog = watchdog(&gate);
    drop(stream.run(bundle, move |c, b| {
        c.kernel(Kernel::Scale { s: 2.0 }, dev(b).view_mut())
    }));
    gate.set(1);
    device.synchronize().unwrap();
    let r = seen.lock().unwrap().take();
    r
}

/// What a bundle's `Drop` saw.
type Seen = Arc<std::sync::Mutex<Option<gpufeed::Result<()>>>>;

gpufeed::backend_tests!(
    a_bundle_that_awaits_a_job_in_its_drop_on_a_completion_thread_gets_an_error_not_a_hang
);
fn a_bundle_that_awaits_a_job_in_its_drop_on_a_completion_thread_gets_an_error_not_a_hang(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let seen = Seen::default();
    let bundle = AwaitsOnDrop {
        stream: stream.clone(),
        seen: seen.clone(),
        _dev: DeviceBuffer::<f32>::new(&device, 1024).unwrap(),
    };
    let seen = dropped_on_the_completion_thread(&device, &stream, bundle, &seen, |b| &mut b._dev);
    assert!(
        matches!(seen, Some(Err(Error::Internal(_)))),
        "{}: {seen:?}",
        device.kind()
    );
    // The stream goes on: a job awaited from here completes.
    block_on(stream.run((), |_, _| Ok(()))).unwrap();
}

gpufeed::backend_tests!(
    a_bundle_that_blocks_in_its_drop_on_a_completion_thread_gets_an_error_not_a_hang
);
fn a_bundle_that_blocks_in_its_drop_on_a_completion_thread_gets_an_error_not_a_hang(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let seen = Seen::default();
    let bundle = BlocksOnDrop {
        device: device.clone(),
        seen: seen.clone(),
        _dev: DeviceBuffer::<f32>::new(&device, 1024).unwrap(),
    };
    let seen = dropped_on_the_completion_thread(&device, &stream, bundle, &seen, |b| &mut b._dev);
    assert!(
        matches!(seen, Some(Err(Error::Internal(_)))),
        "{}: {seen:?}",
        device.kind()
    );
}

gpufeed::backend_tests!(dropping_a_stream_waits_for_its_queued_work_so_synchronize_misses_nothing);
fn dropping_a_stream_waits_for_its_queued_work_so_synchronize_misses_nothing(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let n = 4096;
    let pool = PinnedPool::new(&device);
    let stream = Stream::new(&device).unwrap();
    let mut input = pool.alloc::<f32>(n).unwrap();
    random_floats(input.as_mut_slice(), 21);
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let gate = hold(&stream, &device);
    let _watchdog = watchdog(&gate);
    let job = stream.run((input, dev), |c, (i, d)| c.copy_h2d(i.host(), d.view_mut()));
    let marker = stream.record().unwrap();
    drop(job);
    let opener = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            gate.set(1);
        })
    };
    drop(stream);
    opener.join().unwrap();
    assert!(
        marker.is_done(),
        "{}: the dropped stream's queued work ran before the drop returned",
        device.kind()
    );
    device.synchronize().unwrap();
    assert_eq!(pool.stats().blocks_in_use, 0, "{}", device.kind());
    // A batch that queued no copy or kernel: run_sync still waits for it.
    let stream = Stream::new(&device).unwrap();
    let (ev, ()) = stream
        .run_sync(Vec::<Event>::new(), |c, evs| {
            evs.push(c.record()?);
            Ok(())
        })
        .unwrap();
    assert!(ev.iter().all(Event::is_done), "{}", device.kind());
}

#[test]
fn plans_over_usize_max_zero_sized_elements_do_not_overflow() {
    for plan in [
        Plan::uniform(1, 1),
        Plan::uniform(4, 1),
        Plan::engines(3, 2),
    ] {
        let ranges = plan.ranges(usize::MAX);
        assert_eq!(ranges.first().map(|r| r.start), Some(0), "{plan}");
        assert_eq!(ranges.last().map(|r| r.end), Some(usize::MAX), "{plan}");
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start), "{plan}");
        let last = plan.chunk(1000, usize::MAX);
        assert!(
            last.is_empty(),
            "{plan}: chunk 1000 of {} is {last:?}",
            plan.chunks
        );
    }
    // A pipeline run over them: no panic in the library, the buffers back.
    let device = gpufeed::Device::cpu();
    let pipe = Pipeline::new(&device, 3).unwrap();
    let input = PinnedBuffer::<()>::new(&device, usize::MAX).unwrap();
    let output = PinnedBuffer::<()>::new(&device, usize::MAX).unwrap();
    let run = pipe.run_stage(
        (input,),
        (output,),
        Plan::uniform(2, 2),
        gpufeed::Timeline::Off,
        |_c, _chunk| Ok(()),
    );
    let ((input, output), _) = block_on(run).expect("zero bytes move");
    assert_eq!((input.0.len(), output.0.len()), (usize::MAX, usize::MAX));
}

gpufeed::backend_tests!(
    a_synchronous_wait_inside_a_futures_executor_waits_and_hands_the_buffers_back
);
fn a_synchronous_wait_inside_a_futures_executor_waits_and_hands_the_buffers_back(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let stream = Stream::new(&device).unwrap();
    let pool = PinnedPool::new(&device);
    let n = 1 << 14;
    let data = random(n, 7);
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let out = pool.alloc::<f32>(n).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    // `run_sync` and `Device::synchronize` block; inside another executor
    // they used to panic (futures' block_on refuses to nest), dropping the
    // bundle under its queued work.
    let (r, synced) = block_on(async {
        let r = stream.run_sync((input, dev, out), |c, (i, d, o)| {
            let d = d.view_mut();
            c.copy_h2d(i.host(), d)?;
            c.kernel(Kernel::Intensity { k: 50 }, d)?;
            c.record()?; // the path through the completion source
            c.copy_d2h(d, o.host_mut())
        });
        (r, device.synchronize())
    });
    synced.unwrap();
    let ((_input, _dev, out), ()) = r.unwrap();
    let k = Kernel::Intensity { k: 50 };
    for (got, x) in out.as_slice().iter().zip(&data) {
        assert_eq!(got.to_bits(), gpufeed::testing::expected(k, *x).to_bits());
    }
}

gpufeed::backend_tests!(a_launch_past_the_gpus_limits_is_refused_on_every_backend);
fn a_launch_past_the_gpus_limits_is_refused_on_every_backend(device: gpufeed::Device) {
    use gpufeed::LaunchConfig;
    let stream = Stream::new(&device).unwrap();
    // SAFETY: gpufeed::ptx::PTX is gpu-kernels' PTX, the crate declaring `scale`.
    let m = unsafe { gpufeed::Module::from_ptx(&device, gpufeed::ptx::PTX) }.unwrap();
    let scale = m.function::<gpu_kernels::scale>().unwrap();
    let mut dev = DeviceBuffer::<f32>::new(&device, 256).unwrap();
    let limits = device.info().limits;
    for (cfg, what) in [
        (
            LaunchConfig::linear(LaunchConfig::MAX_GRID + 1, 1),
            "grid x",
        ),
        (LaunchConfig::linear(u32::MAX, 256), "grid x"),
        (LaunchConfig::linear(0, 256), "grid x"),
        (LaunchConfig::new((1, 0, 1), 256), "grid y"),
        (LaunchConfig::new((1, 65536, 1), 256), "grid y"),
        (LaunchConfig::linear(1, 0), "block x"),
        (
            LaunchConfig::linear(1, LaunchConfig::MAX_BLOCK + 1),
            "block x",
        ),
        (LaunchConfig::new(1, (1, 1, 65)), "block z"),
        (LaunchConfig::new(1, (32, 32, 2)), "threads in a block"),
        (
            LaunchConfig::linear(1, 256).with_shared_bytes(limits.max_shared_bytes_per_block + 1),
            "shared memory",
        ),
    ] {
        let r = block_on(stream.run(dev, |c, d| c.launch(&scale, cfg, (d.view_mut(), 2.0f32))));
        let e = r.expect_err("refused");
        match &e.error {
            Error::InvalidLaunch { kernel, reason } => {
                assert_eq!(*kernel, "scale");
                assert!(reason.contains(what), "{cfg:?}: {reason}");
            }
            other => panic!("{cfg:?}: {other:?}"),
        }
        // Nothing was enqueued: the buffer comes back.
        dev = e.bundle.expect("handed back");
    }
    // The limits themselves run: a full block, a 3-D block, the most shared memory.
    for ok in [
        LaunchConfig::linear(1, LaunchConfig::MAX_BLOCK),
        LaunchConfig::new((2, 3, 1), (8, 8, 4)),
        LaunchConfig::linear(1, 32).with_shared_bytes(limits.max_shared_bytes_per_block),
    ] {
        dev = block_on(stream.run(dev, |c, d| c.launch(&scale, ok, (d.view_mut(), 2.0f32))))
            .unwrap()
            .0;
    }
}

gpufeed::backend_tests!(a_job_polled_by_an_executor_that_polls_in_wake_completes_with_its_buffers);
fn a_job_polled_by_an_executor_that_polls_in_wake_completes_with_its_buffers(
    device: gpufeed::Device,
) {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::Mutex;
    use std::task::{Context, Wake, Waker};
    // An executor whose `wake` polls the task at once, on the waking
    // thread (the Waker contract allows it): the second job is polled on
    // the first job's completion thread while it is still pending.
    type Boxed = Pin<Box<dyn Future<Output = ()> + Send>>;
    struct Task(Mutex<Option<Boxed>>);
    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            poll_task(&self)
        }
    }
    fn poll_task(t: &Arc<Task>) {
        let mut slot = t.0.lock().unwrap();
        if let Some(mut f) = slot.take() {
            let waker = Waker::from(t.clone());
            if f.as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending()
            {
                *slot = Some(f);
            }
        }
    }
    let _serial = serial();
    let (s1, s2) = (Stream::new(&device).unwrap(), Stream::new(&device).unwrap());
    let n = 1 << 18;
    let data = random(n, 11);
    let h1 = PinnedBuffer::from_slice(&device, &data).unwrap();
    let h2 = PinnedBuffer::from_slice(&device, &data).unwrap();
    let out = PinnedBuffer::<f32>::new(&device, n).unwrap();
    let d1 = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let d2 = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let job1 = s1.run((h1, d1), |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()));
    let job2 = s2.run((h2, d2, out), |c, (h, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(h.host(), d)?;
        c.kernel(Kernel::Intensity { k: 300 }, d)?;
        c.copy_d2h(d, o.host_mut())
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let task = Arc::new(Task(Mutex::new(Some(Box::pin(async move {
        let first = job1.await.map(drop).map_err(gpufeed::Error::from);
        let second = job2.await;
        let _ = tx.send((first, second.map(|((_, _, o), ())| o).map_err(|e| e.error)));
    })))));
    poll_task(&task);
    let (first, second) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the task finished");
    first.unwrap();
    let out = second.expect("the second job hands its buffers back");
    let k = Kernel::Intensity { k: 300 };
    for (got, x) in out.as_slice().iter().zip(&data) {
        assert_eq!(got.to_bits(), gpufeed::testing::expected(k, *x).to_bits());
    }
    device.synchronize().unwrap();
}

#[test]
fn the_automatic_plan_fits_a_pipeline_of_any_stream_count() {
    let device = gpufeed::Device::cpu();
    let n = 1 << 20;
    let data = random(n, 5);
    for streams in 1..=4 {
        let pipe = Pipeline::new(&device, streams).unwrap();
        let plan = Plan::auto_for(n, streams);
        assert!(
            plan.streams_used() <= streams,
            "{plan} on {streams} streams"
        );
        let input = PinnedBuffer::from_slice(&device, &data).unwrap();
        let output = PinnedBuffer::<f32>::new(&device, n).unwrap();
        let ((_, output), _) = block_on(pipe.run(
            input,
            output,
            Kernel::Scale { s: 2.0 },
            plan,
            gpufeed::Timeline::Off,
        ))
        .unwrap();
        assert!(output
            .as_slice()
            .iter()
            .zip(&data)
            .all(|(o, x)| *o == 2.0 * x));
    }
}

#[test]
fn the_automatic_plan_on_too_few_streams_is_an_error_that_says_how_to_fit_it() {
    let device = gpufeed::Device::cpu();
    let n = 1 << 20;
    let data = random(n, 6);
    let pipe = Pipeline::new(&device, 2).unwrap();
    let input = PinnedBuffer::from_slice(&device, &data).unwrap();
    let output = PinnedBuffer::<f32>::new(&device, n).unwrap();
    let e = block_on(pipe.run(
        input,
        output,
        Kernel::Scale { s: 2.0 },
        Plan::auto(n),
        gpufeed::Timeline::Off,
    ))
    .unwrap_err();
    assert!(
        e.error.to_string().contains("Plan::auto_for(n, 2)"),
        "{}",
        e.error
    );
    // The buffers come back whole.
    let (input, _output) = e
        .bundle
        .expect("a plan refused before any work hands the buffers back");
    assert_eq!(input.as_slice(), &data[..]);
}

gpufeed::backend_tests!(two_pipelines_whose_stages_start_runs_of_each_other_do_not_deadlock);
fn two_pipelines_whose_stages_start_runs_of_each_other_do_not_deadlock(device: gpufeed::Device) {
    use std::sync::Barrier;
    let _serial = serial();
    let p1 = Arc::new(Pipeline::new(&device, 2).unwrap());
    let p2 = Arc::new(Pipeline::new(&device, 2).unwrap());
    let barrier = Arc::new(Barrier::new(2));
    let spawn = |mine: Arc<Pipeline>, other: Arc<Pipeline>, b: Arc<Barrier>| {
        let device = device.clone();
        std::thread::spawn(move || {
            let data = random(1024, 3);
            let input = PinnedBuffer::from_slice(&device, &data).unwrap();
            let output = PinnedBuffer::<f32>::new(&device, 1024).unwrap();
            let inner = Arc::new(std::sync::Mutex::new(None));
            let seen = inner.clone();
            let job = mine.run_stage(
                (input,),
                (output,),
                Plan::uniform(1, 1),
                gpufeed::Timeline::Off,
                move |c, chunk| {
                    // Both stages at once, each holding its own pipeline.
                    b.wait();
                    let a = PinnedBuffer::from_slice(c.device(), &[1.0f32, 2.0]).unwrap();
                    let o = PinnedBuffer::<f32>::new(c.device(), 2).unwrap();
                    let run = other.run(
                        a,
                        o,
                        Kernel::Scale { s: 2.0 },
                        Plan::uniform(1, 1),
                        gpufeed::Timeline::Off,
                    );
                    *seen.lock().unwrap() = Some(run);
                    c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
                },
            );
            let ((_, (output,)), _) = block_on(job).unwrap();
            assert_eq!(output.as_slice(), &data[..]);
            // The inner run either ran or was refused with its buffers back.
            let inner = inner.lock().unwrap().take().expect("the stage ran");
            match block_on(inner) {
                Ok(((_, o), _)) => assert_eq!(o.as_slice(), &[2.0, 4.0]),
                Err(e) => {
                    assert!(
                        matches!(e.error, Error::InvalidArgument(_)),
                        "{:?}",
                        e.error
                    );
                    assert!(e.bundle.is_some());
                }
            }
        })
    };
    let t1 = spawn(p1.clone(), p2.clone(), barrier.clone());
    let t2 = spawn(p2, p1, barrier);
    let t = Instant::now();
    while !(t1.is_finished() && t2.is_finished()) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the two pipelines deadlocked"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t1.join().unwrap();
    t2.join().unwrap();
}

mod past_the_end {
    gpufeed::kernel_abi::kernels! {
        /// Writes element `global_id` of `y`: past its end for threads beyond it.
        pub unsafe fn write_past(y: gpufeed::kernel_abi::SliceMut<u32>) {
            // SAFETY: broken on purpose for threads past `y.len()`: the CPU
            // emulation checks every index and breaks the context.
            unsafe { y.write(gpufeed::kernel_abi::thread::global_id(), 7) }
        }
    }
}

#[test]
fn an_out_of_bounds_kernel_write_breaks_the_emulated_context_in_every_build() {
    let device = gpufeed::Device::cpu();
    let stream = Stream::new(&device).unwrap();
    // SAFETY: on the CPU emulation no PTX is loaded; the declaration's own
    // host body runs.
    let m = unsafe { gpufeed::Module::from_ptx(&device, "") }.unwrap();
    let f = m.function::<past_the_end::write_past>().unwrap();
    let y = DeviceBuffer::<u32>::new(&device, 4).unwrap();
    let cfg = gpufeed::LaunchConfig::linear(1, 64);
    let r = block_on(stream.run(y, |c, y| c.launch(&f, cfg, (y.view_mut(),))));
    let e = r.expect_err("an out-of-bounds write is a fault");
    // The CPU emulation names the kernel and the access; a GPU breaks the
    // context (an illegal address, or the kernel's trap).
    assert!(
        matches!(e.error, Error::ContextBroken(_))
            || matches!(
                &e.error,
                Error::KernelFault {
                    kernel: "write_past",
                    ..
                }
            ),
        "{:?}",
        e.error
    );
    assert!(
        e.bundle.is_some(),
        "a broken context hands the buffers back"
    );
}
