//! Tensor-parallel slices: which bytes of the files each rank reads.
//!
//! A tensor split on dimension `k` among `world_size` ranks gives rank `r`
//! the `r`-th of `world_size` equal chunks of that dimension (the size must
//! divide evenly: an uneven split is refused, naming the tensor). In a
//! row-major tensor that chunk is, for each index of the dimensions before
//! `k`, one contiguous run of `shape[k] / world_size` times the bytes of
//! the dimensions after `k`: dimension 0 (rows) is one contiguous range,
//! dimension 1 of a matrix (columns) is one run per row, a strided read.

use super::checkpoint::Checkpoint;
use super::safetensors::{Dtype, TensorEntry};
use crate::base::error::{Error, Result};

/// How a tensor is divided among ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Split {
    /// Every rank reads all of it.
    #[default]
    Replicated,
    /// Split along this dimension (0: rows, 1: columns).
    Dim(usize),
}

/// A run of a file's bytes and where it lands: `len` bytes from file
/// offset `at` to byte `offset` of the tensor's target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// File offset.
    pub at: u64,
    /// Offset in the target.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// One tensor of a [`LoadPlan`]: the rank's part of it.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    /// Its name.
    pub name: String,
    /// Its shard: an index in [`Checkpoint::shards`].
    pub shard: usize,
    /// Its element type.
    pub dtype: Dtype,
    /// The whole tensor's shape in the file.
    pub full_shape: Vec<usize>,
    /// The rank's part's shape (the target's).
    pub shape: Vec<usize>,
    /// How it is split.
    pub split: Split,
    /// Bytes of the rank's part.
    pub nbytes: usize,
    /// The file runs the part is made of, in file order.
    pub pieces: Vec<Piece>,
}

/// The tensors (or parts of them) one rank reads.
#[derive(Clone, Debug)]
pub struct LoadPlan {
    /// The tensors, by shard and file order.
    pub tensors: Vec<PlannedTensor>,
    /// The rank.
    pub rank: usize,
    /// The ranks in all.
    pub world_size: usize,
}

impl LoadPlan {
    /// Bytes the plan reads from the files.
    pub fn bytes_read(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes as u64).sum()
    }

    /// Bytes of the whole tensors it picks (what one rank reads unsplit).
    pub fn bytes_whole(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| {
                t.full_shape
                    .iter()
                    .fold(t.dtype.size() as u64, |a, &d| a.saturating_mul(d as u64))
            })
            .sum()
    }
}

/// Whether `name` matches the glob `pattern`: `*` any run of characters
/// (dots too), `?` one character, anything else itself.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut i, mut j) = (0, 0);
    // The last `*` seen and the name position it was tried at.
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// The pieces of rank `rank`'s part of `t` split `split` among `world`:
/// its shape and pieces.
fn pieces(
    t: &TensorEntry,
    split: Split,
    rank: usize,
    world: usize,
) -> Result<(Vec<usize>, Vec<Piece>)> {
    let refuse = |why: String| {
        Err(Error::InvalidArgument(format!(
            "tensor {:?}: {why}",
            t.name
        )))
    };
    let nbytes = usize::try_from(t.nbytes)
        .map_err(|_| Error::InvalidArgument(format!("tensor {:?} is too large", t.name)))?;
    let (k, world) = match split {
        Split::Replicated => (0, 1),
        Split::Dim(_) if world == 1 => (0, 1),
        Split::Dim(k) => (k, world),
    };
    if world == 1 {
        let pieces = if nbytes == 0 {
            Vec::new()
        } else {
            vec![Piece {
                at: t.at,
                offset: 0,
                len: nbytes,
            }]
        };
        return Ok((t.shape.clone(), pieces));
    }
    let Some(&dk) = t.shape.get(k) else {
        return refuse(format!(
            "the rule splits dimension {k}, but its shape {:?} has {} dimension(s)",
            t.shape,
            t.shape.len()
        ));
    };
    if dk % world != 0 {
        return refuse(format!(
            "dimension {k} of shape {:?} ({dk}) does not divide among world_size {world} \
             (uneven splits are refused)",
            t.shape
        ));
    }
    let chunk = dk / world;
    let outer: usize = t.shape[..k].iter().product();
    let inner: usize = t.shape[k + 1..].iter().product::<usize>() * t.dtype.size();
    let mut shape = t.shape.clone();
    shape[k] = chunk;
    let run = chunk * inner;
    let mut pieces: Vec<Piece> = Vec::new();
    if run > 0 {
        for o in 0..outer {
            let at = t.at + ((o * dk + rank * chunk) * inner) as u64;
            let offset = o * run;
            match pieces.last_mut() {
                Some(p) if p.at + p.len as u64 == at && p.offset + p.len == offset => p.len += run,
                _ => pieces.push(Piece {
                    at,
                    offset,
                    len: run,
                }),
            }
        }
    }
    Ok((shape, pieces))
}

impl Checkpoint {
    /// The tensors `select` picks (by name), each split as `split` says,
    /// for rank `rank` of `world_size`: what [`super::load`] reads.
    ///
    /// # Errors
    /// `InvalidArgument` for `world_size` 0 or `rank` not below it, and
    /// naming the tensor for a split dimension it doesn't have or whose
    /// size `world_size` does not divide.
    pub fn plan(
        &self,
        mut select: impl FnMut(&str) -> bool,
        mut split: impl FnMut(&TensorEntry) -> Split,
        rank: usize,
        world_size: usize,
    ) -> Result<LoadPlan> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} must be below world_size {world_size} (at least 1)"
            )));
        }
        let mut tensors = Vec::new();
        for (shard, t) in self.tensors() {
            if !select(&t.name) {
                continue;
            }
            let s = split(t);
            let (shape, pieces) = pieces(t, s, rank, world_size)?;
            tensors.push(PlannedTensor {
                name: t.name.clone(),
                shard,
                dtype: t.dtype,
                full_shape: t.shape.clone(),
                nbytes: pieces.iter().map(|p| p.len).sum(),
                shape,
                split: s,
                pieces,
            });
        }
        Ok(LoadPlan {
            tensors,
            rank,
            world_size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{glob_match, pieces, Piece, Split};
    use crate::engines::weights::{Dtype, TensorEntry};

    fn entry(shape: &[usize]) -> TensorEntry {
        TensorEntry {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            at: 1000,
            nbytes: (shape.iter().product::<usize>() * 4) as u64,
        }
    }

    /// Rank `r`'s part of a tensor of `shape` split on `k`, gathered from
    /// the "file" (element `i` at byte 1000 + 4i holds the value i) by the
    /// planned pieces.
    fn gathered(shape: &[usize], k: usize, r: usize, w: usize) -> Vec<usize> {
        let t = entry(shape);
        let (sub, ps) = pieces(&t, Split::Dim(k), r, w).unwrap();
        let mut out = vec![usize::MAX; sub.iter().product()];
        for p in ps {
            for b in (0..p.len).step_by(4) {
                out[(p.offset + b) / 4] = ((p.at - 1000) as usize + b) / 4;
            }
        }
        out
    }

    #[test]
    fn each_ranks_pieces_hold_exactly_its_chunk() {
        // Written out: a 4x6 matrix, 2 ranks.
        assert_eq!(gathered(&[4, 6], 0, 1, 2), (12..24).collect::<Vec<_>>());
        assert_eq!(
            gathered(&[4, 6], 1, 1, 2),
            [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]
        );
        // A 3-d tensor split on its middle dimension, 4 ranks.
        let (a, b, c) = (2, 8, 3);
        for r in 0..4 {
            let want: Vec<usize> = (0..a)
                .flat_map(|i| {
                    (r * 2..r * 2 + 2).flat_map(move |j| (0..c).map(move |l| (i * b + j) * c + l))
                })
                .collect();
            assert_eq!(gathered(&[a, b, c], 1, r, 4), want, "rank {r}");
        }
    }

    #[test]
    fn row_slices_are_one_range_and_columns_one_per_row() {
        let t = entry(&[8, 16]);
        let (_, rows) = pieces(&t, Split::Dim(0), 3, 4).unwrap();
        assert_eq!(
            rows,
            [Piece {
                at: 1000 + 3 * 2 * 16 * 4,
                offset: 0,
                len: 2 * 16 * 4
            }]
        );
        let (shape, cols) = pieces(&t, Split::Dim(1), 1, 4).unwrap();
        assert_eq!(shape, [8, 4]);
        assert_eq!(cols.len(), 8);
        assert!(cols.iter().all(|p| p.len == 16));
    }

    #[test]
    fn uneven_or_impossible_splits_are_refused_naming_the_tensor() {
        let t = entry(&[6, 4]);
        let e = pieces(&t, Split::Dim(0), 0, 4).unwrap_err().to_string();
        assert!(e.contains("\"t\"") && e.contains("does not divide"), "{e}");
        let e = pieces(&t, Split::Dim(2), 0, 2).unwrap_err().to_string();
        assert!(e.contains("dimension 2"), "{e}");
        // One rank: the whole tensor, whatever the rule.
        assert_eq!(pieces(&t, Split::Dim(5), 0, 1).unwrap().0, [6, 4]);
    }

    #[test]
    fn globs_match_as_written() {
        assert!(glob_match(
            "*.q_proj.weight",
            "model.layers.0.self_attn.q_proj.weight"
        ));
        assert!(!glob_match(
            "*.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight"
        ));
        assert!(glob_match("layers.?.w", "layers.7.w"));
        assert!(!glob_match("layers.?.w", "layers.17.w"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*c", "axxbyyc"));
        assert!(!glob_match("a*b*c", "axxbyy"));
        assert!(glob_match("exact", "exact"));
    }
}
