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
//! [`FileIo::Auto`] reads buffered. On the H200 machine (`host files`,
//! 4 GiB, cold), parallel buffered `pread`s with the kernel's read-ahead
//! reached 1.76 GB/s against 0.81 GB/s for the ring's `O_DIRECT` reads and
//! 1.34 GB/s for the disk's own single-stream `O_DIRECT` rate; a cached
//! file is served from memory far faster than any disk. `O_DIRECT` is there
//! for who asks ([`FileIo::Direct`]): reads that must not fill the page
//! cache.

use crate::error::{Error, Result};
use crate::workers::{read_exact_at, CopyWorkers};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;

/// How a file is read into the ring ([`crate::Staging::read_file_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FileIo {
    /// Buffered: measured faster than this ring's `O_DIRECT` reads cold
    /// as well as warm (see the module's notes).
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
        Err(why) if io == FileIo::Direct => refuse(why),
        Err(_) => Ok(None),
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

/// Reads `len` bytes of the file from `at` into `block` with `direct` (the
/// file opened with `O_DIRECT`) for the aligned part and `buffered` (the
/// user's descriptor) for the rest; returns the offset in `block` of the
/// first byte. `block` must hold `at % 4096 + len` bytes.
pub(crate) fn read_block(
    workers: &CopyWorkers,
    direct: &File,
    buffered: &File,
    at: u64,
    block: &mut [u8],
    len: usize,
) -> Result<usize> {
    let align = DIRECT_IO_ALIGN;
    let start = at - at % align;
    let skew = (at - start) as usize;
    let end = at + len as u64;
    let mid_end = end - end % align;
    if block.len() < skew + len {
        return Err(Error::Internal(format!(
            "a direct read of {len} bytes at skew {skew} into a block of {}",
            block.len()
        )));
    }
    let block_aligned = (block.as_ptr() as usize).is_multiple_of(align as usize);
    if mid_end <= start || !block_aligned {
        // All in one unaligned page (or, never with pinned blocks, an
        // unaligned block): buffered.
        read_exact_at(buffered, &mut block[skew..skew + len], at)?;
        return Ok(skew);
    }
    let mid = (mid_end - start) as usize;
    workers.read(direct, start, &mut block[..mid])?;
    read_exact_at(buffered, &mut block[mid..skew + len], mid_end)?;
    Ok(skew)
}
