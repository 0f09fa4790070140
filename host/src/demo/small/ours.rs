//! The library's modes: a slot (a pinned buffer and a device buffer), its
//! one copy as a command, a transfer or a job, and the rounds of copies
//! run synchronously, awaited one by one, in a window, joined, or in one
//! job.

use crate::demo::small::config::Direction;
use futures::stream::{FuturesUnordered, StreamExt};
use gpufeed::{Commands, DeviceBuffer, Job, PinnedHost, PooledBuffer, Stream, Transfer};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A host buffer and a device buffer copied between; `key` names the data
/// the last checked copy should have left in them.
pub(super) struct Slot {
    pub(super) host: PooledBuffer<u64>,
    pub(super) dev: DeviceBuffer<u64>,
    pub(super) key: u64,
}

/// The one copy of a slot, in a batch.
pub(super) fn issue<'a>(
    c: &mut Commands<'a>,
    s: &'a mut Slot,
    dir: Direction,
) -> gpufeed::Result<()> {
    let Slot { host, dev, .. } = s;
    match dir {
        Direction::H2d => c.copy_h2d(host.host(), dev.view_mut()),
        Direction::D2h => c.copy_d2h(dev.view(), host.host_mut()),
    }
}

/// The one copy of a slot, as a part of a [`Commands::copy_batch`].
fn transfer(s: &mut Slot, dir: Direction) -> Transfer<'_, u64> {
    let Slot { host, dev, .. } = s;
    match dir {
        Direction::H2d => Transfer::h2d(host.host(), dev.view_mut()),
        Direction::D2h => Transfer::d2h(dev.view(), host.host_mut()),
    }
}

/// A job of the one copy of a slot.
pub(super) fn job(stream: &Stream, s: Slot, dir: Direction) -> Job<Slot, ()> {
    stream.run(s, move |c, s| issue(c, s, dir))
}

pub(super) fn run_sync_1(
    stream: &Stream,
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let mut q: VecDeque<Slot> = slots.into();
    let t = Instant::now();
    for _ in 0..copies {
        let Some(s) = q.pop_front() else { break };
        let (s, ()) = stream.run_sync(s, |c, s| issue(c, s, dir))?;
        q.push_back(s);
    }
    let took = t.elapsed();
    Ok((q.into(), took))
}

pub(super) async fn awaited_1(
    stream: &Stream,
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let mut q: VecDeque<Slot> = slots.into();
    let t = Instant::now();
    for _ in 0..copies {
        let Some(s) = q.pop_front() else { break };
        let (s, ()) = job(stream, s, dir).await?;
        q.push_back(s);
    }
    let took = t.elapsed();
    Ok((q.into(), took))
}

/// 64 jobs outstanding: each slot's next copy is issued as soon as its last
/// one resolves, on the next of `streams` in turn.
pub(super) async fn awaited_window(
    streams: &[Stream],
    slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    let mut next = streams.iter().cycle();
    let mut issue_next = |s: Slot| {
        next.next()
            .map(|stream| job(stream, s, dir))
            .ok_or_else(|| gpufeed::Error::InvalidArgument("a window over no stream".into()))
    };
    let mut done = Vec::with_capacity(slots.len());
    let mut pending = FuturesUnordered::new();
    let mut issued = 0;
    for s in slots {
        if issued < copies {
            pending.push(issue_next(s)?);
            issued += 1;
        } else {
            done.push(s);
        }
    }
    while let Some(r) = pending.next().await {
        let (s, ()) = r?;
        if issued < copies {
            pending.push(issue_next(s)?);
            issued += 1;
        } else {
            done.push(s);
        }
    }
    Ok((done, t.elapsed()))
}

/// A job per slot, then all of them awaited; `copies / 64` times.
pub(super) async fn awaited_batch(
    stream: &Stream,
    mut slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    for _ in 0..copies / slots.len().max(1) {
        let jobs: Vec<_> = slots.into_iter().map(|s| job(stream, s, dir)).collect();
        slots = futures::future::try_join_all(jobs)
            .await?
            .into_iter()
            .map(|(s, ())| s)
            .collect();
    }
    Ok((slots, t.elapsed()))
}

/// One job copying every slot, awaited; `copies / 64` times.
pub(super) async fn awaited_one_job(
    stream: &Stream,
    mut slots: Vec<Slot>,
    dir: Direction,
    copies: usize,
    batched: bool,
) -> gpufeed::Result<(Vec<Slot>, Duration)> {
    let t = Instant::now();
    for _ in 0..copies / slots.len().max(1) {
        (slots, ()) = stream
            .run(slots, move |c, v| {
                if batched {
                    return c.copy_batch(v.iter_mut().map(|s| transfer(s, dir)));
                }
                for s in v.iter_mut() {
                    issue(c, s, dir)?;
                }
                Ok(())
            })
            .await?;
    }
    Ok((slots, t.elapsed()))
}
