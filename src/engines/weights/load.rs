//! A [`LoadPlan`] read through one staging engine.

use super::checkpoint::Checkpoint;
use super::error::FileError;
use super::slice::LoadPlan;
use crate::base::error::{Error, Result};
use crate::engines::staging::{FileIo, FileRange, ReadTarget, Staging};
use std::io::ErrorKind;

/// What a [`load`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadStats {
    /// Bytes read from the files (the rank's parts of the tensors).
    pub bytes_read: u64,
    /// Files read.
    pub files: usize,
    /// Tensors read.
    pub tensors: usize,
    /// The way the files were read ([`FileIo::Direct`] or
    /// [`FileIo::Buffered`]; `None` when nothing was read).
    pub file_io: Option<FileIo>,
    /// Wall time of the read, in seconds.
    pub seconds: f64,
}

/// Reads `plan` (made by `checkpoint`'s [`Checkpoint::plan`]) into
/// `targets`, one per planned tensor in the plan's order, each exactly its
/// part's bytes: every shard in one stream through `staging`'s ring, the
/// pieces in file order (a tensor's column slice gathered into whole
/// blocks). Returns when every byte is on the device.
///
/// # Errors
/// `InvalidArgument` (before anything is read) for a target count or size
/// that doesn't match the plan, naming the tensor; [`crate::base::error::Error::Io`]
/// with a [`FileError`] naming the file for a shard that can't be opened
/// or that is shorter than its header said when read (cut short since it
/// was opened); as [`Staging::read_files`] otherwise.
pub fn load(
    staging: &Staging,
    checkpoint: &Checkpoint,
    plan: &LoadPlan,
    targets: Vec<ReadTarget<'_>>,
    io: FileIo,
) -> Result<LoadStats> {
    let started = std::time::Instant::now();
    if targets.len() != plan.tensors.len() {
        return Err(Error::InvalidArgument(format!(
            "{} targets for a plan of {} tensors",
            targets.len(),
            plan.tensors.len()
        )));
    }
    for (t, target) in plan.tensors.iter().zip(&targets) {
        if target.len() != t.nbytes {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: a target of {} bytes for its {} bytes",
                t.name,
                target.len(),
                t.nbytes
            )));
        }
        if t.shard >= checkpoint.shards.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: shard {} is not in the checkpoint",
                t.name, t.shard
            )));
        }
    }
    // The shards the plan reads, each opened once.
    let mut used: Vec<usize> = plan.tensors.iter().map(|t| t.shard).collect();
    used.sort_unstable();
    used.dedup();
    let mut files = Vec::with_capacity(used.len());
    for &s in &used {
        let path = &checkpoint.shards[s].path;
        files.push(std::fs::File::open(path).map_err(|e| FileError::io(path, e))?);
    }
    let file_of = |shard: usize| used.binary_search(&shard).ok().map(|i| &files[i]);
    let mut ranges = Vec::with_capacity(plan.tensors.iter().map(|t| t.pieces.len()).sum());
    for (i, t) in plan.tensors.iter().enumerate() {
        let Some(file) = file_of(t.shard) else {
            return Err(Error::Internal("a planned shard not opened".into()));
        };
        ranges.extend(t.pieces.iter().map(|p| FileRange {
            file,
            at: p.at,
            target: i,
            offset: p.offset,
            len: p.len,
        }));
    }
    let file_io = match files.first() {
        Some(f) if plan.bytes_read() > 0 => Some(staging.file_io_for(f, io)?),
        _ => None,
    };
    let read = staging.read_files_blocking(targets, &ranges, io);
    if let Err(e) = read {
        return Err(name_short_file(checkpoint, plan, &used).unwrap_or(e));
    }
    Ok(LoadStats {
        bytes_read: plan.bytes_read(),
        files: used.len(),
        tensors: plan.tensors.len(),
        file_io,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// After a failed read: the first shard now shorter than the plan's
/// pieces need (cut short after it was opened), as an error naming it.
fn name_short_file(checkpoint: &Checkpoint, plan: &LoadPlan, used: &[usize]) -> Option<Error> {
    for &s in used {
        let need = plan
            .tensors
            .iter()
            .filter(|t| t.shard == s)
            .flat_map(|t| t.pieces.iter().map(|p| p.at + p.len as u64))
            .max()?;
        let path = &checkpoint.shards[s].path;
        let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        if len < need {
            return Some(FileError::error(
                path,
                ErrorKind::UnexpectedEof,
                format!(
                    "the file is cut short: the tensors read need {need} bytes, it has {len} \
                     (it shrank after its header was read)"
                ),
            ));
        }
    }
    None
}
