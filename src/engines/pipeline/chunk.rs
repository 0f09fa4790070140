//! One chunk on the device: what a stage sees of it ([`Chunk`], typed views
//! of its inputs and outputs), the stage's signature, and where a run's
//! arrays live in the device scratch (`Placement`, which copies a chunk in
//! and out).

use crate::base::error::{Error, Result};
use crate::engines::pipeline::arrays::Erased;
use crate::runtime::memory::{
    device_slice_mut, host_slice, host_slice_mut, DeviceBuffer, DeviceSlice, DeviceSliceMut,
};
use crate::runtime::stream::Commands;
use bytemuck::Pod;
use std::any::TypeId;
use std::ops::Range;
use std::sync::Arc;

/// One chunk on the device, as a stage sees it: the chunk's part of every
/// input (copied in) and every output (copied out after the stage), typed.
///
/// ```rust
/// # fn main() -> gpufeed::Result<()> {
/// use gpufeed::{block_on, Device, PinnedBuffer, Pipeline, Plan, Timeline};
/// let device = Device::cpu();
/// let x = PinnedBuffer::from_slice(&device, &[1.0f32; 1000])?;
/// let y = PinnedBuffer::<f32>::new(&device, 1000)?;
/// let pipeline = Pipeline::new(&device, 2)?;
/// let seen = std::cell::RefCell::new(Vec::new());
/// let job = pipeline.run_stage((x,), (y,), Plan::uniform(4, 2), Timeline::Off, |c, chunk| {
///     seen.borrow_mut().push((chunk.index(), chunk.range()));
///     assert!(chunk.input::<u32>(0).is_err()); // input 0 holds `f32`
///     c.copy_d2d(chunk.input::<f32>(0)?, chunk.output::<f32>(0)?)
/// });
/// block_on(job)?;
/// let seen = seen.into_inner();
/// assert_eq!(seen[1], (1, 256..512)); // chunks of 256, the last of 232
/// assert_eq!(seen.last(), Some(&(3, 768..1000)));
/// # Ok(()) }
/// ```
pub struct Chunk<'a> {
    index: usize,
    range: Range<usize>,
    inputs: Vec<(Erased, u64)>,
    outputs: Vec<(Erased, u64)>,
    device_id: usize,
    _p: std::marker::PhantomData<&'a mut ()>,
}

impl<'a> Chunk<'a> {
    /// The chunk's index in the run, in issue order.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The chunk's element range in the host arrays.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Elements in the chunk.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the chunk is empty (never, in a run).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    fn typed<T: Pod>(
        &self,
        what: &str,
        arrays: &[(Erased, u64)],
        i: usize,
    ) -> Result<(u64, usize)> {
        let (a, addr) = arrays.get(i).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the stage asked for {what} {i}; the run has {}",
                arrays.len()
            ))
        })?;
        if a.type_id != TypeId::of::<T>() {
            return Err(Error::InvalidArgument(format!(
                "{what} {i} holds {}, the stage asked for {}",
                a.type_name,
                std::any::type_name::<T>()
            )));
        }
        crate::runtime::memory::check_device_align::<T>()?;
        Ok((*addr, self.range.len()))
    }

    /// The chunk of input `i` on the device, as `T` (the input's element type).
    ///
    /// # Errors
    /// `InvalidArgument` for an input that does not exist or holds another type.
    pub fn input<T: Pod>(&self, i: usize) -> Result<DeviceSlice<'a, T>> {
        let (addr, len) = self.typed::<T>("input", &self.inputs, i)?;
        // SAFETY: the slot's scratch array for input i holds at least the
        // chunk's elements of T; the run's job keeps it alive until its
        // streams are done, and only this run's commands use it meanwhile.
        Ok(unsafe { device_slice_mut::<T>(addr, len, self.device_id) }.into())
    }

    /// The chunk of output `j` on the device, as `T`: what the stage writes
    /// there is copied out to the output's chunk.
    ///
    /// # Errors
    /// `InvalidArgument` for an output that does not exist or holds another type.
    pub fn output<T: Pod>(&self, j: usize) -> Result<DeviceSliceMut<'a, T>> {
        let (addr, len) = self.typed::<T>("output", &self.outputs, j)?;
        // SAFETY: as for `input`; outputs have scratch arrays of their own
        // (or, in an in-place run, the one array, written by that run alone).
        Ok(unsafe { device_slice_mut::<T>(addr, len, self.device_id) })
    }
}

/// The arrays a run copies in and out, and where each lives in the slots.
pub(super) struct Placement<'s> {
    pub(super) ins: Vec<Erased>,
    pub(super) outs: Vec<Erased>,
    /// Scratch array index of each input and each output.
    pub(super) in_at: Vec<usize>,
    pub(super) out_at: Vec<usize>,
    pub(super) scratch: &'s [Vec<Arc<DeviceBuffer<u8>>>],
    pub(super) device_id: usize,
}

impl Placement<'_> {
    fn addr(&self, slot: usize, array: usize) -> u64 {
        self.scratch[slot][array].raw_parts().0
    }

    pub(super) fn chunk<'a>(&self, index: usize, r: Range<usize>, slot: usize) -> Chunk<'a> {
        Chunk {
            index,
            range: r,
            inputs: self
                .ins
                .iter()
                .zip(&self.in_at)
                .map(|(a, &k)| (*a, self.addr(slot, k)))
                .collect(),
            outputs: self
                .outs
                .iter()
                .zip(&self.out_at)
                .map(|(a, &k)| (*a, self.addr(slot, k)))
                .collect(),
            device_id: self.device_id,
            _p: std::marker::PhantomData,
        }
    }

    /// Copies chunk `r` of every input into `slot`: one copy for one input,
    /// one batch ([`Commands::copy_batch`]) for several, so a chunk pays
    /// the copy engine's fixed per-operation cost once per direction.
    pub(super) fn copy_in(
        &self,
        c: &mut Commands<'_>,
        r: &Range<usize>,
        slot: usize,
    ) -> Result<()> {
        let mut copies = self.ins.iter().zip(&self.in_at).map(|(a, &k)| {
            let bytes = r.len() * a.size;
            // SAFETY: the chunk lies inside the input (every array is n long,
            // checked), which the run's job owns; the slot's array k holds at
            // least a chunk of this element size (the scratch shape).
            let (h, d) = unsafe {
                (
                    host_slice::<u8>(a.ptr.add(r.start * a.size), bytes, a.device_id),
                    device_slice_mut::<u8>(self.addr(slot, k), bytes, self.device_id),
                )
            };
            crate::runtime::transfer::Transfer::h2d(h, d)
        });
        if self.ins.len() == 1 {
            if let Some(crate::runtime::transfer::Transfer::H2d { src, dst }) = copies.next() {
                return c.copy_h2d(src, dst);
            }
        }
        c.copy_batch(copies)
    }

    /// Copies chunk `r` of every output out of `slot`, as [`Self::copy_in`].
    pub(super) fn copy_out(
        &self,
        c: &mut Commands<'_>,
        r: &Range<usize>,
        slot: usize,
    ) -> Result<()> {
        let mut copies = self.outs.iter().zip(&self.out_at).map(|(a, &k)| {
            let bytes = r.len() * a.size;
            // SAFETY: as for copy_in; outputs are borrowed exclusively (the
            // job owns them and no other view of them exists).
            let (d, h) = unsafe {
                (
                    device_slice_mut::<u8>(self.addr(slot, k), bytes, self.device_id),
                    host_slice_mut::<u8>(a.ptr.add(r.start * a.size), bytes, a.device_id),
                )
            };
            crate::runtime::transfer::Transfer::d2h(d, h)
        });
        if self.outs.len() == 1 {
            if let Some(crate::runtime::transfer::Transfer::D2h { src, dst }) = copies.next() {
                return c.copy_d2h(src, dst);
            }
        }
        c.copy_batch(copies)
    }
}

/// What a run does on the device to each chunk.
pub(super) type StageFn<'f> = &'f dyn for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>;

/// Gives a closure the stage signature (ties its lifetimes together).
pub(super) fn stage_fn<F: for<'a> Fn(&mut Commands<'a>, &Chunk<'a>) -> Result<()>>(f: F) -> F {
    f
}
