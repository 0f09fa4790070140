# Does the link slow down while the host's memory is busy? Pinned DMAs (one 1 GiB, or 128 x 8 MiB)
# timed with CUDA events, with the CPU idle and with N threads copying pageable memory (the staged
# engine's traffic: a 1 GiB source streamed into a ring of pageable or pinned blocks). Variants in turn.
import json, os, sys, threading, time, random
import numpy as np, torch
GiB = 1 << 30; MiB = 1 << 20
dev = torch.device("cuda")
pin = torch.empty(GiB, dtype=torch.uint8, pin_memory=True); pin.numpy()[:] = 7
d = torch.empty(GiB, dtype=torch.uint8, device=dev)
src = np.random.default_rng(1).integers(0, 255, GiB, dtype=np.uint8)
ring_pageable = np.ones(32 * MiB, dtype=np.uint8)
ring_pinned_t = torch.empty(32 * MiB, dtype=torch.uint8, pin_memory=True); ring_pinned = ring_pinned_t.numpy(); ring_pinned[:] = 1
s = torch.cuda.Stream()
def dma(block, h2d=True):
    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        e0.record(s)
        for off in range(0, GiB, block):
            if h2d: d[off:off+block].copy_(pin[off:off+block], non_blocking=True)
            else: pin[off:off+block].copy_(d[off:off+block], non_blocking=True)
        e1.record(s)
    e1.synchronize()
    return GiB / (e0.elapsed_time(e1) / 1e3) / 1e9
class Load:
    def __init__(self, n, ring):
        self.n, self.ring, self.stop, self.bytes = n, ring, False, 0
    def worker(self, t):
        piece = (8 * MiB) // self.n // 4096 * 4096
        off = t * piece; k = 0; moved = 0
        while not self.stop:
            so = (k * 8 * MiB + off) % (GiB - 8 * MiB); ro = (k % 4) * 8 * MiB + off
            np.copyto(self.ring[ro:ro+piece], src[so:so+piece]); moved += piece; k += 1
        self.bytes += moved
    def __enter__(self):
        self.th = [threading.Thread(target=self.worker, args=(t,)) for t in range(self.n)]
        self.t0 = time.perf_counter(); [t.start() for t in self.th]; time.sleep(0.05); return self
    def __exit__(self, *a):
        self.stop = True; [t.join() for t in self.th]; self.gbps = self.bytes / (time.perf_counter() - self.t0) / 1e9
def steal():
    f = open("/proc/stat").readline().split(); return int(f[8])
variants = [("idle", None, 0), ("pageable-ring x12", ring_pageable, 12), ("pinned-ring x12", ring_pinned, 12), ("pinned-ring x6", ring_pinned, 6)]
res = {f"{v[0]} {b>>20}MiB {dirn}": [] for v in variants for b in (GiB, 8*MiB) for dirn in ("h2d","d2h")}
loadrate = {v[0]: [] for v in variants}
for _ in range(2): dma(GiB); dma(8*MiB)
st0 = steal()
for rep in range(9):
    order = variants[:]; random.Random(rep).shuffle(order)
    for name, ring, n in order:
        if ring is None:
            for b in (GiB, 8*MiB):
                for h in (True, False): res[f"{name} {b>>20}MiB {'h2d' if h else 'd2h'}"].append(dma(b, h))
        else:
            with Load(n, ring) as L:
                for b in (GiB, 8*MiB):
                    for h in (True, False): res[f"{name} {b>>20}MiB {'h2d' if h else 'd2h'}"].append(dma(b, h))
            loadrate[name].append(L.gbps)
st1 = steal()
out = {"medians_gbps": {k: float(np.median(v)) for k, v in res.items()}, "min": {k: min(v) for k, v in res.items()},
       "load_copy_gbps": {k: (float(np.median(v)) if v else 0) for k, v in loadrate.items()}, "steal_ticks": st1 - st0,
       "cpus": os.cpu_count()}
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/contention.json", "w"), indent=1)
