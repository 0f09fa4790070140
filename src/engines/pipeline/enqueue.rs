//! The chunks of a run enqueued on its streams, in either layout: round
//! robin (each chunk copied in, staged and copied out on one stream) or the
//! engines (copy-in, compute and copy-out streams linked by events).

use crate::base::error::{Error, Result};
use crate::engines::pipeline::chunk::{Placement, StageFn};
use crate::engines::pipeline::timeline::ChunkEvents;
use crate::runtime::stream::{Commands, Mark};
use std::ops::Range;

/// Enqueues a run in the round-robin layout: chunk `i` on stream
/// `i % streams` (`cmds`), in that stream's slot, after that slot's last use
/// by an earlier run and, when `chain`, after the previous chunk's copy-in.
pub(super) fn enqueue_round_robin<'a>(
    cmds: &mut [Commands<'a>],
    ranges: &[Range<usize>],
    layout: &Placement<'_>,
    chain: bool,
    free: &mut [Option<Mark>],
    stage: StageFn<'_>,
    mut events: Option<&mut Vec<ChunkEvents>>,
) -> Result<()> {
    let streams = cmds.len();
    let mut chained: Option<Mark> = None;
    for (i, r) in ranges.iter().cloned().enumerate() {
        let s = i % streams;
        let c = &mut cmds[s];
        if let Some(prev) = free[s].take() {
            c.wait_mark(&prev)?;
        }
        if let Some(prev) = chained.take() {
            c.wait_mark(&prev)?;
        }
        chained = enqueue_chunk(c, (i, r), s, layout, chain, stage, events.as_deref_mut())?;
    }
    // Each stream's slot is free once the stream has passed this point.
    for (s, c) in cmds.iter_mut().enumerate().take(ranges.len()) {
        free[s] = Some(c.marker(false)?);
    }
    Ok(())
}

/// Enqueues chunk `i` (elements `r`) on `c`, in `slot`: copy in, the stage,
/// copy out, with the chunk's four timed points when `events` records them.
/// Returns, when `chain`, the point after its copy-in.
fn enqueue_chunk(
    c: &mut Commands<'_>,
    (i, r): (usize, Range<usize>),
    slot: usize,
    layout: &Placement<'_>,
    chain: bool,
    stage: StageFn<'_>,
    events: Option<&mut Vec<ChunkEvents>>,
) -> Result<Option<Mark>> {
    let timeline = events.is_some();
    let t0 = timeline.then(|| c.marker(true)).transpose()?;
    layout.copy_in(c, &r, slot)?;
    let chained = if chain { Some(c.marker(false)?) } else { None };
    let t1 = timeline.then(|| c.marker(true)).transpose()?;
    stage(c, &layout.chunk(i, r.clone(), slot))?;
    let t2 = timeline.then(|| c.marker(true)).transpose()?;
    layout.copy_out(c, &r, slot)?;
    if let (Some(ev), Some(t0), Some(t1), Some(t2)) = (events, t0, t1, t2) {
        let t3 = c.marker(true)?;
        ev.push(ChunkEvents {
            chunk: i,
            stream: slot,
            events: [t0, t1, t2, t3],
        });
    }
    Ok(chained)
}

/// Enqueues a run in the engines layout: copy-in, compute and copy-out
/// streams (`cmds[0..3]`), linked by events, over a ring of slots.
pub(super) fn enqueue_engines<'a>(
    cmds: &mut [Commands<'a>],
    ranges: &[Range<usize>],
    layout: &Placement<'_>,
    free: &mut [Option<Mark>],
    stage: StageFn<'_>,
    mut events: Option<&mut Vec<ChunkEvents>>,
) -> Result<()> {
    let [cin, ck, cout] = cmds else {
        return Err(Error::InvalidArgument(
            "the engines layout needs exactly three streams".into(),
        ));
    };
    let slots = layout.scratch.len().max(1);
    let timeline = events.is_some();
    // D2H-done points of the chunks whose slot is still to be reused.
    let mut out_done = std::collections::VecDeque::new();
    for (i, r) in ranges.iter().cloned().enumerate() {
        let slot = i % slots;
        // The slot's previous chunk (of this run, or else of an earlier
        // run) must be out before this one comes in.
        let prev = if i >= slots {
            out_done.pop_front()
        } else {
            free.get_mut(i).and_then(Option::take)
        };
        if let Some(prev) = prev {
            cin.wait_mark(&prev)?;
        }
        let t0 = timeline.then(|| cin.marker(true)).transpose()?;
        layout.copy_in(cin, &r, slot)?;
        // Timed when drawing a timeline, so they serve as its points too.
        let copied = cin.marker(timeline)?;
        ck.wait_mark(&copied)?;
        stage(ck, &layout.chunk(i, r.clone(), slot))?;
        let computed = ck.marker(timeline)?;
        cout.wait_mark(&computed)?;
        layout.copy_out(cout, &r, slot)?;
        out_done.push_back(cout.marker(false)?);
        if let (Some(ev), Some(t0)) = (events.as_mut(), t0) {
            let t3 = cout.marker(true)?;
            ev.push(ChunkEvents {
                chunk: i,
                stream: 0,
                events: [t0, copied, computed, t3],
            });
        }
    }
    // The last chunks' slots are free once their D2H is done.
    let first_left = ranges.len() - out_done.len();
    for (k, done) in out_done.into_iter().enumerate() {
        if let Some(slot) = free.get_mut((first_left + k) % slots) {
            *slot = Some(done);
        }
    }
    Ok(())
}
