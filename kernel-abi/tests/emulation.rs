//! The CPU emulation of block-level programming: barriers, shared memory,
//! warp operations, block reductions and scans, atomics, 3-D indices, and
//! the typed faults (each fault test bounded in time: a hang fails it).

use core::sync::atomic::Ordering::Relaxed;
use kernel_abi::thread::{self, emulate_launch, Dim3, EmulationError, FaultKind, Launch};
use kernel_abi::{block, shared, shared_array, warp, Slice, SliceMut};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::mpsc;
use std::time::Duration;

/// Runs a launch on another thread; fails the test if it takes more than
/// 60 s (a hang).
fn bounded(
    name: &'static str,
    launch: Launch,
    body: impl Fn() + Sync + Send + 'static,
) -> Result<(), EmulationError> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(emulate_launch(name, &launch, 2, &body));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the launch hung")
}

fn slice_mut<T>(v: &mut [T]) -> SliceMut<T> {
    // SAFETY: the tests keep `v` alive until the launch returns.
    unsafe { SliceMut::from_raw_parts(v.as_mut_ptr(), v.len()) }
}

fn slice<T>(v: &[T]) -> Slice<T> {
    // SAFETY: as above.
    unsafe { Slice::from_raw_parts(v.as_ptr(), v.len()) }
}

/// Deterministic pseudo-random floats of mixed magnitude and sign.
fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let m = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * [1.0f32, 1e-3, 1e3, 7.0][(s % 4) as usize]
        })
        .collect()
}

fn reverse_kernel(x: SliceMut<u32>) {
    let tile = shared_array!(u32, 256);
    let t = thread::thread_idx() as usize;
    let n = thread::block_dim() as usize;
    let base = thread::block_idx() as usize * n;
    // SAFETY: each thread reads and writes only its own element.
    tile.set(t, unsafe { x.read(base + t) });
    thread::sync_threads();
    // SAFETY: as above.
    unsafe { x.write(base + t, tile.get(n - 1 - t)) };
}

#[test]
fn a_block_reversed_through_shared_memory_needs_the_barrier_and_gets_it() {
    let mut v: Vec<u32> = (0..256 * 5).collect();
    let x = slice_mut(&mut v);
    emulate_launch("reverse", &Launch::linear(5, 256), 2, &|| reverse_kernel(x)).unwrap();
    for b in 0..5u32 {
        for t in 0..256u32 {
            assert_eq!(v[(b * 256 + t) as usize], b * 256 + 255 - t);
        }
    }
}

#[test]
fn each_block_has_its_own_shared_memory_poisoned_at_its_start() {
    let mut seen = vec![0u32; 8];
    let s = slice_mut(&mut seen);
    emulate_launch("poison", &Launch::linear(8, 64), 3, &|| {
        let a = shared_array!(u32, 64);
        let t = thread::thread_idx() as usize;
        // Before anyone writes: the poison.
        let before = a.get(t);
        thread::sync_threads();
        a.set(t, thread::block_idx());
        thread::sync_threads();
        let all_mine = (0..64).all(|i| a.get(i) == thread::block_idx());
        if t == 0 {
            // SAFETY: one writer per element.
            unsafe {
                s.write(
                    thread::block_idx() as usize,
                    u32::from(before == u32::MAX && all_mine),
                )
            };
        }
    })
    .unwrap();
    assert_eq!(seen, vec![1; 8]);
}

#[test]
fn dynamic_shared_memory_is_sized_by_the_launch() {
    let mut out = vec![0u32; 4];
    let o = slice_mut(&mut out);
    let launch = Launch {
        grid: Dim3::x(4),
        block: Dim3::x(96),
        dynamic_shared_bytes: 96 * 4 + 8,
    };
    emulate_launch("dynamic", &launch, 2, &|| {
        let d = shared::dynamic::<u32>();
        let t = thread::thread_idx() as usize;
        assert_eq!(shared::dynamic_bytes(), 96 * 4 + 8);
        assert_eq!(d.len(), 98);
        let tail = shared::dynamic_at::<u64>(96 * 4);
        assert_eq!(tail.len(), 1);
        d.set(t, t as u32 * 3);
        if t == 0 {
            tail.set(0, 1 << 40);
        }
        thread::sync_threads();
        let sum: u32 = (0..96).map(|i| d.get(i)).sum();
        if t == 95 {
            // SAFETY: one writer per element.
            unsafe {
                o.write(
                    thread::block_idx() as usize,
                    sum + (tail.get(0) >> 40) as u32,
                )
            };
        }
    })
    .unwrap();
    assert_eq!(out, vec![3 * 95 * 96 / 2 + 1; 4]);
}

#[test]
fn warp_shuffles_and_votes_match_plain_loops() {
    // 80 threads: two full warps and a partial one of 16 lanes.
    let mut out = vec![0u64; 80 * 8];
    let o = slice_mut(&mut out);
    emulate_launch("warp", &Launch::linear(1, 80), 1, &|| {
        let t = thread::thread_idx();
        let l = warp::lane_id();
        let v = t * 10 + 1;
        let r = [
            u64::from(warp::shfl_down(v, 3)),
            u64::from(warp::shfl_up(v, 5)),
            u64::from(warp::shfl_xor(v, 6)),
            u64::from(warp::shfl_idx(v, 7)),
            u64::from(warp::ballot(t.is_multiple_of(3))),
            u64::from(warp::any(t == 70)) | (u64::from(warp::all(t < 64)) << 1),
            warp::shfl_down((t as u64) << 40, 1),
            warp::shfl_xor(t as f64 + 0.5, 1).to_bits(),
        ];
        assert_eq!(l, t % 32);
        for (k, x) in r.into_iter().enumerate() {
            // SAFETY: one writer per element.
            unsafe { o.write(t as usize * 8 + k, x) };
        }
    })
    .unwrap();
    for t in 0..80u32 {
        let (w, l) = (t / 32, t % 32);
        let lanes = if w == 2 { 16 } else { 32 };
        let val = |lane: u32| u64::from((w * 32 + lane) * 10 + 1);
        let own = val(l);
        let get = |src: Option<u32>| src.filter(|&s| s < lanes).map_or(own, val);
        let r = &out[t as usize * 8..t as usize * 8 + 8];
        assert_eq!(
            r[0],
            get(Some(l + 3).filter(|&s| s < 32)),
            "down, thread {t}"
        );
        assert_eq!(r[1], get(l.checked_sub(5)), "up, thread {t}");
        assert_eq!(r[2], get(Some(l ^ 6)), "xor, thread {t}");
        assert_eq!(r[3], get(Some(7)), "idx, thread {t}");
        let ballot = (0..lanes)
            .filter(|&x| (w * 32 + x).is_multiple_of(3))
            .fold(0u64, |b, x| b | 1 << x);
        assert_eq!(r[4], ballot, "ballot, thread {t}");
        let any = w == 2; // thread 70 is in warp 2
        let all = w < 2;
        assert_eq!(
            r[5],
            u64::from(any) | (u64::from(all) << 1),
            "votes, thread {t}"
        );
        let src = if l + 1 < lanes { t + 1 } else { t };
        assert_eq!(r[6], (src as u64) << 40, "64-bit down, thread {t}");
        let src = if (l ^ 1) < lanes { w * 32 + (l ^ 1) } else { t };
        assert_eq!(
            f64::from_bits(r[7]),
            src as f64 + 0.5,
            "f64 xor, thread {t}"
        );
    }
}

/// The warp tree of `warp::reduce` on the host: lane 0 after offsets 16..1.
fn warp_tree(v: &[f32]) -> f32 {
    let mut v = v.to_vec();
    let n = v.len();
    let mut off = 16;
    while off > 0 {
        for l in 0..n {
            if l + off < n {
                v[l] += v[l + off];
            }
        }
        off /= 2;
    }
    v[0]
}

/// `block::reduce_sum`'s order, sequentially: each warp's tree, then the
/// tree of the warps' totals.
fn block_tree(v: &[f32]) -> f32 {
    let totals: Vec<f32> = v.chunks(32).map(warp_tree).collect();
    warp_tree(&totals)
}

#[test]
fn a_block_sum_with_shared_memory_is_bit_identical_to_the_same_tree_and_close_to_f64() {
    for &threads in &[1u32, 31, 32, 33, 100, 256, 1024] {
        let x = floats(threads as usize * 3, u64::from(threads));
        let mut out = vec![0f32; 3 * threads as usize];
        let (xs, o) = (slice(&x), slice_mut(&mut out));
        emulate_launch("block_sum", &Launch::linear(3, threads), 2, &|| {
            let i = thread::global_id();
            let s = block::reduce_sum(xs.load(i));
            // SAFETY: one writer per element.
            unsafe { o.write(i, s) };
        })
        .unwrap();
        for (b, chunk) in x.chunks(threads as usize).enumerate() {
            let want = block_tree(chunk);
            let exact: f64 = chunk.iter().map(|&v| f64::from(v)).sum();
            let bound: f64 = chunk.iter().map(|&v| f64::from(v.abs())).sum::<f64>() * 1e-6;
            for t in 0..threads as usize {
                let got = out[b * threads as usize + t];
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "block {b}, thread {t} of {threads}"
                );
            }
            assert!(
                (f64::from(want) - exact).abs() <= bound,
                "{want} vs {exact}"
            );
        }
    }
}

#[test]
fn block_max_and_min_reach_every_thread() {
    let x = floats(200, 9);
    let mut out = vec![0f32; 400];
    let (xs, o) = (slice(&x), slice_mut(&mut out));
    emulate_launch("block_max", &Launch::linear(1, 200), 1, &|| {
        let i = thread::global_id();
        let (mx, mn) = (block::reduce_max(xs.load(i)), block::reduce_min(xs.load(i)));
        // SAFETY: one writer per element.
        unsafe {
            o.write(2 * i, mx);
            o.write(2 * i + 1, mn);
        }
    })
    .unwrap();
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mn = x.iter().copied().fold(f32::INFINITY, f32::min);
    assert!(out.chunks(2).all(|c| c[0] == mx && c[1] == mn));
}

/// `block::scan`'s inclusive order, sequentially (Kogge-Stone per warp,
/// then the warps' prefixes).
fn scan_tree(v: &[f32]) -> Vec<f32> {
    let kogge = |v: &[f32]| {
        let mut v = v.to_vec();
        let mut off = 1;
        while off < 32 {
            let prev = v.clone();
            for l in off..v.len() {
                v[l] = prev[l - off] + prev[l];
            }
            off *= 2;
        }
        v
    };
    let warps: Vec<Vec<f32>> = v.chunks(32).map(kogge).collect();
    let totals: Vec<f32> = warps.iter().map(|w| *w.last().unwrap()).collect();
    let incl = kogge(&totals);
    let mut out = Vec::new();
    for (w, ws) in warps.iter().enumerate() {
        for &x in ws {
            out.push(if w == 0 { x } else { incl[w - 1] + x });
        }
    }
    out
}

#[test]
fn block_scans_are_bit_identical_to_the_same_tree_and_exact_for_integers() {
    for &threads in &[1u32, 32, 33, 96, 257, 1024] {
        let x = floats(threads as usize, 77 + u64::from(threads));
        let n = threads as usize;
        let mut out = vec![0f32; n];
        let mut ints = vec![0u32; 2 * n];
        let (xs, o, io) = (slice(&x), slice_mut(&mut out), slice_mut(&mut ints));
        emulate_launch("scan", &Launch::linear(1, threads), 1, &|| {
            let i = thread::global_id();
            let f = block::inclusive_scan_sum(xs.load(i));
            let inc = block::inclusive_scan_sum(i as u32 + 1);
            let exc = block::exclusive_scan_sum(i as u32 + 1);
            // SAFETY: one writer per element.
            unsafe {
                o.write(i, f);
                io.write(2 * i, inc);
                io.write(2 * i + 1, exc);
            }
        })
        .unwrap();
        let want = scan_tree(&x);
        for i in 0..n {
            assert_eq!(
                out[i].to_bits(),
                want[i].to_bits(),
                "thread {i} of {threads}"
            );
            let k = i as u32 + 1;
            assert_eq!(ints[2 * i], k * (k + 1) / 2);
            assert_eq!(ints[2 * i + 1], k * (k + 1) / 2 - k);
        }
        let mut acc = 0f64;
        for i in 0..n {
            acc += f64::from(x[i]);
            let bound = x[..=i].iter().map(|v| f64::from(v.abs())).sum::<f64>() * 1e-6;
            assert!((f64::from(out[i]) - acc).abs() <= bound);
        }
    }
}

#[test]
fn atomics_count_exactly_under_contention() {
    // A 16-bin histogram: shared-memory atomics per block, then one global
    // atomic per bin and block; plus f32 adds, min/max and CAS.
    let data: Vec<u32> = (0..100_003u32)
        .map(|i| i.wrapping_mul(2_654_435_761) >> 28)
        .collect();
    let mut hist = vec![0u32; 16];
    let mut misc = vec![0u64; 2];
    let mut f = vec![0f32; 2];
    let (d, h, m, fs) = (
        slice(&data),
        slice_mut(&mut hist),
        slice_mut(&mut misc),
        slice_mut(&mut f),
    );
    emulate_launch("histogram", &Launch::linear(7, 128), 2, &|| {
        let local = shared_array!(u32, 16);
        let t = thread::thread_idx() as usize;
        if t < 16 {
            local.set(t, 0);
        }
        thread::sync_threads();
        let mut i = thread::global_id();
        while i < d.len() {
            local.atomic_add(d.load(i) as usize, 1, Relaxed);
            m.atomic_max(0, i as u64, Relaxed);
            i += thread::grid_stride();
        }
        thread::sync_threads();
        if t < 16 {
            h.atomic_add(t, local.get(t), Relaxed);
        }
        fs.atomic_add(0, 0.5, Relaxed);
        fs.atomic_max(1, thread::global_id() as f32, Relaxed);
        // A CAS loop incrementing a counter.
        let mut cur = m.atomic_add(1, 0, Relaxed);
        while let Err(seen) = m.atomic_compare_exchange(1, cur, cur + 1, Relaxed) {
            cur = seen;
        }
    })
    .unwrap();
    let mut want = vec![0u32; 16];
    data.iter().for_each(|&b| want[b as usize] += 1);
    assert_eq!(hist, want);
    assert_eq!(misc, vec![100_002, 7 * 128]);
    assert_eq!(f, vec![7.0 * 128.0 * 0.5, (7 * 128 - 1) as f32]);
}

#[test]
fn three_d_indices_cover_every_thread_exactly_once() {
    let launch = Launch {
        grid: Dim3::new(3, 2, 2),
        block: Dim3::new(5, 3, 4),
        dynamic_shared_bytes: 0,
    };
    let counts: Vec<AtomicU32> = (0..launch.grid.volume() * launch.block.volume())
        .map(|_| AtomicU32::new(0))
        .collect();
    let warps = AtomicU64::new(0);
    emulate_launch("indices", &launch, 2, &|| {
        let (t, b, bd, gd) = (
            thread::thread_idx3(),
            thread::block_idx3(),
            thread::block_dim3(),
            thread::grid_dim3(),
        );
        assert_eq!((bd, gd), (launch.block, launch.grid));
        let lin = thread::linear_thread_idx();
        assert_eq!(u64::from(lin), bd.linear(t));
        assert_eq!(thread::warp_id(), lin / 32);
        assert_eq!(warp::lane_id(), lin % 32);
        let g = gd.linear(b) * bd.volume() + u64::from(lin);
        counts[g as usize].fetch_add(1, Relaxed);
        // A warp operation across the 3-D block (60 threads: 32 + 28).
        let n = warp::reduce_sum(1u32);
        warps.fetch_add(u64::from(n), Relaxed);
    })
    .unwrap();
    assert!(counts.iter().all(|c| c.load(Relaxed) == 1));
    assert_eq!(warps.into_inner(), 12 * (32 * 32 + 28 * 28));
}

#[test]
fn a_divergent_barrier_is_a_typed_error_not_a_hang() {
    let e = bounded("divergent", Launch::linear(4, 64), || {
        if thread::thread_idx() == 7 {
            return; // leaves the others at the barrier
        }
        thread::sync_threads();
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::DivergentBarrier);
    assert_eq!(e.kernel, "divergent");
    // Threads skipping a barrier inside a branch, the others reaching it.
    let e = bounded("branch", Launch::linear(1, 64), || {
        if thread::thread_idx() >= 32 {
            thread::sync_threads();
        }
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::DivergentBarrier);
    // Half the block at a barrier, half at a warp operation.
    let e = bounded("mixed", Launch::linear(1, 64), || {
        if thread::thread_idx() < 16 {
            thread::sync_threads();
        } else {
            warp::reduce_sum(1u32);
        }
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::DivergentBarrier);
}

#[test]
fn a_warp_operation_some_lanes_skip_is_a_typed_error() {
    let e = bounded("incomplete", Launch::linear(2, 64), || {
        if warp::lane_id() != 5 {
            warp::shfl_down(1u32, 1);
        }
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::IncompleteWarp);
    let e = bounded("different", Launch::linear(1, 32), || {
        if warp::lane_id() < 16 {
            warp::shfl_down(1u32, 1);
        } else {
            warp::ballot(true);
        }
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::IncompleteWarp);
}

#[test]
fn an_out_of_bounds_shared_access_is_a_typed_error_naming_kernel_block_and_thread() {
    let e = bounded("oob", Launch::new_2d(), || {
        let a = shared_array!(f32, 16);
        thread::sync_threads();
        if thread::block_idx3() == Dim3::new(1, 1, 0) && thread::thread_idx3() == Dim3::new(3, 1, 0)
        {
            a.set(16, 1.0);
        }
        thread::sync_threads();
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::SharedOutOfBounds { index: 16, len: 16 });
    assert_eq!(
        (e.kernel.as_str(), e.block, e.thread),
        ("oob", Dim3::new(1, 1, 0), Dim3::new(3, 1, 0))
    );
    assert!(e.to_string().contains("shared out of bounds"), "{e}");
    let e = bounded("slice", Launch::linear(1, 32), || {
        let v = [1u32; 4];
        let s = slice(&v);
        s.load(thread::thread_idx() as usize);
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::SliceOutOfBounds { index: 4, len: 4 });
}

trait New2d {
    fn new_2d() -> Launch;
}
impl New2d for Launch {
    fn new_2d() -> Launch {
        Launch {
            grid: Dim3::new(2, 2, 1),
            block: Dim3::new(8, 4, 1),
            dynamic_shared_bytes: 0,
        }
    }
}

#[test]
fn a_trap_in_one_thread_releases_the_others_waiting_at_a_barrier() {
    let start = std::time::Instant::now();
    let e = bounded("trap", Launch::linear(64, 256), || {
        if thread::block_idx() == 3 && thread::thread_idx() == 200 {
            thread::trap();
        }
        thread::sync_threads();
        thread::sync_threads();
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::Trap);
    assert_eq!((e.block.x, e.thread.x), (3, 200));
    assert!(start.elapsed() < Duration::from_secs(20));
    let e = bounded("panic", Launch::linear(1, 64), || {
        if thread::thread_idx() == 40 {
            panic!("boom");
        }
        block::reduce_sum(1.0f32);
    })
    .unwrap_err();
    assert_eq!(e.kind, FaultKind::Panic("boom".into()));
}

#[test]
fn bad_launches_are_refused_before_anything_runs() {
    let ran = AtomicU32::new(0);
    for launch in [
        Launch::linear(0, 32),
        Launch::linear(1, 0),
        Launch::linear(1, 1025),
        Launch {
            grid: Dim3::x(1),
            block: Dim3::new(1, 1, 65),
            dynamic_shared_bytes: 0,
        },
        Launch {
            grid: Dim3::x(1),
            block: Dim3::x(32),
            dynamic_shared_bytes: 300 * 1024,
        },
    ] {
        let e = emulate_launch("bad", &launch, 1, &|| {
            ran.fetch_add(1, Relaxed);
        })
        .unwrap_err();
        assert!(matches!(e.kind, FaultKind::InvalidLaunch(_)), "{e}");
    }
    assert_eq!(ran.into_inner(), 0);
}

#[test]
fn the_one_d_emulate_still_runs_elementwise_kernels_and_reports_traps() {
    let mut v = vec![1.0f32; 1_000_007];
    let x = slice_mut(&mut v);
    let start = std::time::Instant::now();
    thread::emulate(3907, 256, 2, &|| {
        let mut i = thread::global_id();
        while i < x.len() {
            // SAFETY: one thread per element.
            unsafe { x.write(i, x.read(i) * 2.0) };
            i += thread::grid_stride();
        }
    })
    .unwrap();
    assert!(v.iter().all(|&e| e == 2.0));
    assert!(start.elapsed() < Duration::from_secs(30));
    let e = thread::emulate(2, 4, 1, &|| {
        if thread::global_id() == 5 {
            thread::trap()
        }
    })
    .unwrap_err();
    assert_eq!(e, "block 1, thread 1: trap");
}
