//! Every CUDA wait mode (spin, blocking, poll) delivers completions: a job
//! held by a GPU-side gate resolves once the host opens it, not before; a
//! copy-kernel-copy job's result matches the CPU bit for bit. (The CPU
//! emulation has no watcher: these run on a GPU only.)

use futures::executor::block_on;
use gpufeed::testing::{or_skip, random_floats, serial, watchdog};
use gpufeed::{
    BackendChoice, Device, DeviceBuffer, DeviceOptions, Kernel, MappedFlag, PinnedBuffer,
    PinnedHost, Stream, WaitMode,
};
use std::sync::Arc;
use std::time::Duration;

fn open(mode: WaitMode) -> Option<Device> {
    let opts = DeviceOptions {
        backend: BackendChoice::Cuda,
        wait_mode: mode,
        ..Default::default()
    };
    or_skip("wait_modes", Device::open(opts))
}

fn check_mode(mode: WaitMode) {
    let _serial = serial();
    let Some(device) = open(mode) else { return };
    let stream = Stream::new(&device).unwrap();

    // Held by a gate: not done while closed, done soon after it opens.
    let gate = Arc::new(MappedFlag::new(&device).unwrap());
    let _dog = watchdog(&gate);
    gate.set(0);
    let job = stream.run(gate.clone(), |c, g| c.gate(g));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!job.is_done(), "{mode:?}: done while the gate is closed");
    gate.set(1);
    block_on(job).unwrap();

    // Copy in, scale, copy out on random data.
    let n = 1_000_003;
    let mut input = PinnedBuffer::<f32>::new(&device, n).unwrap();
    random_floats(input.as_mut_slice(), 41);
    let output = PinnedBuffer::<f32>::new(&device, n).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let k = Kernel::Scale { s: -2.5 };
    let ((input, _, output), ()) = block_on(stream.run((input, dev, output), |c, (i, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.kernel(k, d)?;
        c.copy_d2h(d, o.host_mut())
    }))
    .unwrap();
    for (o, x) in output.as_slice().iter().zip(input.as_slice()) {
        assert_eq!(
            o.to_bits(),
            gpufeed::testing::expected(k, *x).to_bits(),
            "{mode:?}"
        );
    }
    drop((stream, gate));
    drop(device);
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn spin_watchers_deliver_completions_in_order() {
    check_mode(WaitMode::Spin);
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn blocking_watchers_deliver_completions_in_order() {
    check_mode(WaitMode::Blocking);
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn polling_watchers_deliver_completions_in_order() {
    check_mode(WaitMode::Poll);
}
