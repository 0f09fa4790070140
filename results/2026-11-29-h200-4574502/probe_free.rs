// Temporary probe (not committed): does cuMemFree / cuMemFreeHost wait for
// unrelated work held on another stream?
use host::{Device, DeviceBuffer, MappedFlag, Stream};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> host::Result<()> {
    let device = Device::from_env()?;
    println!("{}", device.banner());
    for what in ["cuMemFree", "cuMemFreeHost", "cuMemAlloc"] {
        let s = Stream::new(&device)?;
        let gate = Arc::new(MappedFlag::new(&device)?);
        let buf = DeviceBuffer::<f32>::new(&device, 1 << 20)?;
        let pinned = host::PinnedBuffer::<f32>::new(&device, 1 << 20)?;
        let held = s.run(gate.clone(), |c, g| c.gate(g));
        std::thread::sleep(Duration::from_millis(50));
        let (tx, rx) = std::sync::mpsc::channel();
        let d2 = device.clone();
        let t = Instant::now();
        let th = std::thread::spawn(move || {
            match what {
                "cuMemFree" => drop(buf),
                "cuMemFreeHost" => drop(pinned),
                _ => drop(DeviceBuffer::<f32>::new(&d2, 1 << 20)),
            }
            let _ = tx.send(t.elapsed());
        });
        let r = rx.recv_timeout(Duration::from_secs(2));
        gate.set(1);
        futures::executor::block_on(held)?;
        let after = rx.recv().ok();
        let _ = th.join();
        match r {
            Ok(d) => println!("{what}: returned in {d:?} while another stream was held"),
            Err(_) => println!("{what}: still blocked after 2 s while another stream was held; returned {after:?} after the gate opened"),
        }
    }
    Ok(())
}
