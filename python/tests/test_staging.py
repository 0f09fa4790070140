"""to_device / to_host: ordinary arrays to the device and back through the
staging ring. Every check compares with the source element by element, into
outputs poisoned beforehand; the GPU half also checks torch and CuPy see the
device array without a copy. The copies release the GIL; the async forms are
awaited in asyncio."""
import _thread
import asyncio
import threading
import time

import numpy as np
import pytest

import gpufeed

from conftest import need, torch_or_skip

POISON = 0xDEADBEEF


def fresh(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "int64"])
@pytest.mark.parametrize("shape", [(0,), (1,), (1000, 3), (5_000_017,)])
def test_to_device_and_back_returns_every_element(device, dtype, shape):
    rng = np.random.default_rng(abs(hash((dtype, shape))) % 2**32)
    a = fresh(rng, shape, dtype)
    d = gpufeed.to_device(a, device)
    assert d.shape == a.shape and d.dtype == np.dtype(dtype).name and d.nbytes == a.nbytes
    # Into an existing array, poisoned first.
    out = np.empty_like(a)
    out.view(np.uint8)[...] = 0xA5
    r = gpufeed.to_host(d, out=out)
    assert r is out
    assert np.array_equal(out.view(np.uint8), a.view(np.uint8))
    # Into a new array.
    n = gpufeed.to_host(d)
    assert n.shape == a.shape and n.dtype == a.dtype
    assert np.array_equal(n.view(np.uint8), a.view(np.uint8))


def test_a_device_array_written_twice_holds_the_second_copy(device):
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2**32, size=3_000_001, dtype=np.uint32)
    b = a ^ np.uint32(0x5A5A5A5A)  # differs from a in every element
    d = gpufeed.to_device(a, device)
    d2 = gpufeed.to_device(b, device)
    assert np.array_equal(gpufeed.to_host(d), a)
    assert np.array_equal(gpufeed.to_host(d2), b)


def test_sources_of_every_kind(device):
    rng = np.random.default_rng(11)
    a = rng.integers(0, 255, size=1 << 20, dtype=np.uint8)
    for src in [bytes(a), bytearray(a), memoryview(a), a[100:200_000]]:
        d = gpufeed.to_device(src, device)
        want = np.frombuffer(bytes(src), dtype=np.uint8)
        assert np.array_equal(gpufeed.to_host(d), want)


def test_a_memory_map_goes_both_ways(device, tmp_path):
    rng = np.random.default_rng(13)
    a = rng.standard_normal(700_001).astype(np.float32)
    path = tmp_path / "a.npy"
    np.save(path, a)
    m = np.load(path, mmap_mode="r")
    d = gpufeed.to_device(m, device)
    out = np.lib.format.open_memmap(tmp_path / "b.npy", mode="w+", dtype=np.float32, shape=a.shape)
    out[...] = np.nan
    gpufeed.to_host(d, out=out)
    out.flush()
    assert np.array_equal(np.load(tmp_path / "b.npy"), a)


def test_bad_input_is_a_clear_error_and_touches_nothing(device):
    a = np.arange(1000, dtype=np.float32)
    with pytest.raises(BufferError):
        gpufeed.to_device(a[::2], device)  # not contiguous
    d = gpufeed.to_device(a, device)
    small = np.full(999, np.nan, dtype=np.float32)
    with pytest.raises(ValueError):
        gpufeed.to_host(d, out=small)
    assert np.isnan(small).all()
    ro = np.full(1000, np.nan, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError):
        gpufeed.to_host(d, out=ro)
    with pytest.raises(BufferError):
        gpufeed.to_host(d, out=np.zeros((1000, 2), dtype=np.float32)[:, 0])
    with pytest.raises(TypeError):
        gpufeed.to_device(object(), device)
    # The device array is intact and usable after all that.
    assert np.array_equal(gpufeed.to_host(d), a)


def test_the_staging_ring_stays_within_its_bound(device):
    a = np.ones(40 << 20, dtype=np.uint8)  # crosses the default 8 MiB blocks
    d = gpufeed.to_device(a, device)
    gpufeed.to_host(d)
    s = gpufeed.staging_stats(device)
    assert s["bound_bytes"] == s["blocks"] * s["block_bytes"]  # 8 MiB: its own size class
    assert 0 < s["peak_in_use_bytes"] <= s["bound_bytes"]
    # The ring keeps its blocks for the next copy, within the bound.
    assert s["in_use_bytes"] <= s["bound_bytes"]


def test_to_host_never_writes_bytes_over_an_object_arrays_references(device):
    d = gpufeed.to_device(np.arange(4, dtype=np.int64), device)
    sentinel = object()
    for out in [np.full(4, sentinel, dtype=object),
                np.zeros(1, dtype=[("a", np.int64), ("o", object), ("b", np.int64)])]:
        with pytest.raises(TypeError, match="plain"):
            gpufeed.to_host(d, out=out)
        with pytest.raises(TypeError, match="plain"):
            gpufeed.to_host_async(d, out=out)
    out = np.full(4, sentinel, dtype=object)
    with pytest.raises(TypeError):
        gpufeed.to_host(d, out=out)
    assert all(x is sentinel for x in out)  # untouched, still references
    assert np.array_equal(gpufeed.to_host(d), np.arange(4))  # and the device array usable


class _CopiesOnConversion:
    """An object NumPy converts only by copying (`__array__` makes new memory)."""

    def __init__(self, n):
        self.data = np.full(n, -1, dtype=np.int64)

    def __array__(self, dtype=None, copy=None):
        return self.data.copy()


def test_to_host_refuses_an_out_that_numpy_can_only_copy(device):
    d = gpufeed.to_device(np.arange(1000, dtype=np.int64), device)
    out = _CopiesOnConversion(1000)
    with pytest.raises(BufferError, match="copy"):
        gpufeed.to_host(d, out=out)
    with pytest.raises(BufferError, match="copy"):
        gpufeed.to_host_async(d, out=out)
    assert (out.data == -1).all()
    # As a source a copy loses nothing: it goes.
    assert np.array_equal(gpufeed.to_host(gpufeed.to_device(out, device)), out.data)


def test_each_refusal_has_the_documented_type_and_says_why(device):
    d = gpufeed.to_device(np.zeros(6, np.float32), device)
    # A dtype a buffer can't describe: TypeError, not a contiguity complaint.
    for kind in ["M8[s]", "m8[s]"]:
        with pytest.raises(TypeError, match="no device dtype"):
            gpufeed.to_device(np.zeros(6, kind), device)
    ro = np.full(6, np.nan, np.float32)
    ro.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        gpufeed.to_host(d, out=ro)
    assert np.isnan(ro).all()


def test_a_0d_array_keeps_its_shape_both_ways(device):
    a = np.array(3.5, np.float32)
    d = gpufeed.to_device(a, device)
    assert d.shape == ()
    back = gpufeed.to_host(d)
    assert back.shape == () and back == a
    out = np.array(np.nan, np.float32)
    assert gpufeed.to_host(d, out=out) is out and out == a


def test_a_non_contiguous_cpu_tensor_is_a_buffer_error_both_ways(device):
    torch = torch_or_skip()
    t = torch.arange(12.0).reshape(3, 4).T
    with pytest.raises(BufferError, match="C-contiguous"):
        gpufeed.to_device(t, device)
    d = gpufeed.to_device(np.zeros((20, 10), np.float32), device)
    out = torch.full((10, 20), float("nan")).T
    with pytest.raises(BufferError, match="C-contiguous"):
        gpufeed.to_host(d, out=out)
    assert out.isnan().all()


def test_a_bfloat16_cpu_tensor_goes_to_the_device_and_back(device):
    torch = torch_or_skip()
    g = torch.Generator().manual_seed(23)
    t = torch.randn(100_003, generator=g).to(torch.bfloat16)
    d = gpufeed.to_device(t, device)
    assert d.dtype == "bfloat16" and d.shape == (100_003,)
    out = torch.full((100_003,), float("nan"), dtype=torch.bfloat16)
    assert gpufeed.to_host(d, out=out) is out
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))  # every bit


def test_a_cpu_tensor_is_written_in_place_by_to_host(device):
    torch = torch_or_skip()
    a = np.random.default_rng(19).standard_normal(300_001).astype(np.float32)
    d = gpufeed.to_device(a, device)
    base = torch.full((300_003,), float("nan"))
    out = base[1:300_002]  # a view at an offset: its data_ptr is not the storage's
    assert gpufeed.to_host(d, out=out) is out
    assert torch.equal(out, torch.from_numpy(a))
    assert base[0].isnan() and base[-1].isnan()


def test_torch_and_cupy_take_a_to_device_array_without_a_copy(cuda_device, torch_cuda, cupy_mod):
    torch = torch_cuda
    rng = np.random.default_rng(17)
    a = rng.standard_normal((1 << 20, 3)).astype(np.float32)
    d = gpufeed.to_device(a, cuda_device)
    t = torch.from_dlpack(d)
    assert t.device.type == "cuda" and t.data_ptr() == d.ptr
    assert torch.equal(t.cpu(), torch.from_numpy(a))
    c = cupy_mod.asarray(d)
    assert c.data.ptr == d.ptr
    # A CPU tensor as the source, and as the destination.
    src = torch.from_numpy(a.copy())
    d2 = gpufeed.to_device(src, cuda_device)
    dst = torch.full_like(src, float("nan"))
    gpufeed.to_host(d2, out=dst)
    assert torch.equal(dst, src)


def test_a_forked_child_makes_its_own_engine_and_copies_not_hangs(device):
    import os
    import time
    if device.kind != "cpu":
        pytest.skip("CUDA does not survive fork(); the CPU emulation's engine is checked")
    a = np.arange(1 << 22, dtype=np.float32)  # large enough for the staging ring
    gpufeed.to_device(a, device)  # the engine and its worker threads exist now
    pid = os.fork()
    if pid == 0:
        code = 5
        try:
            # The parent's engine has no workers here: the child makes its own.
            back = gpufeed.to_host(gpufeed.to_device(a, device))
            code = 0 if np.array_equal(back, a) else 3
        except BaseException:  # noqa: BLE001
            code = 4
        os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in to_device")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


BIG = 64 << 20  # uint32 elements: 256 MiB, a copy of a few hundred ms on the CPU emulation


def _big(seed):
    return np.random.default_rng(seed).integers(0, 2**32, size=BIG, dtype=np.uint32)


def _long_copy_elems(device):
    """uint32 elements whose copy takes well over 50 ms: 1 GiB on the CPU
    emulation (256 MiB took 44 ms on a 2-core CI machine), 8 GiB on a GPU
    (some 150 ms at 55 GB/s)."""
    return (2 << 30) if device.kind == "cuda" else (256 << 20)


def _cheap(n, seed):
    """n distinct-ish words, made fast (8 GiB of random numbers would take long)."""
    a = np.arange(n, dtype=np.uint32)
    a *= np.uint32(2654435761)
    a += np.uint32(seed)
    return a


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_another_python_thread_runs_while_a_large_copy_is_in_progress(device, direction):
    a = _cheap(_long_copy_elems(device), 21)
    if direction == "to_host":
        d = gpufeed.to_device(a, device)
        out = np.empty_like(a)
        out.view(np.uint8)[...] = 0xA5
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.001)

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    time.sleep(0.02)
    t0 = time.monotonic()
    if direction == "to_device":
        d = gpufeed.to_device(a, device)
    else:
        gpufeed.to_host(d, out=out)
    t1 = time.monotonic()
    stop.set()
    t.join()
    # A copy holding the GIL lets the other thread run only before it starts
    # or after it returns: never in the middle half of the call.
    mid = [x for x in ticks if t0 + 0.25 * (t1 - t0) < x < t0 + 0.75 * (t1 - t0)]
    assert t1 - t0 > 0.05, "too short a copy to tell"
    assert mid, f"no tick of the other thread during the {t1 - t0:.3f} s copy"
    if direction == "to_host":
        assert np.array_equal(out, a)
    else:
        assert np.array_equal(gpufeed.to_host(d), a)


def test_ctrl_c_interrupts_a_large_to_host_and_lets_go_of_its_buffers(device):
    # Many of the 50 ms ranges: 1 GiB on the CPU emulation, 8 GiB on a GPU.
    n = (2 << 30) if device.kind == "cuda" else (256 << 20)
    d = gpufeed.to_device(np.arange(n, dtype=np.uint32), device)
    out = np.zeros(n, np.uint32)
    t0 = time.perf_counter()
    gpufeed.to_host(d, out=out)
    full = time.perf_counter() - t0
    assert out[-1] == n - 1
    out[...] = 0
    timer = threading.Timer(0.02, _thread.interrupt_main)
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        gpufeed.to_host(d, out=out)
        time.sleep(5)  # finished before the interrupt: then it lands here
    took = time.perf_counter() - t0
    timer.join()
    # Stopped early (the signal was looked at between ranges), not at the
    # end: the last range never written, and sooner than a whole copy (the
    # interrupt at 20 ms, then the range in progress: about 50 ms).
    assert out[-1] == 0, "the copy ran to its end"
    assert took < full, (took, full)
    # The device array is usable again, and `out` no longer exported.
    assert d.state == "ready"
    out.resize(10)
    assert np.array_equal(gpufeed.to_host(d)[:10], np.arange(10, dtype=np.uint32))


def test_awaiting_to_device_async_and_to_host_async_returns_every_element(device):
    async def main():
        for i, (dtype, shape) in enumerate(
            [("float32", (3_000_017,)), ("int64", (1000, 3)), ("uint8", (0,)), ("float64", (1,))]
        ):
            a = fresh(np.random.default_rng(100 + i), shape, dtype)
            t = gpufeed.to_device_async(a, device)
            assert isinstance(t, gpufeed.Transfer)
            d = await t
            assert isinstance(d, gpufeed.DeviceArray) and d.state == "ready"
            assert d.shape == a.shape and d.dtype == np.dtype(dtype).name
            assert (await t) is d and t.done()  # awaiting again: the same array
            out = np.empty_like(a)
            out.view(np.uint8)[...] = 0xA5
            r = await gpufeed.to_host_async(d, out=out)
            assert r is out
            assert np.array_equal(out.view(np.uint8), a.view(np.uint8))
            n = await gpufeed.to_host_async(d)
            assert n.shape == a.shape and n.dtype == a.dtype
            assert np.array_equal(n.view(np.uint8), a.view(np.uint8))
            # wait() is the synchronous form.
            assert np.array_equal(gpufeed.to_host_async(d).wait().view(np.uint8), a.view(np.uint8))

    asyncio.run(main())


def test_two_awaited_transfers_overlap_with_each_other_and_other_coroutines(device):
    # Copies long enough to sample (256 MiB take ~5 ms on a GPU).
    n = _long_copy_elems(device)
    a, b = _cheap(n, 31), _cheap(n, 32)
    db = gpufeed.to_device(b, device)
    out = np.empty_like(b)
    out.view(np.uint8)[...] = 0xA5
    samples = []

    async def ticker(t1, t2):
        while not (t1.done() and t2.done()):
            samples.append((t1.done(), t2.done()))
            await asyncio.sleep(0.001)

    async def main():
        t1 = gpufeed.to_device_async(a, device)
        t2 = gpufeed.to_host_async(db, out=out)
        assert db.state == "in-flight" or t2.done()  # the source is the transfer's
        d, r, _ = await asyncio.gather(t1, t2, ticker(t1, t2))
        return d, r

    d, r = asyncio.run(main())
    # The loop ran other coroutines while both copies were in flight at once.
    both = [s for s in samples if s == (False, False)]
    assert len(both) >= 3, samples[:10]
    assert r is out and np.array_equal(out, b)
    assert np.array_equal(gpufeed.to_host(d), a)
    assert db.state == "ready"


def test_a_transfer_dropped_mid_copy_stops_before_it_lets_go_of_the_buffers(device):
    a = _big(41)
    d = gpufeed.to_device(a, device)
    out = np.zeros_like(a)
    t = gpufeed.to_host_async(d, out=out)
    with pytest.raises(ValueError):
        out.resize(10)  # exported: the copy's thread writes it
    del t  # stops the copy (or it had ended), then releases the export
    assert d.state == "ready"  # the device array is back, usable
    assert np.array_equal(gpufeed.to_host(d), a)
    out.resize(10)  # no export left (refcheck: no other reference either)
    assert out.shape == (10,)
    # An upload dropped at once: the source is let go of as well.
    src = _big(42)
    gpufeed.to_device_async(src, device)  # a temporary: dropped at once
    src.resize(10)
    assert src.shape == (10,)
