//! A checkpoint's shards and tensors: an index file, a directory or a list
//! of shards, every header read and checked before anything else.

use super::error::FileError;
use super::json::Json;
use super::safetensors::{read_header, Header, TensorEntry};
use crate::base::error::Result;
use std::collections::HashMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

/// The name of a sharded checkpoint's index (as the Hugging Face tools
/// write it).
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Where a checkpoint is.
#[derive(Clone, Debug)]
pub enum Source {
    /// An index file (`*.json`), a directory (its [`INDEX_NAME`], or else
    /// every `*.safetensors` in it, sorted by name), or one safetensors
    /// file.
    Path(PathBuf),
    /// Safetensors files, in this order.
    Shards(Vec<PathBuf>),
}

/// One shard: its path and header.
#[derive(Clone, Debug)]
pub struct Shard {
    /// The file.
    pub path: PathBuf,
    /// Its header, checked against the file.
    pub header: Header,
}

/// A checkpoint's shards and the tensors it holds.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The shards, in reading order.
    pub shards: Vec<Shard>,
    /// The index file, when the checkpoint has one.
    pub index: Option<PathBuf>,
    /// `(shard, entry)` of each tensor: by shard, then by file offset.
    order: Vec<(usize, usize)>,
    by_name: HashMap<String, usize>,
}

impl Checkpoint {
    /// Opens the checkpoint at `source`: reads the index (if any) and every
    /// shard's header, each checked against its file (no tensor byte is
    /// read).
    ///
    /// # Errors
    /// [`crate::base::error::Error::Io`] with a [`FileError`] naming the file: a shard
    /// named by the index that is missing (`NotFound`), an index or header
    /// that is not what it should be (`InvalidData`: not JSON, a tensor the
    /// index puts in a shard that lacks it, one name in two shards), a
    /// tensor's bytes past its file's end (`UnexpectedEof`); a directory
    /// with neither an index nor a `*.safetensors` file (`NotFound`).
    pub fn open(source: &Source) -> Result<Checkpoint> {
        match source {
            Source::Shards(paths) => Checkpoint::from_shards(paths.clone(), None),
            Source::Path(p) => {
                let meta = std::fs::metadata(p).map_err(|e| FileError::io(p, e))?;
                if meta.is_dir() {
                    let index = p.join(INDEX_NAME);
                    if index.is_file() {
                        return Checkpoint::from_index(&index);
                    }
                    let mut shards = Vec::new();
                    for e in std::fs::read_dir(p).map_err(|e| FileError::io(p, e))? {
                        let e = e.map_err(|e| FileError::io(p, e))?;
                        let path = e.path();
                        if path.extension().is_some_and(|x| x == "safetensors") && path.is_file() {
                            shards.push(path);
                        }
                    }
                    if shards.is_empty() {
                        return Err(FileError::error(
                            p,
                            ErrorKind::NotFound,
                            format!("holds neither {INDEX_NAME} nor a *.safetensors file"),
                        ));
                    }
                    shards.sort();
                    Checkpoint::from_shards(shards, None)
                } else if p.extension().is_some_and(|x| x == "json") {
                    Checkpoint::from_index(p)
                } else {
                    Checkpoint::from_shards(vec![p.clone()], None)
                }
            }
        }
    }

    /// Every tensor of `paths`, in order.
    fn from_shards(paths: Vec<PathBuf>, index: Option<PathBuf>) -> Result<Checkpoint> {
        let mut shards = Vec::with_capacity(paths.len());
        for path in paths {
            let header = read_header(&path)?;
            shards.push(Shard { path, header });
        }
        let mut order = Vec::new();
        for (s, shard) in shards.iter().enumerate() {
            let mut entries: Vec<usize> = (0..shard.header.tensors.len()).collect();
            entries.sort_by_key(|&e| shard.header.tensors[e].at);
            order.extend(entries.into_iter().map(|e| (s, e)));
        }
        Checkpoint::indexed(shards, order, index)
    }

    /// The tensors an index's `weight_map` names, from their shards.
    fn from_index(index: &Path) -> Result<Checkpoint> {
        let bad = |why: String| {
            FileError::error(
                index,
                ErrorKind::InvalidData,
                format!("not a safetensors index: {why}"),
            )
        };
        let text = std::fs::read(index).map_err(|e| FileError::io(index, e))?;
        let text = String::from_utf8(text).map_err(|_| bad("not UTF-8".into()))?;
        let json = Json::parse(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let Some(Json::Obj(map)) = json.get("weight_map") else {
            return Err(bad("no \"weight_map\" object".into()));
        };
        let dir = index.parent().unwrap_or(Path::new("."));
        // Shards in the order they first appear; each one's tensors.
        let mut files: Vec<String> = Vec::new();
        let mut wanted: Vec<Vec<&str>> = Vec::new();
        for (name, file) in map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!("weight_map[{name:?}] is not a file name")));
            };
            let i = match files.iter().position(|f| f == file) {
                Some(i) => i,
                None => {
                    files.push(file.to_string());
                    wanted.push(Vec::new());
                    files.len() - 1
                }
            };
            wanted[i].push(name);
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut order = Vec::new();
        for (s, (file, names)) in files.iter().zip(&wanted).enumerate() {
            let path = dir.join(file);
            let header = read_header(&path)?;
            let mut entries = Vec::with_capacity(names.len());
            for name in names {
                match header.tensors.iter().position(|t| t.name == *name) {
                    Some(e) => entries.push(e),
                    None => {
                        return Err(FileError::error(
                            &path,
                            ErrorKind::InvalidData,
                            format!(
                                "the index {} puts tensor {name:?} in this shard, which has no \
                                 such tensor",
                                index.display()
                            ),
                        ))
                    }
                }
            }
            entries.sort_by_key(|&e| header.tensors[e].at);
            order.extend(entries.into_iter().map(|e| (s, e)));
            shards.push(Shard { path, header });
        }
        Checkpoint::indexed(shards, order, Some(index.to_path_buf()))
    }

    fn indexed(
        shards: Vec<Shard>,
        order: Vec<(usize, usize)>,
        index: Option<PathBuf>,
    ) -> Result<Checkpoint> {
        let mut by_name = HashMap::with_capacity(order.len());
        for (i, &(s, e)) in order.iter().enumerate() {
            let name = &shards[s].header.tensors[e].name;
            if let Some(j) = by_name.insert(name.clone(), i) {
                let other = &shards[order[j].0].path;
                return Err(FileError::error(
                    &shards[s].path,
                    ErrorKind::InvalidData,
                    format!("tensor {name:?} is in {} too", other.display()),
                ));
            }
        }
        Ok(Checkpoint {
            shards,
            index,
            order,
            by_name,
        })
    }

    /// Every tensor, with its shard's index in [`Checkpoint::shards`]: by
    /// shard, then in file order.
    pub fn tensors(&self) -> impl Iterator<Item = (usize, &TensorEntry)> + '_ {
        self.order
            .iter()
            .map(|&(s, e)| (s, &self.shards[s].header.tensors[e]))
    }

    /// The tensor `name` and its shard's index.
    pub fn get(&self, name: &str) -> Option<(usize, &TensorEntry)> {
        let &(s, e) = self.order.get(*self.by_name.get(name)?)?;
        Some((s, &self.shards[s].header.tensors[e]))
    }

    /// Tensor count.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether it holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Bytes of all its tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors().map(|(_, t)| t.nbytes).sum()
    }
}
