#!/usr/bin/env python3
"""PyTorch peer of `host multi-gpu`'s copies: what a PyTorch user gets on the
same machine, in the same call, for the same bytes.

Workload (as ours): per GPU a pinned host tensor and a device tensor of
--bytes (default 256 MiB) for each direction, each direction on its own
stream (torch.cuda.Stream per GPU and direction); every copy is
dst.copy_(src, non_blocking=True). Modes: H2D alone, D2H alone, both at once;
each GPU alone, then all GPUs at once. A round issues every copy of the mode,
then synchronizes every stream; GB/s = bytes moved / median round time
(time.perf_counter), over --reps rounds after one warm-up.
Peer copies: dst.copy_(src) between device tensors of two GPUs (PyTorch
enables peer access where the driver allows it), median of --reps.
Every copy's bytes are checked once after the timed rounds (random bytes,
never all zero).

Output (--out PATH): {"peer": "pytorch", "gpus", "torch", "cuda", "bytes",
"reps", "solo": [{"h2d", "d2h", "both"} GB/s per GPU], "all": {...},
"peer_copies": [{"from", "to", "gbps", "can_access_peer"}], "verified"}.
Exit status 1 if a check fails, 2 without a GPU.
"""
import argparse
import json
import statistics
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    k = torch.cuda.device_count()
    n = a.bytes
    g = torch.Generator().manual_seed(7)
    rigs = []
    for d in range(k):
        dev = torch.device("cuda", d)
        src = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g).pin_memory()
        rigs.append({
            "up": torch.cuda.Stream(dev), "down": torch.cuda.Stream(dev),
            "hsrc": src, "dst": torch.empty(n, dtype=torch.uint8, device=dev),
            "dsrc": torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g).to(dev),
            "hdst": torch.empty(n, dtype=torch.uint8).pin_memory(),
        })

    def round_s(which, h2d, d2h):
        t = time.perf_counter()
        for r in which:
            x = rigs[r]
            if h2d:
                with torch.cuda.stream(x["up"]):
                    x["dst"].copy_(x["hsrc"], non_blocking=True)
            if d2h:
                with torch.cuda.stream(x["down"]):
                    x["hdst"].copy_(x["dsrc"], non_blocking=True)
        for r in which:
            rigs[r]["up"].synchronize()
            rigs[r]["down"].synchronize()
        return time.perf_counter() - t

    def gbps(which):
        out = {}
        for name, h2d, d2h in [("h2d", True, False), ("d2h", False, True), ("both", True, True)]:
            times = [round_s(which, h2d, d2h) for _ in range(a.reps + 1)][1:]
            moved = n * len(which) * (h2d + d2h)
            out[name] = moved / statistics.median(times) / 1e9
        return out

    solo = [gbps([d]) for d in range(k)]
    allg = gbps(list(range(k))) if k > 1 else None
    verified = all(
        torch.equal(x["dst"].cpu(), x["hsrc"]) and torch.equal(x["hdst"], x["dsrc"].cpu())
        for x in rigs)

    peers = []
    for i in range(k):
        for j in range(k):
            if i == j:
                continue
            src = rigs[i]["dsrc"]
            dst = torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", j))
            times = []
            for _ in range(a.reps + 1):
                torch.cuda.synchronize(i)
                torch.cuda.synchronize(j)
                t = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(i)
                torch.cuda.synchronize(j)
                times.append(time.perf_counter() - t)
            verified = verified and torch.equal(dst.cpu(), src.cpu())
            peers.append({"from": i, "to": j, "gbps": n / statistics.median(times[1:]) / 1e9,
                          "can_access_peer": torch.cuda.can_device_access_peer(i, j)})

    res = {"peer": "pytorch", "gpus": [torch.cuda.get_device_name(d) for d in range(k)],
           "torch": torch.__version__, "cuda": torch.version.cuda, "bytes": n, "reps": a.reps,
           "solo": solo, "all": allg, "peer_copies": peers, "verified": verified}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    for d, s in enumerate(solo):
        print(f"pytorch GPU {d} alone: H2D {s['h2d']:.1f}  D2H {s['d2h']:.1f}  both {s['both']:.1f} GB/s")
    if allg:
        print(f"pytorch all {k} at once: H2D {allg['h2d']:.1f}  D2H {allg['d2h']:.1f}  both {allg['both']:.1f} GB/s")
    for p in peers:
        print(f"pytorch peer copy {p['from']} -> {p['to']}: {p['gbps']:.1f} GB/s "
              f"(can access peer: {p['can_access_peer']})")
    print("verified" if verified else "MISMATCH")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
