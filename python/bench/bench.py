"""gpufeed benchmark (for the GPU machine): writes JSON to the path given.

    python bench/bench.py out.json [--sizes 10000000 100000000] [--reps 5]

- the pipeline driven from Python (scale kernel, float32), Plan.auto and a
  fixed round-robin plan, median host time per run;
- compare_sync_async(n) from Python (the Rust experiment behind the `host`
  binary's `compare-sync-async`, called through the bindings);
- a PyTorch peer: pinned tensors, non_blocking copies and the multiply on 4
  streams, the same chunk count as the fixed plan;
- the GIL: iterations of a Python busy-loop thread while a pipeline runs,
  against the same loop with the main thread asleep for as long;
- pinned vs pageable H2D from Python: gpufeed (PinnedBuffer via a stream vs
  DeviceArray.upload of a NumPy array) and torch (pin_memory=True vs not).
"""
import argparse
import json
import statistics
import sys
import threading
import time

import numpy as np

import gpufeed


def median_ms(fn, reps):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def gil_probe(run, seconds_hint):
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    c0, t0 = count, time.perf_counter()
    run()
    during, dt = count - c0, time.perf_counter() - t0
    c1 = count
    time.sleep(dt)
    idle = count - c1
    stop.set()
    th.join()
    return {"run_s": dt, "iterations_during_run": during,
            "iterations_same_time_main_asleep": idle,
            "ratio": during / idle if idle else None}


def torch_peer(torch, x_np, chunks, streams, reps):
    n = x_np.size
    src = torch.from_numpy(x_np).pin_memory()
    dst = torch.empty(n, dtype=torch.float32).pin_memory()
    ss = [torch.cuda.Stream() for _ in range(streams)]
    bounds = np.linspace(0, n, chunks + 1).astype(np.int64)
    scratch = [torch.empty(int(np.diff(bounds).max()), device="cuda") for _ in range(streams)]

    def run():
        for c in range(chunks):
            s = ss[c % streams]
            a, b = int(bounds[c]), int(bounds[c + 1])
            with torch.cuda.stream(s):
                d = scratch[c % streams][: b - a]
                d.copy_(src[a:b], non_blocking=True)
                d.mul_(2.0)
                dst[a:b].copy_(d, non_blocking=True)
        torch.cuda.synchronize()

    ms = median_ms(run, reps)
    ok = bool(np.array_equal(dst.numpy().view(np.uint32), (x_np * np.float32(2.0)).view(np.uint32)))
    return {"ms": ms, "chunks": chunks, "streams": streams, "correct": ok}


def pinned_vs_pageable(device, torch, n, reps):
    out = {}
    alloc = gpufeed.PinnedAllocator(device)
    buf = alloc.alloc(n)
    np.asarray(buf)[:] = 1.0
    dev = device.empty(n)
    stream = gpufeed.Stream(device)
    gb = n * 4 / 1e9
    ms = median_ms(lambda: stream.copy_h2d(buf, dev).wait(), reps)
    out["gpufeed_pinned_h2d"] = {"ms": ms, "GBps": gb / (ms / 1e3)}
    pageable = np.ones(n, np.float32)
    ms = median_ms(lambda: dev.upload(pageable), reps)
    out["gpufeed_pageable_h2d"] = {"ms": ms, "GBps": gb / (ms / 1e3)}
    if torch is not None:
        g = torch.empty(n, device="cuda")
        tp = torch.ones(n, pin_memory=True)
        tq = torch.ones(n)

        def copy(src):
            g.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        ms = median_ms(lambda: copy(tp), reps)
        out["torch_pinned_h2d"] = {"ms": ms, "GBps": gb / (ms / 1e3)}
        ms = median_ms(lambda: copy(tq), reps)
        out["torch_pageable_h2d"] = {"ms": ms, "GBps": gb / (ms / 1e3)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 100_000_000])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--streams", type=int, default=4)
    a = ap.parse_args()
    device = gpufeed.default_device()
    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
    except ImportError:
        torch = None
    result = {"backend": device.kind, "banner": device.banner(), "gpufeed": gpufeed.__version__,
              "python": sys.version, "numpy": np.__version__,
              "torch": getattr(torch, "__version__", None), "sizes": {}}
    alloc = gpufeed.PinnedAllocator(device)
    pipe = gpufeed.Pipeline(device, a.streams)
    for n in a.sizes:
        r = {}
        x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        inp, out = alloc.alloc(n), alloc.alloc(n)
        np.asarray(inp)[:] = x
        expect = (x * np.float32(2.0)).view(np.uint32)
        for name, plan in (("auto", None), ("uniform", ("uniform", a.chunks, a.streams))):
            info = {}

            def run():
                info.update(pipe.run(inp, out, "scale", 2.0, plan=plan))

            ms = median_ms(run, a.reps)
            got = np.asarray(out)
            r[f"python_pipeline_{name}"] = {"ms": ms, "GBps_each_way": n * 4 / 1e9 / (ms / 1e3),
                                            "plan": info.get("plan"),
                                            "correct": bool((got.view(np.uint32) == expect).all())}
            del got
        r["python_compare_sync_async"] = gpufeed.compare_sync_async(n, device, reps=a.reps)
        r["gil"] = gil_probe(lambda: pipe.run(inp, out, "scale", 2.0), None)
        if torch is not None:
            r["torch_peer"] = torch_peer(torch, x, a.chunks, a.streams, a.reps)
        r["pinned_vs_pageable"] = pinned_vs_pageable(device, torch, n, a.reps)
        inp.free()
        out.free()
        result["sizes"][str(n)] = r
        print(json.dumps({str(n): r}, indent=1), flush=True)
    result["pool"] = alloc.stats()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
