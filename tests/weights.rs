//! Model weights: `Staging::read_files` (many files, gathered pieces,
//! buffer and slice targets) and `gpufeed::weights` (checkpoints opened
//! from an index, a directory or a list; tensor-parallel slices; loads;
//! checkpoints written and read back). Files are written here by an
//! independent writer (serde_json headers), data is fresh random bytes,
//! outputs are poisoned first, and every byte is compared with what a
//! plain loop over the file gives.

use gpufeed::weights::{
    self, Checkpoint, CheckpointWriter, Dtype, FileError, Snapshot, Source, Split,
};
use gpufeed::{DeviceBuffer, Error, FileIo, FileRange, ReadTarget, Staging, StagingConfig};
use std::path::{Path, PathBuf};

const POISON: u8 = 0xA5;

/// Tensors as (name, shape, bytes).
type Tensors = Vec<(String, Vec<usize>, Vec<u8>)>;

/// A directory of our own, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(what: &str, device: &gpufeed::Device) -> Dir {
        let d = std::env::temp_dir().join(format!(
            "gpufeed-weights-{what}-{}-{:?}",
            std::process::id(),
            device.kind()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn engine(device: &gpufeed::Device, block_bytes: usize) -> Staging {
    let config = StagingConfig {
        block_bytes,
        blocks: 3,
        threads: 3,
        ..StagingConfig::for_device(device)
    };
    Staging::with_config(device, config).unwrap()
}

fn poisoned(device: &gpufeed::Device, n: usize) -> DeviceBuffer<u8> {
    let mut d = DeviceBuffer::<u8>::new(device, n).unwrap();
    d.copy_from_host_sync(&vec![POISON; n]).unwrap();
    d
}

fn host(d: &mut DeviceBuffer<u8>) -> Vec<u8> {
    let mut v = vec![0u8; d.len()];
    d.copy_to_host_sync(&mut v).unwrap();
    v
}

/// A safetensors file of `tensors` (name, dtype name, shape, bytes),
/// header by serde_json; returns each tensor's bytes' file offset.
fn write_safetensors(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut pos = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + bytes.len()]}),
        );
        pos += bytes.len();
    }
    let text = serde_json::Value::Object(header).to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for (_, _, _, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out).unwrap();
}

fn random(n: usize, rng: &mut fastrand::Rng) -> Vec<u8> {
    (0..n).map(|_| rng.u8(..)).collect()
}

gpufeed::backend_tests!(
    many_files_and_gathered_pieces_land_byte_for_byte,
    checkpoints_load_whole_and_sliced_for_2_and_4_ranks,
    missing_shards_and_short_tensors_are_errors_naming_the_file,
    checkpoints_written_in_chunks_read_back_and_replace_the_previous,
);

fn many_files_and_gathered_pieces_land_byte_for_byte(device: gpufeed::Device) {
    let _serial = gpufeed::testing::serial();
    let dir = Dir::new("files", &device);
    let mut rng = fastrand::Rng::with_seed(0x41);
    let sizes = [300_001usize, 70_000, 1 << 20];
    let contents: Vec<Vec<u8>> = sizes.iter().map(|&n| random(n, &mut rng)).collect();
    let paths: Vec<PathBuf> = (0..3).map(|i| dir.0.join(format!("f{i}"))).collect();
    for (p, c) in paths.iter().zip(&contents) {
        std::fs::write(p, c).unwrap();
    }
    let files: Vec<std::fs::File> = paths
        .iter()
        .map(|p| std::fs::File::open(p).unwrap())
        .collect();
    for block in [(64 << 10) + 4, 1 << 20] {
        let staging = engine(&device, block);
        for round in 0..6 {
            // Targets: a buffer and a slice of another (a margin of poison
            // around it) per round; pieces from all three files: strided
            // runs (a column slice), whole ranges, zero-length ones.
            let target_len = [150_000usize, 90_000];
            let mut a = poisoned(&device, target_len[0]);
            let mut b = poisoned(&device, target_len[1] + 64);
            let mut want = [
                vec![POISON; target_len[0]],
                vec![POISON; target_len[1] + 64],
            ];
            let mut ranges: Vec<(usize, u64, usize, usize, usize)> = Vec::new();
            for t in 0..2 {
                let mut off = 0;
                while off < target_len[t] {
                    let f = rng.usize(..3);
                    if rng.usize(..5) == 0 {
                        // A run of the file scattered on the device: pieces
                        // that follow each other in the file, landing in a
                        // shuffled order.
                        let lens: Vec<usize> =
                            (0..rng.usize(2..8)).map(|_| rng.usize(1..3000)).collect();
                        let sum: usize = lens.iter().sum();
                        let start = rng.usize(..sizes[f] / 2);
                        if off + sum > target_len[t] || start + sum > sizes[f] {
                            continue;
                        }
                        let mut order: Vec<usize> = (0..lens.len()).collect();
                        rng.shuffle(&mut order);
                        let mut slot = vec![0; lens.len()];
                        let mut d = off;
                        for &i in &order {
                            slot[i] = d;
                            d += lens[i];
                        }
                        let mut at = start;
                        for (i, &len) in lens.iter().enumerate() {
                            ranges.push((f, at as u64, t, slot[i], len));
                            let o = if t == 1 { 32 } else { 0 };
                            want[t][o + slot[i]..o + slot[i] + len]
                                .copy_from_slice(&contents[f][at..at + len]);
                            at += len;
                        }
                        off += sum;
                        continue;
                    }
                    let (len, stride) = match rng.usize(..4) {
                        0 => (0, 0),
                        1 => (rng.usize(1..64), rng.usize(64..512)),
                        2 => (rng.usize(1..5000), rng.usize(5000..9000)),
                        _ => (rng.usize(1..3 * block), 0),
                    };
                    let reps = if stride > 0 { rng.usize(1..200) } else { 1 };
                    let start = rng.usize(..sizes[f] / 2);
                    for r in 0..reps {
                        let len = len.min(target_len[t] - off);
                        let at = start + r * stride;
                        if at + len > sizes[f] {
                            break;
                        }
                        ranges.push((f, at as u64, t, off, len));
                        let o = if t == 1 { 32 } else { 0 };
                        want[t][o + off..o + off + len].copy_from_slice(&contents[f][at..at + len]);
                        off += len;
                    }
                }
            }
            let io = if round % 2 == 0 {
                FileIo::Buffered
            } else {
                FileIo::Auto
            };
            {
                let slice = b.view_mut().range(32..32 + target_len[1]).unwrap();
                let targets = vec![ReadTarget::buffer(&mut a), ReadTarget::slice(slice)];
                let fr: Vec<FileRange<'_>> = ranges
                    .iter()
                    .map(|&(f, at, t, off, len)| FileRange {
                        file: &files[f],
                        at,
                        target: t,
                        offset: off,
                        len,
                    })
                    .collect();
                staging.read_files_blocking(targets, &fr, io).unwrap();
            }
            assert!(
                host(&mut a) == want[0],
                "block {block} round {round}: target 0"
            );
            assert!(
                host(&mut b) == want[1],
                "block {block} round {round}: target 1"
            );
        }
        // Bad pieces are refused before anything is read.
        let mut a = poisoned(&device, 100);
        let bad = [FileRange {
            file: &files[0],
            at: 0,
            target: 0,
            offset: 90,
            len: 11,
        }];
        let e = staging
            .read_files_blocking(vec![ReadTarget::buffer(&mut a)], &bad, FileIo::Auto)
            .unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
        let bad = [FileRange {
            target: 1,
            ..bad[0]
        }];
        assert!(staging
            .read_files_blocking(vec![ReadTarget::buffer(&mut a)], &bad, FileIo::Auto)
            .is_err());
        assert!(host(&mut a).iter().all(|&x| x == POISON));
    }
}

/// A Llama-like checkpoint of 3 shards plus an index; returns the tensors
/// (name, shape, bytes) by shard.
fn write_checkpoint(dir: &Path, rng: &mut fastrand::Rng) -> Tensors {
    let shapes: [(&str, Vec<usize>); 7] = [
        ("embed.weight", vec![64, 48]),
        ("layers.0.q.weight", vec![48, 48]),
        ("layers.0.o.weight", vec![48, 48]),
        ("layers.0.norm", vec![48]),
        ("layers.1.up.weight", vec![96, 48]),
        ("layers.1.down.weight", vec![48, 96]),
        ("lm_head.weight", vec![64, 48]),
    ];
    let all: Tensors = shapes
        .iter()
        .map(|(n, s)| {
            (
                n.to_string(),
                s.clone(),
                random(s.iter().product::<usize>() * 2, rng),
            )
        })
        .collect();
    let groups = [&all[0..2], &all[2..5], &all[5..7]];
    let mut map = serde_json::Map::new();
    for (i, g) in groups.iter().enumerate() {
        let name = format!("model-{:05}-of-00003.safetensors", i + 1);
        let t: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = g
            .iter()
            .rev()
            .map(|(n, s, b)| (n.as_str(), "BF16", s.clone(), b.clone()))
            .collect();
        write_safetensors(&dir.join(&name), &t);
        for (n, _, _) in g.iter() {
            map.insert(n.clone(), serde_json::Value::String(name.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join(weights::INDEX_NAME), index.to_string()).unwrap();
    all
}

/// Rank `r`'s part of a row-major tensor of `shape` (2-byte elements) split
/// on `dim` among `w`, by plain index arithmetic.
fn reference_slice(
    bytes: &[u8],
    shape: &[usize],
    dim: Option<usize>,
    r: usize,
    w: usize,
) -> Vec<u8> {
    let Some(k) = dim else { return bytes.to_vec() };
    let outer: usize = shape[..k].iter().product();
    let inner: usize = shape[k + 1..].iter().product::<usize>() * 2;
    let c = shape[k] / w;
    let mut out = Vec::new();
    for o in 0..outer {
        let from = (o * shape[k] + r * c) * inner;
        out.extend_from_slice(&bytes[from..from + c * inner]);
    }
    out
}

fn load_all(
    staging: &Staging,
    ck: &Checkpoint,
    rule: impl Fn(&str) -> Option<usize>,
    rank: usize,
    world: usize,
) -> (Tensors, weights::LoadStats) {
    let device = staging.device().clone();
    let plan = ck
        .plan(
            |_| true,
            |t| rule(&t.name).map_or(Split::Replicated, Split::Dim),
            rank,
            world,
        )
        .unwrap();
    let mut bufs: Vec<DeviceBuffer<u8>> = plan
        .tensors
        .iter()
        .map(|t| poisoned(&device, t.nbytes))
        .collect();
    let stats = weights::load(
        staging,
        ck,
        &plan,
        bufs.iter_mut().map(ReadTarget::buffer).collect(),
        FileIo::Auto,
    )
    .unwrap();
    let out = plan
        .tensors
        .iter()
        .zip(bufs.iter_mut())
        .map(|(t, b)| (t.name.clone(), t.shape.clone(), host(b)))
        .collect();
    (out, stats)
}

fn checkpoints_load_whole_and_sliced_for_2_and_4_ranks(device: gpufeed::Device) {
    let _serial = gpufeed::testing::serial();
    let dir = Dir::new("ckpt", &device);
    let mut rng = fastrand::Rng::with_seed(0x4141);
    let all = write_checkpoint(&dir.0, &mut rng);
    let staging = engine(&device, 4096 * 3);
    let by_index = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap();
    assert!(by_index.index.is_some());
    assert_eq!(by_index.len(), all.len());
    // The same tensors from the directory without its index, and a list.
    std::fs::rename(dir.0.join(weights::INDEX_NAME), dir.0.join("index.json")).unwrap();
    let by_dir = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap();
    let shards: Vec<PathBuf> = by_dir.shards.iter().map(|s| s.path.clone()).collect();
    let by_list = Checkpoint::open(&Source::Shards(shards)).unwrap();
    let by_json = Checkpoint::open(&Source::Path(dir.0.join("index.json"))).unwrap();
    let rule = |n: &str| {
        if n.ends_with(".o.weight") || n.ends_with("down.weight") {
            Some(1)
        } else if n.ends_with(".weight") && !n.starts_with("embed") {
            Some(0)
        } else {
            None
        }
    };
    for ck in [&by_index, &by_dir, &by_list, &by_json] {
        let (got, stats) = load_all(&staging, ck, |_| None, 0, 1);
        assert_eq!(got.len(), all.len());
        for (name, shape, bytes) in &got {
            let (_, s, b) = all.iter().find(|t| &t.0 == name).unwrap();
            assert_eq!((shape, bytes), (s, b), "{name}");
        }
        let total: u64 = all.iter().map(|t| t.2.len() as u64).sum();
        assert_eq!(stats.bytes_read, total);
        for world in [2, 4] {
            let mut read = 0;
            for rank in 0..world {
                let (got, stats) = load_all(&staging, ck, rule, rank, world);
                for (name, shape, bytes) in &got {
                    let (_, s, b) = all.iter().find(|t| &t.0 == name).unwrap();
                    let want = reference_slice(b, s, rule(name), rank, world);
                    assert!(bytes == &want, "{name} rank {rank} of {world}");
                    let mut sub = s.clone();
                    if let Some(k) = rule(name) {
                        sub[k] /= world;
                    }
                    assert_eq!(shape, &sub);
                }
                read += stats.bytes_read;
            }
            // Split tensors are read once among the ranks, the others by each.
            let replicated: u64 = all
                .iter()
                .filter(|t| rule(&t.0).is_none())
                .map(|t| t.2.len() as u64)
                .sum();
            assert_eq!(read, total - replicated + replicated * world as u64);
        }
    }
    // An uneven split is refused naming the tensor.
    let e = by_index
        .plan(|_| true, |_| Split::Dim(0), 0, 3)
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not divide"), "{e}");
}

fn file_error(e: &Error) -> &FileError {
    FileError::of(e).unwrap_or_else(|| panic!("not a file error: {e}"))
}

fn missing_shards_and_short_tensors_are_errors_naming_the_file(device: gpufeed::Device) {
    let _serial = gpufeed::testing::serial();
    let dir = Dir::new("faults", &device);
    let mut rng = fastrand::Rng::with_seed(7);
    write_checkpoint(&dir.0, &mut rng);
    let second = dir.0.join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&second).unwrap();
    // Missing.
    std::fs::remove_file(&second).unwrap();
    let e = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap_err();
    let f = file_error(&e);
    assert_eq!(
        (f.path.as_path(), f.errno),
        (second.as_path(), Some(libc::ENOENT))
    );
    // Cut short by one byte.
    std::fs::write(&second, &bytes[..bytes.len() - 1]).unwrap();
    let e = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap_err();
    assert_eq!(file_error(&e).path, second);
    assert!(matches!(&e, Error::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof));
    // Not safetensors.
    std::fs::write(&second, b"{\"not\": \"safetensors\"}").unwrap();
    let e = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap_err();
    assert_eq!(file_error(&e).path, second);
    assert!(matches!(&e, Error::Io(io) if io.kind() == std::io::ErrorKind::InvalidData));
    // Whole when opened, cut short before the read: the read's error names it.
    std::fs::write(&second, &bytes).unwrap();
    let ck = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap();
    std::fs::write(&second, &bytes[..bytes.len() / 2]).unwrap();
    let plan = ck.plan(|_| true, |_| Split::Replicated, 0, 1).unwrap();
    let mut bufs: Vec<DeviceBuffer<u8>> = plan
        .tensors
        .iter()
        .map(|t| poisoned(&device, t.nbytes))
        .collect();
    let staging = engine(&device, 8192);
    let e = weights::load(
        &staging,
        &ck,
        &plan,
        bufs.iter_mut().map(ReadTarget::buffer).collect(),
        FileIo::Auto,
    )
    .unwrap_err();
    assert_eq!(file_error(&e).path, second, "{e}");
}

fn checkpoints_written_in_chunks_read_back_and_replace_the_previous(device: gpufeed::Device) {
    let _serial = gpufeed::testing::serial();
    let dir = Dir::new("save", &device);
    let mut rng = fastrand::Rng::with_seed(99);
    let staging = engine(&device, 16 << 10);
    let shapes = [
        vec![300usize, 7],
        vec![0, 5],
        vec![1000],
        vec![17, 33, 3],
        vec![4],
    ];
    let dtypes = [Dtype::F32, Dtype::BF16, Dtype::U8, Dtype::F16, Dtype::I64];
    let mut previous: Vec<PathBuf> = Vec::new();
    for round in 0..3 {
        let tensors: Vec<(String, Dtype, Vec<usize>)> = shapes
            .iter()
            .zip(dtypes)
            .enumerate()
            .map(|(i, (s, d))| (format!("t{i}"), d, s.clone()))
            .collect();
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, d, s)| random(d.size() * s.iter().product::<usize>(), &mut rng))
            .collect();
        let mut w = CheckpointWriter::create(
            &staging,
            &dir.0,
            &tensors,
            5000,
            &[("format".into(), "pt".into())],
        )
        .unwrap();
        let shard_names: Vec<String> = w.plan().shards.iter().map(|s| s.name.clone()).collect();
        // Never a name a shard of the checkpoint there has (the second
        // round's get a tag of their own; the third's are free again).
        for n in &shard_names {
            assert!(!dir.0.join(n).exists(), "round {round}: {n} exists");
        }
        assert_eq!(
            shard_names.iter().all(|n| n.matches('.').count() == 2),
            round == 1,
            "{shard_names:?}"
        );
        // Chunks of up to 777 bytes, from the device and from the host,
        // written last tensor first.
        for (i, d) in data.iter().enumerate().rev() {
            for (c, chunk) in d.chunks(777).enumerate() {
                let snap = if c % 2 == 0 {
                    let mut b = DeviceBuffer::<u8>::new(&device, chunk.len()).unwrap();
                    b.copy_from_host_sync(chunk).unwrap();
                    Snapshot::Device(b)
                } else {
                    Snapshot::Host(chunk.to_vec())
                };
                w.write(i, (c * 777) as u64, &snap).unwrap();
            }
        }
        w.finish().unwrap();
        let ck = Checkpoint::open(&Source::Path(dir.0.clone())).unwrap();
        assert_eq!(ck.shards.len(), shard_names.len());
        let (got, _) = load_all(&staging, &ck, |_| None, 0, 1);
        for (name, shape, bytes) in got {
            let i: usize = name[1..].parse().unwrap();
            assert_eq!(shape, tensors[i].2);
            assert!(bytes == data[i], "round {round}: {name}");
        }
        // The previous checkpoint's shards are gone, no temporary is left.
        for p in &previous {
            assert!(!p.exists(), "{} left behind", p.display());
        }
        let names: Vec<String> = std::fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".partial-")), "{names:?}");
        previous = ck.shards.iter().map(|s| s.path.clone()).collect();
    }
    // A writer dropped unfinished leaves no file behind.
    let before: usize = std::fs::read_dir(&dir.0).unwrap().count();
    let w = CheckpointWriter::create(
        &staging,
        &dir.0,
        &[("x".into(), Dtype::U8, vec![10])],
        100,
        &[],
    )
    .unwrap();
    drop(w);
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), before);
}
