"""How fast a GPU kernel gathers rows from host memory pinned in place and
mapped (the loader's device route), by the form of its loads, against the
copy engine's DMA of the same bytes from pinned memory: CuPy, NVRTC.

Rows of 4 KiB are gathered from a 1 GiB array registered with
cudaHostRegister(Mapped | ReadOnly), batches of --batch-mib MiB of random rows,
one kernel per batch, back to back on one stream (or alternating on two),
timed with CUDA events over an epoch. Load forms: plain `ld.global.v4`,
`ld.global.nc.v4` (the read-only path), `ld.global.L2::128B` and
`L2::256B` (prefetch-size hints, sm_80+), and two loads in flight per thread
before their stores. Every kernel's output of the epoch's last batch, run on
one stream into an output poisoned first, is checked against NumPy's gather
(a variant's one- and two-stream rows carry that check: the kernel is the
same). Medians of --reps epochs.

    python3 bench/peers/zero_copy.py --out zero_copy.json
"""

import argparse
import json
import statistics

import cupy as cp
import numpy as np

SRC = r"""
#define LOAD(OP, p, v) asm volatile(OP " {%0,%1,%2,%3}, [%4];" \
    : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p))
#define GATHER(NAME, OP)                                                    \
extern "C" __global__ void NAME(const uint4* src, const unsigned long long* idx, \
                                long long per_row, long long total, uint4* dst) { \
  long long stride = (long long)gridDim.x * blockDim.x;                      \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) { \
    long long r = i / per_row, k = i - r * per_row;                          \
    uint4 v; LOAD(OP, src + idx[r] * per_row + k, v); dst[i] = v;           \
  }                                                                          \
}
GATHER(g_plain, "ld.global.v4.u32")
GATHER(g_nc, "ld.global.nc.v4.u32")
GATHER(g_l2_128, "ld.global.L2::128B.v4.u32")
GATHER(g_l2_256, "ld.global.L2::256B.v4.u32")
GATHER(g_nc_l2_256, "ld.global.nc.L2::256B.v4.u32")
extern "C" __global__ void g_two(const uint4* src, const unsigned long long* idx,
                                 long long per_row, long long total, uint4* dst) {
  long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + stride < total; i += 2 * stride) {
    long long j = i + stride;
    long long r = i / per_row, k = i - r * per_row;
    long long q = j / per_row, m = j - q * per_row;
    uint4 a, b;
    LOAD("ld.global.v4.u32", src + idx[r] * per_row + k, a);
    LOAD("ld.global.v4.u32", src + idx[q] * per_row + m, b);
    dst[i] = a; dst[j] = b;
  }
  for (; i < total; i += stride) {
    long long r = i / per_row, k = i - r * per_row;
    uint4 v; LOAD("ld.global.v4.u32", src + idx[r] * per_row + k, v); dst[i] = v;
  }
}
"""

VARIANTS = ["g_plain", "g_nc", "g_l2_128", "g_l2_256", "g_nc_l2_256", "g_two"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--array-mib", type=int, default=1024)
    ap.add_argument("--batch-mib", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--row-bytes", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()

    nbytes = a.array_mib << 20
    rng = np.random.default_rng(5)
    host = rng.integers(0, 2**32, size=nbytes // 4, dtype=np.uint32)
    flags = 2 | 8  # cudaHostRegisterMapped | cudaHostRegisterReadOnly
    cp.cuda.runtime.hostRegister(host.ctypes.data, nbytes, flags)
    # With unified addressing (every 64-bit Linux GPU since Pascal, where
    # canUseHostPointerForRegisteredMem is 1) the registered host address is
    # the device address.
    assert cp.cuda.runtime.deviceGetAttribute(
        cp.cuda.runtime.cudaDevAttrCanUseHostPointerForRegisteredMem, 0) == 1
    mapped = host.ctypes.data
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    props = cp.cuda.runtime.getDeviceProperties(0)
    sms = props["multiProcessorCount"]
    grid, block = sms * 8, 256
    n_rows = nbytes // a.row_bytes
    per_row = a.row_bytes // 16
    rows_u32 = host.reshape(n_rows, a.row_bytes // 4)
    out = {"gpu": props["name"].decode(), "sms": sms, "grid": grid, "block": block,
           "array_bytes": nbytes, "row_bytes": a.row_bytes, "reps": a.reps, "batches": []}
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for bm in a.batch_mib:
        batch_rows = (bm << 20) // a.row_bytes
        nb = n_rows // batch_rows
        total = batch_rows * per_row
        order = rng.permutation(n_rows)[: nb * batch_rows].astype(np.uint64)
        idx = cp.asarray(order.reshape(nb, batch_rows))
        dsts = [cp.empty(batch_rows * a.row_bytes // 4, dtype=cp.uint32) for _ in range(2)]
        res = {"batch_bytes": bm << 20, "batches": nb}

        def epoch(run_one, streams):
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record(streams[0])
            for b in range(nb):
                run_one(b, streams[b % len(streams)], dsts[b % 2])
            for s in streams[1:]:
                e = cp.cuda.Event()
                e.record(s)
                streams[0].wait_event(e)
            ev1.record(streams[0])
            ev1.synchronize()
            return (nb * batch_rows * a.row_bytes) / (cp.cuda.get_elapsed_time(ev0, ev1) / 1e3) / 1e9

        # The copy engine: the same bytes per batch from pinned memory.
        pinned = cp.cuda.alloc_pinned_memory(batch_rows * a.row_bytes)
        pin_arr = np.frombuffer(pinned, dtype=np.uint8, count=batch_rows * a.row_bytes)
        pin_arr[:] = 1

        def dma(b, s, d):
            cp.cuda.runtime.memcpyAsync(d.data.ptr, pin_arr.ctypes.data, batch_rows * a.row_bytes,
                                        cp.cuda.runtime.memcpyHostToDevice, s.ptr)

        epoch(dma, [s1])
        res["pinned_dma_gbps"] = statistics.median(epoch(dma, [s1]) for _ in range(a.reps))
        for name in VARIANTS:
            try:
                k = mod.get_function(name)
            except Exception as e:  # an ISA the driver's NVRTC refuses
                res[name] = {"error": str(e)[:200]}
                continue
            for streams, label in (([s1], name), ([s1, s2], name + "_2streams")):
                def launch(b, s, d, k=k):
                    k((grid,), (block,), (cp.uint64(mapped), idx[b], cp.int64(per_row),
                                          cp.int64(total), d), stream=s)
                epoch(launch, streams)
                g = statistics.median(epoch(launch, streams) for _ in range(a.reps))
                # Check: the last batch (on one stream) into poisoned memory.
                d = dsts[0]
                d.fill(0xDEADBEEF)
                launch(nb - 1, s1, d)
                s1.synchronize()
                want = rows_u32[order.reshape(nb, batch_rows)[nb - 1].astype(np.int64)].ravel()
                ok = bool(np.array_equal(cp.asnumpy(d), want))
                res[label] = {"gbps": round(g, 2), "over_pinned": round(g / res["pinned_dma_gbps"], 3),
                              "verified": ok}
                print(f"{bm:>3} MiB {label:<22} {g:7.2f} GB/s  {g / res['pinned_dma_gbps']:.3f}x pinned DMA"
                      f" {'' if ok else 'WRONG'}", flush=True)
        print(f"{bm:>3} MiB pinned DMA {res['pinned_dma_gbps']:.2f} GB/s", flush=True)
        out["batches"].append(res)
    cp.cuda.runtime.hostUnregister(host.ctypes.data)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
