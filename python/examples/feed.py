"""gpufeed in a few lines: the pinned pool, pin-in-place, a batch on a stream,
the overlap pipeline (sync and asyncio), and compare_sync_async.
Runs anywhere: the CUDA driver when a GPU is there, else the CPU emulation."""
import asyncio

import numpy as np

import gpufeed

device = gpufeed.default_device()
print(device.banner())
alloc = gpufeed.PinnedAllocator(device)

# 1. The seed's flow: pinned memory from the pool, seen by NumPy without a copy.
n = 1_000_000
src = alloc.alloc(n, "float32")
alloc.get_array(src)[:] = np.linspace(0, 1, n, dtype=np.float32)  # the view dies here
dst = alloc.alloc(n, "float32")

# 2. A batch on a stream: the operation owns the buffers until wait().
dev = device.empty(n, "float32")
stream = gpufeed.Stream(device)
op = stream.submit(("h2d", src, dev), ("scale", dev, 2.0), ("d2h", dev, dst))
try:
    src.get_array()
except BufferError as e:
    print("while in flight:", e)
op.wait()
print("scaled:", np.asarray(dst)[:3])

# 3. Pin an existing array in place (no staging copy), then get it back.
data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
pinned = gpufeed.pin(data, device)
del data  # nothing but the PinnedBuffer may reach it while the device does
pipe = gpufeed.Pipeline(device, streams=4)
info = pipe.run(pinned, dst, kernel="scale", arg=0.5)  # GIL released
print("pipeline:", info)
data = pinned.unpin()
assert np.array_equal(np.asarray(dst), data * np.float32(0.5))


# 4. asyncio: await an operation.
async def main():
    return await pipe.run_async(src, dst, "intensity", 16)


print("awaited:", asyncio.run(main()))
result = gpufeed.compare_sync_async(4_000_000, device)
print("compare_sync_async:", result)
assert result["correct"], "a result differs from the CPU reference"
print("pool:", alloc.stats())
