//! Reads of many files through one staging engine, into buffers or slices
//! of device memory ([`Staging::read_files`]): a model's shards in one
//! stream through the ring, and strided pieces of a file (a column slice of
//! a tensor) gathered into whole blocks before their DMA.
//!
//! The pieces of one read are planned as [`Staging::read_file_pieces`]
//! plans its pieces: a block holds pieces that follow each other in one
//! file (one `pread` for them, split among the workers), and never spans
//! two files, so the ring stays full from one file into the next (the
//! reads of the next file's first block overlap the DMA of the last
//! block of the file before). Pieces of one file that follow each other on
//! the device but not in the file (the rows of a column slice) are
//! gathered: one block holds as many of them as it fits, each read by its
//! own buffered `pread` (many in flight, spread over the workers), then
//! sent by one DMA. A direct read ([`FileIo::Direct`]) reads gathered
//! blocks buffered too: their pieces are not aligned.

use super::{FileIo, Seg, StagedCopy, Staging};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceSliceMut, InFlight};
use bytemuck::Pod;
use std::marker::PhantomData;

/// Where a [`Staging::read_files`] lands: a device buffer (its record of
/// staged DMAs keeps its next use and its free behind them, as for every
/// staged copy) or a slice of device memory (a foreign allocation, say):
/// a read into slices waits, when dropped unfinished, for the DMAs it
/// issued (at most a ring of blocks), so none writes the slice after the
/// borrow ends.
pub struct ReadTarget<'a> {
    addr: u64,
    bytes: usize,
    device_id: usize,
    in_flight: Option<&'a InFlight>,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> ReadTarget<'a> {
    /// The whole of `buf`, borrowed exclusively for the read.
    pub fn buffer<T: Pod>(buf: &'a mut DeviceBuffer<T>) -> ReadTarget<'a> {
        let (device, addr, in_flight) = buf.staging_parts();
        ReadTarget {
            addr,
            bytes: std::mem::size_of::<T>() * buf.len(),
            device_id: device.id(),
            in_flight: Some(in_flight),
            _borrow: PhantomData,
        }
    }

    /// A slice of device memory (a buffer's `view_mut`, or foreign memory
    /// through [`crate::interop::device_slice_mut`]), borrowed for the
    /// read.
    pub fn slice<T: Pod>(s: DeviceSliceMut<'a, T>) -> ReadTarget<'a> {
        ReadTarget {
            addr: s.addr,
            bytes: std::mem::size_of::<T>() * s.len,
            device_id: s.device_id,
            in_flight: None,
            _borrow: PhantomData,
        }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
}

/// One piece of a [`Staging::read_files`]: `len` bytes of `file` from
/// offset `at` into target number `target` from byte `offset`.
#[derive(Clone, Copy, Debug)]
pub struct FileRange<'a> {
    /// The file (borrowed for the read; pieces of one file name the same
    /// `File`).
    pub file: &'a std::fs::File,
    /// Offset in the file of the piece's first byte.
    pub at: u64,
    /// Index of its target in the read's targets.
    pub target: usize,
    /// Offset in the target of the piece's first byte.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl Staging {
    /// Reads `ranges` (pieces of one or more files) into `targets` in one
    /// stream through the ring, in the order given: the pieces of several
    /// files (a model's shards) flow through the blocks without a pause
    /// between files, and pieces of one file that follow each other on the
    /// device (the rows of a column slice, in order) are gathered into
    /// whole blocks, one `pread` each, one DMA per block. `io` as for
    /// [`Staging::read_file_with`], decided per file (gathered blocks are
    /// read buffered).
    ///
    /// # Errors
    /// Every piece is checked before any byte is read: `OutOfBounds` for a
    /// piece outside its target (or a target index past `targets`),
    /// `InvalidArgument` for a target of another device or a file range
    /// past `u64::MAX`. As [`Staging::read_file_with`] otherwise (a file
    /// that ends before its last piece is full is `UnexpectedEof`; the
    /// targets then hold unspecified data).
    ///
    /// # Cancel safety
    /// As [`Staging::read_file`]; a read into slices waits, when dropped,
    /// for the DMAs it issued (see [`ReadTarget`]).
    pub fn read_files<'a>(
        &'a self,
        targets: Vec<ReadTarget<'a>>,
        ranges: &[FileRange<'a>],
        io: FileIo,
    ) -> StagedCopy<'a> {
        let device_id = self.engine.device.id();
        let mut check = Ok(());
        let mut fail = |e: Error| {
            if check.is_ok() {
                check = Err(e);
            }
        };
        if targets.iter().any(|t| t.device_id != device_id) {
            fail(Error::InvalidArgument(
                "a read target of another device (or backend) was given to this staging engine"
                    .into(),
            ));
        }
        let mut files: Vec<&'a std::fs::File> = Vec::new();
        let mut segs: Vec<Seg<'a>> = Vec::with_capacity(ranges.len());
        for r in ranges {
            let Some(t) = targets.get(r.target) else {
                fail(Error::OutOfBounds {
                    start: r.target,
                    end: r.target.saturating_add(1),
                    len: targets.len(),
                });
                continue;
            };
            let end = r.offset.checked_add(r.len);
            match end {
                Some(end) if end <= t.bytes => {}
                _ => {
                    fail(Error::OutOfBounds {
                        start: r.offset,
                        end: end.unwrap_or(usize::MAX),
                        len: t.bytes,
                    });
                    continue;
                }
            }
            // Files by identity: the last one first (pieces of one file
            // usually come together).
            let file = match files.iter().rposition(|f| std::ptr::eq(*f, r.file)) {
                Some(i) => i,
                None => {
                    files.push(r.file);
                    files.len() - 1
                }
            };
            segs.push(Seg {
                file,
                file_at: r.at,
                dev: t.addr + r.offset as u64,
                len: r.len,
                start: 0,
                run_end: 0,
                join_end: 0,
                in_flight: t.in_flight,
            });
        }
        self.file_read(files, segs, check, io)
    }

    /// [`Staging::read_files`] for synchronous code: returns when every
    /// piece is on the device (or the read failed and its DMAs are over).
    ///
    /// # Errors
    /// As [`Staging::read_files`].
    pub fn read_files_blocking<'a>(
        &'a self,
        targets: Vec<ReadTarget<'a>>,
        ranges: &[FileRange<'a>],
        io: FileIo,
    ) -> Result<()> {
        crate::block::block_on(self.read_files(targets, ranges, io))
    }
}

impl StagedCopy<'_> {
    /// Fills `block` with the pieces of a gathered block at copy offset
    /// `off` (all of `file`, following each other on the device): pieces
    /// that follow each other in the file are read together, the rest each
    /// by its own buffered `pread`, spread over the workers.
    pub(super) fn fill_gathered(
        &self,
        file: &std::fs::File,
        off: usize,
        block: &mut [u8],
    ) -> Result<()> {
        let len = block.len();
        // (file offset, bytes) of each read, in block order.
        let mut reads: Vec<(u64, usize)> = Vec::new();
        let (mut i, mut pos) = (self.seg_at(off), off);
        while pos < off + len {
            let Some(seg) = self.segs.get(i) else {
                return Err(Error::Internal(
                    "a gathered block past the read's pieces".into(),
                ));
            };
            let at = seg.file_at + (pos - seg.start) as u64;
            let n = (seg.start + seg.len).min(off + len) - pos;
            match reads.last_mut() {
                Some((a, l)) if *a + *l as u64 == at => *l += n,
                _ => reads.push((at, n)),
            }
            pos += n;
            i += 1;
        }
        let mut parts = Vec::with_capacity(reads.len());
        let mut rest = block;
        for (at, n) in reads {
            let (dst, tail) = rest.split_at_mut(n);
            parts.push(crate::workers::ReadPart { at, dst });
            rest = tail;
        }
        self.engine.workers.read_scattered(file, &mut parts)
    }
}
