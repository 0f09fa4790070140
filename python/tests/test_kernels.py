"""gpufeed.kernels: sum, max, cumsum, softmax, histogram, matmul.

On the device at hand (the CPU emulation without a GPU) with gpufeed's own
device arrays: fresh random inputs, outputs poisoned (NaN), every element
checked against NumPy in float64 within the documented bounds (exact for the
integer scan, the maximum and the histogram). Then the typed errors, with the
arrays handed back. The GPU tests take PyTorch CUDA tensors (and a CuPy
array) in place, zero copy, against torch's float64 results.
"""
import numpy as np
import pytest

import gpufeed
import gpufeed.kernels as K

U = 2.0 ** -24
SIZES = [0, 1, 31, 33, 1000, 1_000_007]


@pytest.fixture()
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def wide(rng, n):
    """float32 over a wide range of magnitudes."""
    return (rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-8, 9, n)).astype(np.float32)


def host(a):
    return gpufeed.to_host(a)


def bf16_array(bits):
    """A bfloat16 device array holding `bits` (uint16)."""
    d = gpufeed.default_device().empty(bits.shape, "bfloat16")
    d.upload(bits)
    return d


def bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def poisoned(shape, dtype=np.float32):
    a = np.empty(shape, dtype)
    a.view(np.uint8)[...] = 0xFF
    return gpufeed.to_device(a)


@pytest.mark.parametrize("n", SIZES)
def test_sum_and_max_float32(rng, n):
    x = wide(rng, n)
    d = gpufeed.to_device(x)
    s = K.sum(d)
    assert s.shape == () and s.dtype == "float32"
    x64 = x.astype(np.float64)
    assert abs(float(host(s)) - x64.sum()) <= 64 * U * np.abs(x64).sum()
    out = poisoned((1,))
    assert K.max(d, out=out) is out
    assert host(out)[0] == (x.max() if n else -np.inf)
    assert d.state == "ready" and out.state == "ready"
    # Deterministic: the same bits again.
    assert host(K.sum(d)).tobytes() == host(s).tobytes()


@pytest.mark.parametrize("n", [0, 1, 33, 1000, 100_003])
def test_sum_and_max_bfloat16(rng, n):
    bits = (wide(rng, n).view(np.uint32) >> 16).astype(np.uint16)
    d = bf16_array(bits)
    v = bf16_values(bits).astype(np.float64)
    assert abs(float(host(K.sum(d))) - v.sum()) <= 64 * U * np.abs(v).sum()
    assert float(host(K.max(d))) == (v.max() if n else -np.inf)


def test_max_ignores_nans():
    x = np.array([1.0, np.nan, 3.0, -2.0], np.float32)
    assert host(K.max(gpufeed.to_device(x))) == 3.0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", ["float32", "int32", "uint32"])
def test_cumsum(rng, n, dtype):
    if dtype == "float32":
        x = wide(rng, n)
    else:
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    out = poisoned((n,), dtype)
    got = K.cumsum(gpufeed.to_device(x), out=out)
    assert got is out
    y = host(out)
    if dtype == "float32":
        x64 = x.astype(np.float64)
        exact, bound = np.cumsum(x64), np.cumsum(np.abs(x64))
        depth = 90 + 2 * (np.arange(n) // (4096 * 128))
        assert np.all(np.abs(y - exact) <= depth * U * bound * 1.01)
    else:
        with np.errstate(over="ignore"):
            assert np.array_equal(y, np.cumsum(x, dtype=dtype))  # wrapping


def test_cumsum_new_array_is_one_dimensional():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    y = K.cumsum(gpufeed.to_device(x))
    assert y.shape == (12,) and y.dtype == "int32"
    assert np.array_equal(host(y), np.cumsum(x))


@pytest.mark.parametrize("shape", [(0, 7), (1, 1), (3, 31), (9, 33), (17, 512), (5, 513), (2, 4097), (1, 20000)])
def test_softmax(rng, shape):
    x = rng.uniform(-8, 8, shape).astype(np.float32)
    out = poisoned(shape)
    assert K.softmax(gpufeed.to_device(x), out=out) is out
    y = host(out).astype(np.float64)
    x64 = x.astype(np.float64)
    d = x64 - x64.max(axis=1, keepdims=True) if shape[0] and shape[1] else x64
    exact = np.exp(d) / np.exp(d).sum(axis=1, keepdims=True) if x.size else x64
    # Relative error (|d| + D + 7) u, D the sum's depth (at most 8 + 4 ceil(cols/4/width) + 8).
    depth = 16 + 4 * -(-shape[1] // 128)
    assert np.all(np.abs(y - exact) <= (np.abs(d) + depth + 7) * U * exact * 1.01)


@pytest.mark.parametrize("n", SIZES)
def test_histogram(rng, n):
    x = rng.integers(0, 256, n, dtype=np.uint8)
    if n > 100:
        x[: n // 2] = 42  # many atomics on one bin
    h = K.histogram(gpufeed.to_device(x))
    assert h.shape == (256,) and h.dtype == "uint32"
    assert np.array_equal(host(h), np.bincount(x, minlength=256))
    out = poisoned((256,), np.uint32)
    K.histogram(gpufeed.to_device(x.reshape(-1, 1) if n else x), out=out)
    assert np.array_equal(host(out), np.bincount(x, minlength=256))


def gemm_bound(a, b, alpha, beta, c0, scale):
    k = a.shape[1]
    j = scale * (k + 2)
    gamma = j * U / (1 - j * U)
    mag = abs(alpha) * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    if beta:
        mag = mag + np.abs(beta * c0.astype(np.float64))
    return gamma * mag * 1.01


@pytest.mark.parametrize("mnk", [(0, 5, 3), (4, 5, 0), (1, 1, 1), (33, 31, 17), (129, 257, 65)])
def test_matmul_float32(rng, mnk):
    m, n, k = mnk
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    c = K.matmul(gpufeed.to_device(a), gpufeed.to_device(b))
    assert c.shape == (m, n) and c.dtype == "float32"
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.all(np.abs(host(c) - exact) <= gemm_bound(a, b, 1, 0, None, 1))
    # alpha, beta: into out, whose values are read.
    c0 = rng.uniform(-1, 1, (m, n)).astype(np.float32)
    out = gpufeed.to_device(c0)
    assert K.matmul(gpufeed.to_device(a), gpufeed.to_device(b), out=out, alpha=1.5, beta=-0.75) is out
    exact = 1.5 * exact - 0.75 * c0.astype(np.float64)
    assert np.all(np.abs(host(out) - exact) <= gemm_bound(a, b, 1.5, -0.75, c0, 1))


@pytest.mark.parametrize("mnk", [(4, 5, 0), (1, 1, 1), (33, 31, 17), (130, 136, 72)])
def test_matmul_bfloat16(rng, mnk, device):
    m, n, k = mnk
    ab = (rng.uniform(-1, 1, (m, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    bb = (rng.uniform(-1, 1, (k, n)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    try:
        c = K.matmul(bf16_array(ab), bf16_array(bb))
    except gpufeed.InvalidArgumentError as e:
        assert device.kind == "cuda" and "compute capability" in str(e)  # below sm_80
        return
    a, b = bf16_values(ab), bf16_values(bb)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert c.dtype == "float32" and c.shape == (m, n)
    assert np.all(np.abs(host(c) - exact) <= gemm_bound(a, b, 1, 0, None, 2))


def test_matmul_a_with_itself():
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    d = gpufeed.to_device(a)
    assert np.array_equal(host(K.matmul(d, d)), a @ a)


def test_on_a_stream_of_ours(device):
    s = gpufeed.Stream(device)
    x = gpufeed.to_device(np.ones(100, np.float32))
    assert host(K.sum(x, stream=s)) == 100.0
    assert host(K.cumsum(x, stream=s))[-1] == 100.0


def test_typed_errors_hand_the_arrays_back():
    f64 = gpufeed.to_device(np.ones(10))
    f32 = gpufeed.to_device(np.ones(10, np.float32))
    i8 = gpufeed.to_device(np.ones(10, np.int8))
    with pytest.raises(TypeError, match="float64"):
        K.sum(f64)
    with pytest.raises(TypeError):
        K.cumsum(i8)
    with pytest.raises(TypeError):
        K.histogram(f32)
    with pytest.raises(TypeError, match="host memory"):
        K.sum(np.ones(10, np.float32))
    with pytest.raises(TypeError):
        K.sum([1.0, 2.0])
    with pytest.raises(TypeError):  # out of another dtype
        K.cumsum(f32, out=gpufeed.to_device(np.ones(10, np.int32)))
    with pytest.raises(ValueError):  # out of another size
        K.cumsum(f32, out=gpufeed.to_device(np.ones(11, np.float32)))
    with pytest.raises(ValueError):
        K.sum(f32, out=gpufeed.to_device(np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="2-D"):
        K.softmax(f32)
    with pytest.raises(ValueError, match="chain"):
        K.matmul(gpufeed.to_device(np.ones((2, 3), np.float32)), gpufeed.to_device(np.ones((2, 3), np.float32)))
    with pytest.raises(TypeError):  # mixed dtypes
        K.matmul(gpufeed.to_device(np.ones((2, 2), np.float32)), bf16_array(np.ones((2, 2), np.uint16)))
    with pytest.raises(ValueError, match="out="):
        K.matmul(gpufeed.to_device(np.ones((2, 2), np.float32)), gpufeed.to_device(np.ones((2, 2), np.float32)), beta=1.0)
    with pytest.raises(BufferError, match="in place"):
        K.cumsum(f32, out=f32)
    sq = gpufeed.to_device(np.ones((2, 2), np.float32))
    with pytest.raises(BufferError):
        K.matmul(sq, sq, out=sq)
    for a in (f64, f32, i8, sq):
        assert a.state == "ready"
    assert host(K.sum(f32)) == 10.0


# --- GPU: PyTorch and CuPy arrays, in place -------------------------------


def test_torch_tensors_in_place(torch_cuda):
    torch = torch_cuda
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(1_000_007, device="cuda", generator=g) * 2 - 1
    s = K.sum(x)
    assert abs(float(host(s)) - x.double().sum().item()) <= 64 * U * x.double().abs().sum().item()
    out = torch.full((1,), float("nan"), device="cuda")
    assert K.max(x, out=out) is out
    assert out.item() == x.max().item()
    xb = x.to(torch.bfloat16)
    assert float(host(K.max(xb))) == xb.float().max().item()
    assert abs(float(host(K.sum(xb))) - xb.double().sum().item()) <= 64 * U * xb.double().abs().sum().item()
    # cumsum into a torch tensor, zero copy: the same memory.
    y = torch.full_like(x, float("nan"))
    ptr = y.data_ptr()
    assert K.cumsum(x, out=y) is y and y.data_ptr() == ptr
    exact = torch.cumsum(x.double(), 0)
    assert torch.all((y.double() - exact).abs() <= 100 * U * torch.cumsum(x.double().abs(), 0))
    xi = torch.randint(-(2**31), 2**31 - 1, (100_003,), device="cuda", dtype=torch.int32, generator=g)
    yi = torch.from_dlpack(K.cumsum(xi))
    wrapped = (torch.cumsum(xi.long(), 0) + 2**31) % 2**32 - 2**31  # int32's wrapping
    assert torch.equal(yi.long(), wrapped)
    m = torch.randn(1000, 1000, device="cuda", generator=g)
    sm = torch.empty_like(m)
    K.softmax(m, out=sm)
    assert torch.allclose(sm.double(), torch.softmax(m.double(), 1), rtol=1e-5, atol=0)
    b = torch.randint(0, 256, (1_000_007,), device="cuda", dtype=torch.uint8, generator=g)
    h = torch.from_dlpack(K.histogram(b))
    assert torch.equal(h.long(), torch.bincount(b.long(), minlength=256))


def test_torch_matmul(torch_cuda):
    torch = torch_cuda
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.rand(129, 65, device="cuda", generator=g) * 2 - 1
    b = torch.rand(65, 257, device="cuda", generator=g) * 2 - 1
    c = torch.from_dlpack(K.matmul(a, b))
    exact = a.double() @ b.double()
    bound = 67 * U * (a.double().abs() @ b.double().abs()) * 1.01
    assert torch.all((c.double() - exact).abs() <= bound)
    ab, bb = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if torch.cuda.get_device_capability() >= (8, 0):
        out = torch.full((129, 257), float("nan"), device="cuda")
        assert K.matmul(ab, bb, out=out) is out
        exact = ab.double() @ bb.double()
        bound = 2 * 67 * U * (ab.double().abs() @ bb.double().abs()) * 1.01
        assert torch.all((out.double() - exact).abs() <= bound)
    else:
        with pytest.raises(gpufeed.InvalidArgumentError):
            K.matmul(ab, bb)


def test_torch_non_contiguous_is_a_buffer_error(torch_cuda):
    torch = torch_cuda
    m = torch.rand(64, 32, device="cuda")
    with pytest.raises(BufferError):
        K.softmax(m.t())
    with pytest.raises(BufferError):
        K.sum(m[:, ::2])
    with pytest.raises(TypeError):
        K.sum(m.double())
    with pytest.raises(TypeError, match="host memory"):
        K.sum(m.cpu())


def test_cupy_array_in_place(cupy_mod):
    cp = cupy_mod
    x = cp.random.rand(100_003, dtype=cp.float32)
    out = cp.full((1,), cp.nan, dtype=cp.float32)
    assert K.sum(x, out=out) is out
    exact = float(x.astype(cp.float64).sum())
    assert abs(float(out[0]) - exact) <= 64 * U * exact
    h = K.histogram((x * 255).astype(cp.uint8))
    assert int(cp.asarray(h).sum()) == 100_003
