"""to_device / to_host: ordinary arrays to the device and back through the
staging ring. Every check compares with the source element by element, into
outputs poisoned beforehand; the GPU half also checks torch and CuPy see the
device array without a copy."""
import numpy as np
import pytest

import gpufeed

from conftest import need

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
    assert 0 < s["peak_in_use_bytes"] <= s["bound_bytes"] * 9 // 8
    # The ring keeps its blocks for the next copy, within the bound.
    assert s["in_use_bytes"] <= s["bound_bytes"] * 9 // 8


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


def test_a_forked_child_gets_an_error_from_the_parents_engine_not_a_hang(device):
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
            gpufeed.to_device(a, device)
            code = 3  # the parent's workers copied in the child?
        except gpufeed.InvalidArgumentError:
            code = 0
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
