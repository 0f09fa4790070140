//! `host wait-path`: where an awaited copy's time goes beyond the driver's
//! own wait. One copy at a time (H2D, pinned host memory), issued and
//! waited for in seven ways, the ways taking turns round by round:
//!
//! - `stream_sync`: `cuMemcpyHtoDAsync` + `cuStreamSynchronize` (the raw copy);
//! - `event_sync`: + `cuEventRecord`, then `cuEventSynchronize`, same thread;
//! - `event_query`: + `cuEventRecord`, then `cuEventQuery` in a loop;
//! - `handoff_sync`: + `cuEventRecord`; another (spinning) thread waits with
//!   `cuEventSynchronize` and sets a flag the issuing thread spins on: the
//!   shape of our watcher and `gpufeed::block_on`, in plain driver calls;
//! - `handoff_query`: the same, the other thread looping on `cuEventQuery`;
//! - `ours_run_sync`: `Stream::run_sync` with `copy_h2d`;
//! - `ours_awaited`: `gpufeed::block_on(stream.run(.. copy_h2d ..))`.
//!
//! Each way: microseconds per copy (median of rounds of `copies` copies),
//! and of that the time to issue (the driver calls, or `stream.run`
//! returning its job; not split for `run_sync`).
//! The differences say what the event record, the hand-off to a second
//! thread and our own layers each cost. CUDA only.

use super::bandwidth::raw::{self, check};
use super::report::{median, write_json, Meta};
use cudarc::driver::sys;
use gpufeed::{Device, DeviceBuffer, PinnedBuffer, PinnedHost, Stream};
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Way {
    StreamSync,
    EventSync,
    EventQuery,
    HandoffSync,
    HandoffQuery,
    OursRunSync,
    OursAwaited,
}

const WAYS: [Way; 7] = [
    Way::StreamSync,
    Way::EventSync,
    Way::EventQuery,
    Way::HandoffSync,
    Way::HandoffQuery,
    Way::OursRunSync,
    Way::OursAwaited,
];

#[derive(Serialize)]
struct Row {
    bytes: usize,
    way: Way,
    us_per_copy: f64,
    /// Of which issuing (None: not split).
    issue_us: Option<f64>,
    /// us_per_copy over stream_sync's, same size.
    over_stream_sync: f64,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    copies_per_round: usize,
    rounds: usize,
    rows: Vec<Row>,
}

/// The other thread of the hand-off ways: it waits for each event it is
/// handed (`cuEventSynchronize`, or `cuEventQuery` in a loop) and raises
/// `done`. It spins on `slot` between events, as our watcher does between
/// back-to-back jobs.
struct Helper {
    /// The event to wait for (a `CUevent` as usize; 0: none).
    slot: Arc<AtomicUsize>,
    query: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<gpufeed::Result<()>>>,
}

impl Helper {
    fn start(raw: &raw::Raw) -> gpufeed::Result<Helper> {
        let slot = Arc::new(AtomicUsize::new(0));
        let query = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, q, d, st) = (slot.clone(), query.clone(), done.clone(), stop.clone());
        let ctx = raw.context();
        let thread = std::thread::spawn(move || -> gpufeed::Result<()> {
            ctx.bind_to_thread().map_err(|e| gpufeed::Error::Driver {
                call: "cuCtxSetCurrent",
                code: format!("{:?}", e.0),
            })?;
            while !st.load(Ordering::Acquire) {
                let ev = s.swap(0, Ordering::Acquire);
                if ev == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let ev = ev as sys::CUevent;
                if q.load(Ordering::Relaxed) {
                    loop {
                        // SAFETY: the issuing thread keeps the event alive
                        // until `done` is raised.
                        let r = unsafe { sys::cuEventQuery(ev) };
                        if r != sys::CUresult::CUDA_ERROR_NOT_READY {
                            check(r, "cuEventQuery")?;
                            break;
                        }
                    }
                } else {
                    // SAFETY: as above.
                    check(unsafe { sys::cuEventSynchronize(ev) }, "cuEventSynchronize")?;
                }
                d.store(true, Ordering::Release);
            }
            Ok(())
        });
        Ok(Helper {
            slot,
            query,
            done,
            stop,
            thread: Some(thread),
        })
    }

    /// Hands `ev` over and spins until the helper says it is done.
    fn wait(&self, ev: sys::CUevent, query: bool) -> gpufeed::Result<()> {
        self.query.store(query, Ordering::Relaxed);
        self.done.store(false, Ordering::Relaxed);
        self.slot.store(ev as usize, Ordering::Release);
        let t = Instant::now();
        while !self.done.load(Ordering::Acquire) {
            if t.elapsed().as_secs() > 10 {
                return Err(gpufeed::Error::Internal(
                    "the wait-path helper thread stopped answering".into(),
                ));
            }
            std::hint::spin_loop();
        }
        Ok(())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One raw round: `copies` copies of `b`, each waited for the `way` way.
fn raw_round(
    r: &raw::Raw,
    b: &raw::Buffers,
    ev: sys::CUevent,
    helper: &Helper,
    way: Way,
    copies: usize,
) -> gpufeed::Result<(f64, f64)> {
    let t = Instant::now();
    let mut issue = 0.0;
    for _ in 0..copies {
        let t0 = Instant::now();
        // SAFETY: `b` outlives the round, and every copy is waited for
        // below before the next is issued.
        unsafe { r.enqueue(b, true)? };
        if way == Way::StreamSync {
            issue += t0.elapsed().as_secs_f64();
            r.sync()?;
            continue;
        }
        // SAFETY: a live event of this context, recorded on our stream.
        check(unsafe { sys::cuEventRecord(ev, r.stream) }, "cuEventRecord")?;
        issue += t0.elapsed().as_secs_f64();
        match way {
            // SAFETY: as above.
            Way::EventSync => check(unsafe { sys::cuEventSynchronize(ev) }, "cuEventSynchronize")?,
            Way::EventQuery => loop {
                // SAFETY: as above.
                let q = unsafe { sys::cuEventQuery(ev) };
                if q != sys::CUresult::CUDA_ERROR_NOT_READY {
                    check(q, "cuEventQuery")?;
                    break;
                }
            },
            Way::HandoffSync => helper.wait(ev, false)?,
            _ => helper.wait(ev, true)?,
        }
    }
    Ok((t.elapsed().as_secs_f64(), issue))
}

/// Runs `rounds` rounds (after a warm-up) of `copies` copies per way and size.
pub fn run(
    device: &Device,
    sizes: &[usize],
    copies: usize,
    rounds: usize,
    out: &Path,
) -> gpufeed::Result<()> {
    let Some(r) = raw::Raw::new(device) else {
        println!("wait-path: plain driver calls need a CUDA device; not measured on this backend");
        return Ok(());
    };
    let mut ev = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: out-pointer to a local; the context is current (Raw::new).
    let created = unsafe { sys::cuEventCreate(&mut ev, flags) };
    check(created, "cuEventCreate")?;
    let helper = Helper::start(&r)?;
    let stream = Stream::new(device)?;
    let mut rows = Vec::new();
    for &bytes in sizes {
        let b = r.buffers(bytes)?;
        let mut pair = Some((
            PinnedBuffer::<u8>::from_slice(device, &vec![0x5a; bytes])?,
            DeviceBuffer::<u8>::new(device, bytes)?,
        ));
        let mut times = vec![Vec::new(); WAYS.len()];
        let mut issues = vec![Vec::new(); WAYS.len()];
        for round in 0..=rounds {
            for (k, &way) in WAYS.iter().enumerate() {
                let (s, issue) = match way {
                    Way::OursRunSync => {
                        let mut p = pair
                            .take()
                            .ok_or_else(|| gpufeed::Error::Internal("lost the buffers".into()))?;
                        let t = Instant::now();
                        for _ in 0..copies {
                            (p, ()) = stream
                                .run_sync(p, |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()))?;
                        }
                        pair = Some(p);
                        (t.elapsed().as_secs_f64(), None)
                    }
                    Way::OursAwaited => {
                        let mut p = pair
                            .take()
                            .ok_or_else(|| gpufeed::Error::Internal("lost the buffers".into()))?;
                        let t = Instant::now();
                        let mut issue = 0.0;
                        for _ in 0..copies {
                            let t0 = Instant::now();
                            let job = stream.run(p, |c, (h, d)| c.copy_h2d(h.host(), d.view_mut()));
                            issue += t0.elapsed().as_secs_f64();
                            (p, ()) = gpufeed::block_on(job)?;
                        }
                        pair = Some(p);
                        (t.elapsed().as_secs_f64(), Some(issue))
                    }
                    _ => {
                        let (s, issue) = raw_round(&r, &b, ev, &helper, way, copies)?;
                        (s, Some(issue))
                    }
                };
                if round > 0 {
                    times[k].push(s * 1e6 / copies as f64);
                    issues[k].extend(issue.map(|i| i * 1e6 / copies as f64));
                }
            }
        }
        let base = median(&times[0]);
        for (k, &way) in WAYS.iter().enumerate() {
            let us = median(&times[k]);
            rows.push(Row {
                bytes,
                way,
                us_per_copy: us,
                issue_us: (!issues[k].is_empty()).then(|| median(&issues[k])),
                over_stream_sync: us / base,
            });
        }
    }
    drop(helper);
    // SAFETY: our event; every wait on it has returned.
    unsafe {
        sys::cuEventDestroy_v2(ev);
    }
    println!("one H2D copy at a time, waited for in seven ways (µs per copy, medians of {rounds} rounds of {copies}):");
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>8}",
        "way", "bytes", "µs/copy", "issue µs", "÷ raw"
    );
    for row in &rows {
        println!(
            "{:<20} {:>10} {:>10.2} {:>10} {:>7.3}x",
            format!("{:?}", row.way),
            row.bytes,
            row.us_per_copy,
            row.issue_us.map_or("-".into(), |i| format!("{i:.2}")),
            row.over_stream_sync
        );
    }
    write_json(
        &out.join("wait_path.json"),
        &Results {
            meta: Meta::new(device),
            copies_per_round: copies,
            rounds,
            rows,
        },
    )
}
