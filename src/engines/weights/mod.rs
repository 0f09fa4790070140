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
//! Errors about a file are [`crate::base::error::Error::Io`] carrying a [`FileError`]
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
