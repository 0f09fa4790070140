"""Per-run times of the pipeline driven from Python (GPU machine):

    python bench/waits.py [n] [out.json]

60 runs each of `Pipeline.run` at n floats (default 10^7), plain, with the
output or the input written by NumPy just before each run (host caches), after
importing torch and after a torch copy; and `compare_sync_async` (the same
pipeline driven from Rust, in this process). Prints min / median / p90 / max
per variant and the first runs, so a second mode of slow runs shows (the
reason `Pipeline.run` waits in `host::block_on`, which spins for the wake-up
before it parks: a parked thread's wake-up is sometimes slow on a VM)."""
import json
import statistics
import sys
import time

import numpy as np

import gpufeed

dev = gpufeed.default_device()
alloc = gpufeed.PinnedAllocator(dev)
pipe = gpufeed.Pipeline(dev, 4)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000
inp, out = alloc.alloc(n), alloc.alloc(n)
np.asarray(inp)[:] = np.random.default_rng(0).standard_normal(n).astype(np.float32)
res = {}


def times(k, touch=None):
    ts = []
    for _ in range(k):
        if touch == "out":
            np.asarray(out)[:] = 0
        elif touch == "in":
            np.asarray(inp)[:] += 0
        t = time.perf_counter()
        pipe.run(inp, out, "scale", 2.0)
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


def summ(name, ts):
    s = sorted(ts)
    res[name] = ts
    print(f"{name:<14} min {s[0]:.3f} med {statistics.median(s):.3f} p90 {s[int(.9 * len(s))]:.3f} "
          f"max {s[-1]:.3f}  first: {[round(x, 3) for x in ts[:12]]}", flush=True)


times(3)
summ("plain", times(60))
summ("touch-out", times(30, "out"))
summ("touch-in", times(30, "in"))
summ("plain-again", times(60))
c = gpufeed.compare_sync_async(n, dev, reps=20)
print("compare_sync_async", c, flush=True)
import torch  # noqa: E402

torch.ones(10, device="cuda")
summ("after-torch", times(60))
x = torch.ones(n).pin_memory()
y = torch.empty(n, device="cuda")
y.copy_(x, non_blocking=True)
torch.cuda.synchronize()
summ("after-torch-op", times(60))
json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"))
