#!/usr/bin/env python3
"""PyTorch peer of `host small-transfers`: many small copies between pinned
host tensors and device tensors, written the way a PyTorch user would write
them, in copies per second and GB/s.

Workload (the same as ours, so the rows compare directly):
  * sizes 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB (--sizes, in bytes); both
    directions, H2D (pinned host -> device) and D2H (device -> pinned host).
  * 64 pairs of a pinned host tensor
    (torch.empty(n, dtype=torch.uint8, pin_memory=True)) and a device tensor
    of the same size; the copies cycle over them. Every copy is
    dst.copy_(src, non_blocking=True) on the current stream (the default
    stream: what a user gets without `with torch.cuda.stream(...)`).
  * non_blocking_1: one in flight: each copy is followed by
    torch.cuda.current_stream().synchronize().
  * non_blocking_64: 64 in flight: 64 copies issued (one per pair), then one
    torch.cuda.current_stream().synchronize(); repeated.
  * per size and direction, each mode first runs one checked round of 64
    copies (every pair once): fresh random bytes in (each byte's lowest bit
    set, so never zero, as ours), every byte
    compared with what arrived (H2D: the device tensor read back; D2H: the
    host tensor, scribbled over before the copy). That round is also the
    warm-up, and its time sizes the mode's timed rounds (about --target-ms
    each, a multiple of 64 copies for non_blocking_64). Then --rounds timed
    rounds, the two modes taking turns within each round.
  * copies per second = copies of a round / its host wall time
    (time.perf_counter around the round); median, min and max over rounds;
    GB/s = median * bytes / 1e9.

Output (--out PATH): {"peer": "pytorch", "gpu", "driver", "torch", "cuda",
"stream", "rows": [{"bytes", "direction": "h2d" | "d2h", "mode":
"non_blocking_1" | "non_blocking_64", "in_flight", "streams", "ops_per_s", "gb_per_s",
"ops_per_s_min", "ops_per_s_max", "copies_per_round", "rounds",
"verified"}]}, the rows in the shape of small_transfers.json's, which
compare_small.py compares. Exit status 1 if a check fails (after writing the
JSON), 2 without a GPU.

Usage:
  python3 torch_small.py --out pytorch-small.json
  python3 torch_small.py --sizes 4096,1048576 --rounds 5 --out /tmp/s.json
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

# The same argument checks and driver probe as the pipeline peer beside it.
from torch_pipeline import driver_version, positive_int, positive_int_list
# The table formatting of the comparison script beside it (stdlib only).
from compare_small import rate, size_name

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
IN_FLIGHT = 64
MODES = (("non_blocking_1", 1), ("non_blocking_64", IN_FLIGHT))
DIRECTIONS = ("h2d", "d2h")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch peer: small non_blocking copies of pinned tensors, 1 and 64 in flight",
        allow_abbrev=False,
    )
    p.add_argument("--sizes", type=positive_int_list, default=SIZES,
                   help="bytes per copy, comma-separated (default 4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB)")
    p.add_argument("--rounds", type=positive_int, default=11,
                   help="timed rounds per mode, size and direction (default 11, as ours on a GPU)")
    p.add_argument("--target-ms", type=float, default=25.0,
                   help="wall time a timed round aims at (default 25, as ours on a GPU)")
    p.add_argument("--max-copies", type=positive_int, default=16384,
                   help="most copies in a round (default 16384, as ours)")
    p.add_argument("--out", "--json", dest="out", metavar="PATH", default=None)
    return p.parse_args(argv)


def one_in_flight(pairs, copies):
    """`copies` copies over the pairs, each synchronized before the next."""
    stream = torch.cuda.current_stream()
    t0 = time.perf_counter()
    for dst, src in itertools.islice(itertools.cycle(pairs), copies):
        dst.copy_(src, non_blocking=True)
        stream.synchronize()
    return time.perf_counter() - t0


def batched(pairs, copies):
    """A copy per pair issued, then one synchronize; copies // len(pairs) times."""
    stream = torch.cuda.current_stream()
    t0 = time.perf_counter()
    for _ in range(copies // len(pairs)):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
    return time.perf_counter() - t0


RUNS = {"non_blocking_1": one_in_flight, "non_blocking_64": batched}


def fresh(nbytes, gen):
    """Random bytes with the lowest bit set (never zero, as ours), as a CPU tensor."""
    return torch.randint(0, 128, (nbytes,), dtype=torch.uint8, generator=gen).mul_(2).add_(1)


def checked(mode, direction, hosts, devs, gen):
    """One round of 64 copies (every pair once) on fresh data: (ok, seconds)."""
    run = RUNS[mode]
    if direction == "h2d":
        for h in hosts:
            h.copy_(fresh(h.numel(), gen))
        pairs = list(zip(devs, hosts))
        took = run(pairs, len(pairs))
        # .cpu() copies on the current stream, after the timed copies.
        ok = all(torch.equal(d.cpu(), h) for d, h in zip(devs, hosts))
    else:
        expected = [fresh(d.numel(), gen) for d in devs]
        for d, e, h in zip(devs, expected, hosts):
            d.copy_(e)
            h.copy_(torch.bitwise_xor(e, 2))  # scribbled: every byte differs, none is zero
        torch.cuda.current_stream().synchronize()
        pairs = list(zip(hosts, devs))
        took = run(pairs, len(pairs))
        ok = all(torch.equal(h, e) for h, e in zip(hosts, expected))
    return ok, took


def copies_for(args, in_flight, took, n):
    """Copies of a timed round: about --target-ms, a multiple of in_flight."""
    per_copy = took / max(n, 1)
    want = args.target_ms / 1e3 / per_copy if per_copy > 0 else args.max_copies
    want = -(-int(min(want, args.max_copies)) // in_flight) * in_flight
    return max(in_flight, min(want, max(args.max_copies, in_flight)))


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(device)
    driver = driver_version()
    print("peer: pytorch (small transfers)")
    print(f"gpu: {gpu}")
    print(f"driver: {driver or 'unknown'}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"rounds {args.rounds}, about {args.target_ms:g} ms each; {IN_FLIGHT} buffer pairs; "
          "the current (default) stream")
    seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    print(f"data seed: {seed:#018x}\n")
    print(f"{'dir':<4} {'size':>8} {'mode':<16} {'copies/s':>9} {'GB/s':>7} "
          f"{'min':>9} {'max':>9} {'per round':>9}  ok", flush=True)

    rows = []
    all_ok = True
    for nbytes in args.sizes:
        hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(IN_FLIGHT)]
        devs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(IN_FLIGHT)]
        for direction in DIRECTIONS:
            pairs = list(zip(devs, hosts)) if direction == "h2d" else list(zip(hosts, devs))
            verified, copies = {}, {}
            for mode, in_flight in MODES:
                ok, took = checked(mode, direction, hosts, devs, gen)
                verified[mode] = ok
                copies[mode] = copies_for(args, in_flight, took, IN_FLIGHT)
            samples = {mode: [] for mode, _ in MODES}
            for _ in range(args.rounds):
                for mode, _ in MODES:
                    took = RUNS[mode](pairs, copies[mode])
                    samples[mode].append(copies[mode] / took)
            for mode, in_flight in MODES:
                v = samples[mode]
                med = statistics.median(v)
                r = {"bytes": nbytes, "direction": direction, "mode": mode,
                     "in_flight": in_flight, "streams": 1, "ops_per_s": med, "gb_per_s": med * nbytes / 1e9,
                     "ops_per_s_min": min(v), "ops_per_s_max": max(v),
                     "copies_per_round": copies[mode], "rounds": len(v),
                     "verified": verified[mode]}
                rows.append(r)
                all_ok = all_ok and r["verified"]
                print(f"{direction:<4} {size_name(nbytes):>8} {mode:<16} {rate(med):>9} "
                      f"{r['gb_per_s']:>7.2f} {rate(min(v)):>9} {rate(max(v)):>9} "
                      f"{copies[mode]:>9}  {'true' if r['verified'] else 'FALSE'}", flush=True)
        del hosts, devs, pairs
        torch.cuda.empty_cache()

    if args.out:
        doc = {"peer": "pytorch", "gpu": gpu, "driver": driver, "torch": torch.__version__,
               "cuda": torch.version.cuda, "stream": "current (default) stream", "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.out}")
    if not all_ok:
        print("error: a copy brought back wrong bytes", file=sys.stderr)
        return 1
    print("verified: true (every mode, size and direction)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
