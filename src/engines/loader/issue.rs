//! One batch issued: its pinned block and device buffers taken, its rows
//! gathered on the host (or its indices written, for a gather on the
//! device), its DMAs or gather kernels enqueued, and the event after them.

use crate::base::completion::lock;
use crate::base::error::{Error, Result};
use crate::engines::loader::batch::{Batch, Gather, InFlightBatch};
use crate::engines::loader::handle::Loader;
use crate::runtime::memory::DeviceBuffer;
use crate::runtime::pool::PooledBuffer;
use crate::runtime::stream::Stream;
use bytemuck::Pod;

/// A batch's pinned block, its fields' device buffers, and (for a gather
/// on the device) its indices' buffer.
type BatchBuffers<T> = (
    PooledBuffer<u8>,
    Vec<DeviceBuffer<T>>,
    Option<DeviceBuffer<u64>>,
);

impl<T: Pod> Loader<'_, T> {
    /// Gathers and sends batches until `prefetch` are in flight or the
    /// epoch's are all sent. The gathers run on the calling thread and the
    /// workers, and return when the rows are in pinned memory; the DMAs
    /// run on.
    ///
    /// # Errors
    /// The pinned or device allocation's error, the driver's,
    /// [`Error::WorkerPanicked`]. The epoch then ends (its stream yields
    /// the error once, then nothing).
    pub fn fill_ahead(&mut self) -> Result<()> {
        while !self.failed
            && self.queue.len() < self.config.prefetch
            && self.next_issue < self.batches
        {
            if let Err(e) = self.issue_next() {
                self.failed = true;
                self.drop_queue();
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gathers batch `next_issue` and sends it: on the host into a pinned
    /// block then one DMA per field, or on the device (its indices sent,
    /// then one gather kernel per field).
    fn issue_next(&mut self) -> Result<()> {
        let b = self.config.batch_size;
        let start = self.next_issue * b;
        let end = (start + b).min(self.indices.len());
        let n = end - start;
        // A block holds the largest batch: never more rows than the epoch
        // has (a batch_size far above them, even near usize::MAX, is one
        // batch of every row).
        let cap = b.min(self.indices.len());
        let t = std::time::Instant::now();
        let (mut block, fields, indices) = self.take_buffers(n, cap)?;
        let alloced = std::time::Instant::now();
        // The host's part first, all of it: a failure there leaves no
        // command behind (the block and the buffers go back at once).
        let mut bytes_sent = self.fill_block(&mut block, start, end)?;
        let gathered = std::time::Instant::now();
        // Then the commands, and one event after them, on this batch's stream.
        let on = self.next_issue % self.streams.len();
        let stream = &self.streams[on];
        let issued = match &indices {
            None => self.send_gathered(stream, &block, &fields, n),
            Some(idx) => {
                bytes_sent = self.fields.iter().map(|f| n * f.row_bytes()).sum();
                self.gather_on_device(stream, &block, idx, &fields, n)
            }
        };
        // Recorded even after a failed command: the ones issued before it
        // read the block and write the buffers until it fires.
        let done = match stream.raw().record(false) {
            Ok(ev) => ev.completion,
            Err(e) => {
                // The commands' end can't be observed: never reuse the
                // block nor free the buffers (nor let go of the sources).
                std::mem::forget(block);
                std::mem::forget(fields);
                std::mem::forget(indices);
                std::mem::forget(self.fields.clone());
                return Err(e);
            }
        };
        for buf in &fields {
            buf.staging_parts().2.push(done.clone());
        }
        if let Some(idx) = &indices {
            idx.staging_parts().2.push(done.clone());
        }
        self.last[on] = Some(done.clone());
        if let Err(e) = issued {
            // The buffers' frees and the block's reuse wait for the event.
            self.give_back_when_done(block, &done);
            return Err(e);
        }
        let issued_at = std::time::Instant::now();
        self.stats.batches += 1;
        self.stats.bytes += bytes_sent as u64;
        self.stats.alloc += alloced - t;
        self.stats.gather += gathered - alloced;
        self.stats.issue += issued_at - gathered;
        self.queue.push_back(InFlightBatch {
            batch: Batch {
                fields,
                rows: n,
                index: self.next_issue,
            },
            block,
            done,
        });
        self.next_issue += 1;
        Ok(())
    }

    /// A batch's pinned block (a free one, or a new one of `cap` rows) and
    /// its fresh device buffers of `n` rows: one per field, and the
    /// indices' for a gather on the device.
    fn take_buffers(&mut self, n: usize, cap: usize) -> Result<BatchBuffers<T>> {
        let block_bytes = match self.gather {
            Gather::Host => self.fields.iter().map(|f| f.row_bytes() * cap).sum(),
            Gather::Device => 8 * cap,
        };
        let block = match lock(&self.free).pop() {
            Some(block) => block,
            None => self.pool.alloc::<u8>(block_bytes.max(1))?,
        };
        let mut fields = Vec::with_capacity(self.fields.len());
        let elem = std::mem::size_of::<T>();
        for f in &self.fields {
            fields.push(DeviceBuffer::<T>::new(
                &self.device,
                n * f.row_bytes() / elem,
            )?);
        }
        let indices = match self.gather {
            Gather::Host => None,
            Gather::Device => Some(DeviceBuffer::<u64>::new(&self.device, n)?),
        };
        Ok((block, fields, indices))
    }

    /// The host's part of the batch of rows `self.indices[start..end]`, into
    /// `block`: the rows gathered there, field after field (their bytes
    /// returned), or for a gather on the device their indices (0 returned).
    fn fill_block(
        &mut self,
        block: &mut PooledBuffer<u8>,
        start: usize,
        end: usize,
    ) -> Result<usize> {
        let n = end - start;
        let mut bytes_sent = 0;
        match self.gather {
            Gather::Host => {
                let mut off = 0;
                for f in &self.fields {
                    let bytes = n * f.row_bytes();
                    self.addrs.clear();
                    self.addrs
                        .extend(self.indices[start..end].iter().map(|&i| f.row_addr(i)));
                    let dst = &mut block.as_mut_slice()[off..off + bytes];
                    // SAFETY: every address is a row of the source, readable
                    // and unwritten for 'a (RowSource's contract: a shared
                    // borrow, or the raw constructor's promise); `dst` is
                    // our block.
                    unsafe { self.workers.gather(&self.addrs, f.row_bytes(), dst)? };
                    off += bytes;
                }
                bytes_sent = off;
            }
            Gather::Device => {
                let dst = &mut block.as_mut_slice()[..8 * n];
                for (d, &i) in dst.chunks_exact_mut(8).zip(&self.indices[start..end]) {
                    d.copy_from_slice(&(i as u64).to_ne_bytes());
                }
            }
        }
        Ok(bytes_sent)
    }

    /// The DMAs of a batch gathered on the host: one per field, from its
    /// part of `block` into its buffer, on `stream`.
    fn send_gathered(
        &self,
        stream: &Stream,
        block: &PooledBuffer<u8>,
        fields: &[DeviceBuffer<T>],
        n: usize,
    ) -> Result<()> {
        let mut off = 0;
        for (f, buf) in self.fields.iter().zip(fields) {
            let bytes = n * f.row_bytes();
            let (_, addr, _) = buf.staging_parts();
            if bytes > 0 {
                // SAFETY: the block is pinned memory of ours, held until
                // the completion recorded after this fires; the device range
                // is the fresh buffer, whose in-flight record keeps its
                // uses and its free behind the DMA.
                unsafe { stream.raw().copy_h2d(addr, block.ptr().add(off), bytes)? };
            }
            off += bytes;
        }
        Ok(())
    }

    /// A batch gathered on the device: its indices (in `block`) sent to
    /// `idx`, then one gather kernel per field reading the source where it
    /// is (pinned in place and mapped) into the field's buffer, on `stream`.
    fn gather_on_device(
        &self,
        stream: &Stream,
        block: &PooledBuffer<u8>,
        idx: &DeviceBuffer<u64>,
        fields: &[DeviceBuffer<T>],
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (_, idx_addr, _) = idx.staging_parts();
        // SAFETY: the block is pinned memory of ours holding the n indices,
        // held until the completion recorded after this fires; `idx` is a
        // fresh buffer of n values, its free behind that completion.
        unsafe { stream.raw().copy_h2d(idx_addr, block.ptr(), 8 * n)? };
        let Some(function) = &self.gather_fn else {
            return Err(Error::Internal(
                "a device-gathering loader without its kernel".into(),
            ));
        };
        for ((f, buf), &(src, src_bytes)) in self.fields.iter().zip(fields).zip(&self.mapped) {
            let bytes = n * f.row_bytes();
            let (_, dst, _) = buf.staging_parts();
            let config =
                crate::runtime::kernel::LaunchConfig::grid_stride(&self.device, bytes.div_ceil(16));
            // SAFETY: `src` is the source's mapped address, readable by the
            // device for `src_bytes` while the loader holds the source's
            // registration (it waits for its last command before letting go
            // of it); `idx` holds n indices, each below the source's row
            // count; `dst` is the fresh buffer of n rows, disjoint from
            // both, its free behind the completion recorded after this.
            let params = unsafe {
                (
                    kernel_abi::Slice::from_raw_parts(src as *const u8, src_bytes),
                    kernel_abi::Slice::from_raw_parts(idx_addr as *const u64, n),
                    f.row_bytes() as u64,
                    kernel_abi::SliceMut::from_raw_parts(dst as *mut u8, bytes),
                )
            };
            let launch = crate::backend::RawLaunch {
                name: "gather_rows",
                function: &function.raw,
                config: kernel_abi::thread::Launch {
                    grid: config.grid,
                    block: config.block,
                    dynamic_shared_bytes: config.shared_bytes,
                },
                params: Box::new(crate::runtime::kernel::TypedParams::<
                    gpu_kernels::gather_rows,
                >(params)),
            };
            // SAFETY: as for the parameters above.
            unsafe { stream.raw().launch(launch)? };
        }
        Ok(())
    }
}
