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
//! Errors about a file are [`crate::Error::Io`] carrying a [`FileError`]
//! (its path, kind and the system's errno where there is one).

mod checkpoint;
pub(crate) mod json;
mod load;
mod safetensors;
mod save;
mod slice;

pub use crate::staging::{FileRange, ReadTarget};
pub use checkpoint::{Checkpoint, Shard, Source, INDEX_NAME};
pub use load::{load, LoadStats};
pub use safetensors::{header_bytes, read_header, Dtype, Header, TensorEntry, MAX_HEADER_BYTES};
pub use save::{
    index_json, AtomicFile, CheckpointWriter, ShardFile, ShardPlan, ShardTensor, Snapshot,
};
pub use slice::{glob_match, LoadPlan, Piece, PlannedTensor, Split};

use std::path::{Path, PathBuf};

/// An error about one file: its path, what went wrong, and the system's
/// errno where the system gave one. Carried inside [`crate::Error::Io`]
/// (`std::io::Error::get_ref` downcasts to it), whose kind is the error's.
#[derive(Debug)]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong (the system's text for a system error).
    pub detail: String,
    /// The system's error number, if any.
    pub errno: Option<i32>,
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.detail)
    }
}

impl std::error::Error for FileError {}

impl FileError {
    /// An error of `kind` about `path`.
    pub(crate) fn error(path: &Path, kind: std::io::ErrorKind, detail: String) -> crate::Error {
        std::io::Error::new(
            kind,
            FileError {
                path: path.to_path_buf(),
                detail,
                errno: None,
            },
        )
        .into()
    }

    /// The system's error `e` about `path`.
    pub(crate) fn io(path: &Path, e: std::io::Error) -> crate::Error {
        FileError::wrap(path, &e)
    }

    /// The system's error `e` about `path` (its kind, errno and text).
    pub(crate) fn wrap(path: &Path, e: &std::io::Error) -> crate::Error {
        let errno = e.raw_os_error();
        let mut detail = e.to_string();
        if let Some(code) = errno {
            if let Some(s) = detail.strip_suffix(&format!(" (os error {code})")) {
                detail = s.to_string();
            }
        }
        std::io::Error::new(
            e.kind(),
            FileError {
                path: path.to_path_buf(),
                detail,
                errno,
            },
        )
        .into()
    }

    /// The `FileError` inside `e`, if it carries one.
    pub fn of(e: &crate::Error) -> Option<&FileError> {
        match e {
            crate::Error::Io(io) => io.get_ref().and_then(|r| r.downcast_ref::<FileError>()),
            _ => None,
        }
    }
}
