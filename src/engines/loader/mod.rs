//! A loader for training loops: batches of rows, gathered by index from
//! host memory straight into pinned blocks and sent to the device ahead of
//! their use, as a [`futures::Stream`] of device buffers.
//!
//! - The rows of a batch are gathered by the staging workers' threads
//!   (each thread a slice of the batch's bytes) into a pinned block, and
//!   the block is sent with one DMA per field on the loader's own stream.
//! - Where every field is pinned in place ([`RowSource::registered`]) a
//!   kernel gathers the rows on the device instead, reading them where they
//!   are; batches alternate between two streams of the loader's, so one
//!   batch's indices go up and its kernel starts while the one before it is
//!   still finishing ([`Gather::Device`]).
//! - [`LoaderConfig::prefetch`] batches are in flight at once, also while
//!   the batch just handed out is used (taking a batch issues the next):
//!   the gather of batch *k + 1* runs while the DMA of batch *k* does.
//! - Every batch gets fresh device buffers, so a batch is never overwritten
//!   while its owner holds it.
//!
//! # Order
//! An epoch's order is [`epoch_indices`]: `0..n` in order, or, with
//! [`LoaderConfig::shuffle`], the permutation [`permutation`]`(n, seed,
//! epoch)`, a deterministic function of the three (the same in every
//! process, on every machine, across restarts). With several ranks
//! (`world_size > 1`) each rank takes its shard with
//! `torch.utils.data.DistributedSampler`'s semantics.
//!
//! The module's files, by job: [`order`] the configuration and each epoch's
//! order of rows; [`source`] the rows of a field ([`RowSource`]); [`batch`]
//! what a loader yields and reports; [`handle`] the [`Loader`] itself (its
//! making, its epochs, the batches it yields); [`issue`] the gather and the
//! commands of one batch.

mod batch;
mod handle;
mod issue;
mod order;
mod source;

pub use batch::{Batch, Gather, LoaderStats};
pub use handle::Loader;
pub use order::{batches_per_epoch, epoch_indices, permutation, LoaderConfig, MAX_WORLD_SIZE};
pub use source::RowSource;
