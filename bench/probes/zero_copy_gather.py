# The zero-copy gather probe (run on the H200 machine with CuPy): a 1 GiB array registered
# with cuMemHostRegister(PORTABLE | DEVICEMAP), batches of random 4 KiB rows gathered by
# (a) cuMemcpyBatchAsync_v2, one 4 KiB copy per row, and (b) a CUDA kernel reading the rows where
# they are (one block per row, 16-byte loads), against one pinned copy of the batch's size.
import ctypes, time
import numpy as np, cupy as cp
cuda = ctypes.CDLL("libcuda.so.1")
cp.cuda.Device(0).use(); cp.zeros(1)
c = ctypes
N = 1 << 30; ROW = 4096; NR = N // ROW
a = np.empty(N, np.uint8); a[:] = np.frombuffer(np.random.default_rng(0).bytes(N), np.uint8)
ptr = a.ctypes.data
t = time.perf_counter()
r = cuda.cuMemHostRegister_v2(c.c_void_p(ptr), c.c_size_t(N), c.c_uint(3)); cp.cuda.runtime.deviceSynchronize()
print("register 1 GiB:", r, f"{(time.perf_counter()-t)*1e3:.1f} ms", flush=True)
dptr = c.c_uint64(0); r = cuda.cuMemHostGetDevicePointer_v2(c.byref(dptr), c.c_void_p(ptr), c.c_uint(0))
s = cp.cuda.Stream(non_blocking=True)
class Loc(c.Structure): _fields_ = [("type", c.c_int), ("id", c.c_int)]
class Attr(c.Structure): _fields_ = [("order", c.c_int), ("src", Loc), ("dst", Loc), ("flags", c.c_uint)]
attr = Attr(1, Loc(2, 0), Loc(1, 0), 0)
aidx = (c.c_size_t * 1)(0)
fn = cuda.cuMemcpyBatchAsync_v2
fn.argtypes = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_size_t, c.c_void_p, c.c_void_p, c.c_size_t, c.c_void_p]
k = cp.RawKernel(r'''
extern "C" __global__ void gather(const uint4* __restrict__ src, const long long* __restrict__ idx, uint4* __restrict__ dst, int row16, int nrows) {
  for (int r = blockIdx.x; r < nrows; r += gridDim.x) {
    const uint4* s = src + idx[r] * row16; uint4* d = dst + (long long)r * row16;
    for (int i = threadIdx.x; i < row16; i += blockDim.x) d[i] = s[i];
  }
}''', "gather")
pinned = cp.cuda.alloc_pinned_memory(64 << 20)
def timeit(f, batches, bb):
    s.synchronize(); t = time.perf_counter()
    for b in range(batches): f(b)
    s.synchronize(); return bb * batches / (time.perf_counter() - t) / 1e9
for MB in (1, 8, 16, 64):
    BB = MB << 20; rows = BB // ROW; batches = min(NR // rows, 128)
    dev = [cp.empty(BB, cp.uint8) for _ in range(3)]
    perm = np.random.default_rng(MB).permutation(NR).astype(np.int64)
    def pinned_copy(b):
        cuda.cuMemcpyHtoDAsync_v2(c.c_uint64(dev[b % 3].data.ptr), c.c_void_p(pinned.ptr), c.c_size_t(BB), c.c_void_p(s.ptr))
    srcs = [(ptr + perm[b*rows:(b+1)*rows] * ROW).astype(np.uint64) for b in range(batches)]
    dsts = [(dev[i].data.ptr + np.arange(rows, dtype=np.uint64) * ROW).astype(np.uint64) for i in range(3)]
    sizes = np.full(rows, ROW, np.uint64)
    def batch(b):
        r = fn(dsts[b % 3].ctypes.data, srcs[b].ctypes.data, sizes.ctypes.data, rows, c.addressof(attr), c.addressof(aidx), 1, c.c_void_p(s.ptr))
        if r: raise SystemExit(f"cuMemcpyBatchAsync_v2: {r}")
    idx_dev = [cp.asarray(perm[b*rows:(b+1)*rows]) for b in range(batches)]
    def kern(b):
        with s: k((min(rows, 4096),), (256,), (np.uint64(dptr.value), idx_dev[b], dev[b % 3], np.int32(ROW // 16), np.int32(rows)))
    res = {}
    for name, f in (("pinned", pinned_copy), ("batchcopy", batch), ("kernel", kern)):
        f(0); s.synchronize()
        res[name] = [round(timeit(f, batches, BB), 2) for _ in range(3)]
    want = a.reshape(NR, ROW)[perm[:rows]]
    ok = {}
    batch(0); s.synchronize(); ok["batchcopy"] = bool((dev[0].get().reshape(rows, ROW) == want).all())
    dev[0].fill(0); kern(0); s.synchronize(); ok["kernel"] = bool((dev[0].get().reshape(rows, ROW) == want).all())
    print(f"{MB} MiB batches x{batches}: {res} verified {ok}", flush=True)
