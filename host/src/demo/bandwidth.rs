//! `host bandwidth`: host-to-device and device-to-host bandwidth, pinned vs
//! pageable, against raw driver copies of the same bytes; both directions at
//! once; and what a pinned buffer costs to get: driver allocation vs
//! registration vs a pool hit.

use super::fmt::{size, Words};
use super::report::{cell, median, Meta};
use futures::TryFutureExt;
use gpufeed::block_on;
use gpufeed::{Device, DeviceBuffer, PinnedBuffer, PinnedHost, PinnedPool, Registered, Stream};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize, Clone)]
pub struct Row {
    pub bytes: usize,
    /// GB/s (1e9 bytes per second), medians.
    pub h2d_pinned: f64,
    pub d2h_pinned: f64,
    pub h2d_pageable: f64,
    pub d2h_pageable: f64,
    /// The same copies issued straight through cudarc's `sys` layer
    /// (`cuMemcpyHtoDAsync` + `cuStreamSynchronize`); CUDA only.
    pub h2d_raw: Option<f64>,
    pub d2h_raw: Option<f64>,
    /// Both directions at once (total bytes moved / time).
    pub bidirectional: f64,
    pub reps: usize,
    /// The pinned buffers were page-locked (false only on the CPU emulation,
    /// when the memlock limit refused `mlock`: they are then plain memory).
    pub locked: bool,
}

/// A line of bandwidth.csv: GB/s to three decimals, an empty cell where
/// nothing was measured (raw driver copies on the CPU emulation).
#[derive(Serialize)]
pub struct CsvRow {
    pub bytes: usize,
    pub h2d_pinned: Option<f64>,
    pub h2d_raw: Option<f64>,
    pub h2d_pageable: Option<f64>,
    pub d2h_pinned: Option<f64>,
    pub d2h_raw: Option<f64>,
    pub d2h_pageable: Option<f64>,
    pub bidirectional: Option<f64>,
    pub locked: bool,
}

impl From<&Row> for CsvRow {
    fn from(r: &Row) -> CsvRow {
        let c = |v: f64| cell(v, 3);
        CsvRow {
            bytes: r.bytes,
            h2d_pinned: c(r.h2d_pinned),
            h2d_raw: r.h2d_raw.and_then(c),
            h2d_pageable: c(r.h2d_pageable),
            d2h_pinned: c(r.d2h_pinned),
            d2h_raw: r.d2h_raw.and_then(c),
            d2h_pageable: c(r.d2h_pageable),
            bidirectional: c(r.bidirectional),
            locked: r.locked,
        }
    }
}

#[derive(Serialize, Clone)]
pub struct AllocCost {
    pub bytes: usize,
    /// Milliseconds, medians: driver allocation + free of a pinned buffer.
    pub driver_alloc_ms: f64,
    pub driver_free_ms: f64,
    /// Registering (+ unregistering) an existing, touched Vec.
    pub register_ms: f64,
    pub unregister_ms: f64,
    /// A pool hit: allocate + return, in microseconds.
    pub pool_hit_us: f64,
}

#[derive(Serialize)]
pub struct Results {
    pub meta: Meta,
    pub rows: Vec<Row>,
    pub alloc: Vec<AllocCost>,
}

fn gbps(bytes: usize, ms: f64) -> f64 {
    bytes as f64 / ms / 1e6
}

fn time_ms(mut f: impl FnMut() -> gpufeed::Result<()>) -> gpufeed::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// Sizes from 1 MiB to `max` bytes, by powers of 4.
pub fn sizes(max: usize) -> Vec<usize> {
    std::iter::successors(Some(1usize << 20), |s| Some(s * 4))
        .take_while(|s| *s <= max)
        .collect()
}

pub fn run(
    device: &Device,
    max_bytes: usize,
    alloc_sizes: &[usize],
    progress: &indicatif::ProgressBar,
) -> gpufeed::Result<Results> {
    let stream = Stream::new(device)?;
    let stream2 = Stream::new(device)?;
    let raw = raw::Raw::new(device);
    let mut rows = Vec::new();
    for bytes in sizes(max_bytes) {
        progress.set_message(format!("bandwidth, {} copies", size(bytes)));
        let n = bytes / 4;
        let reps = if bytes >= 256 << 20 { 11 } else { 21 };
        let mut src = PinnedBuffer::<f32>::new(device, n)?;
        gpufeed::testing::random_floats(src.as_mut_slice(), 3);
        let mut dst = PinnedBuffer::<f32>::new(device, n)?;
        let locked = src.is_locked() && dst.is_locked();
        let mut dev = DeviceBuffer::<f32>::new(device, n)?;
        let mut dev2 = DeviceBuffer::<f32>::new(device, n)?;
        let mut pageable = src.as_slice().to_vec();
        dev2.copy_from_host_sync(&pageable)?; // what the bidirectional D2H brings back
        let (mut h2d, mut d2h, mut ph2d, mut pd2h, mut bi) =
            (vec![], vec![], vec![], vec![], vec![]);
        let raw_bufs = raw.as_ref().map(|r| r.buffers(bytes)).transpose()?;
        let (mut rh2d, mut rd2h) = (vec![], vec![]);
        for _ in 0..=reps {
            // Raw driver copies interleaved with ours, so drift hits both alike.
            if let (Some(r), Some(b)) = (&raw, &raw_bufs) {
                rh2d.push(r.copy_ms(b, true)?);
                rd2h.push(r.copy_ms(b, false)?);
            }
            let (s, d) = (src, dev);
            let t = Instant::now();
            let ((s, d), ()) = block_on(stream.copy_h2d(s, d))?;
            h2d.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let ((d, o), ()) = block_on(stream.copy_d2h(d, dst))?;
            d2h.push(t.elapsed().as_secs_f64() * 1e3);
            (src, dev, dst) = (s, d, o);
            ph2d.push(time_ms(|| dev.copy_from_host_sync(&pageable))?);
            pd2h.push(time_ms(|| dev.copy_to_host_sync(&mut pageable))?);
            let t = Instant::now();
            let up = stream.copy_h2d(src, dev);
            let down = stream2.run((dev2, dst), |c, (d, h)| c.copy_d2h(d.view(), h.host_mut()));
            let (((s, d), ()), ((d2, o), ())) = block_on(futures::future::try_join(
                up.err_into::<gpufeed::Error>(),
                down.err_into(),
            ))?;
            bi.push(t.elapsed().as_secs_f64() * 1e3);
            (src, dev, dev2, dst) = (s, d, d2, o);
        }
        for v in [
            &mut h2d, &mut d2h, &mut ph2d, &mut pd2h, &mut bi, &mut rh2d, &mut rd2h,
        ] {
            if !v.is_empty() {
                v.remove(0); // warm-up
            }
        }
        drop(raw_bufs);
        if dst.as_slice() != src.as_slice() || pageable[..] != src.as_slice()[..] {
            return Err(gpufeed::Error::InvalidArgument(format!(
                "bandwidth round trip of {bytes} bytes corrupted data"
            )));
        }
        let (h2d_raw, d2h_raw) = match raw {
            Some(_) => (
                Some(gbps(bytes, median(&rh2d))),
                Some(gbps(bytes, median(&rd2h))),
            ),
            None => (None, None),
        };
        rows.push(Row {
            bytes,
            h2d_pinned: gbps(bytes, median(&h2d)),
            d2h_pinned: gbps(bytes, median(&d2h)),
            h2d_pageable: gbps(bytes, median(&ph2d)),
            d2h_pageable: gbps(bytes, median(&pd2h)),
            h2d_raw,
            d2h_raw,
            bidirectional: gbps(2 * bytes, median(&bi)),
            reps,
            locked,
        });
        progress.inc(1);
    }
    let mut alloc = Vec::new();
    for &bytes in alloc_sizes {
        progress.set_message(format!("cost of a {} pinned buffer", size(bytes)));
        alloc.push(alloc_cost(device, bytes)?);
        progress.inc(1);
    }
    Ok(Results {
        meta: Meta::new(device),
        rows,
        alloc,
    })
}

fn alloc_cost(device: &Device, bytes: usize) -> gpufeed::Result<AllocCost> {
    let n = bytes / 4;
    let reps = if bytes >= 1 << 30 { 3 } else { 5 };
    let (mut a, mut f, mut r, mut u) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        // Driver allocation alone (the pool's stats time exactly the driver calls).
        let pool = PinnedPool::new(device);
        let blk = pool.alloc::<f32>(n)?;
        drop(blk);
        let s0 = pool.stats();
        pool.empty_cache();
        let s1 = pool.stats();
        a.push(s0.driver_alloc_ns as f64 / 1e6);
        f.push((s1.driver_free_ns - s0.driver_free_ns) as f64 / 1e6);
        let v = vec![1.0f32; n]; // touched: registration must pin real pages
        let t = Instant::now();
        let reg = Registered::new(device, v)?;
        r.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let v = reg.into_inner();
        u.push(t.elapsed().as_secs_f64() * 1e3);
        drop(v);
    }
    // Pool hit: allocate + return, many times, from a warm pool.
    let pool = PinnedPool::new(device);
    drop(pool.alloc::<f32>(n)?);
    let mut hits = Vec::new();
    for _ in 0..10_000 {
        let t = Instant::now();
        let b = pool.alloc::<f32>(n)?;
        drop(std::hint::black_box(b));
        hits.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if pool.stats().misses != 1 {
        return Err(gpufeed::Error::InvalidArgument(
            "pool hit benchmark missed the cache".into(),
        ));
    }
    Ok(AllocCost {
        bytes,
        driver_alloc_ms: median(&a),
        driver_free_ms: median(&f),
        register_ms: median(&r),
        unregister_ms: median(&u),
        pool_hit_us: median(&hits),
    })
}

pub fn print(res: &Results) {
    let w = Words::for_kind(res.meta.backend);
    let raw = res.rows.iter().any(|r| r.h2d_raw.is_some());
    let reps = res.rows.first().map_or(0, |r| r.reps);
    if w.cpu {
        println!("\ncopy bandwidth (GB/s, medians of {reps}); gain = pinned / pageable. On the CPU emulation");
        println!("both are memcpy: \"pinned\" (mmap+mlock) is copied by a stream's worker thread and awaited,");
        println!("\"pageable\" (a Vec) on the calling thread, so a gain near or below 1x is expected here; on a");
        println!("GPU, pinned memory is what the copy engine reads directly. Raw driver copies (H2D raw,");
        println!("D2H raw): not measured on the CPU emulation.");
    } else if raw {
        println!("\ncopy bandwidth (GB/s, medians of {reps}): pinned vs pageable, and raw driver copies of the same bytes");
        println!("(cuMemcpyHtoDAsync / cuMemcpyDtoHAsync + cuStreamSynchronize); gain = pinned / pageable:");
    } else {
        println!("\ncopy bandwidth (GB/s, medians of {reps}): pinned vs pageable; gain = pinned / pageable");
        println!(
            "(raw driver copies: not measured, the driver's own context could not be set up):"
        );
    }
    let head_raw = |name: &str| {
        if raw {
            format!(" {name:>10}")
        } else {
            String::new()
        }
    };
    println!(
        "{:>9} {:>10}{} {:>10} {:>10}{} {:>10} {:>8} {:>8} {:>10}",
        "size",
        "H2D pin",
        head_raw("H2D raw"),
        "H2D page",
        "D2H pin",
        head_raw("D2H raw"),
        "D2H page",
        "H2D gain",
        "D2H gain",
        "both dirs"
    );
    for r in &res.rows {
        let f = |v: Option<f64>| {
            if raw {
                format!(" {:>10}", v.map_or("-".to_string(), |v| format!("{v:.1}")))
            } else {
                String::new()
            }
        };
        println!(
            "{:>9} {:>10.1}{} {:>10.1} {:>10.1}{} {:>10.1} {:>7.2}x {:>7.2}x {:>10.1}",
            size(r.bytes),
            r.h2d_pinned,
            f(r.h2d_raw),
            r.h2d_pageable,
            r.d2h_pinned,
            f(r.d2h_raw),
            r.d2h_pageable,
            r.h2d_pinned / r.h2d_pageable,
            r.d2h_pinned / r.d2h_pageable,
            r.bidirectional
        );
    }
    let unlocked: Vec<String> = res
        .rows
        .iter()
        .filter(|r| !r.locked)
        .map(|r| size(r.bytes))
        .collect();
    if !unlocked.is_empty() {
        println!(
            "note: the memlock limit (ulimit -l: {}) refused to lock the {} buffers; they ran as plain mmap memory",
            memlock_limit(),
            unlocked.join(", ")
        );
    }
    println!("\ncost of a pinned buffer (medians):");
    for a in &res.alloc {
        println!(
            "{:>9}: {} {:.2} ms + {} {:.2} ms\n{:>9}  {} {:.2} ms + {} {:.2} ms\n{:>9}  pool hit (alloc + free) {:.2} us",
            size(a.bytes), w.host_alloc(), a.driver_alloc_ms, w.host_free(), a.driver_free_ms,
            "", w.register(), a.register_ms, w.unregister(), a.unregister_ms, "", a.pool_hit_us
        );
    }
}

/// The soft memlock limit, human-readable.
fn memlock_limit() -> String {
    match gpufeed::memlock_limit() {
        gpufeed::MemlockLimit::Bytes(b) => super::fmt::bytes(b),
        other => other.to_string(),
    }
}

/// Raw driver copies through cudarc's `sys` layer, for the "within 2% of the
/// driver" comparison. Allocates its own memory with the driver. The
/// small-transfer part (`small.rs`) issues its own loops over the same handles.
pub(crate) mod raw {
    use cudarc::driver::sys;
    use std::time::Instant;

    pub struct Raw {
        _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
        pub(crate) stream: sys::CUstream,
    }

    pub(crate) fn check(r: sys::CUresult, call: &'static str) -> gpufeed::Result<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(gpufeed::Error::Driver {
                call,
                code: format!("{r:?}"),
            })
        }
    }

    impl Raw {
        pub fn new(device: &gpufeed::Device) -> Option<Raw> {
            if device.kind() != gpufeed::BackendKind::Cuda {
                return None;
            }
            let ctx = cudarc::driver::CudaContext::new(device.info().ordinal).ok()?;
            ctx.bind_to_thread().ok()?;
            let mut stream = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; the context is current.
            let r = unsafe {
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                )
            };
            check(r, "cuStreamCreate").ok()?;
            Some(Raw { _ctx: ctx, stream })
        }

        /// Driver-pinned host memory and device memory of `bytes` each.
        pub fn buffers(&self, bytes: usize) -> gpufeed::Result<Buffers> {
            let mut b = Buffers {
                host: std::ptr::null_mut(),
                dev: 0,
                bytes,
            };
            // SAFETY: out-pointers into `b`; the context is current on this thread.
            unsafe {
                check(
                    sys::cuMemHostAlloc(&mut b.host, bytes, sys::CU_MEMHOSTALLOC_PORTABLE),
                    "cuMemHostAlloc",
                )?;
                check(sys::cuMemAlloc_v2(&mut b.dev, bytes), "cuMemAlloc")?;
            }
            Ok(b)
        }

        /// The handle's context (to make it current on another thread).
        pub fn context(&self) -> std::sync::Arc<cudarc::driver::CudaContext> {
            self._ctx.clone()
        }

        /// Makes this handle's context current on the calling thread (before
        /// allocating on one of several devices).
        pub fn bind(&self) -> gpufeed::Result<()> {
            self._ctx
                .bind_to_thread()
                .map_err(|e| gpufeed::Error::Driver {
                    call: "cuCtxSetCurrent",
                    code: format!("{:?}", e.0),
                })
        }

        /// Enqueues one copy (H2D or D2H) of the buffers' bytes on this
        /// handle's stream, without waiting.
        ///
        /// # Safety
        /// Nothing may free `b` before [`Raw::sync`] returns.
        pub unsafe fn enqueue(&self, b: &Buffers, h2d: bool) -> gpufeed::Result<()> {
            // SAFETY: live allocations of b.bytes (the caller keeps them until
            // the stream is synchronized); the stream is ours.
            unsafe {
                if h2d {
                    check(
                        sys::cuMemcpyHtoDAsync_v2(b.dev, b.host, b.bytes, self.stream),
                        "cuMemcpyHtoDAsync",
                    )
                } else {
                    check(
                        sys::cuMemcpyDtoHAsync_v2(b.host, b.dev, b.bytes, self.stream),
                        "cuMemcpyDtoHAsync",
                    )
                }
            }
        }

        /// Waits until everything enqueued on this handle's stream is done.
        pub fn sync(&self) -> gpufeed::Result<()> {
            // SAFETY: our live stream.
            check(
                unsafe { sys::cuStreamSynchronize(self.stream) },
                "cuStreamSynchronize",
            )
        }

        /// One copy (H2D or D2H) of the buffers' bytes, in ms, host clock.
        pub fn copy_ms(&self, b: &Buffers, h2d: bool) -> gpufeed::Result<f64> {
            let t = Instant::now();
            // SAFETY: `b` outlives this call, which synchronizes before returning.
            unsafe { self.enqueue(b, h2d)? };
            self.sync()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        }
    }

    pub struct Buffers {
        pub(crate) host: *mut std::ffi::c_void,
        pub(crate) dev: sys::CUdeviceptr,
        pub(crate) bytes: usize,
    }

    impl Drop for Buffers {
        fn drop(&mut self) {
            // SAFETY: our allocations; every copy on them was synchronized.
            unsafe {
                sys::cuMemFree_v2(self.dev);
                sys::cuMemFreeHost(self.host);
            }
        }
    }

    /// Device memory of one device, from `cuMemAlloc` (peer-copy baselines).
    pub struct DevAlloc {
        pub(crate) ptr: sys::CUdeviceptr,
        bytes: usize,
        ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    }

    impl Raw {
        /// `bytes` of device memory on this handle's device.
        pub fn device_alloc(&self, bytes: usize) -> gpufeed::Result<DevAlloc> {
            self.bind()?;
            let mut ptr = 0;
            // SAFETY: out-pointer to a local; the context is current.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc")?;
            Ok(DevAlloc {
                ptr,
                bytes,
                ctx: self._ctx.clone(),
            })
        }

        /// A `cuMemcpyPeerAsync` of `bytes` from `src` (this handle's device)
        /// to `dst` (memory of `dst_ctx`'s device) on this handle's stream,
        /// in ms, host clock.
        pub fn peer_ms(
            &self,
            dst: &DevAlloc,
            src: &DevAlloc,
            bytes: usize,
        ) -> gpufeed::Result<f64> {
            if bytes > dst.bytes || bytes > src.bytes {
                return Err(gpufeed::Error::InvalidArgument(
                    "a peer copy longer than its buffers".into(),
                ));
            }
            self.bind()?;
            let t = Instant::now();
            // SAFETY: two live allocations of at least `bytes` (checked), each
            // in its own context; synchronized before returning.
            let r = unsafe {
                sys::cuMemcpyPeerAsync(
                    dst.ptr,
                    dst.ctx.cu_ctx(),
                    src.ptr,
                    src.ctx.cu_ctx(),
                    bytes,
                    self.stream,
                )
            };
            check(r, "cuMemcpyPeerAsync")?;
            self.sync()?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        }
    }

    impl Drop for DevAlloc {
        fn drop(&mut self) {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: our allocation; every copy on it was synchronized.
            unsafe {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }

    impl Drop for Raw {
        fn drop(&mut self) {
            // SAFETY: our stream; nothing is pending on it.
            unsafe {
                sys::cuStreamDestroy_v2(self.stream);
            }
        }
    }
}
