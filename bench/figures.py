#!/usr/bin/env python3
"""Side by side: the headline figures of two demonstration runs (compare.json,
kernels.json, bandwidth.json, peers/comparison.json), with the ratio new/old.

usage: bench/figures.py OLD_RUN_DIR NEW_RUN_DIR   (each holding demo/ and peers/)
"""
import json, os, sys


def load(d, f):
    p = os.path.join(d, f)
    return json.load(open(p)) if os.path.exists(p) else None


def rows(d):
    out = {}
    c = load(d, "demo/compare.json")
    for x in (c or {}).get("comparisons", []):
        k = x["kernel"]["kernel"] + ("" if "k" not in x["kernel"] else f"(k={x['kernel']['k']})")
        tag = f"{k} n={x['n']:.0e}"
        out[f"{tag} sync ms"] = x["sync_ms"]
        out[f"{tag} async ms"] = x["async_ms"]
        out[f"{tag} speedup"] = x["speedup"]
        out[f"{tag} async/bound"] = x["async_over_bound"]
    k = load(d, "demo/kernels.json")
    if k:
        out["kernel scale ms (1e8)"] = k.get("scale_ms")
        out["kernel d2d copy ms (1e8)"] = k.get("copy_ms")
    p = load(d, "peers/comparison.json")
    for r in (p or {}).get("rows", []):
        for name, e in r.get("peers", {}).items():
            out[f"{name} {r['kernel']} n={r['n']:.0e} ms"] = e.get("median_ms")
    return out


def main():
    old, new = rows(sys.argv[1]), rows(sys.argv[2])
    print(f"{'figure':<44} {'old':>10} {'new':>10} {'new/old':>8}")
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        ratio = f"{b / a:8.3f}" if a and b else "       -"
        fa = f"{a:10.4f}" if isinstance(a, (int, float)) else f"{'-':>10}"
        fb = f"{b:10.4f}" if isinstance(b, (int, float)) else f"{'-':>10}"
        print(f"{key:<44} {fa} {fb} {ratio}")


if __name__ == "__main__":
    main()
