#!/usr/bin/env python3
"""Compare the pipelined benchmark results of several peers (stdlib only).

Reads any number of result files in the peers' schema:

  {"peer": ..., "gpu": ..., "driver": ...,
   "results": [{"n", "kernel", "k", "mode", "chunks", "streams",
                "median_ms", "min_ms", "reps", "verified", "best"}, ...]}

Files with the same "peer" are merged (e.g. a scale run and an intensity run).
For each (n, kernel, k) it takes each peer's best pipelined result: the
lowest median among its verified results (recomputed here, not taken from the
"best" flags; if none is verified, the lowest median overall, flagged as not
verified), and its time relative to ours: ratio = peer_ms / ours_ms, so a
ratio above 1 means ours is faster. The sync-mode median is carried along for
reference.

Usage:
  python3 compare.py host-rust.json cuda-cpp.json pytorch.json --out comparison.json
Exit status: 0; 1 if any compared result is not verified; 2 on bad input.
"""

import argparse
import json
import sys

REQUIRED_TOP = ("peer", "gpu", "results")
REQUIRED_RESULT = ("n", "kernel", "k", "mode", "chunks", "streams", "median_ms", "min_ms",
                   "reps", "verified")


class InputError(Exception):
    pass


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: {e}")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: top level is not an object")
    for key in REQUIRED_TOP:
        if key not in doc:
            raise InputError(f"{path}: missing key {key!r}")
    if not isinstance(doc["results"], list):
        raise InputError(f"{path}: 'results' is not a list")
    for i, r in enumerate(doc["results"]):
        missing = [key for key in REQUIRED_RESULT if key not in r]
        if missing:
            raise InputError(f"{path}: results[{i}] lacks {', '.join(missing)}")
        if r["mode"] not in ("pipelined", "sync"):
            raise InputError(f"{path}: results[{i}] has mode {r['mode']!r}")
    return doc


def best_of(results):
    """Lowest median among the verified results, or among all if none is."""
    if not results:
        return None
    pool = [r for r in results if r["verified"] is True] or results
    return min(pool, key=lambda r: r["median_ms"])


def key_of(r):
    return (r["n"], r["kernel"], r["k"])


def sort_key(key):
    n, kernel, k = key
    return (kernel, -1 if k is None else k, n)


def build(docs, ours):
    peers = {}  # name -> {"gpu", "driver", "files", "results"}
    for path, doc in docs:
        p = peers.setdefault(doc["peer"], {"gpu": doc["gpu"], "driver": doc.get("driver"),
                                           "files": [], "results": []})
        if p["gpu"] != doc["gpu"]:
            print(f"warning: peer {doc['peer']!r}: {path} is from GPU {doc['gpu']!r}, "
                  f"an earlier file from {p['gpu']!r}", file=sys.stderr)
        p["files"].append(path)
        p["results"].extend(doc["results"])

    gpus = {p["gpu"] for p in peers.values()}
    if len(gpus) > 1:
        print(f"warning: the peers ran on different GPUs: {sorted(gpus)}; "
              f"the ratios compare different machines", file=sys.stderr)
    if ours not in peers:
        print(f"warning: no results from {ours!r}: ratios are null", file=sys.stderr)

    order = ([ours] if ours in peers else []) + sorted(x for x in peers if x != ours)
    keys = sorted({key_of(r) for p in peers.values() for r in p["results"]
                   if r["mode"] == "pipelined"}, key=sort_key)

    rows = []
    for key in keys:
        entries = {}
        for name in order:
            res = peers[name]["results"]
            pipe = best_of([r for r in res if r["mode"] == "pipelined" and key_of(r) == key])
            sync = best_of([r for r in res if r["mode"] == "sync" and key_of(r) == key])
            if pipe is None:
                continue
            entries[name] = {
                "median_ms": pipe["median_ms"], "min_ms": pipe["min_ms"],
                "chunks": pipe["chunks"], "streams": pipe["streams"], "reps": pipe["reps"],
                "layout": pipe.get("layout", "round-robin"),
                "verified": pipe["verified"] is True,
                "sync_median_ms": None if sync is None else sync["median_ms"],
                "ratio_vs_ours": None,
            }
        base = entries.get(ours)
        for e in entries.values():
            if base is not None and base["median_ms"] > 0:
                e["ratio_vs_ours"] = round(e["median_ms"] / base["median_ms"], 4)
        n, kernel, k = key
        rows.append({"n": n, "kernel": kernel, "k": k, "peers": entries})

    meta = {name: {"gpu": peers[name]["gpu"], "driver": peers[name]["driver"],
                   "files": peers[name]["files"]} for name in order}
    return order, rows, meta


def print_table(order, rows, ours):
    cols = [("n", 11), ("kernel", 9), ("k", 5)]
    head = "  ".join(f"{title:>{w}}" if title != "kernel" else f"{title:<{w}}"
                     for title, w in cols)
    for name in order:
        head += f"  | {name + ' ms':>12} {'cfg':>6} {'x ours':>7} {'sync ms':>9}"
    print(f"best pipelined median per peer; 'x ours' = peer_ms / {ours}_ms "
          f"(> 1: {ours} is faster); cfg = chunks x streams (E: one stream per engine)")
    print(head)
    print("-" * len(head))
    unverified = False
    for row in rows:
        k = "-" if row["k"] is None else str(row["k"])
        line = f"{row['n']:>11}  {row['kernel']:<9}  {k:>5}"
        for name in order:
            e = row["peers"].get(name)
            if e is None:
                line += f"  | {'-':>12} {'':>6} {'':>7} {'':>9}"
                continue
            mark = "" if e["verified"] else "!"
            unverified |= not e["verified"]
            cfg = f"{e['chunks']}x{e['streams']}" + ("E" if e.get("layout") == "engines" else "")
            ratio = "-" if e["ratio_vs_ours"] is None else f"{e['ratio_vs_ours']:.2f}"
            sync = "-" if e["sync_median_ms"] is None else f"{e['sync_median_ms']:.3f}"
            line += f"  | {e['median_ms']:>11.3f}{mark or ' '} {cfg:>6} {ratio:>7} {sync:>9}"
        print(line)
    if unverified:
        print("! = that peer's result failed verification")
    return unverified


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("files", nargs="+", metavar="RESULTS.json")
    ap.add_argument("--ours", default="host-rust", help="peer name the ratios are relative to")
    ap.add_argument("--out", metavar="PATH", help="write the comparison rows as JSON here")
    args = ap.parse_args(argv)

    try:
        docs = [(path, load(path)) for path in args.files]
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    order, rows, meta = build(docs, args.ours)
    for name in order:
        m = meta[name]
        print(f"{name}: gpu {m['gpu']!r}, driver {m['driver']}, from {', '.join(m['files'])}")
    print()
    unverified = print_table(order, rows, args.ours)

    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ours": args.ours, "peers": meta, "rows": rows}, f, indent=1)
            f.write("\n")
        print(f"\nwrote {args.out}")
    return 1 if unverified else 0


if __name__ == "__main__":
    sys.exit(main())
