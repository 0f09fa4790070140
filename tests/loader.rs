//! The loader (`Loader`): every element of every batch equals a plain
//! gather of the batch's expected rows (read back into poisoned memory);
//! epochs cover each row once (or the padded shard), shuffled orders are a
//! deterministic function of (seed, epoch); shards are disjoint and
//! complete; a resumed epoch yields the rest; dropping the loader or a
//! poll mid-epoch is safe; bad arguments are typed errors; the stats count
//! what was sent.

use futures::StreamExt;
use gpufeed::{
    batches_per_epoch, block_on, epoch_indices, permutation, Error, Gather, Loader, LoaderConfig,
    Registered, RowSource,
};
use std::sync::Arc;

const POISON: u32 = 0xDEAD_BEEF;

fn data(rows: usize, row_len: usize, seed: u64) -> Vec<u32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..rows * row_len)
        .map(|_| loop {
            let v = rng.u32(..);
            if v != POISON {
                break v;
            }
        })
        .collect()
}

fn read(buf: &mut gpufeed::DeviceBuffer<u32>) -> Vec<u32> {
    let mut out = vec![POISON; buf.len()];
    buf.copy_to_host_sync(&mut out).unwrap();
    out
}

fn gather(src: &[u32], row_len: usize, rows: &[usize]) -> Vec<u32> {
    rows.iter()
        .flat_map(|&r| src[r * row_len..(r + 1) * row_len].iter().copied())
        .collect()
}

gpufeed::backend_tests!(every_batch_holds_the_rows_of_its_indices);
fn every_batch_holds_the_rows_of_its_indices(device: gpufeed::Device) {
    // Rows of 37 words (148 bytes: a gather's pieces cut rows anywhere),
    // two fields, one of them in three segments.
    let (rows, a_len, b_len) = (1001, 37, 3);
    let a = data(rows, a_len, 1);
    let b = data(rows, b_len, 2);
    let (b0, rest) = b.split_at(300 * b_len);
    let (b1, b2) = rest.split_at(b_len);
    // The same data pinned in place: gathered on the device.
    let pa = Arc::new(Registered::new(&device, a.clone()).unwrap());
    let pb = Arc::new(Registered::new(&device, b.clone()).unwrap());
    for (shuffle, drop_last, batch, prefetch, threads, pinned) in [
        (false, false, 64, 2, 3, false),
        (true, false, 100, 1, 0, false),
        (true, true, 64, 4, 2, false),
        (false, true, 1000, 2, 1, false),
        (true, false, 5000, 3, 3, false),
        (false, false, 64, 2, 3, true),
        (true, false, 100, 1, 0, true),
        (true, true, 64, 4, 2, true),
        (true, false, 5000, 3, 3, true),
    ] {
        let fields = if pinned {
            vec![
                RowSource::registered(pa.clone(), a_len).unwrap(),
                RowSource::registered(pb.clone(), b_len).unwrap(),
            ]
        } else {
            vec![
                RowSource::new(&a, a_len).unwrap(),
                RowSource::concat(&[b0, b1, b2], b_len).unwrap(),
            ]
        };
        let mut config = LoaderConfig::new(batch);
        config.shuffle = shuffle;
        config.drop_last = drop_last;
        config.prefetch = prefetch;
        config.seed = 42;
        let mut loader = Loader::<u32>::with_threads(&device, fields, config, threads).unwrap();
        let want_gather = if pinned { Gather::Device } else { Gather::Host };
        assert_eq!(loader.gather(), want_gather);
        for epoch in 0..2 {
            loader.start_epoch(epoch, 0);
            let order = epoch_indices(rows, &config, epoch);
            let mut seen = 0;
            let mut count = 0;
            while let Some(batch) = block_on(loader.next()) {
                let mut batch = batch.unwrap();
                assert_eq!(batch.index, count);
                let want = &order[seen..seen + batch.rows];
                assert_eq!(loader.batch_indices(epoch, batch.index), want);
                assert_eq!(read(&mut batch.fields[0]), gather(&a, a_len, want));
                assert_eq!(read(&mut batch.fields[1]), gather(&b, b_len, want));
                seen += batch.rows;
                count += 1;
            }
            assert_eq!(count, loader.len());
            assert_eq!(count, batches_per_epoch(rows, &config));
            let expect_rows = if drop_last {
                rows / batch * batch
            } else {
                rows
            };
            assert_eq!(seen, expect_rows);
            // The stream stays ended until the next epoch.
            assert!(block_on(loader.next()).is_none());
        }
    }
}

gpufeed::backend_tests!(a_resumed_epoch_yields_the_rest_and_a_dropped_one_is_safe);
fn a_resumed_epoch_yields_the_rest_and_a_dropped_one_is_safe(device: gpufeed::Device) {
    let (rows, row_len) = (500, 16);
    let a = data(rows, row_len, 3);
    let mut config = LoaderConfig::new(32);
    config.shuffle = true;
    config.seed = 7;
    config.prefetch = 3;
    let mk = || Loader::<u32>::new(&device, vec![RowSource::new(&a, row_len).unwrap()], config);
    let mut first = mk().unwrap();
    first.start_epoch(5, 0);
    let mut full = Vec::new();
    while let Some(b) = block_on(first.next()) {
        full.push(read(&mut b.unwrap().fields[0]));
    }
    // Stop after 4 batches (others in flight), drop the loader; a new one
    // resumed at batch 4 yields exactly the rest.
    let mut part = mk().unwrap();
    part.start_epoch(5, 0);
    for _ in 0..4 {
        let b = block_on(part.next()).unwrap().unwrap();
        drop(b);
    }
    assert_eq!(part.position(), 4);
    drop(part);
    let mut resumed = mk().unwrap();
    resumed.start_epoch(5, 4);
    let mut rest = Vec::new();
    while let Some(b) = block_on(resumed.next()) {
        rest.push(read(&mut b.unwrap().fields[0]));
    }
    assert_eq!(rest, full[4..]);
    // And every batch holds its rows (a plain gather of the expected ones).
    let order = epoch_indices(rows, &config, 5);
    for (k, got) in full.iter().enumerate() {
        let want = &order[k * 32..((k + 1) * 32).min(rows)];
        assert_eq!(got, &gather(&a, row_len, want), "batch {k}");
    }
    // A batch kept past the end of its epoch and of its loader is intact.
    let mut again = mk().unwrap();
    again.start_epoch(5, 0);
    let mut kept = block_on(again.next()).unwrap().unwrap();
    again.start_epoch(6, 0);
    drop(again);
    assert_eq!(read(&mut kept.fields[0]), full[0]);
}

#[test]
fn the_permutation_is_fixed_by_seed_and_epoch() {
    let p = permutation(1000, 1, 2);
    let mut sorted = p.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    assert_eq!(p, permutation(1000, 1, 2));
    assert_ne!(p, permutation(1000, 1, 3));
    assert_ne!(p, permutation(1000, 2, 2));
    // The algorithm is part of the contract: these values pin it.
    assert_eq!(permutation(10, 0, 0), PINNED_0_0);
    assert!(permutation(0, 1, 1).is_empty());
    assert_eq!(permutation(1, 1, 1), vec![0]);
}

/// `permutation(10, 0, 0)`, as first computed: a change of the algorithm
/// changes every user's order and must be deliberate.
const PINNED_0_0: [usize; 10] = [1, 2, 5, 7, 0, 8, 4, 3, 9, 6];

#[test]
fn shards_are_disjoint_complete_and_padded_like_distributed_sampler() {
    for n in [0usize, 1, 7, 10, 1001] {
        for world in [1usize, 2, 3, 4] {
            for drop_last in [false, true] {
                let mut config = LoaderConfig::new(4);
                config.shuffle = true;
                config.seed = 9;
                config.drop_last = drop_last;
                config.world_size = world;
                let order = permutation(n, 9, 3);
                let shards: Vec<Vec<usize>> = (0..world)
                    .map(|r| {
                        config.rank = r;
                        epoch_indices(n, &config, 3)
                    })
                    .collect();
                let len = shards[0].len();
                assert!(shards.iter().all(|s| s.len() == len), "equal lengths");
                // DistributedSampler, written out: pad by wrapping or cut,
                // then rank r takes [r::world].
                let per = if drop_last && !n.is_multiple_of(world) {
                    n.saturating_sub(world).div_ceil(world)
                } else {
                    n.div_ceil(world)
                };
                assert_eq!(len, per);
                let mut all: Vec<usize> = shards.iter().flatten().copied().collect();
                all.sort_unstable();
                if drop_last {
                    all.dedup();
                    assert_eq!(all.len(), per * world, "disjoint");
                } else {
                    let mut want: Vec<usize> =
                        order.iter().copied().cycle().take(per * world).collect();
                    want.sort_unstable();
                    assert_eq!(all, want, "complete, padded by wrapping");
                }
                for (r, s) in shards.iter().enumerate() {
                    for (k, &i) in s.iter().enumerate() {
                        assert_eq!(i, order[(r + k * world) % n.max(1)]);
                    }
                }
            }
        }
    }
}

gpufeed::backend_tests!(each_rank_yields_as_many_batches_and_rows_as_its_shard_holds);
fn each_rank_yields_as_many_batches_and_rows_as_its_shard_holds(device: gpufeed::Device) {
    // Row i holds i: the rows yielded are the indices gathered. Row counts
    // that no world size here divides: a shard is padded up (or cut, with
    // drop_last), never rounded down.
    for n in [61usize, 1001] {
        let a: Vec<u32> = (0..n as u32).collect();
        for world in 2usize..=5 {
            assert!(!n.is_multiple_of(world));
            for drop_last in [false, true] {
                for rank in 0..world {
                    let mut config = LoaderConfig::new(4);
                    config.shuffle = true;
                    config.seed = 5;
                    config.drop_last = drop_last;
                    config.world_size = world;
                    config.rank = rank;
                    // DistributedSampler's shard length, written out.
                    let per = if drop_last {
                        (n - world) / world + 1
                    } else {
                        n / world + 1
                    };
                    let batches = if drop_last { per / 4 } else { per.div_ceil(4) };
                    let what = format!("{n} rows, rank {rank}/{world}, drop_last {drop_last}");
                    let indices = epoch_indices(n, &config, 1);
                    assert_eq!(indices.len(), per, "{what}");
                    let mut loader =
                        Loader::<u32>::new(&device, vec![RowSource::new(&a, 1).unwrap()], config)
                            .unwrap();
                    assert_eq!(loader.len(), batches, "{what}");
                    assert_eq!(batches_per_epoch(n, &config), batches, "{what}");
                    loader.start_epoch(1, 0);
                    let mut got = Vec::new();
                    let mut count = 0;
                    while let Some(b) = block_on(loader.next()) {
                        got.extend(read(&mut b.unwrap().fields[0]).iter().map(|&v| v as usize));
                        count += 1;
                    }
                    assert_eq!(count, batches, "{what}");
                    let rows = if drop_last { batches * 4 } else { per };
                    assert_eq!(got, indices[..rows], "{what}");
                }
            }
        }
    }
}

gpufeed::backend_tests!(a_source_of_separate_allocations_yields_the_first_row_of_each_segment);
fn a_source_of_separate_allocations_yields_the_first_row_of_each_segment(device: gpufeed::Device) {
    // Segments of 5, 1, 7 and 2 rows of 3 words, each its own allocation
    // followed by a poison row: a row read from the wrong segment's
    // address reads the poison, or another segment's rows.
    let row_len = 3;
    let sizes = [5usize, 1, 7, 2];
    let parts: Vec<Vec<u32>> = sizes
        .iter()
        .zip(31u64..)
        .map(|(&rows, seed)| {
            let mut v = data(rows, row_len, seed);
            v.extend([POISON; 3]);
            v
        })
        .collect();
    let segments: Vec<&[u32]> = parts
        .iter()
        .zip(sizes)
        .map(|(v, rows)| &v[..rows * row_len])
        .collect();
    let all: Vec<u32> = segments.concat();
    let rows = all.len() / row_len;
    for (shuffle, batch) in [(false, 1), (false, 4), (true, 3)] {
        let mut config = LoaderConfig::new(batch);
        config.shuffle = shuffle;
        config.seed = 3;
        let source = RowSource::concat(&segments, row_len).unwrap();
        assert_eq!(source.rows(), rows);
        let mut loader = Loader::<u32>::new(&device, vec![source], config).unwrap();
        loader.start_epoch(0, 0);
        let order = epoch_indices(rows, &config, 0);
        let mut seen = 0;
        while let Some(b) = block_on(loader.next()) {
            let mut b = b.unwrap();
            let want = &order[seen..seen + b.rows];
            assert_eq!(
                read(&mut b.fields[0]),
                gather(&all, row_len, want),
                "rows {want:?}, shuffle {shuffle}"
            );
            seen += b.rows;
        }
        assert_eq!(seen, rows);
    }
}

gpufeed::backend_tests!(bad_arguments_are_typed_errors);
fn rows(v: &[u32]) -> RowSource<'_> {
    RowSource::new(v, 10).unwrap()
}

fn bad_arguments_are_typed_errors(device: gpufeed::Device) {
    let a = vec![1u32; 100];
    let b = vec![1u32; 90];
    let invalid = |r: gpufeed::Result<Loader<'_, u32>>| {
        assert!(
            matches!(r, Err(Error::InvalidArgument(_))),
            "{:?}",
            r.map(|_| ())
        )
    };
    invalid(Loader::new(&device, vec![rows(&a)], LoaderConfig::new(0)));
    let mut c = LoaderConfig::new(4);
    c.prefetch = 0;
    invalid(Loader::new(&device, vec![rows(&a)], c));
    let mut c = LoaderConfig::new(4);
    c.world_size = 2;
    c.rank = 2;
    invalid(Loader::new(&device, vec![rows(&a)], c));
    invalid(Loader::new(&device, vec![], LoaderConfig::new(4)));
    invalid(Loader::new(
        &device,
        vec![rows(&a), rows(&b)],
        LoaderConfig::new(4),
    ));
    assert!(matches!(
        RowSource::new(&a[..95], 10),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        RowSource::new(&a, 0),
        Err(Error::InvalidArgument(_))
    ));
    // Rows of 6 bytes can't be u32 batches.
    let bytes = vec![0u8; 60];
    let r = RowSource::new(&bytes, 6).unwrap();
    invalid(Loader::<u32>::new(&device, vec![r], LoaderConfig::new(4)));
}

gpufeed::backend_tests!(the_stats_count_every_batch_and_byte_sent);
fn the_stats_count_every_batch_and_byte_sent(device: gpufeed::Device) {
    let (rows, a_len, b_len) = (300, 8, 3);
    let a = data(rows, a_len, 11);
    let b = data(rows, b_len, 12);
    let mut config = LoaderConfig::new(64);
    config.shuffle = true;
    let fields = vec![
        RowSource::new(&a, a_len).unwrap(),
        RowSource::new(&b, b_len).unwrap(),
    ];
    let mut loader = Loader::<u32>::new(&device, fields, config).unwrap();
    assert_eq!(loader.stats(), gpufeed::LoaderStats::default());
    for epoch in 0..2 {
        loader.start_epoch(epoch, 0);
        while let Some(batch) = block_on(loader.next()) {
            batch.unwrap();
        }
    }
    let s = loader.stats();
    // 300 rows in batches of 64: 5 batches an epoch (the last of 44 rows).
    assert_eq!(s.batches, 10);
    assert_eq!(s.bytes, 2 * (rows * (a_len + b_len) * 4) as u64);
    assert!(s.gather > std::time::Duration::ZERO);
}

gpufeed::backend_tests!(a_loader_gathers_on_the_device_only_when_every_field_is_pinned_in_place);
fn a_loader_gathers_on_the_device_only_when_every_field_is_pinned_in_place(
    device: gpufeed::Device,
) {
    let a = data(50, 4, 21);
    let pa = Arc::new(Registered::new(&device, a.clone()).unwrap());
    let config = LoaderConfig::new(8);
    let mixed = vec![
        RowSource::registered(pa.clone(), 4).unwrap(),
        RowSource::new(&a, 4).unwrap(),
    ];
    let loader = Loader::<u32>::new(&device, mixed, config).unwrap();
    assert_eq!(loader.gather(), Gather::Host);
    assert_eq!(loader.streams().len(), 1, "host gathers: one stream");
    drop(loader);
    let pinned = vec![RowSource::registered(pa.clone(), 4).unwrap()];
    let mut loader = Loader::<u32>::new(&device, pinned, config).unwrap();
    assert_eq!(loader.gather(), Gather::Device);
    // Batches alternate between two streams, so a kernel starts while the
    // one before it finishes.
    assert_eq!(loader.streams().len(), 2, "device gathers: two streams");
    // Dropped with batches in flight: the source outlives their gathers
    // (the loader waits for them), and the guard is the caller's again.
    loader.start_epoch(0, 0);
    let mut first = block_on(loader.next()).unwrap().unwrap();
    drop(loader);
    assert_eq!(read(&mut first.fields[0]), a[..8 * 4].to_vec());
    let guard = Arc::try_unwrap(pa).expect("the loader let go of the source");
    assert_eq!(guard.into_inner(), a);
}

gpufeed::backend_tests!(prefetch_batches_stay_in_flight_while_a_batch_handed_out_is_used);
fn prefetch_batches_stay_in_flight_while_a_batch_handed_out_is_used(device: gpufeed::Device) {
    let a = data(400, 8, 23);
    let pa = Arc::new(Registered::new(&device, a.clone()).unwrap());
    for pinned in [false, true] {
        for prefetch in [1, 3] {
            let mut config = LoaderConfig::new(10);
            config.prefetch = prefetch;
            let field = if pinned {
                RowSource::registered(pa.clone(), 8).unwrap()
            } else {
                RowSource::new(&a, 8).unwrap()
            };
            let mut loader = Loader::<u32>::new(&device, vec![field], config).unwrap();
            loader.start_epoch(0, 0);
            for taken in 1..=5u64 {
                let mut batch = block_on(loader.next()).unwrap().unwrap();
                // Issued: the ones handed out and `prefetch` more.
                assert_eq!(loader.stats().batches, taken + prefetch as u64);
                let i = batch.index;
                assert_eq!(read(&mut batch.fields[0]), a[i * 80..(i + 1) * 80].to_vec());
            }
        }
    }
}
