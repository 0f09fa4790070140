#!/usr/bin/env python3
"""Compare our small-transfer results with PyTorch's (stdlib only).

Reads our small_transfers.json (`host small-transfers`, "peer": "host-rust")
and torch_small.py's JSON ("peer": "pytorch"), whose rows share one shape:
{"bytes", "direction", "mode", "in_flight", "ops_per_s", "gb_per_s",
"verified", ...}. For each direction and size it prints copies per second and
ours / PyTorch's (above 1: ours does more copies per second):
  one in flight:  run_sync_1, awaited_1, awaited_1_tokio (and raw_1)  vs  non_blocking_1
  64 in flight:   awaited_64, awaited_64_batch, awaited_64_one_job,
                  awaited_64_4_streams, awaited_64_copy_batch (and raw_64)  vs  non_blocking_64
then the issue's checks: awaited 1 MiB copies against the raw driver's
(one and 64 in flight), and whether ours is ahead of PyTorch at every size
with 64 in flight (awaited) and with one in flight (run_sync).

Usage:
  python3 compare_small.py out/small_transfers.json pytorch-small.json [--out comparison-small.json]
Exit status: 0; 1 if a compared row is not verified; 2 on bad input.
"""

import argparse
import json
import sys

OURS_1 = ("run_sync_1", "awaited_1", "awaited_1_tokio", "raw_1")
OURS_64 = ("awaited_64", "awaited_64_batch", "awaited_64_one_job", "awaited_64_4_streams",
           "awaited_64_copy_batch", "raw_64")
TORCH = {1: "non_blocking_1", 64: "non_blocking_64"}
REQUIRED = ("bytes", "direction", "mode", "in_flight", "ops_per_s", "verified")


class InputError(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: {e}")
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise InputError(f"{path}: no 'rows' list")
    for i, r in enumerate(doc["rows"]):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise InputError(f"{path}: rows[{i}] lacks {', '.join(missing)}")
    return doc


def index(doc):
    return {(r["direction"], r["bytes"], r["mode"]): r for r in doc["rows"]}


def size_name(b):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def rate(v):
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt_ratio(v):
    return "-" if v is None else f"{v:.2f}x"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("ours", help="small_transfers.json from `host small-transfers`")
    p.add_argument("torch", help="JSON from torch_small.py")
    p.add_argument("--out", metavar="PATH", default=None)
    args = p.parse_args(argv)
    try:
        ours_doc, torch_doc = load(args.ours), load(args.torch)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ours, theirs = index(ours_doc), index(torch_doc)
    our_gpu = (ours_doc.get("meta") or {}).get("device")
    their_gpu = torch_doc.get("gpu")
    print(f"ours: {our_gpu} ({args.ours}); pytorch: {their_gpu} ({args.torch})")
    if our_gpu and their_gpu and our_gpu != their_gpu:
        print(f"warning: different devices: {our_gpu!r} vs {their_gpu!r}", file=sys.stderr)
    print("copies per second; (x) = ours / PyTorch's, above 1: ours does more copies per second")

    out_rows, unverified = [], []
    keys = sorted({(d, b) for (d, b, _) in ours} & {(d, b) for (d, b, _) in theirs},
                  key=lambda k: (k[0] != "h2d", k[1]))
    for in_flight, modes in ((1, OURS_1), (64, OURS_64)):
        tmode = TORCH[in_flight]
        print(f"\n{in_flight} in flight: ours vs PyTorch {tmode}")
        print(f"{'dir':<4} {'size':>8} {'pytorch':>9}" + "".join(f" {m:>20}" for m in modes))
        for d, b in keys:
            t = theirs.get((d, b, tmode))
            t_ops = t and t.get("ops_per_s")
            if t is not None and t.get("verified") is False:
                unverified.append(f"pytorch {d} {b} {tmode}")
            cells = []
            for m in modes:
                r = ours.get((d, b, m))
                ops = r and r.get("ops_per_s")
                if r is not None and r.get("verified") is False:
                    unverified.append(f"ours {d} {b} {m}")
                x = ratio(ops, t_ops)
                cells.append(f"{rate(ops):>9} ({fmt_ratio(x):>6})")
                out_rows.append({"direction": d, "bytes": b, "in_flight": in_flight,
                                 "ours_mode": m, "ours_ops_per_s": ops,
                                 "pytorch_mode": tmode, "pytorch_ops_per_s": t_ops,
                                 "ratio_vs_pytorch": x})
            print(f"{d:<4} {size_name(b):>8} {rate(t_ops):>9}" + "".join(f" {c:>20}" for c in cells))

    def ops(d, b, m, table=ours):
        r = table.get((d, b, m))
        return r and r.get("ops_per_s")

    print("\nchecks (the small-transfer targets):")
    checks = []
    for d in ("h2d", "d2h"):
        for m, raw in (("awaited_1", "raw_1"), ("awaited_64", "raw_64")):
            x = ratio(ops(d, 1 << 20, m), ops(d, 1 << 20, raw))
            if x is not None:
                checks.append((f"{d} 1 MiB {m} / {raw} = {x:.3f} (>= 0.95)", x >= 0.95))
    for m, tmode in (("awaited_64", "non_blocking_64"), ("awaited_64_copy_batch", "non_blocking_64"),
                     ("run_sync_1", "non_blocking_1")):
        for d in ("h2d", "d2h"):
            xs = [(b, ratio(ops(dd, b, m), ops(dd, b, tmode, theirs)))
                  for dd, b in keys if dd == d]
            xs = [(b, x) for b, x in xs if x is not None]
            if xs:
                worst = min(xs, key=lambda bx: bx[1])
                checks.append((f"{d} {m} ahead of PyTorch {tmode} at every size "
                               f"(lowest {worst[1]:.2f}x at {size_name(worst[0])})",
                               all(x > 1 for _, x in xs)))
    for text, ok in checks:
        print(f"  [{'yes' if ok else 'NO '}] {text}")

    if args.out:
        doc = {"ours": args.ours, "pytorch": args.torch, "ours_device": our_gpu,
               "pytorch_gpu": their_gpu, "rows": out_rows,
               "checks": [{"check": t, "ok": ok} for t, ok in checks]}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    if unverified:
        print("error: unverified rows: " + ", ".join(unverified), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
