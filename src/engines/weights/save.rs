//! Writing a checkpoint: tensors packed into shards of at most a given
//! size ([`ShardPlan`]), each shard and the index written to a name of
//! its own, synced and renamed ([`AtomicFile`]), the index last
//! ([`CheckpointWriter`]). A crash at any point leaves the checkpoint
//! that was there before whole: its index names its own shards, and new
//! shards never take the name of a shard that exists (they get a tag of
//! their own when one would); the older shards go once the new index is
//! in place.

use super::checkpoint::INDEX_NAME;
use super::error::FileError;
use super::json::{quote, Json};
use super::safetensors::{header_bytes, Dtype};
use crate::base::error::{Error, Result};
use crate::engines::staging::Staging;
use crate::runtime::memory::DeviceBuffer;
use std::fs::File;
use std::path::{Path, PathBuf};

/// One tensor's place in a [`ShardPlan`].
#[derive(Clone, Debug)]
pub struct ShardTensor {
    /// Its shard: an index in [`ShardPlan::shards`].
    pub shard: usize,
    /// File offset of its first byte.
    pub at: u64,
    /// Its bytes.
    pub nbytes: u64,
}

/// One shard of a [`ShardPlan`].
#[derive(Clone, Debug)]
pub struct ShardFile {
    /// File name (in the checkpoint's directory).
    pub name: String,
    /// The bytes before its data (length and header).
    pub header: Vec<u8>,
    /// Indices of its tensors in the plan's input.
    pub tensors: Vec<usize>,
    /// The file's length.
    pub len: u64,
}

/// Tensors packed into shards, in order: a new shard starts where the next
/// tensor would take the one being filled past `max_shard_bytes` of data
/// (a tensor larger than that has a shard of its own).
#[derive(Clone, Debug)]
pub struct ShardPlan {
    /// The shards.
    pub shards: Vec<ShardFile>,
    /// Each input tensor's place.
    pub tensors: Vec<ShardTensor>,
    /// Names, in input order.
    pub names: Vec<String>,
}

impl ShardPlan {
    /// Plans `tensors` (name, dtype, shape) into shards named
    /// `model-00001-of-0000N.safetensors`, or with `tag`
    /// `model-00001-of-0000N.<tag>.safetensors`; `metadata` goes in each
    /// shard's `__metadata__`.
    ///
    /// # Errors
    /// `InvalidArgument` for `max_shard_bytes` 0, a name given twice or
    /// named `__metadata__`, a size past 2**64 bytes.
    pub fn new(
        tensors: &[(String, Dtype, Vec<usize>)],
        max_shard_bytes: u64,
        metadata: &[(String, String)],
        tag: Option<&str>,
    ) -> Result<ShardPlan> {
        if max_shard_bytes == 0 {
            return Err(Error::InvalidArgument(
                "max_shard_bytes must be at least 1".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut fill = 0u64;
        let mut sizes = Vec::with_capacity(tensors.len());
        for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
            if name == "__metadata__" || !seen.insert(name.as_str()) {
                return Err(Error::InvalidArgument(format!(
                    "tensor name {name:?} is given twice or reserved"
                )));
            }
            let nbytes = shape
                .iter()
                .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
                .ok_or_else(|| {
                    Error::InvalidArgument(format!("tensor {name:?}: size overflows"))
                })?;
            sizes.push(nbytes);
            match groups.last_mut() {
                Some(g) if fill.saturating_add(nbytes) <= max_shard_bytes => {
                    g.push(i);
                    fill += nbytes;
                }
                _ => {
                    groups.push(vec![i]);
                    fill = nbytes;
                }
            }
        }
        let n = groups.len();
        let mut places = vec![
            ShardTensor {
                shard: 0,
                at: 0,
                nbytes: 0
            };
            tensors.len()
        ];
        let mut shards = Vec::with_capacity(n);
        for (s, group) in groups.into_iter().enumerate() {
            let entries: Vec<(&str, Dtype, &[usize])> = group
                .iter()
                .map(|&i| (tensors[i].0.as_str(), tensors[i].1, tensors[i].2.as_slice()))
                .collect();
            let header = header_bytes(&entries, metadata);
            let mut at = header.len() as u64;
            for &i in &group {
                places[i] = ShardTensor {
                    shard: s,
                    at,
                    nbytes: sizes[i],
                };
                at += sizes[i];
            }
            let name = match tag {
                Some(t) => format!("model-{:05}-of-{n:05}.{t}.safetensors", s + 1),
                None => format!("model-{:05}-of-{n:05}.safetensors", s + 1),
            };
            shards.push(ShardFile {
                name,
                header,
                tensors: group,
                len: at,
            });
        }
        Ok(ShardPlan {
            shards,
            tensors: places,
            names: tensors.iter().map(|t| t.0.clone()).collect(),
        })
    }

    /// Bytes of all tensors.
    pub fn total_size(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }
}

/// The text of a `model.safetensors.index.json` for `plan`: `total_size`
/// and the `weight_map` (name → shard file), names sorted.
pub fn index_json(plan: &ShardPlan) -> Vec<u8> {
    let mut map: Vec<(&str, &str)> = plan
        .names
        .iter()
        .zip(&plan.tensors)
        .map(|(n, t)| (n.as_str(), plan.shards[t.shard].name.as_str()))
        .collect();
    map.sort_unstable();
    let mut text = format!(
        "{{\n  \"metadata\": {{\n    \"total_size\": {}\n  }},\n  \"weight_map\": {{",
        plan.total_size()
    );
    for (i, (n, f)) in map.iter().enumerate() {
        text.push_str(if i == 0 { "\n    " } else { ",\n    " });
        text.push_str(&format!("{}: {}", quote(n), quote(f)));
    }
    text.push_str("\n  }\n}\n");
    text.into_bytes()
}

/// A file written under a name of its own beside `path`
/// (`path.partial-<pid>-<n>`, created exclusively) and renamed to `path`
/// by [`AtomicFile::commit`] once its data is on the disk; dropped without
/// a commit, it is removed.
#[derive(Debug)]
pub struct AtomicFile {
    file: Option<File>,
    tmp: PathBuf,
    path: PathBuf,
}

impl AtomicFile {
    /// Creates the temporary file for `path`.
    ///
    /// # Errors
    /// [`crate::base::error::Error::Io`] with a [`FileError`] naming it.
    pub fn create(path: &Path) -> Result<AtomicFile> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut name = path.as_os_str().to_owned();
        name.push(format!(".partial-{}-{n}", std::process::id()));
        let tmp = PathBuf::from(name);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| FileError::io(&tmp, e))?;
        Ok(AtomicFile {
            file: Some(file),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The open file (write it with `pwrite`s or a staging engine).
    ///
    /// # Errors
    /// `Internal` after a failed commit.
    pub fn file(&self) -> Result<&File> {
        self.file
            .as_ref()
            .ok_or_else(|| Error::Internal("an atomic file used after its commit".into()))
    }

    /// The temporary name.
    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// The name it gets when committed.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sets its length to `len`, syncs its data, renames it to its path and
    /// syncs the directory: the file is then whole under its name, or (on
    /// any failure) gone.
    ///
    /// # Errors
    /// [`crate::base::error::Error::Io`] with a [`FileError`] naming the file.
    pub fn commit(mut self, len: u64) -> Result<()> {
        let file = self
            .file
            .take()
            .ok_or_else(|| Error::Internal("an atomic file committed twice".into()))?;
        let tmp = self.tmp.clone();
        file.set_len(len)
            .and_then(|()| file.sync_data())
            .map_err(|e| FileError::io(&tmp, e))?;
        drop(file);
        std::fs::rename(&tmp, &self.path).map_err(|e| FileError::io(&self.path, e))?;
        // Renamed: nothing left to remove.
        self.tmp = PathBuf::new();
        sync_dir(&self.path)
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Syncs the directory holding `path` (its entries: a rename in it).
fn sync_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| FileError::io(dir, e))
}

/// Where a chunk of a snapshot is.
pub enum Snapshot {
    /// Device memory (written through the staging engine).
    Device(DeviceBuffer<u8>),
    /// Host memory (written with `pwrite`).
    Host(Vec<u8>),
    /// A range of device memory shared with other chunks (one allocation
    /// for a whole snapshot: freed with its last chunk).
    Shared(std::sync::Arc<DeviceBuffer<u8>>, std::ops::Range<usize>),
}

impl Snapshot {
    /// Its bytes.
    pub fn len(&self) -> usize {
        match self {
            Snapshot::Device(b) => b.len(),
            Snapshot::Host(v) => v.len(),
            Snapshot::Shared(_, r) => r.end.saturating_sub(r.start),
        }
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Writes a [`ShardPlan`] into a directory, chunk by chunk as the
/// snapshot's pieces come ([`CheckpointWriter::write`]), each shard
/// committed as soon as its last byte is written, the index once every
/// shard is ([`CheckpointWriter::finish`]). Dropped before its index is in
/// place (an error, an abandoned save), it removes its temporary files and
/// the shards it committed.
pub struct CheckpointWriter {
    staging: Staging,
    dir: PathBuf,
    plan: ShardPlan,
    files: Vec<Option<AtomicFile>>,
    /// Bytes each shard still waits for.
    left: Vec<u64>,
    /// The shards of the checkpoint there before (removed after the new
    /// index is in place).
    previous: Vec<PathBuf>,
    /// Shards of ours committed so far: removed if the writer is dropped
    /// before its index is in place (the directory then holds what it held).
    committed: Vec<PathBuf>,
    finished: bool,
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if !self.finished {
            for p in &self.committed {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

impl CheckpointWriter {
    /// Plans `tensors` into shards of at most `max_shard_bytes` in `dir`
    /// (created if missing), and creates every shard's temporary file with
    /// its header.
    ///
    /// # Errors
    /// As [`ShardPlan::new`]; [`crate::base::error::Error::Io`] with a [`FileError`]
    /// naming the file or directory.
    pub fn create(
        staging: &Staging,
        dir: &Path,
        tensors: &[(String, Dtype, Vec<usize>)],
        max_shard_bytes: u64,
        metadata: &[(String, String)],
    ) -> Result<CheckpointWriter> {
        std::fs::create_dir_all(dir).map_err(|e| FileError::io(dir, e))?;
        let previous = previous_shards(dir);
        let mut plan = ShardPlan::new(tensors, max_shard_bytes, metadata, None)?;
        if plan.shards.iter().any(|s| dir.join(&s.name).exists()) {
            // A shard name taken (by the checkpoint there): names of our own.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let tag = format!("{:x}", nanos ^ (u64::from(std::process::id()) << 40));
            plan = ShardPlan::new(tensors, max_shard_bytes, metadata, Some(&tag))?;
        }
        let mut files = Vec::with_capacity(plan.shards.len());
        for s in &plan.shards {
            let path = dir.join(&s.name);
            let f = AtomicFile::create(&path)?;
            use std::os::unix::fs::FileExt;
            f.file()?
                .write_all_at(&s.header, 0)
                .map_err(|e| FileError::io(f.temp_path(), e))?;
            files.push(Some(f));
        }
        let left = plan
            .shards
            .iter()
            .map(|s| s.tensors.iter().map(|&i| plan.tensors[i].nbytes).sum())
            .collect();
        Ok(CheckpointWriter {
            staging: staging.clone(),
            dir: dir.to_path_buf(),
            plan,
            files,
            left,
            previous,
            committed: Vec::new(),
            finished: false,
        })
    }

    /// The plan.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// Writes `data`, bytes `offset..offset + data.len()` of input tensor
    /// `tensor`, into its shard; commits the shard when it is complete.
    ///
    /// # Errors
    /// `OutOfBounds` for a chunk outside the tensor; [`crate::base::error::Error::Io`]
    /// with a [`FileError`] naming the shard (a full disk: `StorageFull`);
    /// the staging engine's error.
    pub fn write(&mut self, tensor: usize, offset: u64, data: &Snapshot) -> Result<()> {
        let Some(place) = self.plan.tensors.get(tensor) else {
            return Err(Error::InvalidArgument(format!(
                "no tensor {tensor} in the plan"
            )));
        };
        let len = data.len() as u64;
        if len == 0 {
            return Ok(());
        }
        if offset.checked_add(len).is_none_or(|end| end > place.nbytes) {
            return Err(Error::OutOfBounds {
                start: offset as usize,
                end: offset.saturating_add(len) as usize,
                len: place.nbytes as usize,
            });
        }
        let (shard, at) = (place.shard, place.at + offset);
        let Some(f) = self.files.get(shard).and_then(Option::as_ref) else {
            return Err(Error::InvalidArgument(format!(
                "shard {shard} is complete already"
            )));
        };
        let file = f.file()?;
        let named = |e: Error| match &e {
            Error::Io(io) if FileError::of(&e).is_none() => FileError::wrap(&f.path, io),
            _ => e,
        };
        match data {
            Snapshot::Device(b) => self
                .staging
                .write_file_blocking(b, file, at)
                .map_err(named)?,
            Snapshot::Shared(b, r) => self
                .staging
                .write_file_with_blocking(b, r.clone(), file, at)
                .map_err(named)?,
            Snapshot::Host(v) => {
                use std::os::unix::fs::FileExt;
                file.write_all_at(v, at)
                    .map_err(|e| FileError::io(&f.path, e))?;
            }
        }
        self.left[shard] = self.left[shard].checked_sub(len).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "shard {} got more bytes than its tensors hold (a chunk written twice?)",
                self.plan.shards[shard].name
            ))
        })?;
        if self.left[shard] == 0 {
            self.commit(shard)?;
        }
        Ok(())
    }

    fn commit(&mut self, shard: usize) -> Result<()> {
        if let Some(f) = self.files[shard].take() {
            let path = f.path().to_path_buf();
            f.commit(self.plan.shards[shard].len)?;
            self.committed.push(path);
        }
        Ok(())
    }

    /// Commits the shards still open (those holding only empty tensors),
    /// writes the index, then removes the shards of the checkpoint that was
    /// there before (those the new index doesn't name).
    ///
    /// # Errors
    /// `InvalidArgument` when a shard still waits for bytes (nothing is
    /// committed then); as [`AtomicFile::commit`].
    pub fn finish(mut self) -> Result<PathBuf> {
        if let Some(s) = self.left.iter().position(|&l| l > 0) {
            return Err(Error::InvalidArgument(format!(
                "shard {} still waits for {} bytes",
                self.plan.shards[s].name, self.left[s]
            )));
        }
        for s in 0..self.files.len() {
            self.commit(s)?;
        }
        let index = self.dir.join(INDEX_NAME);
        let text = index_json(&self.plan);
        let f = AtomicFile::create(&index)?;
        use std::os::unix::fs::FileExt;
        f.file()?
            .write_all_at(&text, 0)
            .map_err(|e| FileError::io(f.temp_path(), e))?;
        f.commit(text.len() as u64)?;
        self.finished = true;
        for old in &self.previous {
            let kept = self
                .plan
                .shards
                .iter()
                .any(|s| old.file_name().is_some_and(|n| n == s.name.as_str()));
            if !kept {
                let _ = std::fs::remove_file(old);
            }
        }
        Ok(index)
    }
}

/// The shard files the index in `dir` names (none without a readable
/// index).
fn previous_shards(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string(dir.join(INDEX_NAME)) else {
        return Vec::new();
    };
    let Ok(json) = Json::parse(&text) else {
        return Vec::new();
    };
    let Some(Json::Obj(map)) = json.get("weight_map") else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = map
        .iter()
        .filter_map(|(_, f)| f.as_str())
        .filter(|f| !f.contains('/'))
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    files
}

#[cfg(test)]
mod tests {
    use super::{index_json, ShardPlan};
    use crate::engines::weights::{json::Json, Dtype};

    #[test]
    fn tensors_pack_into_shards_under_the_bound_in_order() {
        let t = |n: &str, k: usize| (n.to_string(), Dtype::U8, vec![k]);
        let plan = ShardPlan::new(
            &[t("a", 60), t("b", 50), t("c", 40), t("d", 500), t("e", 1)],
            100,
            &[],
            None,
        )
        .unwrap();
        let groups: Vec<Vec<usize>> = plan.shards.iter().map(|s| s.tensors.clone()).collect();
        assert_eq!(groups, [vec![0], vec![1, 2], vec![3], vec![4]]);
        assert_eq!(plan.shards[1].name, "model-00002-of-00004.safetensors");
        assert_eq!(plan.tensors[2].at, plan.shards[1].header.len() as u64 + 50);
        let index = Json::parse(std::str::from_utf8(&index_json(&plan)).unwrap()).unwrap();
        assert_eq!(
            index
                .get("metadata")
                .and_then(|m| m.get("total_size"))
                .and_then(Json::as_u64),
            Some(651)
        );
        assert_eq!(
            index
                .get("weight_map")
                .and_then(|m| m.get("c"))
                .and_then(Json::as_str),
            Some("model-00002-of-00004.safetensors")
        );
        assert!(ShardPlan::new(&[t("a", 1), t("a", 1)], 10, &[], None).is_err());
        assert!(ShardPlan::new(&[t("a", 1)], 0, &[], None).is_err());
    }
}
