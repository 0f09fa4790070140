// Probe: which driver calls wait while another stream of the device is held by
// a running kernel? Needs the library's `hooks` feature (MappedFlag, the gate
// kernel, Event::synchronize_direct) and the `futures` crate.
use gpufeed::{Device, DeviceBuffer, MappedFlag, PinnedBuffer, Registered, Stream};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Op = Box<dyn FnOnce() -> gpufeed::Result<()> + Send>;

fn main() -> gpufeed::Result<()> {
    let device = Device::from_env()?;
    println!("{}", device.banner());
    let names = [
        "cuMemAlloc (DeviceBuffer::new)",
        "cuMemFree (drop DeviceBuffer)",
        "cuMemHostAlloc (PinnedBuffer::new)",
        "cuMemFreeHost (drop PinnedBuffer)",
        "cuMemHostRegister (Registered::new)",
        "cuMemHostUnregister (drop Registered)",
        "cuStreamCreate (Stream::new)",
        "cuStreamDestroy (drop an idle Stream)",
        "cuEventRecord + cuEventSynchronize on another idle stream",
        "cuMemAlloc of a size just freed (before the gate closed)",
    ];
    for (k, what) in names.iter().enumerate() {
        // Prepared before the gate closes.
        let d = device.clone();
        let op: Op = match k {
            0 => Box::new(move || DeviceBuffer::<f32>::new(&d, 1 << 20).map(drop)),
            1 => {
                let b = DeviceBuffer::<f32>::new(&device, 1 << 20)?;
                Box::new(move || {
                    drop(b);
                    Ok(())
                })
            }
            2 => Box::new(move || PinnedBuffer::<f32>::new(&d, 1 << 20).map(drop)),
            3 => {
                let b = PinnedBuffer::<f32>::new(&device, 1 << 20)?;
                Box::new(move || {
                    drop(b);
                    Ok(())
                })
            }
            4 => Box::new(move || Registered::new(&d, vec![1f32; 1 << 20]).map(drop)),
            5 => {
                let r = Registered::new(&device, vec![1f32; 1 << 20])?;
                Box::new(move || {
                    drop(r);
                    Ok(())
                })
            }
            6 => Box::new(move || Stream::new(&d).map(drop)),
            7 => {
                let s = Stream::new(&device)?;
                Box::new(move || {
                    drop(s);
                    Ok(())
                })
            }
            8 => {
                let s = Stream::new(&device)?;
                Box::new(move || s.record()?.synchronize_direct())
            }
            _ => {
                drop(DeviceBuffer::<f32>::new(&device, 1 << 20)?);
                Box::new(move || DeviceBuffer::<f32>::new(&d, 1 << 20).map(drop))
            }
        };
        let held_stream = Stream::new(&device)?;
        let gate = Arc::new(MappedFlag::new(&device)?);
        let held = held_stream.run(gate.clone(), |c, g| c.gate(g));
        std::thread::sleep(Duration::from_millis(50));
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        let th = std::thread::spawn(move || {
            let r = op();
            let _ = tx.send((t.elapsed(), r.is_ok()));
        });
        let r = rx.recv_timeout(Duration::from_secs(1));
        gate.set(1);
        futures::executor::block_on(held)?;
        let after = rx.recv().ok();
        let _ = th.join();
        match r {
            Ok((d, ok)) => println!("{what}: returned in {d:?} (ok: {ok}) while another stream was held"),
            Err(_) => println!("{what}: BLOCKED (still waiting after 1 s); returned {after:?} after the gate opened"),
        }
    }
    Ok(())
}
