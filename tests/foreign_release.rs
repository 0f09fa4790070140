//! Release points for memory handed to a foreign consumer
//! ([`gpufeed::interop::release_after_foreign_stream`],
//! [`gpufeed::interop::release_after_device_idle`]): on CUDA a point passes only
//! once the consumer's stream is past the work queued on it when the point
//! was made, and the actions deferred on it run then, on the crate's
//! release thread; on the CPU emulation (no streams) it passes at once.

use gpufeed::interop::{
    foreign_stream_wait, release_after_device_idle, release_after_foreign_stream, HandshakeStream,
};
use gpufeed::testing::{or_skip, serial, watchdog};
use gpufeed::{BackendChoice, Device, DeviceOptions, MappedFlag, Stream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[test]
fn on_the_cpu_emulation_a_release_point_passes_at_once() {
    let device = Device::open(DeviceOptions {
        backend: BackendChoice::Cpu,
        ..Default::default()
    })
    .unwrap();
    // SAFETY: the CPU emulation never uses the handle.
    let points = [
        unsafe { release_after_foreign_stream(&device, 1234) },
        release_after_device_idle(&device),
    ];
    for p in points {
        assert!(p.is_done());
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        p.defer(move || r.store(true, Ordering::SeqCst));
        assert!(ran.load(Ordering::SeqCst), "a deferred action runs at once");
        p.block().unwrap();
    }
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn a_release_point_waits_for_the_consumers_stream() {
    let _serial = serial();
    let opts = DeviceOptions {
        backend: BackendChoice::Cuda,
        ..Default::default()
    };
    let Some(device) = or_skip("foreign_release", Device::open(opts)) else {
        return;
    };
    // The "consumer's" stream: a driver stream that is not the crate's,
    // held behind a closed gate on a stream of ours.
    let ours = Stream::new(&device).unwrap();
    let theirs = HandshakeStream::new(&device).unwrap();
    let gate = Arc::new(MappedFlag::new(&device).unwrap());
    let _dog = watchdog(&gate);
    gate.set(0);
    let job = ours.run(gate.clone(), |c, g| c.gate(g));
    // SAFETY: `theirs` is a live stream of the device's primary context.
    unsafe { foreign_stream_wait(&ours, theirs.handle()) }.unwrap();
    // SAFETY: as above.
    let point = unsafe { release_after_foreign_stream(&device, theirs.handle()) };
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    point.defer(move || r.store(true, Ordering::SeqCst));
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !point.is_done(),
        "passed while the consumer's stream is held"
    );
    assert!(!ran.load(Ordering::SeqCst));
    gate.set(1);
    point.block().unwrap();
    // The action runs right after the point completes, on the release thread.
    let t = std::time::Instant::now();
    while !ran.load(Ordering::SeqCst) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the deferred action never ran"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    gpufeed::block_on(job).unwrap();
    // A device-wide point passes once the device is idle.
    let idle = release_after_device_idle(&device);
    idle.block().unwrap();
    drop((ours, gate));
}
