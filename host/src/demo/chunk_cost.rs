//! `host chunk-cost`: where a pipeline's per-chunk cost goes, measured with
//! plain driver calls (no library code in the loop). The same bytes go in
//! on one stream while the same bytes go out on another (the bidirectional
//! copy bound), cut into `P` pieces per direction, with:
//!
//! - `plain`: `P` copies per direction, nothing else;
//! - `+record`: an event recorded after every piece (what a pipeline's
//!   per-chunk markers cost);
//! - `+wait`: before every piece, a wait on an event that has already
//!   completed (what a per-chunk dependency costs when nothing is waited
//!   for);
//!
//! - `two-streams`: the pieces of each direction dealt alternately to two
//!   streams, so two copies per direction are in flight and one's start-up
//!   overlaps the other's end;
//! - `batch`: one `cuMemcpyBatchAsync` per direction carrying all `P`
//!   pieces (CUDA 12.8+: the pieces of a batch are not ordered among
//!   themselves);
//! - `batch-each`: every piece its own one-copy `cuMemcpyBatchAsync` (the
//!   batch call's per-operation cost, which a pipeline, needing a
//!   dependency per chunk, would pay);
//!
//! - `chained`: a pipeline's copy skeleton: piece *i* goes out (from the
//!   device copy of what came in) only after piece *i* has come in (an
//!   event per piece, recorded on the way in, waited for on the way out):
//!   the whole copy bound plus one piece plus the pieces' fixed costs;
//! - `graph`, `chained-graph`: `plain` and `chained` captured once into a
//!   CUDA graph (stream capture) and launched as one graph: whether the
//!   graph executor hands the copy engines their pieces for less;
//!
//! and the host time to issue each piece. `P = 1` is the whole-array bound;
//! the extra time per extra piece is the per-piece cost.
//!
//! A second table: 64 small copies (4 KiB to 4 MiB) in one direction, as 64
//! `cuMemcpyAsync` calls on one stream, dealt over two streams, and as one
//! batch, then one synchronize: copies per second.

use super::bandwidth::raw::check;
use super::report::{median, write_json, Meta};
use cudarc::driver::sys;
use gpufeed::{BackendKind, Device, Error, Result};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    Plain,
    Record,
    Wait,
    TwoStreams,
    Batch,
    BatchEach,
    Chained,
    Graph,
    ChainedGraph,
}

#[derive(Serialize)]
struct Row {
    mode: Mode,
    pieces: usize,
    /// Median wall ms from the first issue to both streams done.
    ms: f64,
    /// ms / the plain whole-array time.
    over_whole: f64,
    /// (ms - whole) / (pieces - 1) per direction, in µs.
    us_per_extra_piece: f64,
    /// Median host µs to issue one piece (both directions' calls).
    issue_us_per_piece: f64,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    bytes_each_way: usize,
    reps: usize,
    rows: Vec<Row>,
    small: Vec<SmallRow>,
}

#[derive(Serialize)]
struct SmallRow {
    h2d: bool,
    size: usize,
    how: Small,
    copies_per_s: f64,
}

/// The driver objects of the experiment; freed on drop.
struct Rig {
    _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    up: sys::CUstream,
    down: sys::CUstream,
    up2: sys::CUstream,
    down2: sys::CUstream,
    done: sys::CUevent,
    /// Fork and join of a capture (the `down` stream joins `up`'s).
    fork: sys::CUevent,
    join: sys::CUevent,
    /// Instantiated graphs by (mode, pieces), captured at first use.
    graphs: std::cell::RefCell<Vec<((Mode, usize), sys::CUgraphExec)>>,
    events: Vec<sys::CUevent>,
    host_in: *mut std::ffi::c_void,
    host_out: *mut std::ffi::c_void,
    dev_in: sys::CUdeviceptr,
    dev_out: sys::CUdeviceptr,
}

impl Rig {
    fn new(device: &Device, bytes: usize, max_pieces: usize) -> Result<Rig> {
        let ctx =
            cudarc::driver::CudaContext::new(device.ordinal()).map_err(|e| Error::Driver {
                call: "cuDevicePrimaryCtxRetain",
                code: format!("{:?}", e.0),
            })?;
        ctx.bind_to_thread().map_err(|e| Error::Driver {
            call: "cuCtxSetCurrent",
            code: format!("{:?}", e.0),
        })?;
        let mut rig = Rig {
            _ctx: ctx,
            up: std::ptr::null_mut(),
            down: std::ptr::null_mut(),
            up2: std::ptr::null_mut(),
            down2: std::ptr::null_mut(),
            done: std::ptr::null_mut(),
            fork: std::ptr::null_mut(),
            join: std::ptr::null_mut(),
            graphs: std::cell::RefCell::new(Vec::new()),
            events: Vec::new(),
            host_in: std::ptr::null_mut(),
            host_out: std::ptr::null_mut(),
            dev_in: 0,
            dev_out: 0,
        };
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        let no_timing = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out-pointers into `rig` (freed by its Drop whatever
        // succeeded); the context is current on this thread.
        unsafe {
            check(sys::cuStreamCreate(&mut rig.up, flags), "cuStreamCreate")?;
            check(sys::cuStreamCreate(&mut rig.down, flags), "cuStreamCreate")?;
            check(sys::cuStreamCreate(&mut rig.up2, flags), "cuStreamCreate")?;
            check(sys::cuStreamCreate(&mut rig.down2, flags), "cuStreamCreate")?;
            check(
                sys::cuEventCreate(&mut rig.done, no_timing),
                "cuEventCreate",
            )?;
            check(
                sys::cuEventCreate(&mut rig.fork, no_timing),
                "cuEventCreate",
            )?;
            check(
                sys::cuEventCreate(&mut rig.join, no_timing),
                "cuEventCreate",
            )?;
            for _ in 0..2 * max_pieces {
                let mut e = std::ptr::null_mut();
                check(sys::cuEventCreate(&mut e, no_timing), "cuEventCreate")?;
                rig.events.push(e);
            }
            let portable = sys::CU_MEMHOSTALLOC_PORTABLE;
            check(
                sys::cuMemHostAlloc(&mut rig.host_in, bytes, portable),
                "cuMemHostAlloc",
            )?;
            check(
                sys::cuMemHostAlloc(&mut rig.host_out, bytes, portable),
                "cuMemHostAlloc",
            )?;
            check(sys::cuMemAlloc_v2(&mut rig.dev_in, bytes), "cuMemAlloc")?;
            check(sys::cuMemAlloc_v2(&mut rig.dev_out, bytes), "cuMemAlloc")?;
            // `done` completes at once: the event every `+wait` piece waits on.
            check(sys::cuEventRecord(rig.done, rig.up), "cuEventRecord")?;
            check(sys::cuStreamSynchronize(rig.up), "cuStreamSynchronize")?;
        }
        Ok(rig)
    }

    /// One run: `bytes` in on `up` while `bytes` go out on `down`, in
    /// `pieces` pieces each. Returns (wall ms, host µs spent issuing).
    fn run(&self, bytes: usize, pieces: usize, mode: Mode) -> Result<(f64, f64)> {
        if let Some(base) = match mode {
            Mode::Graph => Some(Mode::Plain),
            Mode::ChainedGraph => Some(Mode::Chained),
            _ => None,
        } {
            let exec = self.graph(bytes, pieces, mode, base)?;
            let t = Instant::now();
            // SAFETY: a graph of copies inside the rig's allocations (see
            // `issue`); `up` is synchronized before returning.
            unsafe {
                check(sys::cuGraphLaunch(exec, self.up), "cuGraphLaunch")?;
                let issued = t.elapsed().as_secs_f64() * 1e6;
                check(sys::cuStreamSynchronize(self.up), "cuStreamSynchronize")?;
                return Ok((t.elapsed().as_secs_f64() * 1e3, issued));
            }
        }
        let piece = bytes.div_ceil(pieces);
        if mode == Mode::Batch || mode == Mode::BatchEach {
            let t = Instant::now();
            let ranges: Vec<(usize, usize)> = (0..pieces)
                .map(|i| (i * piece, piece.min(bytes.saturating_sub(i * piece))))
                .filter(|&(_, len)| len > 0)
                .collect();
            let h2d = ranges
                .iter()
                .map(|&(off, len)| {
                    (
                        self.dev_in + off as u64,
                        self.host_in as u64 + off as u64,
                        len,
                    )
                })
                .collect::<Vec<_>>();
            let d2h = ranges
                .iter()
                .map(|&(off, len)| {
                    (
                        self.host_out as u64 + off as u64,
                        self.dev_out + off as u64,
                        len,
                    )
                })
                .collect::<Vec<_>>();
            // SAFETY: every range lies inside the allocations of `bytes`;
            // both streams are synchronized before returning.
            unsafe {
                if mode == Mode::Batch {
                    batch(&h2d, self.up)?;
                    batch(&d2h, self.down)?;
                } else {
                    for (u, d) in h2d.iter().zip(&d2h) {
                        batch(std::slice::from_ref(u), self.up)?;
                        batch(std::slice::from_ref(d), self.down)?;
                    }
                }
                let issued = t.elapsed().as_secs_f64() * 1e6;
                check(sys::cuStreamSynchronize(self.up), "cuStreamSynchronize")?;
                check(sys::cuStreamSynchronize(self.down), "cuStreamSynchronize")?;
                return Ok((t.elapsed().as_secs_f64() * 1e3, issued));
            }
        }
        let t = Instant::now();
        // SAFETY: `issue` enqueues copies inside the rig's allocations; every
        // stream is synchronized before returning.
        unsafe {
            self.issue(bytes, pieces, mode)?;
            let issued = t.elapsed().as_secs_f64() * 1e6;
            for s in [self.up, self.down, self.up2, self.down2] {
                check(sys::cuStreamSynchronize(s), "cuStreamSynchronize")?;
            }
            Ok((t.elapsed().as_secs_f64() * 1e3, issued))
        }
    }

    /// The graph of `base` (plain or chained) at `pieces`, captured and
    /// instantiated at its first use, kept for the rig's life.
    fn graph(
        &self,
        bytes: usize,
        pieces: usize,
        mode: Mode,
        base: Mode,
    ) -> Result<sys::CUgraphExec> {
        if let Some(&(_, g)) = self
            .graphs
            .borrow()
            .iter()
            .find(|(k, _)| *k == (mode, pieces))
        {
            return Ok(g);
        }
        // SAFETY: a fork/join capture on our streams: `down` joins `up`'s
        // capture through `fork` and is joined back through `join` before
        // the capture ends; the capture is ended on every path; the copies
        // lie inside the rig's allocations.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(
                    self.up,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "cuStreamBeginCapture",
            )?;
            let captured = (|| {
                check(sys::cuEventRecord(self.fork, self.up), "cuEventRecord")?;
                check(
                    sys::cuStreamWaitEvent(self.down, self.fork, 0),
                    "cuStreamWaitEvent",
                )?;
                self.issue(bytes, pieces, base)?;
                check(sys::cuEventRecord(self.join, self.down), "cuEventRecord")?;
                check(
                    sys::cuStreamWaitEvent(self.up, self.join, 0),
                    "cuStreamWaitEvent",
                )
            })();
            let mut graph = std::ptr::null_mut();
            let ended = check(
                sys::cuStreamEndCapture(self.up, &mut graph),
                "cuStreamEndCapture",
            );
            captured?;
            ended?;
            let mut exec = std::ptr::null_mut();
            let made = check(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "cuGraphInstantiateWithFlags",
            );
            sys::cuGraphDestroy(graph);
            made?;
            self.graphs.borrow_mut().push(((mode, pieces), exec));
            Ok(exec)
        }
    }

    /// Enqueues one run of `mode` (not a batch or graph mode) on the rig's
    /// streams, without waiting.
    ///
    /// # Safety
    /// The caller synchronizes the streams before the rig goes.
    unsafe fn issue(&self, bytes: usize, pieces: usize, mode: Mode) -> Result<()> {
        let piece = bytes.div_ceil(pieces);
        // SAFETY: every range lies inside the allocations of `bytes` made in
        // `new` (`bytes` never exceeds them); events are ours.
        unsafe {
            for i in 0..pieces {
                let off = i * piece;
                let len = piece.min(bytes.saturating_sub(off));
                if len == 0 {
                    break;
                }
                if mode == Mode::Wait {
                    check(
                        sys::cuStreamWaitEvent(self.up, self.done, 0),
                        "cuStreamWaitEvent",
                    )?;
                    check(
                        sys::cuStreamWaitEvent(self.down, self.done, 0),
                        "cuStreamWaitEvent",
                    )?;
                }
                let (up, down) = if mode == Mode::TwoStreams && i % 2 == 1 {
                    (self.up2, self.down2)
                } else {
                    (self.up, self.down)
                };
                check(
                    sys::cuMemcpyHtoDAsync_v2(
                        self.dev_in + off as u64,
                        self.host_in.cast::<u8>().add(off).cast(),
                        len,
                        up,
                    ),
                    "cuMemcpyHtoDAsync",
                )?;
                if mode == Mode::Chained {
                    check(sys::cuEventRecord(self.events[2 * i], up), "cuEventRecord")?;
                    check(
                        sys::cuStreamWaitEvent(down, self.events[2 * i], 0),
                        "cuStreamWaitEvent",
                    )?;
                }
                // Chained: what came in goes out again.
                let from = if mode == Mode::Chained {
                    self.dev_in
                } else {
                    self.dev_out
                };
                check(
                    sys::cuMemcpyDtoHAsync_v2(
                        self.host_out.cast::<u8>().add(off).cast(),
                        from + off as u64,
                        len,
                        down,
                    ),
                    "cuMemcpyDtoHAsync",
                )?;
                if mode == Mode::Record {
                    check(
                        sys::cuEventRecord(self.events[2 * i], self.up),
                        "cuEventRecord",
                    )?;
                    check(
                        sys::cuEventRecord(self.events[2 * i + 1], self.down),
                        "cuEventRecord",
                    )?;
                }
            }
        }
        Ok(())
    }

    /// 64 copies of `size` bytes in one direction (the pieces of the
    /// buffers, from offset 0), issued as `how`, then synchronized: seconds.
    fn small(&self, size: usize, h2d: bool, how: Small) -> Result<f64> {
        let copies: Vec<(u64, u64, usize)> = (0..SMALL_COPIES)
            .map(|i| {
                let off = (i * size) as u64;
                if h2d {
                    (self.dev_in + off, self.host_in as u64 + off, size)
                } else {
                    (self.host_out as u64 + off, self.dev_out + off, size)
                }
            })
            .collect();
        let t = Instant::now();
        // SAFETY: 64 pieces of `size` lie inside the buffers (`run` is called
        // with bytes >= 64 * the largest size); every stream is synchronized
        // before returning.
        unsafe {
            match how {
                Small::Batch => batch(&copies, self.up)?,
                Small::Plain | Small::TwoStreams => {
                    for (i, &(dst, src, len)) in copies.iter().enumerate() {
                        let s = if how == Small::TwoStreams && i % 2 == 1 {
                            self.up2
                        } else {
                            self.up
                        };
                        check(sys::cuMemcpyAsync(dst, src, len, s), "cuMemcpyAsync")?;
                    }
                }
            }
            for s in [self.up, self.up2] {
                check(sys::cuStreamSynchronize(s), "cuStreamSynchronize")?;
            }
        }
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Copies of the small-copy table's rounds.
const SMALL_COPIES: usize = 64;

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
enum Small {
    Plain,
    TwoStreams,
    Batch,
}

/// One `cuMemcpyBatchAsync` on `stream` of `(dst, src, bytes)` copies
/// (unified addresses), the source read in stream order.
///
/// # Safety
/// Every range must be valid for its direction until `stream` has done
/// the batch.
unsafe fn batch(copies: &[(u64, u64, usize)], stream: sys::CUstream) -> Result<()> {
    let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
    // SAFETY: a plain C struct of integers, for which zero is valid (the
    // location hints' "invalid" type: no hint).
    let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    let mut idx = 0usize;
    // SAFETY: the arrays have `copies.len()` entries and outlive the call;
    // one attribute applies from index 0; the ranges are the caller's.
    check(
        unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                &mut attrs,
                &mut idx,
                1,
                stream,
            )
        },
        "cuMemcpyBatchAsync",
    )
}

impl Drop for Rig {
    fn drop(&mut self) {
        // SAFETY: our objects; every run synchronized both streams, so none
        // is in use (null handles and zero addresses are skipped).
        unsafe {
            for (_, g) in self.graphs.borrow_mut().drain(..) {
                sys::cuGraphExecDestroy(g);
            }
            for &e in self
                .events
                .iter()
                .chain([&self.done, &self.fork, &self.join])
            {
                if !e.is_null() {
                    sys::cuEventDestroy_v2(e);
                }
            }
            for s in [self.up, self.down, self.up2, self.down2] {
                if !s.is_null() {
                    sys::cuStreamDestroy_v2(s);
                }
            }
            for p in [self.host_in, self.host_out] {
                if !p.is_null() {
                    sys::cuMemFreeHost(p);
                }
            }
            for d in [self.dev_in, self.dev_out] {
                if d != 0 {
                    sys::cuMemFree_v2(d);
                }
            }
        }
    }
}

/// `host chunk-cost`: the table, and chunk_cost.json.
pub fn run(device: &Device, bytes: usize, reps: usize, out: &Path) -> Result<()> {
    if device.kind() != BackendKind::Cuda {
        println!("chunk-cost measures the CUDA driver's copies: skipped on the CPU emulation.");
        return Ok(());
    }
    let pieces = [1usize, 4, 8, 16, 32, 64];
    let modes = [
        Mode::Plain,
        Mode::Record,
        Mode::Wait,
        Mode::TwoStreams,
        Mode::Batch,
        Mode::BatchEach,
        Mode::Chained,
        Mode::Graph,
        Mode::ChainedGraph,
    ];
    let rig = Rig::new(device, bytes.max(SMALL_COPIES * (4 << 20)), 64)?;
    // Interleaved: every (mode, pieces) once per round, after a warm-up round.
    let mut times = vec![Vec::new(); modes.len() * pieces.len()];
    let mut issue = vec![Vec::new(); modes.len() * pieces.len()];
    for round in 0..=reps {
        for (m, &mode) in modes.iter().enumerate() {
            for (p, &n) in pieces.iter().enumerate() {
                let (ms, us) = rig.run(bytes, n, mode)?;
                if round > 0 {
                    times[m * pieces.len() + p].push(ms);
                    issue[m * pieces.len() + p].push(us / n as f64);
                }
            }
        }
    }
    let whole = median(&times[0]);
    let mut rows = Vec::new();
    for (m, &mode) in modes.iter().enumerate() {
        for (p, &n) in pieces.iter().enumerate() {
            let ms = median(&times[m * pieces.len() + p]);
            rows.push(Row {
                mode,
                pieces: n,
                ms,
                over_whole: ms / whole,
                us_per_extra_piece: if n > 1 {
                    (ms - whole) * 1e3 / (n - 1) as f64
                } else {
                    0.0
                },
                issue_us_per_piece: median(&issue[m * pieces.len() + p]),
            });
        }
    }
    println!(
        "{} in and {} out at once, cut into pieces (medians of {reps}; plain driver calls):",
        super::fmt::bytes(bytes as u64),
        super::fmt::bytes(bytes as u64)
    );
    println!(
        "{:<8} {:>6} {:>10} {:>8} {:>14} {:>14}",
        "mode", "pieces", "ms", "÷whole", "µs/extra piece", "issue µs/piece"
    );
    for r in &rows {
        println!(
            "{:<8} {:>6} {:>10.3} {:>7.3}x {:>14.2} {:>14.2}",
            format!("{:?}", r.mode).to_lowercase(),
            r.pieces,
            r.ms,
            r.over_whole,
            r.us_per_extra_piece,
            r.issue_us_per_piece
        );
    }
    // The small-copy table.
    let sizes = [4usize << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
        .into_iter()
        .filter(|&s| s * SMALL_COPIES <= bytes)
        .collect::<Vec<_>>();
    let hows = [Small::Plain, Small::TwoStreams, Small::Batch];
    let mut small = Vec::new();
    for h2d in [true, false] {
        for &size in &sizes {
            let mut t = vec![Vec::new(); hows.len()];
            for round in 0..=reps * 4 {
                for (k, &how) in hows.iter().enumerate() {
                    let s = rig.small(size, h2d, how)?;
                    if round > 0 {
                        t[k].push(SMALL_COPIES as f64 / s);
                    }
                }
            }
            for (k, &how) in hows.iter().enumerate() {
                small.push(SmallRow {
                    h2d,
                    size,
                    how,
                    copies_per_s: median(&t[k]),
                });
            }
        }
    }
    println!(
        "64 copies then one synchronize (copies per second, medians of {}):",
        reps * 4
    );
    println!(
        "{:<4} {:>8} {:>12} {:>12} {:>12}",
        "dir", "size", "plain", "two-streams", "batch"
    );
    for row in small.chunks(hows.len()) {
        println!(
            "{:<4} {:>8} {:>11.1}k {:>11.1}k {:>11.1}k",
            if row[0].h2d { "h2d" } else { "d2h" },
            super::fmt::bytes(row[0].size as u64),
            row[0].copies_per_s / 1e3,
            row[1].copies_per_s / 1e3,
            row[2].copies_per_s / 1e3
        );
    }
    write_json(
        &out.join("chunk_cost.json"),
        &Results {
            meta: Meta::new(device),
            bytes_each_way: bytes,
            reps,
            rows,
            small,
        },
    )
}
