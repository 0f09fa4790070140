//! What the small-transfer benchmark (`host small-transfers`) exercises,
//! checked for correctness, not timed: many small copies in flight at once
//! (64 buffer pairs, 4 KiB to 1 MiB, both directions) all land with the
//! right bytes, whether each copy is its own job, the 64 copies are one job,
//! or a window keeps 64 jobs outstanding. One test per backend
//! (`gpufeed::backend_tests!`).

use futures::executor::block_on;
use futures::stream::{FuturesUnordered, StreamExt};
use gpufeed::testing::serial;
use gpufeed::{Commands, Device, DeviceBuffer, Job, PinnedHost, PinnedPool, PooledBuffer, Stream};

const IN_FLIGHT: usize = 64;
const SIZES: [usize; 4] = [4 << 10, 64 << 10, 256 << 10, 1 << 20];

struct Slot {
    host: PooledBuffer<u64>,
    dev: DeviceBuffer<u64>,
    back: PooledBuffer<u64>,
}

/// Fresh random bytes, never zero (each byte's lowest bit set); handled as
/// 8-byte words, so a debug build fills and compares quickly.
fn fill(v: &mut [u64], rng: &mut fastrand::Rng) {
    for w in v {
        *w = rng.u64(..) | 0x0101_0101_0101_0101;
    }
}

/// A job per slot, dealt over the streams, all in flight at once, then all
/// awaited.
fn each_its_own_job(
    streams: &[Stream],
    v: Vec<Slot>,
    f: for<'a> fn(&mut Commands<'a>, &'a mut Slot) -> gpufeed::Result<()>,
) -> Vec<Slot> {
    let jobs: Vec<Job<Slot, ()>> = v
        .into_iter()
        .enumerate()
        .map(|(i, s)| streams[i % streams.len()].run(s, f))
        .collect();
    block_on(futures::future::try_join_all(jobs))
        .unwrap()
        .into_iter()
        .map(|(s, ())| s)
        .collect()
}

fn up<'a>(c: &mut Commands<'a>, s: &'a mut Slot) -> gpufeed::Result<()> {
    c.copy_h2d(s.host.host(), s.dev.view_mut())
}

fn down<'a>(c: &mut Commands<'a>, s: &'a mut Slot) -> gpufeed::Result<()> {
    let Slot { dev, back, .. } = s;
    c.copy_d2h(dev.view(), back.host_mut())
}

/// Both copies of a slot in one batch: up, then back down.
fn both<'a>(c: &mut Commands<'a>, s: &'a mut Slot) -> gpufeed::Result<()> {
    let Slot { host, dev, back } = s;
    let d = dev.view_mut();
    c.copy_h2d(host.host(), d)?;
    c.copy_d2h(d, back.host_mut())
}

fn slots(device: &Device, pool: &PinnedPool, bytes: usize, rng: &mut fastrand::Rng) -> Vec<Slot> {
    (0..IN_FLIGHT)
        .map(|_| {
            let n = bytes / 8;
            let mut host = pool.alloc::<u64>(n).unwrap();
            fill(host.as_mut_slice(), rng);
            let mut back = pool.alloc::<u64>(n).unwrap();
            back.as_mut_slice().fill(0);
            Slot {
                host,
                dev: DeviceBuffer::new(device, n).unwrap(),
                back,
            }
        })
        .collect()
}

/// Every slot's bytes came back, and no slot got another's.
fn check(slots: &[Slot], what: &str) {
    for (i, s) in slots.iter().enumerate() {
        assert!(
            s.back.as_slice() == s.host.as_slice(),
            "{what}: slot {i} of {} bytes came back wrong",
            s.host.len() * 8
        );
    }
}

fn refresh(slots: &mut [Slot], rng: &mut fastrand::Rng) {
    for s in slots {
        fill(s.host.as_mut_slice(), rng);
        s.back.as_mut_slice().fill(0);
    }
}

gpufeed::backend_tests!(sixty_four_small_copies_in_flight_all_land);
fn sixty_four_small_copies_in_flight_all_land(device: Device) {
    let _serial = serial();
    let pool = PinnedPool::new(&device);
    let streams = [Stream::new(&device).unwrap(), Stream::new(&device).unwrap()];
    let mut rng = fastrand::Rng::with_seed(0x5EED_0064);
    for bytes in SIZES {
        let mut v = slots(&device, &pool, bytes, &mut rng);

        // 64 separate jobs each way, all in flight at once, over two streams;
        // every upload is awaited before the downloads are issued.
        v = each_its_own_job(&streams, v, up);
        v = each_its_own_job(&streams, v, down);
        check(&v, "64 separate jobs");

        // One job of 64 uploads, then one of 64 downloads, fresh data.
        refresh(&mut v, &mut rng);
        let (w, ()) = block_on(streams[0].run(v, |c, v| {
            for s in v.iter_mut() {
                up(c, s)?;
            }
            Ok(())
        }))
        .unwrap();
        let (w, ()) = block_on(streams[0].run(w, |c, v| {
            for s in v.iter_mut() {
                down(c, s)?;
            }
            Ok(())
        }))
        .unwrap();
        v = w;
        check(&v, "one job of 64 copies each way");

        // A window of 64 jobs, each slot's round trip issued as its own job
        // when its buffers come back; three times round, fresh data first.
        refresh(&mut v, &mut rng);
        let stream = &streams[1];
        let round_trip = |s: Slot| stream.run(s, both);
        let mut pending: FuturesUnordered<_> = v.into_iter().map(round_trip).collect();
        let (mut issued, mut done) = (IN_FLIGHT, Vec::new());
        block_on(async {
            while let Some(r) = pending.next().await {
                let (s, ()) = r.unwrap();
                if issued < 3 * IN_FLIGHT {
                    issued += 1;
                    pending.push(round_trip(s));
                } else {
                    done.push(s);
                }
            }
        });
        assert_eq!(done.len(), IN_FLIGHT);
        check(&done, "a window of 64 jobs");

        // run_sync, one at a time, fresh data: the benchmark's blocking mode.
        refresh(&mut done, &mut rng);
        let v: Vec<Slot> = done
            .into_iter()
            .map(|s| {
                let (s, ()) = streams[0].run_sync(s, up).unwrap();
                streams[0].run_sync(s, down).unwrap().0
            })
            .collect();
        check(&v, "run_sync one at a time");
        drop(v);
        pool.empty_cache();
    }
}
