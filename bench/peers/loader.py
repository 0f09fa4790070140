#!/usr/bin/env python3
"""gpufeed.Loader against the ways PyTorch users feed a training loop, in one
process, one run (issue 27). Batches of random 4 KiB rows of a 1 GiB
in-memory float32 array (rows of 1024 floats), sent to the GPU:

  * gpufeed:             gpufeed.Loader(a, rows, shuffle=True) -> torch tensors
  * gpufeed_prefetch4:   the same with prefetch=4 (the default is 2)
  * pinned_copy:         one pinned tensor of the batch's bytes, .cuda(non_blocking=True)
                         per batch (the link's own speed for those bytes: the bound)
  * torch_hand:          torch.index_select into two pinned buffers, each sent with
                         .cuda(non_blocking=True) and reused after its event
  * dataloader_sample:   DataLoader(per-sample dataset, pin_memory=True), 0/2/4/8 workers
  * dataloader_batch:    DataLoader(batch sampler: the dataset indexes a whole batch), 0/2/4/8
  * gpufeed_mmap:        gpufeed.Loader over np.load(path, mmap_mode="r") of the same
                         array saved as .npy, the file in the page cache
  * sweep:               gpufeed at 64 KiB-64 MiB batches, random and sequential order,
                         in memory and memory-mapped

Timing: host wall time from the first batch asked for to the last one's data
on the device (torch.cuda.synchronize), after one warm-up batch; GB/s =
bytes / time; the median of --reps runs. The DataLoader runs are capped at
--dl-batches batches (their per-sample collation is slow). Host CPU seconds
per GB: time.process_time() of this process plus the CPU time of the
DataLoader's worker processes (resource.getrusage(RUSAGE_CHILDREN) once they
have exited), over the bytes delivered.

Checks: before each gpufeed configuration's timed runs, a verification pass
compares batches with NumPy's own gather a[idx] of the rows the loader says
the batch holds (loader.indices()): every batch of an epoch (capped at
--verify-batches; 16 per sweep configuration), element for element. The DataLoader and hand-written
peers' first batch is compared likewise.

Usage (on the GPU machine, with torch installed and the gpufeed wheel):
    OMP_WAIT_POLICY=PASSIVE python3 bench/peers/loader.py --out loader.json
    python3 bench/peers/loader.py --smoke    # seconds, any machine (CPU torch too)

Prints one JSON object (also written to --out); exit 1 if a check failed.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Meter:
    """Host CPU seconds (this process and exited children) and wall time."""

    def __enter__(self):
        self.cpu0, self.kids0, self.t0 = time.process_time(), children_cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0 + children_cpu() - self.kids0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--array-bytes", type=int, default=1 << 30)
    p.add_argument("--row-bytes", type=int, default=4096)
    p.add_argument("--batch-bytes", type=int, default=8 << 20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batches", type=int, default=64, help="batches per timed run (ours, the bound, the hand loop)")
    p.add_argument("--dl-batches", type=int, default=6, help="batches per timed DataLoader run")
    p.add_argument("--workers", default="0,2,4,8")
    p.add_argument("--sweep", default="65536,262144,1048576,4194304,16777216,67108864")
    p.add_argument("--verify-batches", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a check that it runs")
    p.add_argument("--out")
    a = p.parse_args()
    if a.smoke:
        a.array_bytes, a.batch_bytes, a.reps, a.batches, a.dl_batches = 16 << 20, 256 << 10, 2, 8, 2
        a.workers, a.sweep, a.verify_batches = "0,2", "65536,1048576", 8

    import torch
    import gpufeed

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row_floats = a.row_bytes // 4
    rows = a.array_bytes // a.row_bytes
    batch_rows = a.batch_bytes // a.row_bytes
    t0 = time.perf_counter()
    arr = np.random.default_rng(0).random((rows, row_floats), dtype=np.float32)
    at = torch.from_numpy(arr)
    failures = []
    out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "numpy": np.__version__, "gpufeed": gpufeed.__version__, "array_bytes": a.array_bytes,
           "row_bytes": a.row_bytes, "batch_bytes": batch_rows * a.row_bytes, "reps": a.reps,
           "prepare_s": None, "rows": []}

    def row(name, gbps_runs, cpu_s_per_gb=None, verified=None, **extra):
        r = {"idiom": name, "gbps": statistics.median(gbps_runs), "gbps_min": min(gbps_runs),
             "gbps_max": max(gbps_runs), "runs": len(gbps_runs), "cpu_s_per_gb": cpu_s_per_gb,
             "verified": verified, **extra}
        out["rows"].append(r)
        print(f"  {name:<34} {r['gbps']:7.2f} GB/s" +
              (f"  {cpu_s_per_gb:.3f} CPU s/GB" if cpu_s_per_gb is not None else "") +
              ("" if verified is None else f"  verified={verified}"), file=sys.stderr)
        return r

    def check(got, idx):
        want = arr[np.asarray(idx, dtype=np.int64)]
        return got.shape == want.shape and np.array_equal(got.cpu().numpy().view(np.uint32), want.view(np.uint32))

    def ours(source, batch, shuffle, label, verify=None, prefetch=2, **extra):
        """Verification pass, then timed runs, of a gpufeed.Loader."""
        ld = gpufeed.Loader(source, batch, shuffle=shuffle, seed=1, framework="torch", prefetch=prefetch)
        idx = ld.indices(0)
        ok = True
        for k, b in enumerate(ld):
            if k >= (verify or a.verify_batches):
                break
            ok &= check(b, idx[k * batch:(k + 1) * batch])
        if not ok:
            failures.append(label)
        runs, cpus = [], []
        per_run = max(2, min(a.batches, len(ld) - 1))
        epoch = 1
        for _ in range(a.reps):
            ld.set_epoch(epoch)
            it = iter(ld)
            next(it)  # warm-up: the first batch's pinned block and threads
            sync()
            got = 0
            with Meter() as m:
                for _ in range(per_run):
                    try:
                        next(it)
                    except StopIteration:
                        epoch += 1
                        ld.set_epoch(epoch)
                        it = iter(ld)
                        next(it)
                    got += 1
                sync()
            nbytes = got * batch * a.row_bytes
            runs.append(nbytes / m.wall / 1e9)
            cpus.append(m.cpu / (nbytes / 1e9))
            epoch += 1
        del it
        return row(label, runs, statistics.median(cpus), ok, gather=ld.gather, **extra)

    out["prepare_s"] = time.perf_counter() - t0
    print(f"{out['gpu']}: {a.array_bytes >> 20} MiB array, {a.row_bytes} B rows, "
          f"{batch_rows * a.row_bytes >> 10} KiB batches", file=sys.stderr)

    # The bound: the same bytes from one pinned tensor.
    if cuda:
        pinned = torch.empty((batch_rows, row_floats), dtype=torch.float32).pin_memory()
        pinned.copy_(at[:batch_rows])
        runs = []
        for _ in range(a.reps):
            pinned.cuda(non_blocking=True)
            sync()
            with Meter() as m:
                for _ in range(a.batches):
                    pinned.cuda(non_blocking=True)
                sync()
            runs.append(a.batches * batch_rows * a.row_bytes / m.wall / 1e9)
        bound = row("pinned_copy", runs)
    else:
        bound = None

    main_row = ours(arr, batch_rows, True, "gpufeed")
    # The same, 4 batches ahead instead of the default 2 (how much a deeper queue hides).
    ours(arr, batch_rows, True, "gpufeed_prefetch4", prefetch=4, prefetch_depth=4)

    # The hand-written loop: index_select into two pinned buffers.
    bufs = [torch.empty((batch_rows, row_floats), dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
    events = [None, None]
    gen = torch.Generator().manual_seed(0)
    runs, cpus, ok = [], [], True
    for rep in range(a.reps):
        perm = torch.randperm(rows, generator=gen)
        first = None
        with Meter() as m:
            for k in range(a.batches):
                i = k % 2
                if events[i] is not None:
                    events[i].synchronize()
                idx = perm[(k * batch_rows) % rows:][:batch_rows]
                if len(idx) < batch_rows:
                    idx = perm[:batch_rows]
                torch.index_select(at, 0, idx, out=bufs[i])
                d = bufs[i].to(dev, non_blocking=True)
                if cuda:
                    events[i] = torch.cuda.Event()
                    events[i].record()
                if first is None:
                    first = (d.clone(), idx.clone())
            sync()
        ok &= check(first[0], first[1].numpy())
        nbytes = a.batches * batch_rows * a.row_bytes
        runs.append(nbytes / m.wall / 1e9)
        cpus.append(m.cpu / (nbytes / 1e9))
    hand = row("torch_hand", runs, statistics.median(cpus), ok)
    if not ok:
        failures.append("torch_hand")

    # DataLoader, per sample and with a batch sampler, at each worker count.
    class PerSample(torch.utils.data.Dataset):
        def __len__(self):
            return rows

        def __getitem__(self, i):
            return at[i], i

    class PerBatch(torch.utils.data.Dataset):
        def __len__(self):
            return rows

        def __getitem__(self, idx):
            idx = torch.as_tensor(idx)
            return at[idx], idx

    dl_rows = {}
    for kind in ["sample", "batch"]:
        for w in [int(x) for x in a.workers.split(",")]:
            runs, cpus, ok = [], [], True
            reps = max(1, min(a.reps, 2))
            for _ in range(reps):
                if kind == "sample":
                    dl = torch.utils.data.DataLoader(PerSample(), batch_size=batch_rows, shuffle=True,
                                                     num_workers=w, pin_memory=cuda)
                else:
                    bs = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(rows)),
                                                       batch_rows, drop_last=True)
                    dl = torch.utils.data.DataLoader(PerBatch(), sampler=bs, batch_size=None,
                                                     num_workers=w, pin_memory=cuda)
                it = iter(dl)
                x, idx = next(it)  # warm-up (workers started)
                d = x.to(dev, non_blocking=True)
                sync()
                ok &= check(d, idx.numpy())
                with Meter() as m:
                    for _ in range(a.dl_batches):
                        x, _ = next(it)
                        x.to(dev, non_blocking=True)
                    sync()
                    del it  # workers exit: their CPU time is counted
                nbytes = a.dl_batches * batch_rows * a.row_bytes
                runs.append(nbytes / m.wall / 1e9)
                cpus.append(m.cpu / (nbytes / 1e9))
            dl_rows[(kind, w)] = row(f"dataloader_{kind}_w{w}", runs, statistics.median(cpus), ok, workers=w)
            if not ok:
                failures.append(f"dataloader_{kind}_w{w}")

    # The same array as a memory-mapped .npy in the page cache.
    tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=tmpdir) as d:
        path = os.path.join(d, "a.npy")
        np.save(path, arr)
        m = np.load(path, mmap_mode="r")
        _ = int(np.asarray(m).view(np.uint8)[::4096].sum())  # into the page cache
        mmap_row = ours([path], batch_rows, True, "gpufeed_mmap")
        # The sweep: batch sizes, random and sequential, in memory and mapped.
        for size in [int(s) for s in a.sweep.split(",")]:
            br = max(1, size // a.row_bytes)
            if br > rows:
                continue
            for shuffle in [True, False]:
                for src, where in [(arr, "memory"), ([path], "mmap")]:
                    ours(src, br, shuffle, f"sweep_{where}_{'random' if shuffle else 'sequential'}_{size}",
                         verify=16, sweep_bytes=size, order="random" if shuffle else "sequential",
                         where=where)
        del m

    best_sample = max((r for (k, _), r in dl_rows.items() if k == "sample"), key=lambda r: r["gbps"])
    best_batch = max((r for (k, _), r in dl_rows.items() if k == "batch"), key=lambda r: r["gbps"])
    g = main_row["gbps"]
    out["checks"] = {
        "vs_pinned_copy": g / bound["gbps"] if bound else None, "vs_pinned_copy_needs": 0.9,
        "vs_torch_hand": g / hand["gbps"], "vs_torch_hand_needs": 1.3,
        "vs_dataloader_sample_best": g / best_sample["gbps"], "vs_dataloader_sample_best_needs": 20,
        "dataloader_sample_best_workers": best_sample["workers"],
        "vs_dataloader_batch_best": g / best_batch["gbps"],
        "cpu_s_per_gb_ours": main_row["cpu_s_per_gb"],
        "cpu_s_per_gb_dataloader_sample_best": best_sample["cpu_s_per_gb"],
        "cpu_below_dataloader": main_row["cpu_s_per_gb"] < best_sample["cpu_s_per_gb"],
        "mmap_vs_memory": mmap_row["gbps"] / g, "mmap_vs_memory_needs": 0.8,
    }
    out["failures"] = failures
    out["total_s"] = time.perf_counter() - t0
    text = json.dumps(out, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
