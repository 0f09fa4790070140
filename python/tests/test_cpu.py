"""gpufeed on the CPU emulation (NumPy only): the seed's PinnedAllocator flow,
pin-in-place, the ownership rules, copies/launches/pipeline, bad input."""
import asyncio
import gc
import _thread
import threading
import time

import numpy as np
import pytest

import gpufeed


def test_seed_allocator_flow(alloc):
    buf = alloc.alloc((256, 4), np.float32)
    arr = alloc.get_array(buf)
    assert arr.shape == (256, 4) and arr.dtype == np.float32 and arr.flags.writeable
    arr[:] = 7.0
    # No copy: a second view sees the same memory.
    again = np.asarray(buf)
    assert again.__array_interface__["data"][0] == arr.__array_interface__["data"][0] == buf.ptr
    assert (again == 7.0).all()
    assert buf.exports == 2
    del arr, again
    assert buf.exports == 0
    stats = alloc.stats()
    assert stats["blocks_in_use"] >= 1 and stats["in_use_bytes"] >= buf.nbytes
    alloc.free(buf)
    assert buf.state == "freed"
    assert alloc.stats()["cached_bytes"] >= 4096
    # Reuse from the cache: a hit.
    hits = alloc.stats()["hits"]
    b2 = alloc.alloc((256, 4), "float32")
    assert alloc.stats()["hits"] == hits + 1
    b2.free()
    alloc.empty_cache()
    assert alloc.stats()["cached_bytes"] == 0
    alloc.max_cached_bytes = 0
    assert alloc.max_cached_bytes == 0
    b3 = alloc.alloc(10)
    b3.free()
    assert alloc.stats()["cached_bytes"] == 0
    alloc.max_cached_bytes = None
    assert alloc.max_cached_bytes is None


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int8", "int16", "int32",
                                   "int64", "uint8", "uint16", "uint32", "uint64"])
def test_dtypes_round_trip_through_numpy(alloc, dtype):
    buf = alloc.alloc(5, dtype, zero=True)
    arr = buf.get_array()
    assert arr.dtype == np.dtype(dtype)
    arr[:] = np.arange(5).astype(dtype)
    np.testing.assert_array_equal(np.asarray(buf), np.arange(5).astype(dtype))


def test_bfloat16_is_exported_as_raw_bits(alloc):
    buf = alloc.alloc(3, "bfloat16")
    assert buf.dtype == "bfloat16" and buf.get_array().dtype == np.uint16


def test_views_block_operations_and_free(device, alloc):
    buf = alloc.alloc(16)
    dev = device.empty(16)
    view = buf.get_array()
    s = gpufeed.Stream(device)
    with pytest.raises(BufferError, match="live view"):
        s.copy_h2d(buf, dev)
    with pytest.raises(BufferError, match="live view"):
        buf.free()
    assert buf.state == "ready" and dev.state == "ready"  # nothing was taken
    again = np.asarray(buf)  # a counted view too
    del view
    with pytest.raises(BufferError):
        s.copy_h2d(buf, dev)
    del again
    s.copy_h2d(buf, dev).wait()


def test_in_flight_buffers_cannot_be_touched(device, alloc):
    src = alloc.alloc(1 << 16)
    src.get_array()[:] = 1.0
    dev = device.empty(1 << 16)
    dst = alloc.alloc(1 << 16)
    s = gpufeed.Stream(device)
    op = s.submit(("h2d", src, dev), ("intensity", dev, 64), ("d2h", dev, dst))
    for b in (src, dst):
        assert b.state == "in-flight"
        with pytest.raises(BufferError, match="in use by an operation"):
            np.asarray(b)
        with pytest.raises(BufferError, match="in use by an operation"):
            b.get_array()
        with pytest.raises(BufferError):
            b.free()
    with pytest.raises(BufferError):
        dev.download()
    with pytest.raises(BufferError):
        s.copy_h2d(src, device.empty(1 << 16))  # already owned by `op`
    assert op.wait() is None
    assert op.done()
    assert op.wait() is None  # idempotent
    assert src.state == dst.state == dev.state == "ready"
    out = np.asarray(dst)
    assert out.shape == (1 << 16,) and np.isfinite(out).all()


def test_copies_and_kernels_match_numpy(device, alloc):
    rng = np.random.default_rng(0)
    n = 10_001
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    hx, hy, out = alloc.alloc(n), alloc.alloc(n), alloc.alloc(n)
    hx.get_array()[:] = x
    hy.get_array()[:] = y
    dx, dy = device.empty(n), device.empty(n)
    s = gpufeed.Stream(device)
    s.submit(("h2d", hx, dx), ("h2d", hy, dy), ("saxpy", 2.5, dx, dy),
             ("scale", dy, 0.5), ("d2h", dy, out)).wait()
    expect = (np.float32(2.5) * x + y) * np.float32(0.5)
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-6, atol=1e-6)
    # d2d, and the single-command helpers
    dz = device.empty(n)
    s.copy_d2d(dx, dz).wait()
    s.scale(dz, 2.0).wait()
    np.testing.assert_array_equal(dz.download(), x * np.float32(2.0))
    # pageable sync path
    dz.upload(np.full(n, 3.0, np.float32))
    np.testing.assert_array_equal(dz.download(), np.full(n, 3.0, np.float32))


def test_copy_batch_moves_many_buffers_in_one_operation(device, alloc):
    rng = np.random.default_rng(3)
    sizes = [1, 7, 1000, 4096, 33, 10_001]
    hs = [alloc.alloc(n, "int32") for n in sizes]
    for h in hs:
        h.get_array()[:] = rng.integers(1, 2**31 - 1, h.shape, dtype=np.int32)
    want = [np.array(h.get_array()) for h in hs]
    ds = [device.empty(n, "int32") for n in sizes]
    d2 = [device.empty(n, "int32") for n in sizes]
    back = [alloc.alloc(n, "int32") for n in sizes]
    s = gpufeed.Stream(device)
    s.copy_batch(list(zip(hs, ds))).wait()
    s.copy_batch(list(zip(ds, d2))).wait()
    s.copy_batch(list(zip(d2, back))).wait()
    for b, w in zip(back, want):
        np.testing.assert_array_equal(np.asarray(b), w)
    # A buffer written by two copies, or written by one and read by another:
    # the copies of a batch have no order, so it is refused; nothing is lost.
    with pytest.raises(gpufeed.OverlapError):
        s.copy_batch([(hs[0], ds[0]), (hs[0], ds[0])]).wait()
    with pytest.raises(gpufeed.OverlapError):
        s.copy_batch([(ds[1], d2[1]), (d2[1], back[1])]).wait()
    assert all(b.state == "ready" for b in hs + back)
    np.testing.assert_array_equal(np.asarray(back[1]), want[1])
    with pytest.raises(TypeError, match="host buffers"):
        s.copy_batch([(hs[0], back[0])])
    with pytest.raises(TypeError, match="tuples"):
        s.copy_batch([hs[0]])
    with pytest.raises(gpufeed.LengthMismatchError):
        s.copy_batch([(hs[0], ds[1])]).wait()


def _narrow_rne(f32):
    """float32 -> bfloat16 bits, round to nearest even (finite inputs)."""
    bits = f32.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_a_user_kernel_crate_runs_from_python_bit_for_bit(device, alloc):
    # examples/bf16-kernels, built to PTX by the extension's build.rs:
    # bfloat16 in, float32 or bfloat16 out, against a NumPy reference.
    rng = np.random.default_rng(7)
    n = 30_001
    x_bits = _narrow_rne(rng.standard_normal(n).astype(np.float32) * np.float32(100))
    hx = alloc.alloc(n, "bfloat16")
    hx.get_array()[:] = x_bits
    dx = device.empty(n, "bfloat16")
    d16, d32 = device.empty(n, "bfloat16"), device.empty(n, "float32")
    o16, o32 = alloc.alloc(n, "bfloat16"), alloc.alloc(n, "float32")
    s = gpufeed.Stream(device)
    s.submit(("h2d", hx, dx), ("scale_bf16", dx, d16, 1.7), ("scale_bf16_f32", dx, d32, 1.7),
             ("d2h", d16, o16), ("d2h", d32, o32)).wait()
    widened = (x_bits.astype(np.uint32) << 16).view(np.float32)
    product = widened * np.float32(1.7)
    np.testing.assert_array_equal(np.asarray(o32).view(np.uint32), product.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(o16), _narrow_rne(product))
    # Wrong dtypes and lengths: typed errors, the buffers untouched.
    with pytest.raises(TypeError):
        s.scale_bf16(dx, d32, 1.0)
    short = device.empty(n - 1, "bfloat16")
    with pytest.raises(gpufeed.GpuFeedError):
        s.scale_bf16(dx, short, 1.0)
    assert dx.state == d32.state == short.state == "ready"


def test_pipeline_bit_identical_to_reference(device, alloc):
    n = 1_000_003
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(np.float32)
    inp, out = alloc.alloc(n), alloc.alloc(n)
    inp.get_array()[:] = x
    pipe = gpufeed.Pipeline(device, streams=4)
    for plan in (None, "auto", 7, ("uniform", 8, 4), ("engines", 12, 3)):
        np.asarray(out)[:] = 0
        info = pipe.run(inp, out, kernel="scale", arg=3.0, plan=plan)
        assert set(info) == {"plan", "chunks", "streams", "layout"}
        got = np.asarray(out)
        assert (got.view(np.uint32) == (x * np.float32(3.0)).view(np.uint32)).all(), plan
        del got  # a live view would block the next run
    assert inp.state == out.state == "ready"


@pytest.mark.parametrize("plan", [2**62, ("uniform", 2**62, 4), ("engines", 2**62, 3)])
def test_a_plan_of_more_chunks_than_elements_runs_in_fewer_at_once(device, alloc, plan):
    x = np.arange(10, dtype=np.float32)
    inp, out = alloc.alloc(10), alloc.alloc(10)
    inp.get_array()[:] = x
    np.asarray(out)[:] = np.nan
    info = gpufeed.Pipeline(device, streams=4).run(inp, out, kernel="scale", arg=3.0, plan=plan)
    assert info["chunks"] == 1, info
    assert np.array_equal(np.asarray(out), x * np.float32(3.0))


def test_pipeline_to_a_device_array(device, alloc):
    n = 50_000
    inp = alloc.alloc(n)
    inp.get_array()[:] = np.arange(n, dtype=np.float32)
    dev = device.empty(n)
    gpufeed.Pipeline(device, 3).run(inp, dev, "scale", 2.0, plan=("uniform", 5, 3))
    np.testing.assert_array_equal(dev.download(), np.arange(n, dtype=np.float32) * 2)


def test_pipeline_releases_the_gil(device, alloc):
    n = 4_000_000
    inp, out = alloc.alloc(n), alloc.alloc(n)
    np.asarray(inp)[:] = 1.0
    pipe = gpufeed.Pipeline(device, 4)
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = count
        pipe.run(inp, out, "intensity", 64, plan=("uniform", 8, 4))
        during = count - before
    finally:
        stop.set()
        t.join()
    assert during > 1000, during


def test_asyncio_await(device, alloc):
    n = 100_000
    inp, out = alloc.alloc(n), alloc.alloc(n)
    np.asarray(inp)[:] = 2.0
    pipe = gpufeed.Pipeline(device, 4)

    async def main():
        op = pipe.run_async(inp, out, "scale", 4.0)
        info = await op
        return info

    info = asyncio.run(main())
    assert info["chunks"] >= 1
    assert (np.asarray(out) == 8.0).all()


def test_pin_in_place(device):
    x = np.arange(4096, dtype=np.float64)
    addr = x.__array_interface__["data"][0]
    buf = gpufeed.pin(x, device)
    assert buf.pinned_in_place and buf.ptr == addr and buf.dtype == "float64"
    # While `x` is reachable, Python could touch the memory: refused.
    dev = device.empty(4096, "float64")
    s = gpufeed.Stream(device)
    with pytest.raises(BufferError, match="still referenced"):
        s.copy_h2d(buf, dev)
    with pytest.raises(ValueError):
        x.resize(10)  # the export keeps the owner from reallocating
    del x
    gc.collect()
    s.copy_h2d(buf, dev).wait()
    np.testing.assert_array_equal(dev.download(), np.arange(4096, dtype=np.float64))
    view = buf.get_array()
    assert view.__array_interface__["data"][0] == addr
    with pytest.raises(BufferError):
        buf.unpin()
    del view
    back = buf.unpin()
    assert isinstance(back, np.ndarray) and back.__array_interface__["data"][0] == addr
    assert buf.state == "freed"
    back.resize(10, refcheck=False)  # no export any more


def test_pinned_buffers_say_they_are_locked(device, alloc):
    buf = alloc.alloc(1000, "float32")
    assert buf.locked is True
    pinned = gpufeed.pin(np.zeros(1000, np.float32), device)
    assert pinned.locked is True and pinned.pinned_in_place
    pinned.unpin()
    assert pinned.locked is True  # what it was: kept after the unpin
    buf.free()
    assert alloc.stats()["failed_frees"] == 0
    assert device.release_failures == 0


_UNDER_A_MEMLOCK_LIMIT = r"""
import ctypes, resource, sys
import numpy as np

# As root, mlock ignores the limit (CAP_IPC_LOCK): drop the capability from
# this thread, the one that allocates and pins below.
libc = ctypes.CDLL(None, use_errno=True)
hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)()
assert libc.capget(hdr, data) == 0, ctypes.get_errno()
data[0] &= ~(1 << 14)  # effective
data[1] &= ~(1 << 14)  # permitted
assert libc.capset(hdr, data) == 0, ctypes.get_errno()
limit = 1 << 20
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))

import gpufeed
dev = gpufeed.Device("cpu")
alloc = gpufeed.PinnedAllocator(dev)
small = alloc.alloc(1024, "uint8")
big = alloc.alloc(8 * limit, "uint8")
pinned_small = gpufeed.pin(np.zeros(1024, np.uint8), dev)
pinned_big = gpufeed.pin(np.zeros(8 * limit, np.uint8), dev)
print(small.locked, big.locked, pinned_small.locked, pinned_big.locked)
"""


def test_under_a_memlock_limit_buffers_say_they_are_not_locked(device):
    # The CPU emulation's default policy hands out unlocked memory when the
    # memlock limit refuses: `locked` says so, for allocated and pinned-in-place
    # buffers. Its own process: the limit is process-wide.
    import os
    import subprocess
    import sys

    env = dict(os.environ, HOST_BACKEND="cpu")
    r = subprocess.run(
        [sys.executable, "-c", _UNDER_A_MEMLOCK_LIMIT],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "True", "False"], r.stdout + r.stderr


def test_pin_in_place_d2h_writes_the_original_array(device):
    n = 1000
    dev = device.empty(n, "int32")
    dev.upload(np.arange(n, dtype=np.int32))
    buf = gpufeed.pin(np.zeros(n, np.int32), device)
    gpufeed.Stream(device).copy_d2h(dev, buf).wait()
    np.testing.assert_array_equal(buf.unpin(), np.arange(n, dtype=np.int32))


def test_pinning_an_array_again_names_the_buffer_that_holds_it(device):
    x = np.arange(4096, dtype=np.float32)
    addr = x.__array_interface__["data"][0]
    first = gpufeed.pin(x, device)
    with pytest.raises(BufferError) as e:
        gpufeed.pin(x, device)
    msg = str(e.value)
    # The holder: which buffer, where, how big, and how to let it go.
    assert "pinned already" in msg, msg
    assert "PinnedBuffer shape=(4096,) dtype=float32" in msg, msg
    assert f"ptr={addr:#x}" in msg and "16384 bytes" in msg, msg
    assert f"{addr:#x}..{addr + 16384:#x}" in msg, msg
    assert "still alive" in msg and "buf.unpin()" in msg and "del buf" in msg, msg
    assert first.state == "ready"  # the refusal left the first one alone
    # Once released, the same array pins again.
    back = first.unpin()
    assert back is x
    again = gpufeed.pin(x, device)
    assert again.ptr == addr
    del again  # dropping the buffer unpins too
    gc.collect()
    gpufeed.pin(x, device).free()


@pytest.mark.parametrize("release", ["unpin", "free"])
def test_a_released_buffer_holds_nothing_so_its_array_pins_again_and_goes_to_an_operation(device, release):
    import weakref
    x = np.arange(4096, dtype=np.float64)
    first = gpufeed.pin(x, device)
    if release == "unpin":
        assert first.unpin() is x
    else:
        first.free()
    assert first.state == "freed"
    # `first` is kept: released, it holds no reference to the array, so the
    # array pinned again goes to an operation once `x` is dropped.
    again = gpufeed.pin(x, device)
    del x
    gc.collect()
    dev = device.empty(4096, "float64")
    gpufeed.Stream(device).copy_h2d(again, dev).wait()
    np.testing.assert_array_equal(dev.download(), np.arange(4096, dtype=np.float64))
    # Both buffers released: nothing holds the array but its last name.
    back = again.unpin()
    gone = weakref.ref(back)
    del back
    gc.collect()
    assert gone() is None
    assert first.state == again.state == "freed"
    with pytest.raises(BufferError):
        first.unpin()


def test_pin_refusals(device):
    with pytest.raises(BufferError, match="non-contiguous"):
        gpufeed.pin(np.asfortranarray(np.zeros((10, 10), np.float32)), device)
    ro = np.zeros(10, np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        gpufeed.pin(ro, device)
    with pytest.raises(TypeError, match="takes a numpy.ndarray"):
        gpufeed.pin(b"bytes are immutable", device)
    base = np.zeros(100, np.float32)
    with pytest.raises(BufferError, match="view of another array"):
        gpufeed.pin(base[10:20], device)
    with pytest.raises(BufferError, match="memoryview"):
        gpufeed.pin(memoryview(bytearray(10)), device)
    with pytest.raises(TypeError, match="takes a numpy.ndarray"):
        gpufeed.pin([1, 2, 3], device)
    with pytest.raises(TypeError, match="unsupported element type"):
        gpufeed.pin(np.zeros(3, np.complex64), device)
    # A bytearray works (as do array.array and mmap.mmap).
    ba = gpufeed.pin(bytearray(100), device)
    assert ba.dtype == "uint8" and ba.nbytes == 100
    ba.free()


def test_dropped_operation_releases_at_completion(device, alloc):
    buf = alloc.alloc(1 << 20)
    dev = device.empty(1 << 20)
    op = gpufeed.Stream(device).copy_h2d(buf, dev)
    del op
    gc.collect()
    device.synchronize()
    # Either handed back (finished before the drop) or released by the device's completion.
    assert buf.state in ("ready", "freed")
    if buf.state == "freed":
        with pytest.raises(BufferError, match="dropped before wait"):
            buf.get_array()


def test_dlpack_host_exports(alloc):
    buf = alloc.alloc((3, 4), "float32")
    np.asarray(buf)[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert buf.__dlpack_device__() == (1, 0)
    t = np.from_dlpack(buf)
    assert t.shape == (3, 4) and t.__array_interface__["data"][0] == buf.ptr
    assert buf.exports == 1
    with pytest.raises(BufferError):
        buf.free()
    del t
    assert buf.exports == 0
    buf.dlpack_device = "cuda_host"
    assert buf.__dlpack_device__() == (3, 0)
    # NumPy accepts kDLCUDAHost (see FACTS); the versioned capsule too.
    t = np.from_dlpack(buf)
    assert t[2, 3] == 11
    del t
    cap = buf.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap)
    del cap
    gc.collect()
    assert buf.exports == 0
    with pytest.raises(BufferError, match="copy"):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    with pytest.raises(ValueError):
        buf.dlpack_device = "gpu"


def test_device_interop_is_refused_on_the_cpu_emulation(device):
    if device.kind != "cpu":
        pytest.skip("CPU emulation only")
    dev = device.empty(10)
    with pytest.raises(BufferError, match="CPU emulation"):
        dev.__cuda_array_interface__
    with pytest.raises(BufferError, match="CPU emulation"):
        dev.__dlpack__()
    with pytest.raises(gpufeed.BackendUnavailableError):
        gpufeed.as_device_array(np.zeros(3), device)


def test_bad_input(device, alloc):
    s = gpufeed.Stream(device)
    a, dev = alloc.alloc(10), device.empty(11)
    with pytest.raises(gpufeed.LengthMismatchError) as e:
        s.copy_h2d(a, dev)
    assert e.value.kind == "LengthMismatch" and "length mismatch" in str(e.value)
    assert isinstance(e.value, gpufeed.GpuFeedError) and isinstance(e.value, RuntimeError)
    with pytest.raises(TypeError, match="float64"):
        s.copy_h2d(a, device.empty(10, "float64"))
    with pytest.raises(TypeError, match="PinnedBuffer"):
        s.copy_h2d(np.zeros(10, np.float32), device.empty(10))
    with pytest.raises(TypeError, match="DeviceArray"):
        s.copy_h2d(a, alloc.alloc(10))
    with pytest.raises(TypeError, match="float32"):
        s.scale(device.empty(10, "int32"), 2.0)
    with pytest.raises(gpufeed.OverlapError):
        s.copy_d2d(dev, dev)
    with pytest.raises(ValueError, match="unknown command"):
        s.submit(("frobnicate", dev))
    with pytest.raises(TypeError):
        s.submit(("scale", dev))
    with pytest.raises(TypeError, match="dtype"):
        alloc.alloc(10, "complex128")
    with pytest.raises(TypeError, match="shape"):
        alloc.alloc("ten")
    with pytest.raises(ValueError, match="overflows"):
        alloc.alloc((1 << 40, 1 << 40))
    with pytest.raises(gpufeed.InvalidArgumentError, match="unknown backend"):
        gpufeed.Device("tpu")
    pipe = gpufeed.Pipeline(device, 2)
    inp, out = alloc.alloc(100), alloc.alloc(99)
    with pytest.raises(gpufeed.LengthMismatchError):
        pipe.run(inp, out)
    assert inp.state == out.state == "ready"  # handed back on error
    with pytest.raises(gpufeed.InvalidArgumentError):
        pipe.run(inp, alloc.alloc(100), plan=("uniform", 4, 8))  # more streams than the pipeline's
    with pytest.raises(BufferError, match="different"):
        pipe.run(inp, inp)
    with pytest.raises(ValueError, match="unknown kernel"):
        pipe.run(inp, alloc.alloc(100), kernel="relu")
    with pytest.raises(TypeError, match="float32"):
        pipe.run(alloc.alloc(100, "float64"), alloc.alloc(100, "float64"))
    with pytest.raises(gpufeed.InvalidArgumentError):
        gpufeed.compare_sync_async(0)
    with pytest.raises(gpufeed.InvalidArgumentError):
        gpufeed.Pipeline(device, 0)


def test_compare_sync_async():
    r = gpufeed.compare_sync_async(200_000)
    assert r["correct"] is True and r["sync_ms"] > 0 and r["async_ms"] > 0


def _long_operation(device, alloc, seconds):
    """A batch of intensity kernels that runs for about `seconds` (k sized
    from timed runs long enough that launch costs don't count), ending in a
    copy back into a poisoned pinned array."""
    n = 1 << 20
    dev = device.empty(n)
    src, dst = alloc.alloc(n), alloc.alloc(n)
    src.get_array()[:] = 1.0
    s = gpufeed.Stream(device)
    s.submit(("h2d", src, dev)).wait()
    k = 16
    while True:
        t0 = time.perf_counter()
        s.submit(("intensity", dev, k)).wait()
        took = time.perf_counter() - t0
        if took >= 0.2 or k >= (1 << 28):
            break
        k *= 4
    k = min(int(k * seconds / max(took, 1e-6)), (1 << 31) - 1)
    dst.get_array()[:] = np.nan
    op = s.submit(("h2d", src, dev), ("intensity", dev, k), ("d2h", dev, dst))
    return op, s, (src, dst, dev)


def test_ctrl_c_interrupts_a_blocking_wait_and_the_operation_stays_safe(device, alloc):
    op, s, (src, dst, dev) = _long_operation(device, alloc, 3.0)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        op.wait()
    latency = time.perf_counter() - t0 - 0.3
    assert not op.done(), "the operation ended before the interrupt: too short to test"
    assert latency < 0.2, f"Ctrl-C took {latency:.3f} s to interrupt the wait"
    # Interrupted, not finished: the buffers are still the operation's.
    assert dst.state == "in-flight"
    with pytest.raises(BufferError):
        np.asarray(dst)
    # Waiting again finishes it; every element is the kernel's result.
    assert op.wait() is None
    out = np.asarray(dst)
    assert np.isfinite(out).all() and (out == out[0]).all()
    # A stream's synchronize is interruptible too, and the work goes on.
    op2, s2, _ = _long_operation(device, alloc, 3.0)
    threading.Timer(0.3, _thread.interrupt_main).start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        s2.synchronize()
    assert time.perf_counter() - t0 - 0.3 < 0.2
    assert op2.wait() is None
