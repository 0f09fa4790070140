//! `O_DIRECT` file reads for the staging ring ([`crate::FileIo`]).
//!
//! The user's `File` is reopened with `O_DIRECT` through `/proc/self/fd`
//! (the same file, a descriptor of our own: the user's keeps its flags and
//! offset). Each block then holds the 4 KiB-aligned range around its bytes:
//! the aligned middle is read by the workers with `O_DIRECT` straight into
//! the pinned block (page-aligned; every worker's piece a multiple of
//! 4 KiB from the block's start), the unaligned tail (under 4 KiB) with a
//! buffered `pread`, and the DMA starts at the skew of the first byte.
//!
//! [`FileIo::Auto`] reads buffered. On the H200 machine (2026-12-02,
//! 4 GiB and 1 GiB files, `host files` and `bench/peers/files.py`) cold
//! `O_DIRECT` reads in large requests were no faster than buffered ones
//! (1.52 against 1.52 GB/s, and 1.54 against 1.67), while a file read
//! `O_DIRECT` stays out of the page cache: read again, it comes from the
//! disk again (the files peer's "warm" `read_file` fell to 1.79 GB/s when
//! the automatic choice took `O_DIRECT` for a file evicted before it).
//! `O_DIRECT` is there for who asks ([`FileIo::Direct`]): a read that must
//! not fill the page cache. [`cached_share`] tells how much of a range is
//! cached (`mincore`: nothing is read). Direct reads go in large requests:
//! the workers fill half the ring's blocks in one job, each participant
//! one aligned `pread` of 4-16 MiB ([`crate::base::workers::DIRECT_PIECE_MIN`]),
//! while the DMAs of the blocks filled before run.

use crate::base::error::{Error, Result};
use crate::base::workers::{read_exact_at, CopyWorkers, ReadPart};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;

/// How a file is read into the ring ([`crate::Staging::read_file_with`]).
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, DeviceBuffer, FileIo, Staging};
/// let path = std::env::temp_dir().join(format!("gpufeed-doc-fileio-{}", std::process::id()));
/// std::fs::write(&path, vec![3u8; 1 << 16])?;
/// let device = Device::cpu();
/// let staging = Staging::new(&device)?;
/// let file = std::fs::File::open(&path)?;
/// assert_eq!(staging.file_io_for(&file, FileIo::Auto)?, FileIo::Buffered);
/// let mut dev = DeviceBuffer::<u8>::new(&device, 1 << 16)?;
/// let read = staging.read_file_with(&file, 0, &mut dev, 0..1 << 16, FileIo::Auto);
/// assert_eq!(read.file_io(), Some(FileIo::Buffered)); // the way `Auto` took
/// block_on(read)?;
/// # std::fs::remove_file(&path)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FileIo {
    /// Buffered: on the H200 machine cold `O_DIRECT` reads were no faster
    /// than buffered ones (1.52 against 1.52 GB/s at 4 GiB), and a file read
    /// `O_DIRECT` stays out of the page cache, so its next read comes from
    /// the disk again (REPORT.md, "Files to the device and back"). The way
    /// taken: [`crate::StagedCopy::file_io`], or
    /// [`crate::Staging::file_io_for`] before a read.
    #[default]
    Auto,
    /// Through the page cache (`pread`).
    Buffered,
    /// `O_DIRECT`: the 4 KiB-aligned middle of each block read around the
    /// page cache straight into the pinned block, the unaligned ends (under
    /// 4 KiB each) buffered. Refused with an [`Error::Io`] of kind
    /// `Unsupported` where the file system refuses `O_DIRECT` (or the
    /// descriptor can't be reopened), `InvalidArgument` for blocks under
    /// 8 KiB.
    Direct,
}

/// `O_DIRECT` alignment of file offsets, lengths and memory addresses
/// (the largest logical block size in common use).
pub const DIRECT_IO_ALIGN: u64 = 4096;

/// Pages [`cached_share`] samples to tell whether a range is cached.
pub const PROBE_SAMPLES: usize = 32;

/// The `O_DIRECT` descriptor for a read of `file` the way `io` asks, or
/// `None` for a buffered read.
///
/// # Errors
/// For [`FileIo::Direct`] only: `Io` of kind `Unsupported` when the file
/// can't be reopened with `O_DIRECT` (the file system refuses it: tmpfs
/// before Linux 6.6, some FUSE and network file systems; no `/proc`), or
/// the descriptor is write-only; `InvalidArgument` for blocks under 8 KiB.
pub(crate) fn choose(file: &File, io: FileIo, block_bytes: usize) -> Result<Option<File>> {
    let refuse = |why: String| -> Result<Option<File>> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("O_DIRECT read refused: {why}"),
        )
        .into())
    };
    match io {
        FileIo::Buffered | FileIo::Auto => return Ok(None),
        FileIo::Direct => {
            if (block_bytes as u64) < 2 * DIRECT_IO_ALIGN {
                return Err(Error::InvalidArgument(format!(
                    "O_DIRECT reads need staging blocks of at least {} bytes (these are {block_bytes})",
                    2 * DIRECT_IO_ALIGN
                )));
            }
        }
    }
    match reopen_direct(file) {
        Ok(f) => Ok(Some(f)),
        Err(why) => refuse(why),
    }
}

/// `file` opened anew for reading with `O_DIRECT`; why not otherwise.
fn reopen_direct(file: &File) -> std::result::Result<File, String> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL on a descriptor we borrow reads its flags only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(format!("fcntl: {}", std::io::Error::last_os_error()));
    }
    if flags & libc::O_ACCMODE == libc::O_WRONLY {
        return Err("the file was opened for writing only".into());
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{fd}"))
        .map_err(|e| format!("the file system does not accept it ({e})"))
}

/// The share of the pages sampled over `file`'s `ranges` (`(offset,
/// length)` pairs) that are in the page cache: [`PROBE_SAMPLES`] pages
/// spread evenly over the ranges' bytes, each looked up with `mincore` on a
/// read-only mapping of its range (nothing is read or faulted in). `None`
/// when it can't be told (the file can't be mapped: a pipe, a write-only
/// descriptor) or the ranges are empty.
pub fn cached_share(file: &File, ranges: &[(u64, u64)]) -> Option<f64> {
    let page = DIRECT_IO_ALIGN;
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    if total == 0 {
        return None;
    }
    let (mut cached, mut sampled) = (0usize, 0usize);
    let mut base = 0u64;
    let mut sample = 0usize;
    for &(at, len) in ranges {
        // The samples whose position falls in this range.
        let mut wanted = Vec::new();
        while sample < PROBE_SAMPLES {
            let pos = (2 * sample as u64 + 1) * total / (2 * PROBE_SAMPLES as u64);
            if pos >= base + len {
                break;
            }
            wanted.push(at + (pos - base));
            sample += 1;
        }
        base += len;
        if wanted.is_empty() {
            continue;
        }
        let start = at - at % page;
        let map_len = usize::try_from(at + len - start).ok()?;
        let offset = libc::off_t::try_from(start).ok()?;
        // SAFETY: a fresh shared read-only mapping of the file's range,
        // which nothing reads (only its residency is asked) and which is
        // unmapped below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset,
            )
        };
        if map == libc::MAP_FAILED {
            return None;
        }
        for off in wanted {
            let in_map = ((off - start) - (off - start) % page) as usize;
            let mut resident = 0u8;
            // SAFETY: one page of our mapping (`in_map` < `map_len`, page
            // aligned); one byte of result.
            let ok = unsafe {
                libc::mincore(
                    map.cast::<u8>().add(in_map).cast(),
                    page as usize,
                    &mut resident,
                )
            } == 0;
            if ok {
                sampled += 1;
                cached += usize::from(resident & 1 != 0);
            }
        }
        // SAFETY: the mapping made above, unmapped once.
        unsafe { libc::munmap(map, map_len) };
    }
    (sampled > 0).then(|| cached as f64 / sampled as f64)
}

/// One staging block of a direct read: `len` bytes of the file from `at`,
/// to land at `at % 4096` in `block` (which holds the aligned range around
/// them: `block` holds at least `at % 4096 + len` bytes).
pub(crate) struct DirectBlock<'a> {
    pub(crate) at: u64,
    pub(crate) block: &'a mut [u8],
    pub(crate) len: usize,
}

/// Reads the blocks with `direct` (the file opened with `O_DIRECT`) for
/// their aligned middles, all in one job of the workers (large requests,
/// several in flight: [`CopyWorkers::read_parts`]), and `buffered` (the
/// user's descriptor) for the unaligned tails (under 4 KiB each).
pub(crate) fn read_blocks(
    workers: &CopyWorkers,
    direct: &File,
    buffered: &File,
    blocks: &mut [DirectBlock<'_>],
) -> Result<()> {
    let align = DIRECT_IO_ALIGN;
    let mut parts = Vec::with_capacity(blocks.len());
    let mut tails = Vec::with_capacity(blocks.len());
    for b in blocks.iter_mut() {
        let (at, len) = (b.at, b.len);
        let start = at - at % align;
        let skew = (at - start) as usize;
        let end = at + len as u64;
        let mid_end = end - end % align;
        if b.block.len() < skew + len {
            return Err(Error::Internal(format!(
                "a direct read of {len} bytes at skew {skew} into a block of {}",
                b.block.len()
            )));
        }
        let block_aligned = (b.block.as_ptr() as usize).is_multiple_of(align as usize);
        if mid_end <= start || !block_aligned {
            // All in one unaligned page (or, never with pinned blocks, an
            // unaligned block): buffered.
            tails.push((at, &mut b.block[skew..skew + len]));
            continue;
        }
        let mid = (mid_end - start) as usize;
        let (middle, rest) = b.block[..skew + len].split_at_mut(mid);
        parts.push(ReadPart {
            at: start,
            dst: middle,
        });
        tails.push((mid_end, rest));
    }
    if !parts.is_empty() {
        workers.read_parts(direct, &mut parts)?;
    }
    for (at, buf) in tails {
        read_exact_at(buffered, buf, at)?;
    }
    Ok(())
}
