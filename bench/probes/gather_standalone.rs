use std::sync::atomic::{AtomicUsize, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::Instant;

struct Job { rows: AtomicUsize, dst: AtomicUsize, n: AtomicUsize, next: AtomicUsize, done: AtomicUsize, gen: AtomicU64, stop: AtomicUsize, piece: AtomicUsize, pf: AtomicUsize }

fn piece(j: &Job, i: usize) {
    let rows = j.rows.load(Acquire) as *const usize;
    let dst = j.dst.load(Acquire) as *mut u8;
    let n = j.n.load(Acquire);
    let p = j.piece.load(Acquire);
    let pf = j.pf.load(Relaxed);
    let (s, e) = (i * p, ((i + 1) * p).min(n));
    for r in s..e {
        unsafe {
            if pf > 0 && r + pf < e {
                let a = *rows.add(r + pf);
                let mut l = 0; while l < 4096 { std::arch::x86_64::_mm_prefetch::<{std::arch::x86_64::_MM_HINT_T0}>((a + l) as *const i8); l += 64; }
            }
            std::ptr::copy_nonoverlapping(*rows.add(r) as *const u8, dst.add(r * 4096), 4096);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(12);
    let huge = args.get(2).map(|s| s == "huge").unwrap_or(false);
    let bytes = 1usize << 30;
    let src = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) } as *mut u8;
    if huge { unsafe { libc::madvise(src as _, bytes, libc::MADV_HUGEPAGE) }; }
    unsafe { std::ptr::write_bytes(src, 1, bytes) };
    let nrows = bytes / 4096;
    let j = Arc::new(Job { rows: 0.into(), dst: 0.into(), n: 0.into(), next: 0.into(), done: 0.into(), gen: 0.into(), stop: 0.into(), piece: 40.into(), pf: 0.into() });
    let mut hs = vec![];
    for _ in 0..threads {
        let j = j.clone();
        hs.push(std::thread::spawn(move || { let mut seen = 0; loop {
            while j.gen.load(Acquire) == seen { std::hint::spin_loop(); }
            seen = j.gen.load(Acquire);
            if j.stop.load(Acquire) == 1 { return; }
            let parts = j.n.load(Acquire).div_ceil(j.piece.load(Acquire));
            loop { let i = j.next.fetch_add(1, AcqRel); if i >= parts { break; } piece(&j, i); j.done.fetch_add(1, AcqRel); }
        }}));
    }
    let mut seed = 88172645463325252u64;
    let mut rnd = || { seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17; seed };
    for pf in [0usize, 2, 4] {
    for mb in [1usize, 8, 16, 64] {
        let n = mb * 256;
        let mut dstv = vec![1u8; n * 4096 * 3]; dstv.iter_mut().step_by(4096).for_each(|x| *x = 2);
        let mut times = vec![];
        for it in 0..60 {
            let rows: Vec<usize> = (0..n).map(|_| src as usize + (rnd() as usize % nrows) * 4096).collect();
            let dst = unsafe { dstv.as_mut_ptr().add((it % 3) * n * 4096) };
            let t = Instant::now();
            j.rows.store(rows.as_ptr() as usize, Release); j.dst.store(dst as usize, Release); j.n.store(n, Release);
            j.piece.store((n / (threads * 4)).max(16), Release); j.pf.store(pf, Relaxed);
            j.done.store(0, Release); j.next.store(0, Release);
            j.gen.fetch_add(1, AcqRel);
            let parts = n.div_ceil(j.piece.load(Acquire));
            loop { let i = j.next.fetch_add(1, AcqRel); if i >= parts { break; } piece(&j, i); j.done.fetch_add(1, AcqRel); }
            while j.done.load(Acquire) < parts { std::hint::spin_loop(); }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len()/2];
        println!("threads {threads}+1 huge {huge} pf {pf} {mb:>3} MiB: median {:.1} us = {:.1} GB/s (p10 {:.1} p90 {:.1} us)", med*1e6, (n*4096) as f64/med/1e9, times[6]*1e6, times[54]*1e6);
    }}
    j.stop.store(1, Release); j.gen.fetch_add(1, AcqRel);
    for h in hs { h.join().unwrap(); }
}
