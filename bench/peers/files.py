#!/usr/bin/env python3
"""Files to the GPU: gpufeed.load / load_safetensors against what users do
today, in one process, one run, on the same files.

  * npy:         np.load(path) then torch.from_numpy(a).cuda()
                 against gpufeed.load(path)
  * safetensors: safetensors.torch.load_file(path, device="cuda") (when the
                 package is importable) against gpufeed.load_safetensors(path)
Warm: the file in the page cache (read once before). Cold: its pages
evicted first with posix_fadvise(POSIX_FADV_DONTNEED) (after os.sync), one
run each; the disk's own rate measured in the same run with dd
(iflag=direct, 16 MiB blocks).

Timing: wall time of the call plus torch.cuda.synchronize(); medians of
--reps runs warm. Every result checked against the file's data element by
element on the GPU (torch.equal over the raw words).

Output (--out): {"gpu", "rows": [{"format", "cache", "idiom", "bytes",
"gbps", "reps", "verified"}], "disk_direct_gbps"}; exit 1 if a check failed.
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time

import numpy as np


def evict(path):
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_safetensors(path, tensors):
    header, pos = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(t.tobytes())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=1 << 30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default="/tmp/gpufeed-files")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        return 2
    import gpufeed

    try:
        import safetensors.torch as st
    except ImportError:
        st = None
    dev = gpufeed.Device("cuda", 0)
    os.makedirs(args.dir, exist_ok=True)
    n = args.bytes // 4
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**31, size=n, dtype=np.int32).view(np.float32)
    want = torch.from_numpy(a).cuda()
    npy = os.path.join(args.dir, "a.npy")
    np.save(npy, a)
    parts = 8
    tensors = {f"layer{i}.weight": a[i * (n // parts):(i + 1) * (n // parts)].reshape(-1, 1024) for i in range(parts)}
    sft = os.path.join(args.dir, "a.safetensors")
    write_safetensors(sft, tensors)
    want_parts = {k: torch.from_numpy(v).cuda() for k, v in tensors.items()}
    torch.cuda.synchronize()
    rows, ok_all = [], True

    def same(x, y):
        return bool(torch.equal(x.reshape(-1).view(torch.int32), y.reshape(-1).view(torch.int32)))

    def run(fmt, idiom, call, check, path, reps):
        nonlocal ok_all
        for cache in ["warm", "cold"]:
            times, verified = [], True
            for r in range(reps + 1 if cache == "warm" else 1):
                if cache == "cold":
                    evict(path)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = call()
                torch.cuda.synchronize()
                t = time.perf_counter() - t0
                verified &= check(res)
                del res
                if cache == "cold" or r > 0:
                    times.append(t)
            gbps = statistics.median([args.bytes / t / 1e9 for t in times])
            ok_all &= verified
            rows.append({"format": fmt, "cache": cache, "idiom": idiom, "bytes": args.bytes,
                         "gbps": gbps, "reps": len(times), "verified": verified})
            print(f"{fmt:<12} {cache:<5} {idiom:<34} {gbps:7.2f} GB/s{'' if verified else '  WRONG'}", flush=True)

    run("npy", "np.load + torch .cuda()", lambda: torch.from_numpy(np.load(npy)).cuda(),
        lambda t: same(t, want), npy, min(args.reps, 3))
    run("npy", "gpufeed.load", lambda: gpufeed.load(npy, dev),
        lambda d: same(torch.from_dlpack(d), want), npy, args.reps)
    if st is not None:
        run("safetensors", "safetensors.torch.load_file(cuda)", lambda: st.load_file(sft, device="cuda"),
            lambda d: all(same(d[k], want_parts[k]) for k in tensors), sft, min(args.reps, 3))
    run("safetensors", "gpufeed.load_safetensors", lambda: gpufeed.load_safetensors(sft, dev),
        lambda d: all(same(torch.from_dlpack(d[k]), want_parts[k]) for k in tensors), sft, args.reps)

    evict(npy)
    dd = subprocess.run(["dd", f"if={npy}", "of=/dev/null", "bs=16M", "iflag=direct"],
                        capture_output=True, text=True)
    disk = None
    for line in dd.stderr.splitlines():
        if "copied" in line:
            fields = line.split(",")
            secs = float(fields[-2].split()[0])
            disk = os.path.getsize(npy) / secs / 1e9
    print(f"disk, dd iflag=direct 16M: {disk} GB/s")
    g = {(r["format"], r["cache"], r["idiom"]): r["gbps"] for r in rows}
    ratio = lambda f, c, ours, peer: g.get((f, c, ours), float("nan")) / g.get((f, c, peer), float("nan"))
    print(f"npy warm: gpufeed.load {ratio('npy', 'warm', 'gpufeed.load', 'np.load + torch .cuda()'):.2f}x np.load + .cuda()")
    if st is not None:
        print(f"safetensors warm: {ratio('safetensors', 'warm', 'gpufeed.load_safetensors', 'safetensors.torch.load_file(cuda)'):.2f}x load_file")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    with open(args.out, "w") as f:
        json.dump({"gpu": smi, "rows": rows, "disk_direct_gbps": disk,
                   "safetensors": getattr(st, "__name__", None)}, f, indent=1)
    for path in [npy, sft]:
        os.remove(path)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
