# The link's rate against the host's copy load: pinned DMAs timed with CUDA events while N threads
# (ctypes.memmove: the GIL released, so N copies at once) stream a 1 GiB pageable source into a
# 32 MiB pinned ring, each thread its slice of every 8 MiB block, as the staged engine's workers do.
# DMA source: one 1 GiB pinned buffer (one DMA), or the ring itself (32 DMAs of 32 MiB). In turn.
import ctypes, json, os, threading, time, random
import numpy as np, torch
GiB = 1 << 30; MiB = 1 << 20
pin = torch.empty(GiB, dtype=torch.uint8, pin_memory=True); pin.numpy()[:] = 7
d = torch.empty(GiB, dtype=torch.uint8, device="cuda")
src = np.random.default_rng(1).integers(0, 255, GiB, dtype=np.uint8)
ring_t = torch.empty(32 * MiB, dtype=torch.uint8, pin_memory=True); ring = ring_t.numpy(); ring[:] = 1
sp, rp = src.ctypes.data, ring.ctypes.data
s = torch.cuda.Stream()
def dma(source, h2d):
    e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        e0.record(s)
        if source == "big":
            if h2d: d.copy_(pin, non_blocking=True)
            else: pin.copy_(d, non_blocking=True)
        else:
            for k in range(32):
                o = k * 32 * MiB
                if h2d: d[o:o + 32 * MiB].copy_(ring_t, non_blocking=True)
                else: ring_t.copy_(d[o:o + 32 * MiB], non_blocking=True)
        e1.record(s)
    e1.synchronize()
    return GiB / (e0.elapsed_time(e1) / 1e3) / 1e9
class Load:
    def __init__(self, n): self.n, self.stop, self.moved = n, False, [0] * n
    def worker(self, t):
        piece = (8 * MiB) // self.n // 4096 * 4096; off = t * piece; k = 0
        mm = ctypes.memmove
        while not self.stop:
            so = (k * 8 * MiB + off) % (GiB - 8 * MiB); ro = (k % 4) * 8 * MiB + off
            mm(rp + ro, sp + so, piece); k += 1
        self.moved[t] = k * piece
    def __enter__(self):
        self.th = [threading.Thread(target=self.worker, args=(t,)) for t in range(self.n)]
        self.t0 = time.perf_counter(); [t.start() for t in self.th]; time.sleep(0.03); return self
    def __exit__(self, *a):
        self.stop = True; [t.join() for t in self.th]; self.gbps = sum(self.moved) / (time.perf_counter() - self.t0) / 1e9
loads = [0, 4, 8, 12, 15]
res = {}; rate = {n: [] for n in loads}
for n in loads: dma("big", True)
for rep in range(7):
    order = loads[:]; random.Random(rep).shuffle(order)
    for n in order:
        runs = [(src_, h) for src_ in ("big", "ring") for h in (True, False)]
        if n == 0:
            for src_, h in runs: res.setdefault(f"{n} threads {src_} {'h2d' if h else 'd2h'}", []).append(dma(src_, h))
        else:
            with Load(n) as L:
                for src_, h in runs: res.setdefault(f"{n} threads {src_} {'h2d' if h else 'd2h'}", []).append(dma(src_, h))
            rate[n].append(L.gbps)
out = {"link_gbps_median": {k: round(float(np.median(v)), 2) for k, v in res.items()},
       "link_gbps_min": {k: round(min(v), 2) for k, v in res.items()},
       "load_copy_gbps_median": {n: round(float(np.median(v)), 1) for n, v in rate.items() if v}}
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/contention2.json", "w"), indent=1)
