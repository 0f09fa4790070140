//! Stream-ordered device memory: a cancelled job's device buffers are freed
//! the moment its work is done, by the completion source itself, with no
//! later call on any thread (no allocation, free or synchronize needed);
//! the plain path (`cuMemFree`, which waits for the whole device) parks such
//! frees instead. CUDA only: the CPU emulation frees at once either way.

use gpufeed::testing::{or_skip, ordered_bytes_in_use, parked_device_frees, serial, watchdog};
use gpufeed::{
    BackendChoice, Device, DeviceBuffer, DeviceMemory, DeviceOptions, Kernel, MappedFlag, Stream,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn open(memory: DeviceMemory) -> Option<Device> {
    let opts = DeviceOptions {
        backend: BackendChoice::Cuda,
        device_memory: memory,
        ..Default::default()
    };
    or_skip("device_memory", Device::open(opts))
}

/// A job holding a 64 MiB device buffer behind a closed gate, dropped
/// (cancelled) before the gate opens; then the gate opens.
fn cancel_a_job_holding_device_memory(device: &Device, stream: &Stream, gate: &Arc<MappedFlag>) {
    gate.set(0);
    let d = DeviceBuffer::<f32>::new(device, 16 << 20).unwrap();
    let job = stream.run((gate.clone(), d), |c, (g, d)| {
        c.gate(g)?;
        c.kernel(Kernel::Scale { s: 2.0 }, d.view_mut())
    });
    drop(job);
    gate.set(1);
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn a_cancelled_jobs_device_memory_is_freed_when_its_work_ends_with_no_further_call() {
    let _serial = serial();
    let Some(device) = open(DeviceMemory::StreamOrdered) else {
        return;
    };
    assert!(device.info().stream_ordered_memory, "{:?}", device.info());
    let stream = Stream::new(&device).unwrap();
    let gate = Arc::new(MappedFlag::new(&device).unwrap());
    let _dog = watchdog(&gate);
    let before = ordered_bytes_in_use(&device).expect("a stream-ordered pool");
    cancel_a_job_holding_device_memory(&device, &stream, &gate);
    // Only the pool's counter is read (a query): nothing allocates, frees or
    // synchronizes on this or any other thread of ours.
    let t = Instant::now();
    while ordered_bytes_in_use(&device) != Some(before) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "still {:?} bytes in use, {} frees parked",
            ordered_bytes_in_use(&device),
            parked_device_frees(&device)
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(parked_device_frees(&device), 0);
    drop((stream, gate));
}

#[test]
#[cfg_attr(not(host_gpu), ignore = "needs a CUDA GPU")]
fn the_plain_path_parks_a_cancelled_jobs_free_until_the_next_allocation() {
    let _serial = serial();
    let Some(device) = open(DeviceMemory::Plain) else {
        return;
    };
    assert!(!device.info().stream_ordered_memory);
    let stream = Stream::new(&device).unwrap();
    let gate = Arc::new(MappedFlag::new(&device).unwrap());
    let _dog = watchdog(&gate);
    cancel_a_job_holding_device_memory(&device, &stream, &gate);
    // Completions are delivered in order: once a later point of the stream
    // is, the release has run (and parked its cuMemFree).
    stream.record().unwrap().synchronize().unwrap();
    assert_eq!(parked_device_frees(&device), 1);
    drop(DeviceBuffer::<u8>::new(&device, 1).unwrap());
    assert_eq!(parked_device_frees(&device), 0);
    drop((stream, gate));
}
