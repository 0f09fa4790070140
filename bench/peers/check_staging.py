#!/usr/bin/env python3
"""The ordinary-memory targets, checked against one run's figures (stdlib only).

Reads `host staging`'s staging.json and, when given, the Python peer's JSON
(bench/peers/staging.py) from the same round, and prints each target with the
measured figure, the bound and whether it is met:

  Rust (staging.json), at 1 GiB and 4 GiB, each direction:
    staged / pinned >= 0.95 and auto / pinned >= 0.95 (medians of one run)
  Rust, at every size measured, each direction:
    auto >= 0.95 x the best of pageable, register_copy and staged
  Rust: every row verified; the engine's peak pinned bytes within its bound;
    under 25 ms of CPU in the 500 ms with no copy in flight (no busy core)
  Python (the peer's JSON), at 1 GiB and 4 GiB:
    gpufeed_to_device / torch_pinned >= 0.95, gpufeed_to_device / torch_cuda >= 7.5
    gpufeed_to_host / torch_pinned >= 0.95, gpufeed_to_host / torch_copy_into >= 4
    every row verified

A figure a target needs that the run lacks is reported as missing (not met).
A ratio against a peer's idiom also shows the most any copy could reach there:
the pinned copy (the link) over that idiom's figure; a bound above it is out
of reach in that run, whatever the library does.

Usage:
  check_staging.py staging.json [python-staging.json] [--out checks.json]
  check_staging.py --self-test   (planted misses must be reported not met)
Exit status: 0 every target met; 1 one or more not met or missing; 2 bad input.
"""

import argparse
import json
import sys

LARGE = (1 << 30, 4 << 30)
DIRS = ("h2d", "d2h")
SLOWER = ("pageable", "register_copy", "staged")
IDLE_CPU_MS_MAX = 25.0


def _size(b):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def _check(name, value, bound, at_least=True):
    """One target: value against bound (None when the run lacks the figure)."""
    if value is None:
        met = False
    else:
        met = value >= bound if at_least else value <= bound
    return {"check": name, "value": value, "bound": bound,
            "at_least": at_least, "met": met}


def _ratio(num, den):
    return None if num is None or den is None or den <= 0 else num / den


def rust_checks(run):
    rows = run["rows"]
    by = {(r["bytes"], r["dir"], r["path"]): r["gbps"] for r in rows}
    out = []
    for size in LARGE:
        for d in DIRS:
            pinned = by.get((size, d, "pinned"))
            for path in ("staged", "auto"):
                out.append(_check(f"rust {d} {_size(size)} {path} / pinned",
                                  _ratio(by.get((size, d, path)), pinned), 0.95))
    for size in sorted({r["bytes"] for r in rows}):
        for d in DIRS:
            best = [by.get((size, d, p)) for p in SLOWER]
            best = max((b for b in best if b is not None), default=None)
            out.append(_check(f"rust {d} {_size(size)} auto / best of the three",
                              _ratio(by.get((size, d, "auto")), best), 0.95))
    bad = [r for r in rows if not r.get("verified")]
    out.append(_check("rust rows not verified", len(bad), 0, at_least=False))
    out.append(_check("rust staging peak bytes over bound",
                      run["staging_peak_bytes"] - run["staging_bound_bytes"], 0,
                      at_least=False))
    out.append(_check("rust idle CPU ms over 500 ms", run["idle_cpu_ms"],
                      IDLE_CPU_MS_MAX, at_least=False))
    return out


def python_checks(peer):
    rows = peer["rows"]
    by = {(r["bytes"], r["dir"], r["idiom"]): r["gbps"] for r in rows}
    out = []
    targets = (("h2d", "gpufeed_to_device", "torch_pinned", 0.95),
               ("h2d", "gpufeed_to_device", "torch_cuda", 7.5),
               ("d2h", "gpufeed_to_host", "torch_pinned", 0.95),
               ("d2h", "gpufeed_to_host", "torch_copy_into", 4.0))
    for size in LARGE:
        for d, ours, theirs, bound in targets:
            c = _check(f"python {d} {_size(size)} {ours} / {theirs}",
                       _ratio(by.get((size, d, ours)), by.get((size, d, theirs))), bound)
            if theirs != "torch_pinned":
                # The most any copy could reach: the link (the pinned copy) / theirs.
                c["ceiling"] = _ratio(by.get((size, d, "torch_pinned")), by.get((size, d, theirs)))
            out.append(c)
    bad = [r for r in rows if not r.get("verified")]
    out.append(_check("python rows not verified", len(bad), 0, at_least=False))
    return out


def report(checks):
    for c in checks:
        v = "missing" if c["value"] is None else (
            f"{c['value']:.3f}" if isinstance(c["value"], float) else str(c["value"]))
        op = ">=" if c["at_least"] else "<="
        ceiling = c.get("ceiling")
        beyond = "" if ceiling is None else f"   (the link / theirs: {ceiling:.2f}x{'; out of reach' if ceiling < c['bound'] else ''})"
        print(f"{'met    ' if c['met'] else 'NOT MET'}  {c['check']:<58} {v:>9} {op} {c['bound']}{beyond}")
    missed = sum(not c["met"] for c in checks)
    print(f"{len(checks) - missed} of {len(checks)} targets met")
    return missed


def _synthetic():
    """A run meeting every target, for the self-test to plant misses in."""
    rows = []
    for size in (64 << 10, 1 << 30, 4 << 30):
        for d in DIRS:
            for path, g in (("pageable", 7.0), ("register_copy", 12.0), ("staged", 53.0),
                            ("auto", 53.0), ("pinned", 55.0)):
                rows.append({"bytes": size, "dir": d, "path": path, "gbps": g, "verified": True})
    run = {"rows": rows, "staging_peak_bytes": 32 << 20, "staging_bound_bytes": 32 << 20,
           "idle_cpu_ms": 0.4}
    prows = []
    for size in LARGE:
        for d, idioms in (("h2d", (("torch_pinned", 55.0), ("torch_cuda", 7.0),
                                   ("gpufeed_to_device", 53.0))),
                          ("d2h", (("torch_pinned", 55.0), ("torch_copy_into", 12.0),
                                   ("gpufeed_to_host", 53.0)))):
            for idiom, g in idioms:
                prows.append({"bytes": size, "dir": d, "idiom": idiom, "gbps": g, "verified": True})
    return run, {"rows": prows}


def self_test():
    """Each planted miss must turn exactly the check it is for to not met."""
    run, peer = _synthetic()
    base = rust_checks(run) + python_checks(peer)
    if not all(c["met"] for c in base):
        raise SystemExit(f"self-test: the clean run misses {[c for c in base if not c['met']]}")

    def plant(change, want):
        r, p = _synthetic()
        change(r, p)
        missed = [c["check"] for c in rust_checks(r) + python_checks(p) if not c["met"]]
        if missed != want:
            raise SystemExit(f"self-test: planted {want}, reported {missed}")

    def set_gbps(rows, key, value, field="path"):
        for row in rows:
            if (row["bytes"], row["dir"], row[field]) == key:
                row["gbps"] = value

    plant(lambda r, p: set_gbps(r["rows"], (1 << 30, "h2d", "staged"), 0.949 * 55.0),
          ["rust h2d 1 GiB staged / pinned"])
    plant(lambda r, p: set_gbps(r["rows"], (4 << 30, "d2h", "auto"), 0.90 * 55.0),
          ["rust d2h 4 GiB auto / pinned", "rust d2h 4 GiB auto / best of the three"])
    plant(lambda r, p: set_gbps(r["rows"], (64 << 10, "d2h", "pageable"), 60.0),
          ["rust d2h 64 KiB auto / best of the three"])
    plant(lambda r, p: r["rows"].pop(), ["rust d2h 4 GiB staged / pinned",
                                         "rust d2h 4 GiB auto / pinned"])
    plant(lambda r, p: r["rows"][0].update(verified=False), ["rust rows not verified"])
    plant(lambda r, p: r.update(staging_peak_bytes=(32 << 20) + 1),
          ["rust staging peak bytes over bound"])
    plant(lambda r, p: r.update(idle_cpu_ms=400.0), ["rust idle CPU ms over 500 ms"])
    plant(lambda r, p: set_gbps(p["rows"], (1 << 30, "h2d", "torch_cuda"), 53.0 / 7.4, "idiom"),
          ["python h2d 1 GiB gpufeed_to_device / torch_cuda"])
    plant(lambda r, p: set_gbps(p["rows"], (4 << 30, "d2h", "gpufeed_to_host"), 52.0, "idiom"),
          ["python d2h 4 GiB gpufeed_to_host / torch_pinned"])
    plant(lambda r, p: set_gbps(p["rows"], (4 << 30, "d2h", "torch_copy_into"), 13.5, "idiom"),
          ["python d2h 4 GiB gpufeed_to_host / torch_copy_into"])
    plant(lambda r, p: p["rows"][-1].update(verified=False), ["python rows not verified"])
    print("check_staging self-test: 11 planted misses each reported, nothing else")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("staging", nargs="?", help="host staging's staging.json")
    ap.add_argument("peer", nargs="?", help="bench/peers/staging.py's JSON")
    ap.add_argument("--out", help="write the checks here (JSON)")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.staging:
        ap.error("staging.json is required")
    try:
        with open(args.staging) as f:
            run = json.load(f)
        checks = rust_checks(run)
        peer = None
        if args.peer:
            with open(args.peer) as f:
                peer = json.load(f)
            checks += python_checks(peer)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"check_staging: bad input: {e!r}", file=sys.stderr)
        return 2
    meta = run.get("meta", {})
    print(f"targets of {args.staging}: {meta.get('device', '?')}, commit {meta.get('commit', '?')}"
          + (f"; {args.peer}: {peer.get('gpu', '?')}" if peer else ""))
    if peer is not None and peer.get("complete") is False:
        print(f"{args.peer}: the peer's run was cut short; the rows it did not reach are missing")
    missed = report(checks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "peer_gpu": peer.get("gpu") if peer else None,
                       "checks": checks}, f, indent=1)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
