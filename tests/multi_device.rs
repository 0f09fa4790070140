//! Several devices: enumeration, peer copies, one array spread over every
//! device, pinned memory placed on a NUMA node. On the CPU emulation with two
//! and three emulated devices (CI); on CUDA with every GPU of the machine
//! (with one GPU, two handles of it stand in for two devices: the peer path
//! still runs, through one context).

use futures::executor::block_on;
use gpufeed::testing::{or_skip, random_floats, serial};
use gpufeed::{
    BackendChoice, Device, DeviceBuffer, DeviceOptions, Error, Kernel, MultiPipeline, PinnedHost,
    PinnedPool, Plan, Stream,
};

fn cpu_devices(n: usize) -> Vec<Device> {
    Device::all(DeviceOptions {
        backend: BackendChoice::Cpu,
        emulated_devices: n,
        ..Default::default()
    })
    .unwrap()
}

/// Every GPU, or two handles of the only one; `None` (skipped) without a GPU.
fn cuda_devices() -> Option<Vec<Device>> {
    let opts = DeviceOptions {
        backend: BackendChoice::Cuda,
        ..Default::default()
    };
    let mut all = or_skip("multi_device", Device::all(opts))?;
    if all.len() == 1 {
        all.push(Device::open(opts).unwrap());
    }
    Some(all)
}

macro_rules! multi_device_tests {
    ($($name:ident),+ $(,)?) => {$(
        mod $name {
            #[test]
            fn cpu_two_devices() {
                let _s = gpufeed::testing::serial();
                super::$name(super::cpu_devices(2));
            }

            #[test]
            fn cpu_three_devices() {
                let _s = gpufeed::testing::serial();
                super::$name(super::cpu_devices(3));
            }

            #[test]
            #[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
            fn cuda() {
                let _s = gpufeed::testing::serial();
                if let Some(devices) = super::cuda_devices() {
                    super::$name(devices);
                }
            }
        }
    )+};
}

multi_device_tests!(
    devices_are_numbered_and_distinct,
    peer_copies_move_every_bit_between_devices_both_ways,
    one_array_spread_over_every_device_matches_the_cpu,
    a_spread_run_hands_the_buffers_back_on_bad_input_and_frees_them_after_a_cancel,
);

fn devices_are_numbered_and_distinct(devices: Vec<Device>) {
    assert!(devices.len() >= 2);
    for (i, d) in devices.iter().enumerate() {
        if d.kind() == gpufeed::BackendKind::Cpu {
            assert_eq!(d.ordinal(), i);
        }
        for e in &devices {
            // Peer access is enabled where the topology allows; on the CPU
            // emulation copies between devices are always direct.
            let direct = d.enable_peer_access(e).unwrap();
            if d.kind() == gpufeed::BackendKind::Cpu {
                assert!(direct);
            }
        }
    }
    let cpu = gpufeed::Device::cpu();
    if devices[0].kind() == gpufeed::BackendKind::Cuda {
        assert!(matches!(
            devices[0].enable_peer_access(&cpu),
            Err(Error::InvalidArgument(_))
        ));
    }
}

fn peer_copies_move_every_bit_between_devices_both_ways(devices: Vec<Device>) {
    let n = 1_000_003;
    let (a, b) = (&devices[0], &devices[devices.len() - 1]);
    let pool = PinnedPool::new(a);
    let mut input = pool.alloc::<f32>(n).unwrap();
    random_floats(input.as_mut_slice(), 11);
    let back = pool.alloc::<f32>(n).unwrap();
    let (da, db, da2) = (
        DeviceBuffer::<f32>::new(a, n).unwrap(),
        DeviceBuffer::<f32>::new(b, n).unwrap(),
        DeviceBuffer::<f32>::new(a, n).unwrap(),
    );
    // a → b on a stream of a, b → a on a stream of b; host memory of a's
    // pool is used by b's stream too (portable pinned memory).
    let sa = Stream::new(a).unwrap();
    let sb = Stream::new(b).unwrap();
    let ((input, da, db), ()) = block_on(sa.run((input, da, db), |c, (i, da, db)| {
        let da = da.view_mut();
        c.copy_h2d(i.host(), da)?;
        c.copy_peer(da, db.view_mut())
    }))
    .unwrap();
    let ((db, da2, back), ()) = block_on(sb.run((db, da2, back), |c, (db, da2, o)| {
        let da2 = da2.view_mut();
        c.copy_peer(db.view(), da2)?;
        // Still on b's stream: a's memory is read by a peer copy, then
        // copied out of b's buffer to the host.
        c.copy_d2h(db.view(), o.host_mut())
    }))
    .unwrap();
    assert_eq!(back.as_slice(), input.as_slice());
    // da2 (on a) came from b: copy it out on a's stream.
    let out = pool.alloc::<f32>(n).unwrap();
    let ((_, out), ()) =
        block_on(sa.run((da2, out), |c, (d, o)| c.copy_d2h(d.view(), o.host_mut()))).unwrap();
    assert_eq!(out.as_slice(), input.as_slice());
    // A stream of neither device refuses, handing the buffers back.
    if devices.len() >= 3 {
        let sc = Stream::new(&devices[1]).unwrap();
        let err = block_on(sc.run((da, db), |c, (x, y)| c.copy_peer(x.view(), y.view_mut())))
            .unwrap_err();
        assert!(matches!(err.error, Error::InvalidArgument(_)), "{err}");
        assert!(err.bundle.is_some());
    }
    // copy_d2d does not cross devices (a peer copy says so explicitly).
    let (x, y) = (
        DeviceBuffer::<f32>::new(a, 4).unwrap(),
        DeviceBuffer::<f32>::new(b, 4).unwrap(),
    );
    let err = block_on(sa.run((x, y), |c, (x, y)| c.copy_d2d(x.view(), y.view_mut()))).unwrap_err();
    assert!(matches!(err.error, Error::InvalidArgument(_)), "{err}");
}

fn one_array_spread_over_every_device_matches_the_cpu(devices: Vec<Device>) {
    let multi = MultiPipeline::new(&devices, 3).unwrap();
    let pool = PinnedPool::new(&devices[0]);
    let kernel = Kernel::Scale { s: -1.75 };
    for (n, plan) in [
        (1_000_003, Plan::engines(6, 3)),
        (777, Plan::uniform(4, 2)),
        (100, Plan::auto(100)),
        (1, Plan::uniform(1, 1)),
    ] {
        let mut input = pool.alloc::<f32>(n).unwrap();
        random_floats(input.as_mut_slice(), n as u64);
        let output = pool.alloc::<f32>(n).unwrap();
        let ((input, output), infos) = block_on(multi.run(input, output, kernel, plan)).unwrap();
        let parts = multi.parts(n);
        assert_eq!(infos.len(), parts.iter().filter(|p| !p.is_empty()).count());
        for (o, x) in output.as_slice().iter().zip(input.as_slice()) {
            assert_eq!(
                o.to_bits(),
                gpufeed::testing::expected(kernel, *x).to_bits(),
                "n={n} {plan}"
            );
        }
    }
}

fn a_spread_run_hands_the_buffers_back_on_bad_input_and_frees_them_after_a_cancel(
    devices: Vec<Device>,
) {
    let multi = MultiPipeline::new(&devices, 3).unwrap();
    let pool = PinnedPool::new(&devices[0]);
    let (input, short) = (
        pool.alloc::<f32>(1000).unwrap(),
        pool.alloc::<f32>(999).unwrap(),
    );
    let err = block_on(multi.run(input, short, Kernel::Scale { s: 2.0 }, Plan::uniform(2, 1)))
        .unwrap_err();
    assert!(matches!(err.error, Error::LengthMismatch { .. }), "{err}");
    let (input, _short) = err.bundle.expect("handed back");
    // A plan no part can run (more streams than each pipeline has).
    let output = pool.alloc::<f32>(1000).unwrap();
    let err = block_on(multi.run(input, output, Kernel::Scale { s: 2.0 }, Plan::uniform(4, 8)))
        .unwrap_err();
    assert!(matches!(err.error, Error::InvalidArgument(_)), "{err}");
    let (input, output) = err.bundle.expect("handed back");
    // Dropped while in flight: the buffers return to the pool once every
    // device is done, not before.
    let in_use = pool.stats().in_use_bytes;
    drop(multi.run(input, output, Kernel::Scale { s: 2.0 }, Plan::uniform(2, 2)));
    for d in &devices {
        d.synchronize().unwrap();
    }
    assert_eq!(pool.stats().in_use_bytes, in_use - 2 * 4096);
}

#[test]
fn pinned_memory_placed_on_a_node_is_found_there() {
    let _s = serial();
    let device = Device::cpu();
    let Some(&node) = gpufeed::online_nodes().first() else {
        eprintln!("SKIPPED: this kernel reports no NUMA nodes");
        return;
    };
    let pool = PinnedPool::on_node(&device, node);
    assert_eq!(pool.node(), Some(node));
    let mut b = pool.alloc::<f32>(3 << 20).unwrap();
    random_floats(b.as_mut_slice(), 3);
    assert_eq!(b.numa_node().unwrap(), Some(node));
    // A node the host does not have: refused by name, at allocation.
    let missing = gpufeed::online_nodes().iter().max().map_or(1, |m| m + 1);
    let err = PinnedPool::on_node(&device, missing)
        .alloc::<f32>(10)
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains(&format!("node {missing}"))),
        "{err}"
    );
    // The emulation has no PCI address, so no node of its own: `near` is
    // the driver's placement.
    assert_eq!(device.numa_node(), None);
    assert_eq!(PinnedPool::near(&device).node(), None);
}

#[test]
fn a_multi_device_run_refuses_the_plans_one_device_refuses_and_hands_the_buffers_back() {
    let devices = cpu_devices(2);
    let multi = MultiPipeline::new(&devices, 2).unwrap();
    let pool = PinnedPool::new(&devices[0]);
    let n = 1000;
    for plan in [Plan::uniform(0, 1), Plan::engines(0, 2)] {
        let mut input = pool.alloc::<f32>(n).unwrap();
        input.as_mut_slice().fill(1.5);
        let output = pool.alloc::<f32>(n).unwrap();
        let err = block_on(multi.run(input, output, Kernel::Scale { s: 2.0 }, plan))
            .expect_err("the plan fits no run of 1000 elements");
        assert!(
            matches!(err.error, Error::InvalidArgument(_)),
            "{plan}: {:?}",
            err.error
        );
        let (input, _output) = err
            .bundle
            .expect("a validation error hands the buffers back");
        assert!(input.as_slice().iter().all(|&v| v == 1.5));
    }
    // More chunks than elements is no error: fewer run, and each part says
    // how many.
    let mut input = pool.alloc::<f32>(n).unwrap();
    input.as_mut_slice().fill(1.5);
    let output = pool.alloc::<f32>(n).unwrap();
    let ((_, output), infos) = block_on(multi.run(
        input,
        output,
        Kernel::Scale { s: 2.0 },
        Plan::uniform(5000, 2),
    ))
    .unwrap();
    assert!(output.as_slice().iter().all(|&v| v == 3.0));
    for info in infos {
        assert!(info.chunks >= 1 && info.chunks <= 500 / 64 + 1, "{info:?}");
    }
}

#[test]
fn parts_of_usize_max_zero_sized_elements_do_not_overflow() {
    let devices = cpu_devices(2);
    let multi = MultiPipeline::new(&devices, 1).unwrap();
    let parts = multi.parts(usize::MAX);
    assert_eq!(parts.first().map(|r| r.start), Some(0));
    assert_eq!(parts.last().map(|r| r.end), Some(usize::MAX));
    assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
}
