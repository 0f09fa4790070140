#!/usr/bin/env python3
"""Python peer of `host staging`: ordinary NumPy arrays to the GPU and back,
the way Python users write it today, beside gpufeed.to_device / to_host, in
one process, one run.

Host to device (a pageable float32 NumPy array `a`):
  * torch_cuda:          torch.from_numpy(a).cuda()
  * torch_copy:          dev.copy_(torch.from_numpy(a)); synchronize
  * cupy_asarray:        cupy.asarray(a); synchronize
  * torch_pin_then_copy: torch.from_numpy(a).pin_memory().cuda(non_blocking=True); synchronize
  * torch_pinned:        a pinned tensor (filled beforehand) .cuda(non_blocking=True); synchronize
                         (the link's own speed: the bound)
  * gpufeed_to_device:   gpufeed.to_device(a)
Device to host, into an existing pageable array `out` unless said:
  * torch_copy_into:     torch.from_numpy(out).copy_(dev)
  * torch_cpu_numpy:     dev.cpu().numpy() (a new array)
  * cupy_get_into:       dev.get(out=out)
  * torch_pinned:        pinned.copy_(dev, non_blocking=True); synchronize (the bound)
  * gpufeed_to_host:     gpufeed.to_host(d, out=out)

Timing: the idioms of one size and direction take turns run by run, each
run's order shuffled (seeded), so the machine's drift falls on all alike;
host wall time (time.perf_counter) around each call, including the
synchronize, 10 ms after the run's preparation (so the checker's own
threads are idle; run it with OMP_WAIT_POLICY=PASSIVE so PyTorch's OpenMP
threads sleep instead of spinning on the cores the copies use); one untimed warm-up, then --reps runs (--slow-reps for the
idioms below 20 GB/s at the largest sizes); GB/s = bytes / median.
Checks: gpufeed's every run (sources alternate between `a` and `a ^ mask`,
which differ in every element; host destinations filled with NaN first),
compared element by element on the CPU (torch.equal over the raw words);
the peers' first and last run.

Output (--out): {"gpu", "torch", "numpy", "gpufeed", "staging", "complete",
"rows": [{"bytes", "dir", "idiom", "gbps", "gbps_min", "gbps_max", "reps",
"verified"}]}, written after every size and direction, so a run cut short (a
time limit) keeps the rows it finished ("complete": false until the last);
exit 1 if a check failed, 2 without a GPU.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=f"{1 << 30},{4 << 30}")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--slow-reps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 2
    try:
        import cupy
    except ImportError:
        cupy = None
    import gpufeed

    dev0 = gpufeed.Device("cuda", 0)
    torch.set_num_threads(16)
    rows = []
    ok_all = True
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()

    def write(complete):
        """The rows so far to --out (replaced whole: never half a file)."""
        result = {
            "gpu": smi,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "gpufeed": gpufeed.__version__,
            "staging": gpufeed.staging_stats(dev0),
            "complete": complete,
            "rows": rows,
        }
        with open(args.out + ".partial", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".partial", args.out)

    def same(x, y):
        tx = torch.from_numpy(np.ascontiguousarray(x).view(np.int32).reshape(-1))
        ty = torch.from_numpy(np.ascontiguousarray(y).view(np.int32).reshape(-1))
        return bool(torch.equal(tx, ty))

    for nbytes in [int(s) for s in args.sizes.split(",")]:
        n = nbytes // 4
        rng = np.random.default_rng(nbytes)
        a = rng.integers(0, 2**31, size=n, dtype=np.int32).view(np.float32)
        b = (a.view(np.int32) ^ np.int32(0x5A5A5A5A)).view(np.float32)
        srcs = [a, b]
        out = np.empty_like(a)
        out_t = torch.from_numpy(out)
        dev = torch.empty(n, dtype=torch.float32, device="cuda")
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
        pinned.copy_(torch.from_numpy(a))
        # The sources on the device (through pinned memory), for checks there.
        src_dev = [pinned.cuda()]
        pinned.copy_(torch.from_numpy(b))
        src_dev.append(pinned.cuda())
        pinned.copy_(torch.from_numpy(a))
        torch.cuda.synchronize()

        def h2d_check(result_dev, r):
            t = torch.as_tensor(result_dev, device="cuda")
            return bool(torch.equal(t.view(torch.int32), src_dev[r % 2].view(torch.int32)))

        entries = []

        def run(idiom, direction, reps, call, check, prepare=None):
            entries.append((idiom, direction, reps, call, check, prepare))

        def play():
            """The idioms of one direction in turn, run by run, each run's
            order shuffled (seeded), as `host staging` does: the machine's
            drift falls on every idiom alike."""
            nonlocal ok_all
            times = [[] for _ in entries]
            verified = [True] * len(entries)
            order = list(range(len(entries)))
            shuffle = random.Random(nbytes ^ len(rows))
            for r in range(max(e[2] for e in entries) + 1):
                shuffle.shuffle(order)
                for i in order:
                    idiom, direction, reps, call, check, prepare = entries[i]
                    if r > reps:
                        continue
                    if prepare:
                        prepare(r)
                    torch.cuda.synchronize()
                    time.sleep(0.01)
                    t0 = time.perf_counter()
                    res = call(r)
                    t = time.perf_counter() - t0
                    if r in (0, 1, reps) or idiom.startswith("gpufeed"):
                        verified[i] &= check(r, res)
                    if r > 0:
                        times[i].append(t)
                    del res
            for i, (idiom, direction, reps, *_rest) in enumerate(entries):
                gbps = [nbytes / t / 1e9 for t in times[i]]
                row = {
                    "bytes": nbytes,
                    "dir": direction,
                    "idiom": idiom,
                    "gbps": statistics.median(gbps),
                    "gbps_min": min(gbps),
                    "gbps_max": max(gbps),
                    "reps": reps,
                    "verified": verified[i],
                }
                ok_all &= verified[i]
                rows.append(row)
                print(f"{nbytes >> 20:>6} MiB {direction} {idiom:<22} {row['gbps']:7.2f} GB/s "
                      f"(min {row['gbps_min']:.2f}, max {row['gbps_max']:.2f}){'' if verified[i] else '  WRONG'}",
                      flush=True)
            entries.clear()
            write(False)

        slow = args.slow_reps if nbytes >= (1 << 30) else args.reps
        fast = args.reps

        def sync():
            torch.cuda.synchronize()

        # Host to device.
        def torch_cuda(r):
            x = torch.from_numpy(srcs[r % 2]).cuda()
            sync()
            return x

        run("torch_cuda", "h2d", slow, torch_cuda, lambda r, x: h2d_check(x, r))

        def torch_copy(r):
            dev.copy_(torch.from_numpy(srcs[r % 2]))
            sync()
            return dev

        run("torch_copy", "h2d", slow, torch_copy, lambda r, x: h2d_check(x, r))

        if cupy is not None:
            def cupy_asarray(r):
                x = cupy.asarray(srcs[r % 2])
                cupy.cuda.runtime.deviceSynchronize()
                return x

            run("cupy_asarray", "h2d", slow, cupy_asarray, lambda r, x: h2d_check(x, r))

        def pin_then_copy(r):
            x = torch.from_numpy(srcs[r % 2]).pin_memory().cuda(non_blocking=True)
            sync()
            return x

        run("torch_pin_then_copy", "h2d", slow, pin_then_copy, lambda r, x: h2d_check(x, r))

        def pinned_cuda(r):
            x = pinned.cuda(non_blocking=True)
            sync()
            return x

        run("torch_pinned", "h2d", fast, pinned_cuda, lambda r, x: h2d_check(x, 0))

        def to_device(r):
            return gpufeed.to_device(srcs[r % 2], dev0)

        run("gpufeed_to_device", "h2d", fast, to_device,
            lambda r, d: h2d_check(torch.from_dlpack(d), r))
        play()

        # Device to host.
        def load(r):
            dev.copy_(torch.from_numpy(srcs[r % 2]))
            out_t.fill_(float("nan"))
            sync()

        def copy_into(r):
            out_t.copy_(dev)
            return out

        run("torch_copy_into", "d2h", slow, copy_into, lambda r, o: same(o, srcs[r % 2]), load)

        def cpu_numpy(r):
            return dev.cpu().numpy()

        run("torch_cpu_numpy", "d2h", slow, cpu_numpy, lambda r, o: same(o, srcs[r % 2]), load)

        if cupy is not None:
            c = cupy.asarray(dev)

            def get_into(r):
                c.get(out=out)
                return out

            run("cupy_get_into", "d2h", slow, get_into, lambda r, o: same(o, srcs[r % 2]), load)

        def pinned_back(r):
            pinned.copy_(dev, non_blocking=True)
            sync()
            return pinned

        run("torch_pinned", "d2h", fast, pinned_back, lambda r, o: same(o.numpy(), srcs[r % 2]), load)

        d_ours = [gpufeed.to_device(a, dev0), gpufeed.to_device(b, dev0)]

        def prep_ours(r):
            out_t.fill_(float("nan"))

        def to_host(r):
            return gpufeed.to_host(d_ours[r % 2], out=out)

        run("gpufeed_to_host", "d2h", fast, to_host, lambda r, o: same(o, srcs[r % 2]), prep_ours)
        play()
        c = None
        del d_ours, dev, pinned, src_dev, out_t, out, a, b, srcs
        torch.cuda.empty_cache()

    write(True)
    # The ratios the targets are stated in.
    by = {(r["bytes"], r["dir"], r["idiom"]): r["gbps"] for r in rows}
    for nbytes in sorted({r["bytes"] for r in rows}):
        g = lambda d, i: by.get((nbytes, d, i), float("nan"))
        print(f"{nbytes >> 20} MiB: to_device {g('h2d', 'gpufeed_to_device') / g('h2d', 'torch_pinned'):.3f}x pinned, "
              f"{g('h2d', 'gpufeed_to_device') / g('h2d', 'torch_cuda'):.2f}x torch .cuda(); "
              f"to_host {g('d2h', 'gpufeed_to_host') / g('d2h', 'torch_pinned'):.3f}x pinned, "
              f"{g('d2h', 'gpufeed_to_host') / g('d2h', 'torch_copy_into'):.2f}x torch copy_ into")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
