#!/usr/bin/env python3
"""Files to the GPU: gpufeed against what users do today and against
KvikIO, in one process, one run, on the same files (4 GiB by default).

  * raw:         gpufeed.read_file  vs  KvikIO CuFile.read into a torch
                 tensor at 1, 8 and 16 threads (best reported), and the
                 staged copy of the same bytes from memory (to_device: the
                 link's figure)
  * npy:         gpufeed.load  vs  np.load + torch.from_numpy(a).cuda()
  * torch:       torch.load(map_location="cuda") of the same tensors
  * safetensors: gpufeed.load_safetensors  vs
                 safetensors.torch.load_file(device="cuda") (8 tensors)
--formats picks which of the four run (`--formats raw --bytes 4294967296`:
one 4 GiB file, the raw rows alone). Warm: the file in the page cache (read once before). Cold: its pages
evicted first with posix_fadvise(POSIX_FADV_DONTNEED) (after os.sync; the
eviction checked once by timing a plain read of 256 MiB right after it),
--cold-reps runs. The disk's own rate in the same run: dd iflag=direct
bs=16M of the same file (before the cold reads and at the end: the ratio
uses their mean). gpufeed's cold reads run with the automatic choice
(direct=None: buffered); the mode it took (gpufeed.file_read_mode right
after the eviction) is in the row's "mode"; gpufeed.read_file also runs
cold with direct=False and direct=True for comparison.

Timing: wall time of the call plus torch.cuda.synchronize(); medians.
Every result checked against the data on the GPU (torch.equal over the raw
words), and for gpufeed once per configuration also copied back to host
memory and compared there with the generated array.

Output (--out): {"gpu", "rows": [{"format", "cache", "idiom", "bytes",
"gbps", "runs", "verified", "mode"}], "disk_direct_gbps", "disk_direct_runs", "kvikio", "gds",
"evict_check", "ratios"}; exit 1 if a check failed. Budget: < 150 s on the
H200 machine at 4 GiB (cold runs capped).
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

MiB = 1 << 20


def evict(path):
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read_gbps(path, nbytes):
    """A plain buffered read of the first `nbytes` of the file."""
    buf = bytearray(16 * MiB)
    t0 = time.perf_counter()
    done = 0
    with open(path, "rb", buffering=0) as f:
        while done < nbytes:
            n = f.readinto(buf)
            if not n:
                break
            done += n
    return done / (time.perf_counter() - t0) / 1e9


def write_safetensors(path, tensors):
    header, pos = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "I32", "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(memoryview(np.ascontiguousarray(t)).cast("B"))


def kvikio_threads(kvikio, n):
    """Sets KvikIO's thread pool size (its API changed over releases)."""
    import importlib

    d = importlib.import_module("kvikio.defaults")  # a submodule: not imported by `import kvikio`
    if hasattr(d, "set"):
        try:
            d.set({"num_threads": n})
            return
        except TypeError:
            d.set("num_threads", n)
            return
    d.num_threads_reset(n)


def dd_direct_gbps(path):
    dd = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                        capture_output=True, text=True)
    for line in dd.stderr.splitlines():
        if "copied" in line:
            secs = float(line.split(",")[-2].split()[0])
            return os.path.getsize(path) / secs / 1e9
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=4 << 30)
    p.add_argument("--reps", type=int, default=5, help="warm runs of the fast idioms")
    p.add_argument("--slow-reps", type=int, default=2, help="warm runs of np.load / torch.load / load_file")
    p.add_argument("--cold-reps", type=int, default=1)
    p.add_argument("--formats", default="raw,npy,torch,safetensors",
                   help="comma-separated: which of raw, npy, torch, safetensors to run (raw alone writes one file)")
    p.add_argument("--dir", default=os.environ.get("FILES_DIR", "/tmp/gpufeed-files"))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    formats = set(args.formats.split(","))
    t_start = time.perf_counter()
    import torch

    if not torch.cuda.is_available():
        return 2
    import gpufeed

    try:
        import safetensors.torch as st
    except ImportError:
        st = None
    try:
        import kvikio
    except Exception as e:  # not installed, or its libraries missing
        print(f"kvikio unavailable: {e!r}")
        kvikio = None
    dev = gpufeed.Device("cuda", 0)
    gds = gpufeed.gds_status(dev)
    print(f"gpufeed GPUDirect Storage probe: {gds['message']}", flush=True)
    os.makedirs(args.dir, exist_ok=True)
    n = args.bytes // 4
    nbytes = 4 * n
    parts = 8
    # The data: random words made on the GPU (fast), one host copy.
    want = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    a = want.cpu().numpy()
    back = np.empty_like(a)
    back.view(np.uint8)[::4096] = 0xA5  # touched: to_host into it is not page faults
    npy = os.path.join(args.dir, "a.npy")
    np.save(npy, a)
    with open(npy, "rb") as f:
        major = f.read(8)[6]
        hlen = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))[0]
    data_offset = (10 if major == 1 else 12) + hlen
    per = n // parts
    names = [f"layer{i}.weight" for i in range(parts)]
    views = {k: a[i * per:(i + 1) * per].reshape(-1, 1024) if per % 1024 == 0 else a[i * per:(i + 1) * per]
             for i, k in enumerate(names)}
    sft = os.path.join(args.dir, "a.safetensors")
    if "safetensors" in formats:
        write_safetensors(sft, views)
    pt = os.path.join(args.dir, "a.pt")
    # Separate tensors, as a model's state dict holds them (views of one array would be saved
    # as one storage).
    if "torch" in formats:
        torch.save({k: torch.from_numpy(v).clone() for k, v in views.items()}, pt)
    want_parts = {k: want[i * per:(i + 1) * per] for i, k in enumerate(names)}
    st_bytes = per * parts * 4
    os.sync()
    torch.cuda.synchronize()
    print(f"files written in {time.perf_counter() - t_start:.1f} s", flush=True)
    rows, ok_all = [], True

    def same(x, y):
        return bool(torch.equal(x.reshape(-1).view(torch.int32), y.reshape(-1).view(torch.int32)))

    def host_check_one(d):
        gpufeed.to_host(d, out=back)
        return bool(np.array_equal(back, a))

    def host_check_parts(d):
        ok = True
        for i, k in enumerate(names):
            gpufeed.to_host(d[k], out=back[i * per:(i + 1) * per].reshape(d[k].shape))
            ok &= bool(np.array_equal(back[i * per:(i + 1) * per], a[i * per:(i + 1) * per]))
        return ok

    def run(fmt, idiom, call, check, path, size, warm_reps, caches=("warm", "cold"), host_check=None,
            mode=None):
        nonlocal ok_all
        for cache in caches:
            times, verified, modes = [], True, []
            reps = warm_reps + 1 if cache == "warm" else args.cold_reps
            for r in range(reps):
                if cache == "cold":
                    evict(path)
                if mode is not None:
                    modes.append(mode())  # what gpufeed's automatic choice takes now (reads nothing)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = call()
                torch.cuda.synchronize()
                t = time.perf_counter() - t0
                verified &= check(res)
                if host_check is not None and r == reps - 1:
                    verified &= host_check(res)
                del res
                if cache == "cold" or r > 0:
                    times.append(t)
            gbps = statistics.median([size / t / 1e9 for t in times])
            ok_all &= verified
            chosen = ",".join(sorted(set(modes))) or None
            rows.append({"format": fmt, "cache": cache, "idiom": idiom, "bytes": size, "gbps": gbps,
                         "runs": [round(size / t / 1e9, 3) for t in times], "verified": verified,
                         "mode": chosen})
            print(f"{fmt:<12} {cache:<5} {idiom:<40} {gbps:7.2f} GB/s{'' if verified else '  WRONG'}"
                  f"{f'  ({chosen})' if chosen else ''}   [{time.perf_counter() - t_start:.0f} s]", flush=True)

    # The eviction works: a plain read right after it is at the disk's pace.
    plain_read_gbps(npy, 256 * MiB)
    warm_plain = plain_read_gbps(npy, 256 * MiB)
    evict(npy)
    cold_plain = plain_read_gbps(npy, 256 * MiB)
    evict_check = {"plain_read_256MiB_warm_gbps": warm_plain, "plain_read_256MiB_after_evict_gbps": cold_plain,
                   "evicts": cold_plain < warm_plain / 2}
    print(f"eviction check: plain read {warm_plain:.2f} GB/s warm, {cold_plain:.2f} GB/s after DONTNEED", flush=True)

    disk_runs = []
    evict(npy)
    disk_runs.append(dd_direct_gbps(npy))
    print(f"disk, dd iflag=direct bs=16M: {disk_runs[-1]} GB/s", flush=True)

    def npy_mode():
        return gpufeed.file_read_mode(npy, device=dev)

    # raw: the same file's data region, ours against KvikIO.
    run("raw", "gpufeed.read_file", lambda: gpufeed.read_file(npy, "int32", shape=(n,), offset=data_offset, device=dev),
        lambda d: same(torch.from_dlpack(d), want), npy, nbytes, args.reps, host_check=host_check_one, mode=npy_mode)
    for direct, name in [(False, "buffered"), (True, "O_DIRECT")]:
        run("raw", f"gpufeed.read_file (direct={direct}: {name})",
            lambda direct=direct: gpufeed.read_file(npy, "int32", shape=(n,), offset=data_offset, device=dev,
                                                    direct=direct),
            lambda d: same(torch.from_dlpack(d), want), npy, nbytes, args.reps, caches=("cold",),
            host_check=host_check_one)
    if kvikio is not None:
        dst = torch.empty(n, dtype=torch.int32, device="cuda")
        best = None
        for threads in (1, 8, 16):
            kvikio_threads(kvikio, threads)

            def kv_read():
                dst.fill_(0)
                with kvikio.CuFile(npy, "r") as f:
                    got = f.read(dst, nbytes, data_offset)
                assert got == nbytes, got
                return dst
            run("raw", f"kvikio CuFile.read ({threads} threads)", kv_read, lambda d: same(d, want), npy, nbytes,
                args.reps, caches=("warm",))
            if best is None or rows[-1]["gbps"] > best[1]:
                best = (threads, rows[-1]["gbps"])
        kvikio_threads(kvikio, best[0])
        run("raw", f"kvikio CuFile.read ({best[0]} threads)", kv_read, lambda d: same(d, want), npy, nbytes,
            args.reps, caches=("cold",))
        del dst
    run("raw", "gpufeed.to_device (same bytes from memory)", lambda: gpufeed.to_device(a, dev),
        lambda d: same(torch.from_dlpack(d), want), npy, nbytes, args.reps, caches=("warm",))

    # npy
    if "npy" in formats:
        run("npy", "np.load + torch .cuda()", lambda: torch.from_numpy(np.load(npy)).cuda(),
            lambda t: same(t, want), npy, nbytes, args.slow_reps)
        run("npy", "gpufeed.load", lambda: gpufeed.load(npy, dev),
            lambda d: same(torch.from_dlpack(d), want), npy, nbytes, args.reps, host_check=host_check_one,
            mode=npy_mode)

    # torch.load of the same tensors
    if "torch" in formats:
        run("torch", "torch.load(map_location=cuda)", lambda: torch.load(pt, map_location="cuda"),
            lambda d: all(same(d[k], want_parts[k]) for k in names), pt, st_bytes, args.slow_reps)

    # safetensors
    if "safetensors" in formats:
        if st is not None:
            run("safetensors", "safetensors.torch.load_file(cuda)", lambda: st.load_file(sft, device="cuda"),
                lambda d: all(same(d[k], want_parts[k]) for k in names), sft, st_bytes, args.slow_reps)
        run("safetensors", "gpufeed.load_safetensors", lambda: gpufeed.load_safetensors(sft, dev),
            lambda d: all(same(torch.from_dlpack(d[k]), want_parts[k]) for k in names), sft, st_bytes, args.reps,
            host_check=host_check_parts, mode=lambda: gpufeed.file_read_mode(sft, device=dev))

    evict(npy)
    disk_runs.append(dd_direct_gbps(npy))
    print(f"disk, dd iflag=direct bs=16M: {disk_runs[-1]} GB/s", flush=True)
    got_disk = [d for d in disk_runs if d]
    disk = statistics.mean(got_disk) if got_disk else None
    g = {(r["format"], r["cache"], r["idiom"]): r["gbps"] for r in rows}
    nan = float("nan")
    kv_warm = max([r["gbps"] for r in rows if r["idiom"].startswith("kvikio") and r["cache"] == "warm"] or [nan])
    ratios = {
        "raw warm: gpufeed.read_file / kvikio best": g.get(("raw", "warm", "gpufeed.read_file"), nan) / kv_warm,
        "raw warm: gpufeed.read_file / gpufeed.to_device from memory":
            g.get(("raw", "warm", "gpufeed.read_file"), nan)
            / g.get(("raw", "warm", "gpufeed.to_device (same bytes from memory)"), nan),
        "raw cold: gpufeed.read_file (auto) / dd iflag=direct": g.get(("raw", "cold", "gpufeed.read_file"), nan)
            / (disk or nan),
        "raw cold: gpufeed.read_file (direct=False) / dd iflag=direct":
            g.get(("raw", "cold", "gpufeed.read_file (direct=False: buffered)"), nan) / (disk or nan),
        "raw cold: gpufeed.read_file (direct=True) / dd iflag=direct":
            g.get(("raw", "cold", "gpufeed.read_file (direct=True: O_DIRECT)"), nan) / (disk or nan),
        "safetensors cold: gpufeed / dd iflag=direct":
            g.get(("safetensors", "cold", "gpufeed.load_safetensors"), nan) / (disk or nan),
        "safetensors warm: gpufeed / load_file(cuda)":
            g.get(("safetensors", "warm", "gpufeed.load_safetensors"), nan)
            / g.get(("safetensors", "warm", "safetensors.torch.load_file(cuda)"), nan),
        "npy warm: gpufeed.load / np.load + .cuda()":
            g.get(("npy", "warm", "gpufeed.load"), nan) / g.get(("npy", "warm", "np.load + torch .cuda()"), nan),
        "torch warm: gpufeed.load_safetensors / torch.load(cuda)":
            g.get(("safetensors", "warm", "gpufeed.load_safetensors"), nan)
            / g.get(("torch", "warm", "torch.load(map_location=cuda)"), nan),
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    with open(args.out, "w") as f:
        modes = {f"{r['format']} {r['cache']} {r['idiom']}": r["mode"] for r in rows if r["mode"]}
        print(f"gpufeed's automatic choice: {modes}")
        json.dump({"gpu": smi, "bytes": nbytes, "formats": sorted(formats), "rows": rows, "disk_direct_gbps": disk, "disk_direct_runs": disk_runs,
                   "modes": modes, "ratios": ratios,
                   "kvikio": getattr(kvikio, "__version__", None), "gds": gds, "evict_check": evict_check,
                   "safetensors": getattr(st, "__name__", None), "seconds": time.perf_counter() - t_start},
                  f, indent=1)
    for path in [npy, sft, pt]:
        if os.path.exists(path):
            os.remove(path)
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
