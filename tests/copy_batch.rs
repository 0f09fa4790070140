//! `Commands::copy_batch`: many copies as one command (one
//! `cuMemcpyBatchAsync` on CUDA). Every byte lands where it should, in all
//! three directions, with pieces of uneven lengths in scrambled order; a
//! batch whose copies would race (a destination overlapping another copy's
//! range) or whose lengths differ is refused before anything is enqueued,
//! and the buffers come back untouched. One test per backend.

use futures::executor::block_on;
use gpufeed::testing::serial;
use gpufeed::{DeviceBuffer, Error, PinnedBuffer, PinnedHost, Stream, Transfer};

/// Fresh random words, never zero.
fn random(n: usize, rng: &mut fastrand::Rng) -> Vec<u32> {
    (0..n).map(|_| rng.u32(..) | 0x0101_0101).collect()
}

/// Cuts `0..n` into pieces of uneven lengths (some empty).
fn pieces(n: usize, rng: &mut fastrand::Rng) -> Vec<(usize, usize)> {
    let mut cuts = vec![0, n];
    for _ in 0..40 {
        cuts.push(rng.usize(0..=n));
    }
    cuts.sort_unstable();
    cuts.windows(2).map(|w| (w[0], w[1])).collect()
}

gpufeed::backend_tests!(a_batch_of_copies_lands_every_byte_in_all_three_directions);
fn a_batch_of_copies_lands_every_byte_in_all_three_directions(device: gpufeed::Device) {
    let _serial = serial();
    let mut rng = fastrand::Rng::with_seed(0xba7c);
    let n = 100_003;
    let data = random(n, &mut rng);
    let stream = Stream::new(&device).unwrap();
    let input = PinnedBuffer::from_slice(&device, &data).unwrap();
    let output = PinnedBuffer::<u32>::new(&device, n).unwrap();
    let a = DeviceBuffer::<u32>::new(&device, n).unwrap();
    let b = DeviceBuffer::<u32>::new(&device, n).unwrap();
    // The same pieces in every direction, each batch in its own order:
    // input -> a (reversed), a -> b (shuffled), b -> output (as cut).
    let cut = pieces(n, &mut rng);
    let mut shuffled = cut.clone();
    rng.shuffle(&mut shuffled);
    let ((_, _, _, output), ()) = block_on(stream.run((input, a, b, output), |c, (i, a, b, o)| {
        let (a, b) = (a.view_mut(), b.view_mut());
        let up = cut
            .iter()
            .rev()
            .map(|&(s, e)| Ok(Transfer::h2d(i.host().range(s..e)?, a.range(s..e)?)))
            .collect::<gpufeed::Result<Vec<_>>>()?;
        c.copy_batch(up)?;
        let across = shuffled
            .iter()
            .map(|&(s, e)| Ok(Transfer::d2d(a.range(s..e)?, b.range(s..e)?)))
            .collect::<gpufeed::Result<Vec<_>>>()?;
        c.copy_batch(across)?;
        // Disjoint host destinations: split the output as cut.
        let mut rest = o.host_mut();
        let mut down = Vec::new();
        for &(s, e) in &cut {
            let (piece, tail) = rest.split_at(e - s)?;
            down.push(Transfer::d2h(b.range(s..e)?, piece));
            rest = tail;
        }
        c.copy_batch(down)
    }))
    .unwrap();
    assert_eq!(output.as_slice(), &data[..], "{}", device.kind());
}

gpufeed::backend_tests!(a_batch_whose_copies_would_race_is_refused_and_loses_nothing);
fn a_batch_whose_copies_would_race_is_refused_and_loses_nothing(device: gpufeed::Device) {
    let _serial = serial();
    let mut rng = fastrand::Rng::with_seed(0x0ace);
    let n = 4096;
    let data = random(n, &mut rng);
    let before = random(n, &mut rng);
    let stream = Stream::new(&device).unwrap();
    let input = PinnedBuffer::from_slice(&device, &data).unwrap();
    let back = PinnedBuffer::from_slice(&device, &before).unwrap();
    let mut dev = DeviceBuffer::<u32>::new(&device, n).unwrap();
    // The device buffer starts as `before`.
    (_, dev) = {
        let ((b, d), ()) = block_on(stream.copy_h2d(back, dev)).unwrap();
        (b, d)
    };
    let mut bundle = (input, dev);
    type Case = for<'a> fn(
        &mut gpufeed::Commands<'a>,
        gpufeed::HostSlice<'a, u32>,
        gpufeed::DeviceSliceMut<'a, u32>,
    ) -> gpufeed::Result<()>;
    let cases: [(&str, Case, bool); 4] = [
        (
            "two destinations overlap",
            |c, i, d| {
                c.copy_batch([
                    Transfer::h2d(i.range(0..100)?, d.range(0..100)?),
                    Transfer::h2d(i.range(100..200)?, d.range(50..150)?),
                ])
            },
            true,
        ),
        (
            "a source overlaps another copy's destination",
            |c, i, d| {
                c.copy_batch([
                    Transfer::h2d(i.range(0..100)?, d.range(0..100)?),
                    Transfer::d2d(d.range(90..190)?, d.range(1000..1100)?),
                ])
            },
            true,
        ),
        (
            "a device-to-device copy overlaps itself",
            |c, _, d| c.copy_batch([Transfer::d2d(d.range(0..100)?, d.range(50..150)?)]),
            true,
        ),
        (
            "lengths differ",
            |c, i, d| {
                c.copy_batch([
                    Transfer::h2d(i.range(0..100)?, d.range(0..100)?),
                    Transfer::h2d(i.range(100..200)?, d.range(200..201)?),
                ])
            },
            false,
        ),
    ];
    for (what, case, overlap) in cases {
        let err = block_on(stream.run(bundle, move |c, (i, d)| case(c, i.host(), d.view_mut())))
            .unwrap_err();
        if overlap {
            assert!(
                matches!(err.error, Error::Overlap { .. }),
                "{}: {what}: {err}",
                device.kind()
            );
        } else {
            assert!(
                matches!(err.error, Error::LengthMismatch { .. }),
                "{}: {what}: {err}",
                device.kind()
            );
        }
        bundle = err.bundle.expect("a refused batch hands the buffers back");
    }
    // Nothing was copied: the device buffer still holds `before`.
    let (input, dev) = bundle;
    assert_eq!(input.as_slice(), &data[..]);
    let out = PinnedBuffer::<u32>::new(&device, n).unwrap();
    let ((_, out), ()) = block_on(stream.copy_d2h(dev, out)).unwrap();
    assert_eq!(out.as_slice(), &before[..], "{}", device.kind());
}

gpufeed::backend_tests!(a_batch_of_thousands_of_one_word_copies_lands_every_word);
fn a_batch_of_thousands_of_one_word_copies_lands_every_word(device: gpufeed::Device) {
    let _serial = serial();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let n = 10_000;
    let data = random(n, &mut rng);
    let stream = Stream::new(&device).unwrap();
    let input = PinnedBuffer::from_slice(&device, &data).unwrap();
    let output = PinnedBuffer::<u32>::new(&device, n).unwrap();
    let dev = DeviceBuffer::<u32>::new(&device, n).unwrap();
    // Word i goes to position n-1-i on the device, and back in place.
    let ((_, _, output), ()) = block_on(stream.run((input, dev, output), |c, (i, d, o)| {
        let d = d.view_mut();
        let up = (0..n)
            .map(|k| {
                Ok(Transfer::h2d(
                    i.host().range(k..k + 1)?,
                    d.range(n - 1 - k..n - k)?,
                ))
            })
            .collect::<gpufeed::Result<Vec<_>>>()?;
        c.copy_batch(up)?;
        let mut rest = o.host_mut();
        let mut down = Vec::with_capacity(n);
        for k in 0..n {
            let (word, tail) = rest.split_at(1)?;
            down.push(Transfer::d2h(d.range(n - 1 - k..n - k)?, word));
            rest = tail;
        }
        c.copy_batch(down)
    }))
    .unwrap();
    assert_eq!(output.as_slice(), &data[..], "{}", device.kind());
}
