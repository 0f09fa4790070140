"""Files to the device and back: load / save (.npy), load_safetensors,
read_file. Every check compares every element with the source (fresh random
data), through outputs poisoned beforehand; bad files raise typed errors."""
import json
import os
import struct

import numpy as np
import pytest

import gpufeed


def fresh(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def host_copy(d):
    out = np.empty(d.shape, dtype=d.dtype)
    out.view(np.uint8)[...] = 0xA5
    return gpufeed.to_host(d, out=out)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint8", "int64"])
@pytest.mark.parametrize("shape", [(0,), (7,), (513, 77), (3_000_001,)])
def test_npy_load_and_save_are_bit_exact(device, tmp_path, dtype, shape):
    rng = np.random.default_rng(abs(hash((dtype, shape))) % 2**32)
    a = fresh(rng, shape, dtype)
    path = tmp_path / "a.npy"
    np.save(path, a)
    d = gpufeed.load(path, device)
    assert d.shape == a.shape and d.dtype == a.dtype.name
    assert np.array_equal(host_copy(d).view(np.uint8), a.view(np.uint8))
    out = tmp_path / "b.npy"
    gpufeed.save(out, d)
    b = np.load(out)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(b.view(np.uint8), a.view(np.uint8))
    assert not os.path.exists(str(out) + ".partial")


def test_a_version_2_header_and_a_memory_map_agree(device, tmp_path):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((1000, 5)).astype(np.float32)
    path = tmp_path / "v2.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=(2, 0))
    d = gpufeed.load(path, device)
    assert np.array_equal(host_copy(d), np.load(path, mmap_mode="r"))


def test_raw_files_read_from_any_offset(device, tmp_path):
    rng = np.random.default_rng(9)
    a = rng.integers(0, 2**32, size=2_000_003, dtype=np.uint32)
    path = tmp_path / "raw.bin"
    with open(path, "wb") as f:
        f.write(b"x" * 13)
        f.write(a.tobytes())
    d = gpufeed.read_file(path, "uint32", offset=13 + 4 * 5, device=device)
    assert d.shape == (a.size - 5,)
    assert np.array_equal(host_copy(d), a[5:])
    d = gpufeed.read_file(path, "uint32", shape=(1000, 3), offset=13, device=device)
    assert np.array_equal(host_copy(d), a[:3000].reshape(1000, 3))


def write_safetensors(path, tensors, metadata=None):
    header, blobs, pos = {}, [], 0
    names = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("int64"): "I64",
             np.dtype("uint8"): "U8", np.dtype("int32"): "I32", np.dtype("float16"): "F16"}
    for name, t in tensors.items():
        b = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def test_safetensors_every_tensor_arrives(device, tmp_path):
    rng = np.random.default_rng(21)
    tensors = {
        "embed.weight": rng.standard_normal((3000, 64)).astype(np.float32),
        "head.bias": rng.standard_normal(17).astype(np.float64),
        "step": np.array([12345], dtype=np.int64),
        "mask": rng.integers(0, 255, size=(33, 5), dtype=np.uint8),
        "half": rng.standard_normal(999).astype(np.float16),
        "empty": np.zeros((0, 4), dtype=np.int32),
    }
    path = tmp_path / "m.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    got = gpufeed.load_safetensors(path, device)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].shape == t.shape and got[k].dtype == t.dtype.name, k
        assert np.array_equal(host_copy(got[k]).view(np.uint8), t.view(np.uint8)), k


def test_bad_files_are_typed_errors(device, tmp_path):
    a = np.arange(100_000, dtype=np.float32)
    good = tmp_path / "good.npy"
    np.save(good, a)
    raw = good.read_bytes()
    # Truncated data.
    short = tmp_path / "short.npy"
    short.write_bytes(raw[:-5])
    with pytest.raises(OSError):
        gpufeed.load(short, device)
    # A corrupt header.
    bad = tmp_path / "bad.npy"
    bad.write_bytes(b"\x93NUMPZ" + raw[6:])
    with pytest.raises(ValueError):
        gpufeed.load(bad, device)
    # An unknown dtype, a big-endian one, Fortran order.
    for arr in [np.zeros(10, dtype=np.complex64), np.zeros(10, dtype=">f4"),
                np.asfortranarray(np.zeros((3, 4), dtype=np.float32))]:
        p = tmp_path / "odd.npy"
        np.save(p, arr)
        with pytest.raises(ValueError):
            gpufeed.load(p, device)
    # Missing, a directory.
    with pytest.raises(FileNotFoundError):
        gpufeed.load(tmp_path / "nope.npy", device)
    with pytest.raises(OSError):
        gpufeed.read_file(tmp_path, "uint8", shape=(10,), device=device)
    # Safetensors: a header length past the end, bad JSON, offsets that lie.
    st = tmp_path / "x.safetensors"
    st.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError):
        gpufeed.load_safetensors(st, device)
    st.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError):
        gpufeed.load_safetensors(st, device)
    write_safetensors(st, {"w": np.zeros(10, dtype=np.float32)})
    blob = bytearray(st.read_bytes())
    blob = blob.replace(b"[0, 40]", b"[0, 44]")
    st.write_bytes(bytes(blob))
    with pytest.raises(ValueError):
        gpufeed.load_safetensors(st, device)


def test_a_failed_save_leaves_no_file_behind(device, tmp_path):
    d = gpufeed.to_device(np.arange(1000, dtype=np.float32), device)
    target = tmp_path / "no" / "such" / "dir" / "a.npy"
    with pytest.raises(OSError):
        gpufeed.save(target, d)
    assert not target.exists() and not os.path.exists(str(target) + ".partial")
