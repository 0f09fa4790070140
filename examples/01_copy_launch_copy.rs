//! Example 1: one async copy in, one kernel, one copy out, awaited as one job.
//!
//! `cargo run -p host --release --example 01_copy_launch_copy`
//! (HOST_BACKEND=cpu runs it on the CPU emulation.)

use gpufeed::{Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Stream};

#[tokio::main]
async fn main() -> gpufeed::Result<()> {
    let device = Device::from_env()?;
    println!("{}", device.banner());
    let n = 1 << 24;

    // Pinned host memory from a caching pool: the first allocation pays the
    // driver, the next ones are reused in well under a microsecond.
    let pool = PinnedPool::new(&device);
    let mut input = pool.alloc::<f32>(n)?;
    for (i, v) in input.as_mut_slice().iter_mut().enumerate() {
        *v = (i % 1000) as f32 * 0.001 + 0.5;
    }
    let output = pool.alloc::<f32>(n)?;
    let dev = DeviceBuffer::<f32>::new(&device, n)?;
    let stream = Stream::new(&device)?;

    // The job owns the three buffers until the GPU is done with them; the
    // closure only borrows them to enqueue the commands. `view_mut` borrows
    // the device buffer for the whole batch: take it once, reuse it.
    let job = stream.run((input, dev, output), |c, (i, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.kernel(Kernel::Scale { s: 2.0 }, d)?;
        c.copy_d2h(d, o.host_mut())
    });
    // The CPU is free here: do other work, or just await.
    let ((input, _dev, output), ()) = job.await?;

    let wrong = input
        .as_slice()
        .iter()
        .zip(output.as_slice())
        .filter(|(x, y)| **x * 2.0 != **y)
        .count();
    println!("{n} floats copied in, scaled by 2, copied out: {wrong} wrong");
    if wrong > 0 {
        return Err(gpufeed::Error::InvalidArgument("wrong results".into()));
    }
    Ok(())
}
