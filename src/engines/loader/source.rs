//! The rows of one field of a loader's source ([`RowSource`]): borrowed
//! slices, concatenated segments, raw memory, or memory pinned in place,
//! and the address of each row.

use crate::base::error::{Error, Result};
use crate::interop::RegisteredRaw;
use crate::runtime::memory::Registered;
use bytemuck::Pod;
use std::marker::PhantomData;
use std::sync::Arc;

/// The rows of one field of a loader's source: memory in one or several
/// segments (concatenated), each a whole number of rows of `row_bytes`.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{Error, RowSource};
/// let features = vec![0.5f32; 10 * 3];
/// let rows = RowSource::new(&features, 3)?; // 10 rows of 3 values
/// assert_eq!((rows.rows(), rows.row_bytes()), (10, 12));
/// let halves = RowSource::concat(&[&features[..15], &features[15..]], 3)?; // two segments
/// assert_eq!(halves.rows(), 10);
/// let err = RowSource::new(&features, 4).unwrap_err(); // 30 values aren't rows of 4
/// assert!(matches!(err, Error::InvalidArgument(_)));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RowSource<'a> {
    /// (address, rows) of each segment.
    segments: Vec<(usize, usize)>,
    /// The row index each segment ends at (cumulative).
    ends: Vec<usize>,
    row_bytes: usize,
    /// The registration keeping the rows pinned in place, for a source the
    /// device can read where it is.
    pinned: Option<PinnedRows>,
    _borrow: PhantomData<&'a [u8]>,
}

/// A registration guard ([`Registered`] or [`RegisteredRaw`]) shared by the
/// row sources over its memory and the loaders reading it.
#[derive(Clone)]
struct PinnedRows {
    _keep: Arc<dyn std::any::Any + Send + Sync>,
    /// The host-memory domain it is registered in.
    domain: usize,
}

impl std::fmt::Debug for PinnedRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRows").finish_non_exhaustive()
    }
}

impl<'a> RowSource<'a> {
    /// The rows of `data`, `row_len` values each.
    ///
    /// # Errors
    /// `InvalidArgument` for `row_len` 0 or a length not a multiple of it.
    pub fn new<T: Pod>(data: &'a [T], row_len: usize) -> Result<Self> {
        Self::concat(&[data], row_len)
    }

    /// The rows of `parts` one after another (`row_len` values each).
    ///
    /// # Errors
    /// As [`RowSource::new`], for any part.
    pub fn concat<T: Pod>(parts: &[&'a [T]], row_len: usize) -> Result<Self> {
        let raw: Vec<(*const u8, usize)> = parts
            .iter()
            .map(|p| (p.as_ptr().cast::<u8>(), p.len()))
            .collect();
        RowSource::from_segments(&raw, row_len, std::mem::size_of::<T>())
    }

    /// Rows from raw segments: `(address, rows)` pairs of `row_bytes`-byte
    /// rows, concatenated (what a binding holding the memory alive uses).
    ///
    /// # Safety
    /// Each segment's `rows × row_bytes` bytes stay readable, and are
    /// written by no one, for `'a`.
    ///
    /// # Errors
    /// `InvalidArgument` for `row_bytes` 0, `SizeOverflow` for a segment
    /// beyond the address space.
    pub unsafe fn from_raw_parts(
        segments: &[(*const u8, usize)],
        row_bytes: usize,
    ) -> Result<Self> {
        if row_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row size must be at least 1 byte".into(),
            ));
        }
        let mut out = Vec::with_capacity(segments.len());
        for &(p, rows) in segments {
            crate::base::error::byte_size::<u8>(rows.checked_mul(row_bytes).ok_or(
                Error::SizeOverflow {
                    count: rows,
                    elem_size: row_bytes,
                },
            )?)?;
            out.push((p as usize, rows));
        }
        Ok(Self::build(out, row_bytes))
    }

    /// The rows of a vector pinned in place, `row_len` values each: a
    /// loader on a device of the backend that registered it gathers its
    /// batches on the device, reading the rows where they are
    /// ([`Gather::Device`](crate::engines::loader::Gather::Device)). The
    /// source holds the guard, and a loader keeps it until its last gather
    /// is done.
    ///
    /// # Errors
    /// As [`RowSource::new`].
    pub fn registered<T: Pod + Send + Sync>(
        data: Arc<Registered<T>>,
        row_len: usize,
    ) -> Result<RowSource<'static>> {
        let slice = data.as_slice();
        let mut source = RowSource::<'static>::from_segments(
            &[(slice.as_ptr().cast::<u8>(), slice.len())],
            row_len,
            std::mem::size_of::<T>(),
        )?;
        source.pinned = Some(PinnedRows {
            domain: data.device().host_domain(),
            _keep: data,
        });
        Ok(source)
    }

    /// The rows of a range pinned in place by a [`RegisteredRaw`] guard
    /// (from its first byte, `row_bytes` bytes each, as many whole rows as
    /// it holds): as [`RowSource::registered`].
    ///
    /// # Safety
    /// The range is written by no one while a loader reads it (the guard's
    /// contract covers the rest: valid, unmoved while registered).
    ///
    /// # Errors
    /// `InvalidArgument` for `row_bytes` 0.
    pub unsafe fn from_registered_raw(
        guard: Arc<RegisteredRaw>,
        row_bytes: usize,
    ) -> Result<RowSource<'static>> {
        if row_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row size must be at least 1 byte".into(),
            ));
        }
        let rows = guard.byte_len() / row_bytes;
        let mut source = Self::build(vec![(guard.as_ptr() as usize, rows)], row_bytes);
        source.pinned = Some(PinnedRows {
            domain: guard.device().host_domain(),
            _keep: guard,
        });
        Ok(source)
    }

    fn from_segments(
        parts: &[(*const u8, usize)],
        row_len: usize,
        elem: usize,
    ) -> Result<RowSource<'static>> {
        if row_len == 0 {
            return Err(Error::InvalidArgument(
                "a row source's row length must be at least 1".into(),
            ));
        }
        let mut segments = Vec::with_capacity(parts.len());
        for &(p, len) in parts {
            if !len.is_multiple_of(row_len) {
                return Err(Error::InvalidArgument(format!(
                    "a row source of {len} values is not a whole number of rows of {row_len}"
                )));
            }
            segments.push((p as usize, len / row_len));
        }
        Ok(RowSource::build(segments, row_len * elem))
    }

    /// Whether the device can read the rows where they are: the first
    /// segment's address and its byte length, when the source is pinned in
    /// place in `domain`, in one segment.
    pub(super) fn device_readable(&self, domain: usize) -> Option<(usize, usize)> {
        let p = self.pinned.as_ref()?;
        (p.domain == domain && self.segments.len() == 1)
            .then(|| (self.segments[0].0, self.segments[0].1 * self.row_bytes))
    }

    fn build<'b>(segments: Vec<(usize, usize)>, row_bytes: usize) -> RowSource<'b> {
        let mut total = 0usize;
        let ends = segments
            .iter()
            .map(|&(_, r)| {
                total += r;
                total
            })
            .collect();
        RowSource {
            segments,
            ends,
            row_bytes,
            pinned: None,
            _borrow: PhantomData,
        }
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The address of row `i` (`i < rows()`).
    pub(super) fn row_addr(&self, i: usize) -> usize {
        let s = self.ends.partition_point(|&e| e <= i);
        let start = if s == 0 { 0 } else { self.ends[s - 1] };
        self.segments[s].0 + (i - start) * self.row_bytes
    }
}
