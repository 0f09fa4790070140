//! File reads in pieces (`Staging::read_file_pieces`: many ranges of a file
//! into many device buffers in one stream through the ring) and the
//! automatic choice between buffered and `O_DIRECT` reads (`FileIo::Auto`).
//! Every check compares every byte with the file's, read by a plain loop,
//! in outputs poisoned beforehand: pieces following each other in the file
//! and scattered, offsets and lengths that are multiples of nothing,
//! zero-length pieces, blocks of 64 KiB + 4 and 1 MiB, buffered, direct and
//! automatic; a truncated file and bad pieces are typed errors.

use gpufeed::{DeviceBuffer, Error, FileIo, FilePiece, Staging, StagingConfig};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;

const POISON: u8 = 0xA5;

fn poisoned(device: &gpufeed::Device, n: usize) -> DeviceBuffer<u8> {
    let mut dev = DeviceBuffer::<u8>::new(device, n).unwrap();
    dev.copy_from_host_sync(&vec![POISON; n]).unwrap();
    dev
}

fn read(dev: &mut DeviceBuffer<u8>) -> Vec<u8> {
    let mut out = vec![0u8; dev.len()];
    dev.copy_to_host_sync(&mut out).unwrap();
    out
}

fn engine(device: &gpufeed::Device, block_bytes: usize, blocks: usize, threads: usize) -> Staging {
    let config = StagingConfig {
        block_bytes,
        blocks,
        threads,
        ..StagingConfig::for_device(device)
    };
    Staging::with_config(device, config).unwrap()
}

/// A directory of our own under `base`, removed on drop.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new(base: &std::path::Path, what: &str, device: &gpufeed::Device) -> Dir {
        let d = base.join(format!(
            "host-{what}-{}-{:?}",
            std::process::id(),
            device.kind()
        ));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A piece as the test describes it: `len` bytes of the file from `at`
/// into buffer `buf` at byte `dst`.
#[derive(Clone, Copy, Debug)]
struct Want {
    at: usize,
    buf: usize,
    dst: usize,
    len: usize,
}

/// Reads `wants` into fresh poisoned buffers of `sizes` bytes in one
/// `read_file_pieces`; the way taken and the buffers' contents.
fn read_pieces(
    staging: &Staging,
    file: &std::fs::File,
    sizes: &[usize],
    wants: &[Want],
    io: FileIo,
) -> Result<(Option<FileIo>, Vec<Vec<u8>>), Error> {
    let device = staging.device().clone();
    let mut bufs: Vec<DeviceBuffer<u8>> = sizes.iter().map(|&n| poisoned(&device, n)).collect();
    // Each buffer borrowed once: the pieces of one buffer are given as
    // separate buffers by the callers.
    let mut slots: Vec<Option<&mut DeviceBuffer<u8>>> = bufs.iter_mut().map(Some).collect();
    let pieces: Vec<FilePiece<'_, u8>> = wants
        .iter()
        .map(|w| FilePiece {
            at: w.at as u64,
            dst: slots[w.buf].take().expect("one piece per buffer"),
            range: w.dst..w.dst + w.len,
        })
        .collect();
    let copy = staging.read_file_pieces(file, pieces, io);
    let way = copy.file_io();
    gpufeed::block_on(copy)?;
    Ok((way, bufs.iter_mut().map(read).collect()))
}

/// What a plain loop puts in each buffer: the poison, and each piece's
/// bytes of the file.
fn expected(bytes: &[u8], sizes: &[usize], wants: &[Want]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![POISON; n]).collect();
    for w in wants {
        out[w.buf][w.dst..w.dst + w.len].copy_from_slice(&bytes[w.at..w.at + w.len]);
    }
    out
}

fn check(got: &[Vec<u8>], want: &[Vec<u8>], what: &str) {
    for (b, (g, w)) in got.iter().zip(want).enumerate() {
        if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
            panic!(
                "{what}: buffer {b} differs first at byte {i} of {}: {:#x} instead of {:#x}",
                g.len(),
                g[i],
                w[i]
            );
        }
    }
}

/// Random pieces: `n` of them, one buffer each (a margin of poison on both
/// sides), lengths from 0 to a few blocks; `follow`: each starts where the
/// last ended in the file (a safetensors data region), else anywhere.
fn random_pieces(
    rng: &mut fastrand::Rng,
    file_len: usize,
    n: usize,
    block: usize,
    follow: bool,
) -> (Vec<usize>, Vec<Want>) {
    let mut sizes = Vec::new();
    let mut wants = Vec::new();
    let mut at = rng.usize(..4099);
    for i in 0..n {
        let len = match rng.usize(..6) {
            0 => 0,
            1 => rng.usize(1..100),
            2 => block,
            3 => block - 1 + rng.usize(..3),
            _ => rng.usize(1..3 * block),
        };
        if !follow {
            at = rng.usize(..file_len);
        }
        let len = len.min(file_len - at.min(file_len));
        let margin = rng.usize(..9);
        sizes.push(margin + len + rng.usize(..9));
        wants.push(Want {
            at,
            buf: i,
            dst: margin,
            len,
        });
        at += len;
    }
    (sizes, wants)
}

fn random_bytes(n: usize, rng: &mut fastrand::Rng) -> Vec<u8> {
    (0..n).map(|_| rng.u8(..)).collect()
}

/// Drops the file's pages from the page cache (clean pages: after fsync).
fn evict(file: &std::fs::File) {
    file.sync_all().unwrap();
    // SAFETY: advice on our own open descriptor.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// The share of the file's pages in the page cache, every page looked up
/// (the test's own count, independent of the library's sampling).
fn resident_share(file: &std::fs::File) -> f64 {
    let len = file.metadata().unwrap().len() as usize;
    // SAFETY: a read-only mapping of our file, only its residency asked,
    // unmapped below.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED);
        let pages = len.div_ceil(4096);
        let mut v = vec![0u8; pages];
        assert_eq!(libc::mincore(map, len, v.as_mut_ptr()), 0);
        libc::munmap(map, len);
        v.iter().filter(|&&r| r & 1 != 0).count() as f64 / pages as f64
    }
}

/// Whether the file system under `path` opens files with `O_DIRECT`.
fn takes_o_direct(path: &std::path::Path) -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .is_ok()
}

gpufeed::backend_tests!(pieces_in_one_stream_land_as_a_plain_loop_puts_them);
fn pieces_in_one_stream_land_as_a_plain_loop_puts_them(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0x9ece5);
    // The build's own directory (a real disk where /tmp is tmpfs) and /tmp.
    for base in [std::env::current_dir().unwrap(), std::env::temp_dir()] {
        let dir = Dir::new(&base, "pieces", &device);
        let path = dir.0.join("data.bin");
        let bytes = random_bytes(3_000_017, &mut rng);
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // 64 KiB + 4 (block ends move against the pages), 4 blocks (a
        // direct fill takes 2); 1 MiB, 3 blocks (a direct fill takes 1).
        for (block, blocks, threads) in [((64 << 10) + 4, 4, 3), (1 << 20, 3, 1)] {
            let staging = engine(&device, block, blocks, threads);
            for round in 0..4 {
                let follow = round % 2 == 0;
                let (sizes, wants) = random_pieces(&mut rng, bytes.len(), 9, block, follow);
                let want = expected(&bytes, &sizes, &wants);
                for io in [FileIo::Buffered, FileIo::Direct, FileIo::Auto] {
                    let what = format!("{io:?}, blocks of {block}, follow {follow}: {wants:?}");
                    match read_pieces(&staging, &file, &sizes, &wants, io) {
                        Ok((way, got)) => {
                            check(&got, &want, &what);
                            let any = wants.iter().any(|w| w.len > 0);
                            assert_eq!(way.is_some(), any, "{what}");
                            if io != FileIo::Auto && any {
                                assert_eq!(way, Some(io), "{what}");
                            }
                        }
                        Err(Error::Io(e))
                            if io == FileIo::Direct
                                && e.kind() == std::io::ErrorKind::Unsupported =>
                        {
                            eprintln!("{}: O_DIRECT refused ({e})", dir.0.display());
                        }
                        Err(e) => panic!("{what}: {e:?}"),
                    }
                }
            }
        }
        // No pieces at all, and only empty ones: nothing read, done.
        let staging = engine(&device, 1 << 20, 3, 1);
        let (way, got) = read_pieces(&staging, &file, &[], &[], FileIo::Auto).unwrap();
        assert!(way.is_none() && got.is_empty());
        let empty = [Want {
            at: 5,
            buf: 0,
            dst: 3,
            len: 0,
        }];
        let (way, got) = read_pieces(&staging, &file, &[7], &empty, FileIo::Direct).unwrap();
        assert!(way.is_none());
        assert_eq!(got, vec![vec![POISON; 7]]);
    }
}

gpufeed::backend_tests!(a_truncated_file_and_bad_pieces_are_typed_errors);
fn a_truncated_file_and_bad_pieces_are_typed_errors(device: gpufeed::Device) {
    let mut rng = fastrand::Rng::with_seed(0x7a1);
    let dir = Dir::new(&std::env::current_dir().unwrap(), "pieces-bad", &device);
    let path = dir.0.join("short.bin");
    let bytes = random_bytes(600_001, &mut rng);
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let staging = engine(&device, (64 << 10) + 4, 4, 2);
    // The last piece runs 3 bytes past the end of the file.
    let wants = [
        Want {
            at: 11,
            buf: 0,
            dst: 0,
            len: 300_000,
        },
        Want {
            at: 300_011,
            buf: 1,
            dst: 1,
            len: 299_993,
        },
    ];
    for io in [FileIo::Buffered, FileIo::Direct, FileIo::Auto] {
        match read_pieces(&staging, &file, &[300_000, 299_994], &wants, io) {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(Error::Io(e))
                if io == FileIo::Direct && e.kind() == std::io::ErrorKind::Unsupported => {}
            other => panic!("{io:?}: a truncated file: {:?}", other.map(|r| r.0)),
        }
    }
    // A bad piece among good ones: refused before any byte is read (every
    // buffer still all poison), and the buffers stay usable.
    let mut a = poisoned(&device, 1000);
    let mut b = poisoned(&device, 1000);
    let mut c = poisoned(&device, 10);
    let (seven, three) = (7, 3);
    for bad in [5..11, seven..three] {
        let pieces = vec![
            FilePiece {
                at: 0,
                dst: &mut a,
                range: 0..1000,
            },
            FilePiece {
                at: 1000,
                dst: &mut c,
                range: bad.clone(),
            },
            FilePiece {
                at: 2000,
                dst: &mut b,
                range: 0..1000,
            },
        ];
        let err = staging
            .read_file_pieces_blocking(&file, pieces, FileIo::Auto)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { .. }), "{bad:?}: {err:?}");
        assert_eq!(read(&mut a), vec![POISON; 1000], "{bad:?}: a byte was read");
        assert_eq!(read(&mut b), vec![POISON; 1000], "{bad:?}: a byte was read");
    }
    let pieces = vec![FilePiece {
        at: u64::MAX - 3,
        dst: &mut a,
        range: 0..10,
    }];
    let err = staging
        .read_file_pieces_blocking(&file, pieces, FileIo::Buffered)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    let pieces = vec![
        FilePiece {
            at: 3,
            dst: &mut a,
            range: 0..1000,
        },
        FilePiece {
            at: 7,
            dst: &mut b,
            range: 0..1000,
        },
    ];
    staging
        .read_file_pieces_blocking(&file, pieces, FileIo::Auto)
        .unwrap();
    assert!(read(&mut a) == bytes[3..1003] && read(&mut b) == bytes[7..1007]);
}

gpufeed::backend_tests!(
    auto_reads_buffered_so_a_cold_file_is_cached_after_and_direct_only_when_asked
);
fn auto_reads_buffered_so_a_cold_file_is_cached_after_and_direct_only_when_asked(
    device: gpufeed::Device,
) {
    let mut rng = fastrand::Rng::with_seed(0xc01d);
    for base in [std::env::current_dir().unwrap(), std::env::temp_dir()] {
        let dir = Dir::new(&base, "auto", &device);
        let path = dir.0.join("data.bin");
        // 9 MiB + 13: the header makes the first byte unaligned.
        let bytes = random_bytes((9 << 20) + 13, &mut rng);
        std::fs::write(&path, &bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let direct_ok = takes_o_direct(&path);
        let staging = engine(&device, 1 << 20, 4, 2);
        let n = bytes.len() - 13;
        let sizes = [n + 2];
        let wants = [Want {
            at: 13,
            buf: 0,
            dst: 1,
            len: n,
        }];
        let want = expected(&bytes, &sizes, &wants);
        // Just written: cached.
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let cached = resident_share(&file);
        assert!(cached > 0.9, "a file just read is {cached} cached");
        let probe = gpufeed::cached_share(&file, &[(13, n as u64)]).unwrap();
        assert!(
            probe > 0.9,
            "the probe finds {probe} of a cached file cached"
        );
        let planned = staging.file_io_for(&file, FileIo::Auto).unwrap();
        assert_eq!(planned, FileIo::Buffered, "a cached file");
        let (way, got) = read_pieces(&staging, &file, &sizes, &wants, FileIo::Auto).unwrap();
        check(&got, &want, "auto, cached");
        assert_eq!(way, Some(FileIo::Buffered), "a cached file");
        // Evicted (where the file system lets pages go: tmpfs keeps them,
        // its pages are the file): still buffered, and the read leaves the
        // file cached for the next one.
        evict(&file);
        let cold = resident_share(&file) < 0.05;
        let probe = gpufeed::cached_share(&file, &[(13, n as u64)]).unwrap();
        assert_eq!(probe < 0.125, cold, "the probe finds {probe} cached");
        let planned = staging.file_io_for(&file, FileIo::Auto).unwrap();
        assert_eq!(planned, FileIo::Buffered, "an evicted file");
        let (way, got) = read_pieces(&staging, &file, &sizes, &wants, FileIo::Auto).unwrap();
        check(&got, &want, "auto, evicted");
        assert_eq!(way, Some(FileIo::Buffered), "an evicted file");
        let after = resident_share(&file);
        assert!(
            after > 0.9,
            "an automatic read left {after} of the file cached"
        );
        // Asked for, O_DIRECT reads around the page cache: it stays empty.
        if direct_ok {
            evict(&file);
            let cold = resident_share(&file) < 0.05;
            let (way, got) = read_pieces(&staging, &file, &sizes, &wants, FileIo::Direct).unwrap();
            check(&got, &want, "direct, evicted");
            assert_eq!(way, Some(FileIo::Direct));
            if cold {
                let after = resident_share(&file);
                assert!(
                    after < 0.05,
                    "a direct read left {after} of the file cached"
                );
            }
        }
        // Buffered and Direct stay what they say, cold or not.
        assert_eq!(
            staging.file_io_for(&file, FileIo::Buffered).unwrap(),
            FileIo::Buffered
        );
        match staging.file_io_for(&file, FileIo::Direct) {
            Ok(w) => assert!(direct_ok && w == FileIo::Direct),
            Err(Error::Io(e)) => {
                assert!(
                    !direct_ok && e.kind() == std::io::ErrorKind::Unsupported,
                    "{e:?}"
                )
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

gpufeed::backend_tests!(a_read_of_pieces_dropped_at_any_point_leaves_the_engine_whole);
fn a_read_of_pieces_dropped_at_any_point_leaves_the_engine_whole(device: gpufeed::Device) {
    use std::future::Future;
    let mut rng = fastrand::Rng::with_seed(0xd209);
    let dir = Dir::new(&std::env::current_dir().unwrap(), "pieces-drop", &device);
    let path = dir.0.join("data.bin");
    let bytes = random_bytes(2_000_003, &mut rng);
    std::fs::write(&path, &bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let block = (64 << 10) + 4;
    let staging = engine(&device, block, 4, 2);
    let (sizes, wants) = random_pieces(&mut rng, bytes.len(), 7, block, true);
    let want = expected(&bytes, &sizes, &wants);
    for io in [FileIo::Buffered, FileIo::Direct] {
        for polls in 0..12 {
            {
                let mut bufs: Vec<DeviceBuffer<u8>> =
                    sizes.iter().map(|&n| poisoned(&device, n)).collect();
                let pieces: Vec<FilePiece<'_, u8>> = bufs
                    .iter_mut()
                    .zip(&wants)
                    .map(|(b, w)| FilePiece {
                        at: w.at as u64,
                        dst: b,
                        range: w.dst..w.dst + w.len,
                    })
                    .collect();
                let mut copy = staging.read_file_pieces(&file, pieces, io);
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                for _ in 0..polls {
                    if std::pin::Pin::new(&mut copy).poll(&mut cx).is_ready() {
                        break;
                    }
                }
                drop(copy);
                // The buffers are freed with DMAs perhaps still in flight.
            }
            // Every block came back: a whole read still runs, and lands.
            match read_pieces(&staging, &file, &sizes, &wants, io) {
                Ok((_, got)) => check(&got, &want, &format!("{io:?} after a drop at {polls}")),
                Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::Unsupported => break,
                Err(e) => panic!("{io:?} after a drop at {polls}: {e:?}"),
            }
            let stats = staging.pool_stats();
            assert!(
                stats.in_use_bytes <= (72 << 10) * 4, // 4 blocks of the size class of 64 KiB + 4
                "{stats:?}"
            );
        }
    }
}
