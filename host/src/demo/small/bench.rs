//! The buffers and streams of one size, and a round (timed) or a checked
//! round (fresh data, every byte compared) of any mode on them.

use crate::demo::small::config::{Direction, Mode};
use crate::demo::small::data::{fill, holds, scribble, Data};
use crate::demo::small::ours::{
    awaited_1, awaited_batch, awaited_one_job, awaited_window, issue, run_sync_1, Slot,
};
use crate::demo::small::raw_set::RawSet;
use gpufeed::{PinnedHost, PooledBuffer, Stream};
use std::time::Duration;

/// The buffers and streams of one size.
pub(super) struct Bench<'r> {
    pub(super) rt: &'r tokio::runtime::Runtime,
    /// The stream of every mode of ours...
    pub(super) stream: &'r Stream,
    /// ...but `awaited_64_4_streams`, which spreads its jobs over these
    /// (`stream` first).
    pub(super) streams: &'r [Stream],
    pub(super) slots: Vec<Slot>,
    /// Where a device buffer's bytes are brought back to be checked.
    pub(super) check: Option<PooledBuffer<u64>>,
    pub(super) raw: Option<RawSet<'r>>,
    pub(super) data: Data,
}

impl Bench<'_> {
    /// One round of `copies` copies of `mode`.
    pub(super) fn round(
        &mut self,
        mode: Mode,
        dir: Direction,
        copies: usize,
    ) -> gpufeed::Result<Duration> {
        if mode.is_raw() {
            return match &self.raw {
                Some(r) => r.round(dir, copies, mode == Mode::Raw64),
                None => Err(gpufeed::Error::InvalidArgument(
                    "raw driver copies without a driver".into(),
                )),
            };
        }
        let slots = std::mem::take(&mut self.slots);
        let stream = self.stream;
        let (slots, took) = match mode {
            Mode::RunSync1 => run_sync_1(stream, slots, dir, copies)?,
            Mode::Awaited1 => gpufeed::block_on(awaited_1(stream, slots, dir, copies))?,
            Mode::Awaited1Tokio => self.rt.block_on(awaited_1(stream, slots, dir, copies))?,
            Mode::Awaited64 => gpufeed::block_on(awaited_window(
                std::slice::from_ref(stream),
                slots,
                dir,
                copies,
            ))?,
            Mode::Awaited64Streams4 => {
                gpufeed::block_on(awaited_window(self.streams, slots, dir, copies))?
            }
            Mode::Awaited64Batch => gpufeed::block_on(awaited_batch(stream, slots, dir, copies))?,
            Mode::Awaited64OneJob => {
                gpufeed::block_on(awaited_one_job(stream, slots, dir, copies, false))?
            }
            Mode::Awaited64CopyBatch => {
                gpufeed::block_on(awaited_one_job(stream, slots, dir, copies, true))?
            }
            Mode::Raw1 | Mode::Raw64 => (slots, Duration::ZERO),
        };
        self.slots = slots;
        Ok(took)
    }

    /// One round of 64 copies of `mode` (each buffer once) on fresh random
    /// data: whether every byte arrived, and how long the round took.
    pub(super) fn checked(
        &mut self,
        mode: Mode,
        dir: Direction,
    ) -> gpufeed::Result<(bool, Duration)> {
        if mode.is_raw() {
            return match self.raw.as_mut() {
                Some(r) => r.checked(dir, mode == Mode::Raw64, &mut self.data),
                None => Err(gpufeed::Error::InvalidArgument(
                    "raw driver copies without a driver".into(),
                )),
            };
        }
        let mut slots = std::mem::take(&mut self.slots);
        self.data.fresh();
        for s in &mut slots {
            s.key = self.data.key();
            fill(s.host.as_mut_slice(), &self.data.pattern, s.key);
        }
        if dir == Direction::D2h {
            // To the device first, then the host copy is scribbled over: only
            // the mode's own copy can restore it.
            let mut up = Vec::with_capacity(slots.len());
            for s in slots {
                let (mut s, ()) = self
                    .stream
                    .run_sync(s, |c, s| issue(c, s, Direction::H2d))?;
                scribble(s.host.as_mut_slice());
                up.push(s);
            }
            slots = up;
        }
        let n = slots.len();
        self.slots = slots;
        let took = self.round(mode, dir, n)?;
        let mut ok = true;
        let mut back = Vec::with_capacity(n);
        for s in std::mem::take(&mut self.slots) {
            match dir {
                Direction::D2h => {
                    ok &= holds(s.host.as_slice(), &self.data.pattern, s.key);
                    back.push(s);
                }
                Direction::H2d => {
                    // The device's bytes, brought back into `check`.
                    let mut check = self.check.take().ok_or_else(|| {
                        gpufeed::Error::InvalidArgument("small transfers: check buffer lost".into())
                    })?;
                    scribble(check.as_mut_slice());
                    let ((check, s), ()) = self.stream.run_sync((check, s), |c, (k, s)| {
                        c.copy_d2h(s.dev.view(), k.host_mut())
                    })?;
                    ok &= check.as_slice() == s.host.as_slice()
                        && holds(s.host.as_slice(), &self.data.pattern, s.key);
                    self.check = Some(check);
                    back.push(s);
                }
            }
        }
        self.slots = back;
        Ok((ok, took))
    }
}
