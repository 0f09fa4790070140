"""Does PyTorch see gpufeed's pinned memory as pinned? Prints one JSON object:
for a pool block, a pinned-in-place NumPy array and PyTorch's own pinned
tensor, what `Tensor.is_pinned()` says (through DLPack and through NumPy),
what the CUDA runtime's `cudaPointerGetAttributes` says (through CuPy), and
whether a `non_blocking` copy from it is asynchronous (returns before a
64 MiB copy could have finished)."""
import json
import sys
import time

import numpy as np
import torch

import gpufeed

out = {"torch": torch.__version__, "cases": {}}
torch.cuda.init()
dev = gpufeed.default_device()
alloc = gpufeed.PinnedAllocator(dev)
n = 16 << 20  # 64 MiB of float32
blk = alloc.alloc(n)
np.asarray(blk)[:] = 1.0
arr = np.ones(n, np.float32)
pinned_arr = gpufeed.pin(arr) if hasattr(gpufeed, "pin") else None
mine = torch.ones(n).pin_memory()

try:
    import cupy

    def runtime_type(ptr):
        return int(cupy.cuda.runtime.pointerGetAttributes(ptr).type)
except ImportError:
    def runtime_type(ptr):
        return None


def case(name, t, ptr):
    g = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.copy_(t, non_blocking=True)
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    out["cases"][name] = {
        "is_pinned": bool(t.is_pinned()),
        "runtime_memory_type": runtime_type(ptr),
        "non_blocking_issue_ms": issued * 1e3,
        "copy_right": bool(torch.equal(g.cpu(), t.cpu())),
    }


case("pool block via DLPack", torch.from_dlpack(blk), blk.ptr)
case("pool block via NumPy", torch.from_numpy(np.asarray(blk)), blk.ptr)
if pinned_arr is not None:
    case("pinned-in-place array via NumPy", torch.from_numpy(arr), arr.ctypes.data)
case("torch pin_memory()", mine, mine.data_ptr())
json.dump(out, sys.stdout, indent=1)
print()
