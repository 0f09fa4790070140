"""GPU tests (CUDA, PyTorch, CuPy): skipped with the reason printed when those
are absent; with REQUIRE_GPU=1 they fail instead. Zero-copy (same pointer on
both sides), stream ordering, results bit-identical to a CPU reference."""
import numpy as np
import pytest

import gpufeed

N = 1 << 22


def random_f32(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_pinned_buffer_zero_copy_to_torch(cuda_device, torch_cuda):
    torch = torch_cuda
    alloc = gpufeed.PinnedAllocator(cuda_device)
    buf = alloc.alloc(1000)
    np.asarray(buf)[:] = np.arange(1000, dtype=np.float32)
    t = torch.from_dlpack(buf)  # kDLCPU
    assert t.device.type == "cpu" and t.data_ptr() == buf.ptr
    # Page-locked in the driver's view (what a DMA copy needs).
    import cupy
    attrs = cupy.cuda.runtime.pointerGetAttributes(buf.ptr)
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost, attrs.type
    # PyTorch's own view (informational: it may consult its own allocator).
    print("torch is_pinned:", t.is_pinned())
    # non_blocking H2D from our pinned memory
    g = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(g.cpu(), torch.arange(1000, dtype=torch.float32))
    with pytest.raises(BufferError):
        buf.free()  # torch holds a view
    del t
    buf.free()


def test_device_array_zero_copy_both_libraries(cuda_device, torch_cuda, cupy_mod):
    torch, cupy = torch_cuda, cupy_mod
    x = random_f32(N)
    dev = cuda_device.empty(N)
    dev.upload(x)
    t = torch.from_dlpack(dev)
    assert t.is_cuda and t.data_ptr() == dev.ptr
    assert np.array_equal(t.cpu().numpy(), x)
    c = cupy.from_dlpack(dev)
    assert c.data.ptr == dev.ptr
    assert np.array_equal(cupy.asnumpy(c), x)
    with pytest.raises(BufferError, match="DLPack"):
        dev.free()
    del t, c
    import gc

    gc.collect()
    dev.free()
    # __cuda_array_interface__ (uncounted: the array is shared for good)
    dev2 = cuda_device.empty(16)
    c2 = cupy.asarray(dev2)
    assert c2.data.ptr == dev2.ptr
    with pytest.raises(BufferError, match="__cuda_array_interface__"):
        gpufeed.Stream(cuda_device).scale(dev2, 2.0)


class _FakeCai:
    """A duck-typed array whose __cuda_array_interface__ says what we tell it."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3,
        }


def test_a_forged_cuda_array_interface_is_refused_not_used(cuda_device, torch_cuda):
    torch = torch_cuda
    alloc = gpufeed.PinnedAllocator(cuda_device)
    victim = alloc.alloc(1 << 16)
    np.asarray(victim)[:] = 7.0
    # Pinned host memory posing as device memory.
    with pytest.raises(gpufeed.InvalidArgumentError, match="not device memory"):
        gpufeed.as_device_array(_FakeCai(victim.ptr, 1 << 16), cuda_device)
    # A real device allocation, claimed longer than it is.
    t = torch.zeros(16, device="cuda")
    with pytest.raises(gpufeed.InvalidArgumentError, match="inside its allocation"):
        gpufeed.as_device_array(_FakeCai(t.data_ptr(), 1 << 30), cuda_device)
    # An address the driver does not know.
    with pytest.raises(gpufeed.InvalidArgumentError):
        gpufeed.as_device_array(_FakeCai(0x10, 4), cuda_device)
    # The honest one still works.
    ok = gpufeed.as_device_array(_FakeCai(t.data_ptr(), 16), cuda_device)
    assert ok.ptr == t.data_ptr()
    assert (np.asarray(victim) == 7.0).all()


def test_torch_tensor_as_pipeline_output_written_in_place(cuda_device, torch_cuda):
    torch = torch_cuda
    x = random_f32(N, 1)
    alloc = gpufeed.PinnedAllocator(cuda_device)
    inp = alloc.alloc(N)
    np.asarray(inp)[:] = x
    t = torch.full((N,), -1.0, device="cuda")  # pending work on torch's stream
    out = gpufeed.as_device_array(t, cuda_device)
    assert out.is_foreign and out.ptr == t.data_ptr()
    gpufeed.Pipeline(cuda_device, 4).run(inp, out, "scale", 3.0)
    # A consumer on another stream reads the finished result.
    s2 = torch.cuda.Stream()
    with torch.cuda.stream(s2):
        y = t.clone()
    s2.synchronize()
    got = y.cpu().numpy()
    assert (got.view(np.uint32) == (x * np.float32(3.0)).view(np.uint32)).all()


def test_cupy_array_as_pipeline_output(cuda_device, cupy_mod):
    cupy = cupy_mod
    x = random_f32(N, 2)
    alloc = gpufeed.PinnedAllocator(cuda_device)
    inp = alloc.alloc(N)
    np.asarray(inp)[:] = x
    c = cupy.zeros(N, dtype=cupy.float32)
    out = gpufeed.as_device_array(c, cuda_device)
    assert out.ptr == c.data.ptr
    gpufeed.Pipeline(cuda_device, 4).run(inp, out, "scale", 0.5)
    assert (cupy.asnumpy(c).view(np.uint32) == (x * np.float32(0.5)).view(np.uint32)).all()


def test_foreign_stream_waits_for_our_work(cuda_device, torch_cuda):
    torch = torch_cuda
    n = 1 << 24
    t = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    arr = gpufeed.as_device_array(t, cuda_device)
    ours = gpufeed.Stream(cuda_device)
    op = ours.submit(("intensity", arr, 512), ("scale", arr, 2.0))  # slow, in flight
    theirs = torch.cuda.Stream()
    gpufeed.foreign_stream_wait(ours, theirs.cuda_stream)
    with torch.cuda.stream(theirs):
        y = t.clone()  # ordered after our kernels on the GPU, not by the host
    op.wait()
    theirs.synchronize()
    assert torch.equal(y, t)
    assert float(y[0]) != 1.0


def test_foreign_stream_wait_on_torch_default_stream(cuda_device, torch_cuda):
    torch = torch_cuda
    n = 1 << 24
    t = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    arr = gpufeed.as_device_array(t, cuda_device)
    ours = gpufeed.Stream(cuda_device)
    op = ours.submit(("intensity", arr, 512), ("scale", arr, 2.0))  # slow, in flight
    default = torch.cuda.default_stream()
    assert default.cuda_stream == 0
    # The stream object itself (its handle is 0: the legacy default stream).
    gpufeed.foreign_stream_wait(ours, default)
    with torch.cuda.stream(default):
        y = t.clone()  # ordered after our kernels on the GPU, not by the host
    op.wait()
    default.synchronize()
    assert torch.equal(y, t)
    assert float(y[0]) != 1.0


def test_pipeline_bit_identical_on_random_inputs(cuda_device):
    alloc = gpufeed.PinnedAllocator(cuda_device)
    pipe = gpufeed.Pipeline(cuda_device, 4)
    for seed, n in enumerate([1, 4097, 1_000_003, 10_000_000]):
        x = random_f32(n, seed)
        inp, out = alloc.alloc(n), alloc.alloc(n)
        np.asarray(inp)[:] = x
        for plan in (None, ("uniform", 8, 4), ("engines", 12, 3)):
            if n < 12 and plan is not None:
                continue
            pipe.run(inp, out, "scale", 1.75, plan=plan)
            got = np.asarray(out)
            assert (got.view(np.uint32) == (x * np.float32(1.75)).view(np.uint32)).all(), (n, plan)
            del got
        inp.free()
        out.free()


def test_copy_batch_on_cuda_bit_identical(cuda_device):
    alloc = gpufeed.PinnedAllocator(cuda_device)
    s = gpufeed.Stream(cuda_device)
    sizes = [1, 1024, 16384, 65536, 262_147] * 8
    xs = [random_f32(n, 100 + i) for i, n in enumerate(sizes)]
    hs = [alloc.alloc(n) for n in sizes]
    for h, x in zip(hs, xs):
        np.asarray(h)[:] = x
    ds = [cuda_device.empty(n) for n in sizes]
    back = [alloc.alloc(n) for n in sizes]
    s.copy_batch(list(zip(hs, ds))).wait()
    s.copy_batch(list(zip(ds, back))).wait()
    for b, x in zip(back, xs):
        assert (np.asarray(b).view(np.uint32) == x.view(np.uint32)).all()


def test_pin_in_place_on_cuda(cuda_device):
    x = random_f32(N, 3)
    ref = x.copy()
    buf = gpufeed.pin(x, cuda_device)
    del x
    dev = cuda_device.empty(N)
    back = cuda_device.empty(N)
    out = gpufeed.pin(np.zeros(N, np.float32), cuda_device)
    gpufeed.Stream(cuda_device).submit(("h2d", buf, dev), ("d2d", dev, back), ("d2h", back, out)).wait()
    assert np.array_equal(out.unpin(), ref)
    assert np.array_equal(buf.unpin(), ref)


def test_compare_sync_async_on_cuda(cuda_device):
    r = gpufeed.compare_sync_async(10_000_000, cuda_device)
    assert r["correct"] and r["backend"] == "cuda"


@pytest.mark.parametrize("how", ["from_dlpack", "capsule", "no_sync", "free", "cai"])
def test_export_release_waits_for_the_consumer_stream(cuda_device, torch_cuda, how):
    """A DeviceArray exported to torch on a side stream and let go while
    torch's kernel on it is still queued (behind a ~100 ms spin): its memory
    must not be freed and reused (new arrays filled with NaN) before that
    kernel has read it. `how`: torch.from_dlpack with the side stream
    current (torch passes its handle); a capsule made with the handle
    given by hand; stream=-1 (no sync: the release waits for the device);
    the array freed with free() after the tensor dies (it waits); the
    __cuda_array_interface__ (freed after a device-wide synchronize)."""
    import gc

    torch = torch_cuda
    n = 1 << 22  # 16 MiB
    x = random_f32(n, seed=7)
    arr = cuda_device.empty(n)
    arr.upload(x)
    ptr = arr.ptr
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        if how == "capsule":
            t = torch.from_dlpack(arr.__dlpack__(stream=s.cuda_stream))
        elif how == "no_sync":
            t = torch.from_dlpack(arr.__dlpack__(stream=-1))
        elif how == "cai":
            t = torch.as_tensor(arr, device="cuda")
        else:
            t = torch.from_dlpack(arr)  # __dlpack__(stream=<s's handle>)
        assert t.data_ptr() == ptr
        torch.cuda._sleep(200_000_000)  # ~100 ms before the read below
        y = t * 2
    # The export released while `y = t * 2` is still queued on `s`.
    del t
    gc.collect()
    if how == "free":
        arr.free()  # waits (GIL released) for `s` to pass the release
    del arr
    gc.collect()
    nan = np.full(n, np.nan, dtype=np.float32)
    reused = 0
    for _ in range(8):
        d = cuda_device.empty(n)
        reused += d.ptr == ptr
        d.upload(nan)  # synchronous: done before the next allocation
        del d
    s.synchronize()
    print(f"{how}: the freed address came back {reused} time(s) of 8")
    expect = (x * np.float32(2)).view(np.uint32)
    got = y.cpu().numpy().view(np.uint32)
    assert np.array_equal(got, expect), (
        f"{how}: torch's kernel read memory reused after the export's release"
    )
    torch.cuda.synchronize()
