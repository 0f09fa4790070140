//! A user's program outside the repository: the library as a dependency
//! with its default features, one job (copy in, scale, copy out) on the
//! device `Device::from_env` opens (the CPU emulation without a GPU), every
//! element checked against a plain loop.

use gpufeed::{block_on, Device, DeviceBuffer, Kernel, PinnedHost, PinnedPool, Stream};

fn main() -> gpufeed::Result<()> {
    let n = 100_003;
    let device = Device::from_env()?;
    let pool = PinnedPool::new(&device);
    let stream = Stream::new(&device)?;
    let mut input = pool.alloc::<f32>(n)?;
    for (i, v) in input.as_mut_slice().iter_mut().enumerate() {
        *v = i as f32 * 0.5 - 7.0;
    }
    let mut output = pool.alloc::<f32>(n)?;
    output.as_mut_slice().fill(f32::NAN);
    let dev = DeviceBuffer::<f32>::new(&device, n)?;
    let ((input, _dev, output), ()) = block_on(stream.run((input, dev, output), |c, (i, d, o)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.kernel(Kernel::Scale { s: 3.0 }, d)?;
        c.copy_d2h(d, o.host_mut())
    }))?;
    let bad = input
        .as_slice()
        .iter()
        .zip(output.as_slice())
        .filter(|(x, y)| (**x * 3.0).to_bits() != y.to_bits())
        .count();
    if bad != 0 {
        eprintln!("outside: {bad} of {n} elements wrong");
        std::process::exit(1);
    }
    println!("outside: {n} elements scaled on {:?}, every one checked", device.kind());
    Ok(())
}
