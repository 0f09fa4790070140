//! `Pipeline::run_stage`: several inputs and outputs of different element
//! types through both layouts, checked bit for bit against the CPU on every
//! backend; a stage's errors hand every array back.

use futures::executor::block_on;
use gpufeed::testing::{poison, random_floats, serial, watchdog};
use gpufeed::{Error, PinnedHost, PinnedPool, Pipeline, Plan};

fn plans(n: usize) -> Vec<Plan> {
    vec![
        Plan::uniform(1, 1),
        Plan::uniform(5, 2),
        Plan::uniform(7, 3).chained(),
        Plan::engines(6, 2),
        Plan {
            ramp: true,
            ..Plan::engines(9, 3)
        },
        Plan::auto(n),
    ]
}

gpufeed::backend_tests!(saxpy_through_the_pipeline_matches_the_cpu_bit_for_bit);
fn saxpy_through_the_pipeline_matches_the_cpu_bit_for_bit(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 3).unwrap();
    for (k, n) in [1usize, 1000, 65_537, 1_000_003].into_iter().enumerate() {
        for plan in plans(n) {
            let plan = Plan {
                chunks: plan.chunks.min(n),
                ..plan
            };
            let (mut x, mut y) = (pool.alloc::<f32>(n).unwrap(), pool.alloc::<f32>(n).unwrap());
            random_floats(x.as_mut_slice(), 100 + k as u64);
            random_floats(y.as_mut_slice(), 200 + k as u64);
            // Poisoned: the pool may hand back the previous plan's output
            // block, which already holds the right answer.
            let mut out = pool.alloc::<f32>(n).unwrap();
            poison(out.as_mut_slice());
            let a = 1.75f32;
            let (((x, y), (out,)), info) = block_on(pipe.run_stage(
                (x, y),
                (out,),
                plan,
                gpufeed::Timeline::Off,
                |c, chunk| {
                    let y_out = chunk.output::<f32>(0)?;
                    c.copy_d2d(chunk.input::<f32>(1)?, y_out)?;
                    c.saxpy(a, chunk.input::<f32>(0)?, y_out)
                },
            ))
            .unwrap_or_else(|e| panic!("{} n={n} {plan}: {e}", device.kind()));
            assert_eq!(info.plan, plan);
            for i in 0..n {
                // SAXPY is one fused multiply-add.
                let want = a.mul_add(x.as_slice()[i], y.as_slice()[i]);
                assert_eq!(
                    out.as_slice()[i].to_bits(),
                    want.to_bits(),
                    "{} n={n} {plan}: element {i}",
                    device.kind()
                );
            }
        }
    }
}

gpufeed::backend_tests!(
    arrays_of_different_element_types_travel_together_and_type_errors_hand_them_back
);
fn arrays_of_different_element_types_travel_together_and_type_errors_hand_them_back(
    device: gpufeed::Device,
) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let pipe = Pipeline::new(&device, 3).unwrap();
    let n = 100_003;
    let mut ids = pool.alloc::<u32>(n).unwrap();
    for (i, v) in ids.as_mut_slice().iter_mut().enumerate() {
        *v = (i as u32).wrapping_mul(2_654_435_761);
    }
    let mut xs = pool.alloc::<f32>(n).unwrap();
    random_floats(xs.as_mut_slice(), 5);
    let mut bytes = pool.alloc::<u8>(n).unwrap();
    for (i, v) in bytes.as_mut_slice().iter_mut().enumerate() {
        *v = (i * 7 + 3) as u8;
    }
    let (out_ids, out_xs, out_bytes) = (
        pool.alloc::<u32>(n).unwrap(),
        pool.alloc::<f32>(n).unwrap(),
        pool.alloc::<u8>(n).unwrap(),
    );
    // A stage that asks for the wrong type: refused, everything back.
    let err = block_on(pipe.run_stage(
        (ids, xs, bytes),
        (out_ids, out_xs, out_bytes),
        Plan::engines(4, 2),
        gpufeed::Timeline::Off,
        |c, chunk| c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(1)?),
    ))
    .unwrap_err();
    assert!(
        matches!(&err.error, Error::InvalidArgument(m) if m.contains("holds u32")),
        "{err}"
    );
    let ((ids, xs, bytes), (out_ids, out_xs, out_bytes)) =
        err.bundle.expect("the arrays come back");
    // The right types: each output a copy of its input, scaled for f32.
    let (((ids, xs, bytes), (out_ids, out_xs, out_bytes)), _) = block_on(pipe.run_stage(
        (ids, xs, bytes),
        (out_ids, out_xs, out_bytes),
        Plan::uniform(6, 3),
        gpufeed::Timeline::Off,
        |c, chunk| {
            c.copy_d2d(chunk.input::<u32>(0)?, chunk.output::<u32>(0)?)?;
            let x = chunk.output::<f32>(1)?;
            c.copy_d2d(chunk.input::<f32>(1)?, x)?;
            c.kernel(gpufeed::Kernel::Scale { s: 3.0 }, x)?;
            c.copy_d2d(chunk.input::<u8>(2)?, chunk.output::<u8>(2)?)
        },
    ))
    .unwrap();
    assert_eq!(out_ids.as_slice(), ids.as_slice());
    assert_eq!(out_bytes.as_slice(), bytes.as_slice());
    for (o, x) in out_xs.as_slice().iter().zip(xs.as_slice()) {
        assert_eq!(o.to_bits(), (x * 3.0).to_bits());
    }
    // Arrays of unequal lengths: refused before anything is enqueued.
    let short = pool.alloc::<u8>(n - 1).unwrap();
    let err = block_on(pipe.run_stage(
        (ids,),
        (short,),
        Plan::uniform(2, 1),
        gpufeed::Timeline::Off,
        |_, _| Ok(()),
    ))
    .unwrap_err();
    assert!(matches!(err.error, Error::LengthMismatch { .. }), "{err}");
    assert!(err.bundle.is_some());
}

/// One element type through every generic path: a pool block, a plain
/// pinned buffer, a device buffer (H2D, D2D, D2H in one batch) and a
/// pipeline stage whose output is its input copied on the device; every
/// bit compared with the random input.
fn every_path_keeps_every_bit<T>(
    device: &gpufeed::Device,
    pipe: &Pipeline,
    n: usize,
    make: impl Fn(u64) -> T,
) where
    T: bytemuck::Pod + Send,
{
    let pool = PinnedPool::new(device);
    let mut rng = fastrand::Rng::with_seed(n as u64);
    let data: Vec<T> = (0..n).map(|_| make(rng.u64(..))).collect();
    let mut input = pool.alloc::<T>(n).unwrap();
    input.as_mut_slice().copy_from_slice(&data);
    let back = gpufeed::PinnedBuffer::<T>::new(device, n).unwrap();
    let (d1, d2) = (
        gpufeed::DeviceBuffer::<T>::new(device, n).unwrap(),
        gpufeed::DeviceBuffer::<T>::new(device, n).unwrap(),
    );
    let stream = gpufeed::Stream::new(device).unwrap();
    let ((input, _, _, back), ()) =
        block_on(stream.run((input, d1, d2, back), |c, (i, d1, d2, b)| {
            let (d1, d2) = (d1.view_mut(), d2.view_mut());
            c.copy_h2d(i.host(), d1)?;
            c.copy_d2d(d1, d2)?;
            c.copy_d2h(d2, b.host_mut())
        }))
        .unwrap();
    let bits = |v: &[T]| bytemuck::cast_slice::<T, u8>(v).to_vec();
    // Bits, not values: NaN patterns included.
    assert!(
        bits(back.as_slice()) == bits(&data),
        "{}",
        std::any::type_name::<T>()
    );
    let mut out = pool.alloc::<T>(n).unwrap();
    poison(out.as_mut_slice());
    let (((input,), (out,)), _) = block_on(pipe.run_stage(
        (input,),
        (out,),
        Plan::engines(5, 3),
        gpufeed::Timeline::Off,
        |c, chunk| c.copy_d2d(chunk.input::<T>(0)?, chunk.output::<T>(0)?),
    ))
    .unwrap();
    assert!(
        bits(out.as_slice()) == bits(&data),
        "{}",
        std::any::type_name::<T>()
    );
    assert!(bits(input.as_slice()) == bits(&data));
}

gpufeed::backend_tests!(f32_f64_i32_u32_u8_bf16_and_f16_travel_every_path_bit_for_bit);
fn f32_f64_i32_u32_u8_bf16_and_f16_travel_every_path_bit_for_bit(device: gpufeed::Device) {
    let _serial = serial();
    let pipe = Pipeline::new(&device, 3).unwrap();
    // Odd lengths: the last chunk and the tails are partial.
    let n = 70_001;
    every_path_keeps_every_bit(&device, &pipe, n, |r| f32::from_bits(r as u32));
    every_path_keeps_every_bit(&device, &pipe, n, f64::from_bits);
    every_path_keeps_every_bit(&device, &pipe, n, |r| r as i32);
    every_path_keeps_every_bit(&device, &pipe, n, |r| r as u32);
    every_path_keeps_every_bit(&device, &pipe, n, |r| r as u8);
    every_path_keeps_every_bit(&device, &pipe, n, |r| half::bf16::from_bits(r as u16));
    every_path_keeps_every_bit(&device, &pipe, n, |r| half::f16::from_bits(r as u16));
}

gpufeed::backend_tests!(a_run_ends_only_when_every_stream_has_finished_its_chunks);
fn a_run_ends_only_when_every_stream_has_finished_its_chunks(device: gpufeed::Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let n = 40_000;
    for streams in [2usize, 3] {
        let pipe = Pipeline::new(&device, streams).unwrap();
        for held_stream in 1..streams {
            let gate = std::sync::Arc::new(gpufeed::MappedFlag::new(&device).unwrap());
            let _watchdog = watchdog(&gate);
            // One stream other than the first held on a GPU-side gate: its
            // chunks queue behind it while the other streams finish theirs.
            let held = pipe.streams()[held_stream].run(gate.clone(), |c, g| c.gate(g));
            let mut input = pool.alloc::<f32>(n).unwrap();
            random_floats(input.as_mut_slice(), streams as u64);
            let mut output = pool.alloc::<f32>(n).unwrap();
            poison(output.as_mut_slice());
            let kernel = gpufeed::Kernel::Scale { s: 2.0 };
            let plan = Plan::uniform(2 * streams, streams);
            let run = pipe.run(input, output, kernel, plan, gpufeed::Timeline::Off);
            // The run must not end while a stream's chunks are still queued.
            // (Asserted once the gate is open: a test failing with the gate
            // closed would wait for it when the pipeline is dropped.)
            let start = std::time::Instant::now();
            let mut ended_early = false;
            while !ended_early && start.elapsed() < std::time::Duration::from_millis(300) {
                ended_early = run.is_done();
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            gate.set(1);
            let ((input, output), _) = block_on(run).unwrap();
            block_on(held).unwrap();
            assert!(
                !ended_early,
                "{} {plan}: the run ended while stream {held_stream} was held",
                device.kind()
            );
            let (checked, bad) =
                gpufeed::testing::verify(kernel, input.as_slice(), output.as_slice());
            assert_eq!((checked, bad), (n, 0), "{} {plan}", device.kind());
        }
    }
}
