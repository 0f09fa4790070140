//! Model weights: a directory of safetensors shards into device memory as
//! one job, sliced per tensor-parallel rank, and checkpoints written as
//! shards with an index.
//!
//! - [`Checkpoint::open`] takes a `model.safetensors.index.json`, a
//!   directory (its index, or every `*.safetensors` in it, sorted) or a
//!   list of shards, and checks every shard's header against its file
//!   before any tensor byte is read.
//! - [`Checkpoint::plan`] picks tensors (a name filter) and slices each for
//!   a rank ([`Split`]: rows, columns, any dimension, or replicated); a
//!   [`LoadPlan`] lists, per tensor, the byte ranges of the files that rank
//!   reads and where they land.
//! - [`load`] reads a plan into [`ReadTarget`]s (new buffers, or memory
//!   that exists: a model's own parameters) through one
//!   [`Staging`](crate::Staging) engine: every shard in one stream through
//!   its ring (the next file's reads overlap the last DMA of the file
//!   before), column slices gathered into whole blocks on the host, one
//!   `pread` per row piece, one DMA per block.
//! - [`ShardPlan`], [`AtomicFile`] and [`index_json`] write a checkpoint:
//!   shards of at most a given size, each written to a name of its own,
//!   synced and renamed, the index last, so a crash leaves the checkpoint
//!   before it whole.
//!
//! ```rust
//! # fn main() -> gpufeed::Result<()> {
//! use gpufeed::weights::{self, Checkpoint, CheckpointWriter, Dtype, Snapshot, Source, Split};
//! use gpufeed::{Device, DeviceBuffer, FileIo, ReadTarget, Staging};
//! let device = Device::cpu();
//! let staging = Staging::new(&device)?;
//! let dir = std::env::temp_dir().join(format!("gpufeed-weights-doc-{}", std::process::id()));
//! // A checkpoint of one 4 x 6 matrix of bytes 0..24, written from host memory.
//! let tensors = [("w".to_string(), Dtype::U8, vec![4, 6])];
//! let mut writer = CheckpointWriter::create(&staging, &dir, &tensors, 1 << 30, &[])?;
//! writer.write(0, 0, &Snapshot::Host((0u8..24).collect()))?;
//! writer.finish()?;
//! // Rank 1 of 2 reads the last 3 columns of every row: 12 of the 24 bytes.
//! let ck = Checkpoint::open(&Source::Path(dir.clone()))?;
//! let plan = ck.plan(|_| true, |_| Split::Dim(1), 1, 2)?;
//! assert_eq!(plan.tensors[0].shape, [4, 3]);
//! let mut part = DeviceBuffer::<u8>::new(&device, plan.tensors[0].nbytes)?;
//! let stats = weights::load(&staging, &ck, &plan, vec![ReadTarget::buffer(&mut part)], FileIo::Auto)?;
//! assert_eq!(stats.bytes_read, 12);
//! let mut host = vec![0u8; 12];
//! part.copy_to_host_sync(&mut host)?;
//! assert_eq!(host, [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(()) }
//! ```
//!
//! Errors about a file are [`Error::Io`](crate::Error::Io) carrying a [`FileError`]
//! (its path, kind and the system's errno where there is one).

mod checkpoint;
mod error;
pub(crate) mod json;
mod load;
mod safetensors;
mod save;
mod slice;

pub use crate::engines::staging::{FileRange, ReadTarget};
pub use checkpoint::{Checkpoint, Shard, Source, INDEX_NAME};
pub use error::FileError;
pub use load::{load, LoadStats};
pub use safetensors::{header_bytes, read_header, Dtype, Header, TensorEntry, MAX_HEADER_BYTES};
pub use save::{
    index_json, AtomicFile, CheckpointWriter, ShardFile, ShardPlan, ShardTensor, Snapshot,
};
pub use slice::{glob_match, LoadPlan, Piece, PlannedTensor, Split};
