//! `host files`: a file to the device through the staging ring, warm (the
//! page cache) and cold (the file's pages evicted with
//! `posix_fadvise(DONTNEED)`, read as [`FileIo::Auto`] chooses, which the
//! row's `way` records, with `O_DIRECT` and buffered), against the disk's own `O_DIRECT` read rate
//! measured in the same run (a plain loop of 16 MiB `pread`s into an
//! aligned host buffer, as `dd iflag=direct bs=16M` does) and the staged
//! copy of the same bytes from ordinary memory (the link's figure).
//!
//! Every run's device buffer is poisoned first and read back whole after,
//! and compared with the data generated on the host (not with anything
//! read through the code under test).

use super::report::{cell, median, write_json, Meta};
use gpufeed::{Device, DeviceBuffer, FileIo, Staging};
use serde::Serialize;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Bytes of header before the data (as a `.npy` file's): reads start
/// unaligned.
const HEADER: u64 = 128;
const POISON: u32 = 0xDEAD_BEEF;

pub struct Config {
    /// Bytes of data in the file.
    pub bytes: usize,
    /// Timed warm runs (cold: `cold_reps`).
    pub reps: usize,
    pub cold_reps: usize,
    /// Where the file is written (a real disk for the cold figures).
    pub dir: Option<PathBuf>,
}

impl Config {
    pub fn new(small: bool) -> Config {
        if small {
            Config {
                bytes: 24 << 20,
                reps: 3,
                cold_reps: 2,
                dir: None,
            }
        } else {
            Config {
                bytes: 1 << 30,
                reps: 5,
                cold_reps: 3,
                dir: None,
            }
        }
    }
}

#[derive(Serialize)]
struct Row {
    case: &'static str,
    /// The way the file was read (`direct`, `buffered`, `gds`), or `-`.
    way: String,
    bytes: usize,
    gbps: Option<f64>,
    runs: Vec<f64>,
    verified: bool,
}

#[derive(Serialize)]
struct Results {
    meta: Meta,
    file: String,
    bytes: usize,
    gds: String,
    /// Share of the file's pages in the page cache just after an eviction
    /// (the cold runs are cold only if it is near 0).
    cached_after_evict: Option<f64>,
    rows: Vec<Row>,
    /// Cold `Auto` read / the disk's own `O_DIRECT` rate.
    cold_vs_disk: Option<f64>,
    /// Warm read / the staged copy of the same bytes from memory.
    warm_vs_staged_memory: Option<f64>,
}

fn random_words(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n)
        .map(|_| loop {
            let v = rng.u32(..);
            if v != POISON {
                break v;
            }
        })
        .collect()
}

fn evict(file: &File) -> gpufeed::Result<()> {
    file.sync_all()?;
    // SAFETY: advice on our own open descriptor.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(std::io::Error::from_raw_os_error(r).into());
    }
    Ok(())
}

/// The share of `file`'s pages in the page cache (`mincore`).
fn cached_share(file: &File, len: usize) -> Option<f64> {
    // SAFETY: a fresh read-only shared mapping, only asked for residency,
    // unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return None;
    }
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: our mapping of `len` bytes, one byte per page in `v`.
    let ok = unsafe { libc::mincore(map, len, v.as_mut_ptr()) } == 0;
    // SAFETY: the mapping above, unmapped once.
    unsafe { libc::munmap(map, len) };
    ok.then(|| v.iter().filter(|&&b| b & 1 != 0).count() as f64 / v.len().max(1) as f64)
}

/// The disk's own rate: one thread of 16 MiB `O_DIRECT` `pread`s of the
/// whole file into an aligned buffer (`dd iflag=direct bs=16M`). `None`
/// where the file system refuses `O_DIRECT`.
fn disk_direct_gbps(path: &Path) -> gpufeed::Result<Option<f64>> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(f) => f,
        Err(_) => return Ok(None),
    };
    let len = f.metadata()?.len();
    let chunk = 16usize << 20;
    let layout = std::alloc::Layout::from_size_align(chunk, 4096)
        .map_err(|e| gpufeed::Error::Internal(e.to_string()))?;
    // SAFETY: a non-zero size.
    let ptr = unsafe { std::alloc::alloc(layout) };
    if ptr.is_null() {
        return Err(gpufeed::Error::Internal(
            "no memory for the O_DIRECT buffer".into(),
        ));
    }
    // SAFETY: `chunk` bytes just allocated, freed below.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, chunk) };
    let t = Instant::now();
    let mut at = 0u64;
    let mut result = Ok(());
    while at < len {
        match f.read_at(buf, at) {
            Ok(0) => break,
            Ok(n) => at += n as u64,
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    // SAFETY: allocated above with `layout`.
    unsafe { std::alloc::dealloc(ptr, layout) };
    result?;
    Ok(Some(at as f64 / secs / 1e9))
}

pub fn run(device: &Device, config: &Config, out: &Path) -> gpufeed::Result<()> {
    let n = config.bytes / 4;
    let bytes = n * 4;
    let words = random_words(n, 0xf11e5);
    let dir = config.dir.clone().unwrap_or_else(|| out.to_path_buf());
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("files-demo.bin");
    {
        let f = File::create(&path)?;
        f.write_all_at(&[0x5a; HEADER as usize], 0)?;
        let raw: &[u8] = bytemuck::cast_slice(&words);
        f.write_all_at(raw, HEADER)?;
        f.sync_all()?;
    }
    let file = File::open(&path)?;
    let staging = Staging::new(device)?;
    let gds = staging.file_route();
    println!(
        "   file: {} ({} MiB of random words after a {HEADER}-byte header)",
        path.display(),
        bytes >> 20
    );
    println!("   {gds}");
    let mut dev = DeviceBuffer::<u32>::new(device, n)?;
    let mut back = vec![0u32; n];
    let poison = vec![POISON; n];
    let mut rows = Vec::new();
    let mut cached_after_evict = None;

    let mut measure = |case: &'static str,
                       io: FileIo,
                       cold: bool,
                       reps: usize,
                       dev: &mut DeviceBuffer<u32>|
     -> gpufeed::Result<Row> {
        let mut runs = Vec::new();
        let mut verified = true;
        let mut way = String::new();
        for _ in 0..reps {
            dev.copy_from_host_sync(&poison)?;
            if cold {
                evict(&file)?;
                cached_after_evict = cached_share(&file, HEADER as usize + bytes);
            }
            let t = Instant::now();
            let copy = staging.read_file_with(&file, HEADER, dev, 0..n, io);
            way = match (copy.uses_gds(), copy.file_io()) {
                (true, _) => "gds".into(),
                (false, Some(FileIo::Direct)) => "direct".into(),
                (false, Some(_)) => "buffered".into(),
                (false, None) => "-".into(),
            };
            gpufeed::block_on(copy)?;
            runs.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
            dev.copy_to_host_sync(&mut back)?;
            verified &= back == words;
        }
        Ok(Row {
            case,
            way,
            bytes,
            gbps: cell(median(&runs), 2),
            runs: runs.iter().filter_map(|&g| cell(g, 2)).collect(),
            verified,
        })
    };
    // Warm: read once to fill the cache, then timed.
    let mut warmup = measure("warm (page cache)", FileIo::Auto, false, 1, &mut dev)?;
    warmup.case = "warm-up";
    rows.push(measure(
        "warm (page cache)",
        FileIo::Auto,
        false,
        config.reps,
        &mut dev,
    )?);
    // O_DIRECT only where the file system takes it (not tmpfs, say).
    match measure(
        "cold, O_DIRECT",
        FileIo::Direct,
        true,
        config.cold_reps,
        &mut dev,
    ) {
        Ok(row) => rows.push(row),
        Err(gpufeed::Error::Io(e)) if e.kind() == std::io::ErrorKind::Unsupported => {
            println!("   cold, O_DIRECT: refused here ({e})");
        }
        Err(e) => return Err(e),
    }
    rows.push(measure(
        "cold, auto",
        FileIo::Auto,
        true,
        config.cold_reps,
        &mut dev,
    )?);
    rows.push(measure(
        "cold, buffered",
        FileIo::Buffered,
        true,
        config.cold_reps,
        &mut dev,
    )?);
    if !warmup.verified {
        rows.push(warmup);
    }
    // The disk's own O_DIRECT rate, in the same run.
    let mut disk = Vec::new();
    for _ in 0..config.cold_reps {
        evict(&file)?;
        if let Some(g) = disk_direct_gbps(&path)? {
            disk.push(g);
        }
    }
    rows.push(Row {
        case: "disk's own O_DIRECT (16 MiB preads, 1 thread)",
        way: "-".into(),
        bytes: HEADER as usize + bytes,
        gbps: cell(median(&disk), 2),
        runs: disk.iter().filter_map(|&g| cell(g, 2)).collect(),
        verified: true,
    });
    // The link's figure from ordinary memory: the same bytes staged.
    let mut mem = Vec::new();
    let mut mem_ok = true;
    for _ in 0..config.reps {
        dev.copy_from_host_sync(&poison)?;
        let t = Instant::now();
        staging.h2d_blocking(&words, &mut dev)?;
        mem.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        dev.copy_to_host_sync(&mut back)?;
        mem_ok &= back == words;
    }
    rows.push(Row {
        case: "staged copy from memory (same bytes)",
        way: "-".into(),
        bytes,
        gbps: cell(median(&mem), 2),
        runs: mem.iter().filter_map(|&g| cell(g, 2)).collect(),
        verified: mem_ok,
    });
    println!(
        "   {:<48} {:>9} {:>9}  (GB/s, medians; every byte of every run checked)",
        "case", "way", "GB/s"
    );
    for r in &rows {
        println!(
            "   {:<48} {:>9} {:>9}{}",
            r.case,
            r.way,
            r.gbps.map_or("-".into(), |g| format!("{g:.2}")),
            if r.verified { "" } else { "  WRONG DATA" }
        );
    }
    let g = |case: &str| rows.iter().find(|r| r.case == case).and_then(|r| r.gbps);
    let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).and_then(|(a, b)| cell(a / b, 3));
    let cold_vs_disk = ratio(
        g("cold, auto"),
        g("disk's own O_DIRECT (16 MiB preads, 1 thread)"),
    );
    let warm_vs_staged_memory = ratio(
        g("warm (page cache)"),
        g("staged copy from memory (same bytes)"),
    );
    println!(
        "   cold (auto) / disk's O_DIRECT: {}; warm / staged from memory: {}; cached share after eviction: {}",
        cold_vs_disk.map_or("-".into(), |r| format!("{r:.2}x")),
        warm_vs_staged_memory.map_or("-".into(), |r| format!("{r:.2}x")),
        cached_after_evict.map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
    );
    let bad = rows.iter().filter(|r| !r.verified).count();
    let results = Results {
        meta: Meta::new(device),
        file: path.display().to_string(),
        bytes,
        gds: gds.to_string(),
        cached_after_evict,
        rows,
        cold_vs_disk,
        warm_vs_staged_memory,
    };
    drop(file);
    let _ = std::fs::remove_file(&path);
    write_json(&out.join("files.json"), &results)?;
    if bad > 0 {
        return Err(gpufeed::Error::Internal(format!(
            "files: {bad} measurement(s) delivered wrong data"
        )));
    }
    Ok(())
}
