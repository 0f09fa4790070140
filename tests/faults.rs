//! A trapping kernel breaks the context for good: every awaiting future
//! resolves with a typed error (never a hang), and so does every later
//! operation. Its own test binary: a trap poisons the whole CUDA context of
//! the process.

use futures::executor::block_on;
use gpufeed::{DeviceBuffer, Kernel, PinnedBuffer, PinnedHost, Stream};
use std::time::{Duration, Instant};

gpufeed::backend_tests!(a_trap_reaches_every_awaiting_future_and_every_later_call);
fn a_trap_reaches_every_awaiting_future_and_every_later_call(device: gpufeed::Device) {
    let t0 = Instant::now();
    let (s1, s2) = (Stream::new(&device).unwrap(), Stream::new(&device).unwrap());
    let n = 1 << 16;
    let input = PinnedBuffer::<f32>::from_slice(&device, &vec![1.5; n]).unwrap();
    let dev = DeviceBuffer::<f32>::new(&device, n).unwrap();
    let before = s2.run((input, dev), |c, (i, d)| {
        let d = d.view_mut();
        c.copy_h2d(i.host(), d)?;
        c.kernel(Kernel::Scale { s: 2.0 }, d)
    });
    block_on(before).unwrap();
    let trapped = s1.run((), |c, ()| c.trap());
    // Work queued behind the trap fails too; if the trap has already hit,
    // queueing itself reports the broken context.
    let after = s1.record();
    let r = block_on(trapped);
    assert!(
        matches!(&r, Err(e) if matches!(e.error, gpufeed::Error::ContextBroken(_))),
        "{r:?}"
    );
    // The failed job hands its (empty) bundle back: the broken context
    // runs nothing more, so nothing can still be in use.
    assert!(matches!(
        r,
        Err(gpufeed::JobError {
            bundle: Some(()),
            ..
        })
    ));
    match after {
        Ok(ev) => assert!(matches!(
            block_on(ev.wait()),
            Err(gpufeed::Error::ContextBroken(_))
        )),
        Err(e) => assert!(matches!(e, gpufeed::Error::ContextBroken(_)), "{e:?}"),
    }
    // Every later operation reports the broken context.
    assert!(device.broken().is_some());
    for len in [8, 0] {
        let late = PinnedBuffer::<f32>::new(&device, len);
        assert!(
            matches!(late, Err(gpufeed::Error::ContextBroken(_))),
            "{late:?}"
        );
    }
    let late = gpufeed::Registered::new(&device, Vec::<f32>::new());
    assert!(
        matches!(late, Err(gpufeed::Error::ContextBroken(_))),
        "{late:?}"
    );
    assert!(Stream::new(&device).is_err());
    assert!(t0.elapsed() < Duration::from_secs(30), "no hang");
}
