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
    assert leftovers(out) == []


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


def write_safetensors_scattered(path, tensors, order):
    """A safetensors file whose data lies in `order` (indices into the
    tensors), not in the header's order, with a gap of 3 bytes between
    tensors: the reads follow each other in neither."""
    names = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("int64"): "I64",
             np.dtype("uint8"): "U8", np.dtype("int32"): "I32", np.dtype("float16"): "F16"}
    items = list(tensors.items())
    header, data, pos = {}, bytearray(), 0
    for i in order:
        name, t = items[i]
        b = np.ascontiguousarray(t).tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(b)]}
        data += b + b"\x5a" * 3
        pos += len(b) + 3
    header = {k: header[k] for k, _ in items}  # the header in the tensors' order
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes(data))


def evict(path):
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [None, True, False])
@pytest.mark.parametrize("layout", ["in order", "scattered"])
def test_safetensors_stream_every_tensor_in_one_read_with_progress(device, tmp_path, direct, layout):
    rng = np.random.default_rng(33)
    # 70 MiB in all: the progress ranges (64 MiB) cut a tensor; sizes of no
    # block multiple, an empty tensor between two others.
    tensors = {
        "a": rng.standard_normal(1_000_003).astype(np.float32),
        "empty": np.zeros((0, 7), dtype=np.int32),
        "b": rng.integers(0, 255, size=(8_000_009,), dtype=np.uint8),
        "c": rng.standard_normal((7_000_001,)).astype(np.float64),
        "d": rng.integers(-2**40, 2**40, size=3, dtype=np.int64),
        "e": rng.standard_normal(99_999).astype(np.float16),
    }
    path = tmp_path / "m.safetensors"
    if layout == "in order":
        write_safetensors(path, tensors)
    else:
        write_safetensors_scattered(path, tensors, [3, 0, 5, 2, 1, 4])
    total = sum(t.nbytes for t in tensors.values())
    for progress in [None, True]:
        evict(path)  # cold: the automatic choice reads direct where it can
        calls = []
        try:
            got = gpufeed.load_safetensors(
                path, device, direct=direct,
                progress=(lambda done, tot: calls.append((done, tot))) if progress else None)
        except OSError as e:
            if direct and "O_DIRECT read refused" in str(e):
                pytest.skip(f"this file system refuses O_DIRECT: {e}")
            raise
        assert list(got) == list(tensors)
        for k, t in tensors.items():
            assert got[k].shape == t.shape and got[k].dtype == t.dtype.name, k
            assert np.array_equal(host_copy(got[k]).view(np.uint8), t.view(np.uint8)), k
        if progress:
            assert calls == [(64 << 20, total), (total, total)], calls

    def stop(done, tot):
        raise Stop(done)

    with pytest.raises(Stop):
        gpufeed.load_safetensors(path, device, direct=direct, progress=stop)


def test_empty_safetensors_report_progress_once(device, tmp_path):
    path = tmp_path / "e.safetensors"
    write_safetensors(path, {"z": np.zeros((0,), dtype=np.float32)})
    calls = []
    got = gpufeed.load_safetensors(path, device, progress=lambda d, t: calls.append((d, t)))
    assert got["z"].shape == (0,) and calls == [(0, 0)]


def resident_share(path):
    """The share of the file's pages in the page cache (mincore over a
    mapping: the test's own count)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        pages = (size + 4095) // 4096
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) / pages


def takes_o_direct(path):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def test_the_automatic_read_mode_is_buffered_and_leaves_a_cold_file_cached(device, tmp_path):
    rng = np.random.default_rng(12)
    a = rng.integers(0, 2**32, size=(9 << 20) // 4 + 5, dtype=np.uint32)
    path = tmp_path / "a.npy"
    np.save(path, a)
    assert np.array_equal(np.load(path), a)  # read: cached
    assert resident_share(path) > 0.9
    assert gpufeed.file_read_mode(path, device=device) == "buffered"
    assert np.array_equal(host_copy(gpufeed.load(path, device)), a)
    evict(path)
    cold = resident_share(path) < 0.05  # tmpfs keeps its pages: they are the file
    assert gpufeed.file_read_mode(path, device=device) == "buffered"
    assert gpufeed.file_read_mode(path, direct=False, device=device) == "buffered"
    assert np.array_equal(host_copy(gpufeed.load(path, device)), a)
    if cold:
        assert resident_share(path) > 0.9, "the automatic read of a cold file left it uncached"
    if takes_o_direct(path):
        assert gpufeed.file_read_mode(path, direct=True, device=device) == "direct"
        evict(path)
        cold = resident_share(path) < 0.05
        assert np.array_equal(host_copy(gpufeed.load(path, device, direct=True)), a)
        if cold:
            assert resident_share(path) < 0.05, "a direct read filled the page cache"


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
    # Offsets whose sum with the header's end wraps past 2**64 (the header
    # would be read as the tensor), for load_safetensors and Loader alike.
    def wrapping(begin):
        h = json.dumps({"t": {"dtype": "U8", "shape": [16],
                              "data_offsets": [begin, begin + 16]}}).encode()
        h += b" " * (-len(h) % 8)
        st.write_bytes(struct.pack("<Q", len(h)) + h + bytes(16))
        return 8 + len(h)
    data_start = wrapping(0)
    wrapping(2**64 - data_start)
    with pytest.raises(ValueError, match="data_offsets"):
        gpufeed.load_safetensors(st, device)
    with pytest.raises(ValueError, match="data_offsets"):
        gpufeed.Loader(str(st), 16, device=device)


def test_a_corrupt_safetensors_entry_is_refused_alike_by_load_and_loader(device, tmp_path):
    """One header parser serves load_safetensors and Loader: a field of the
    wrong type is a ValueError naming the file for both; a dtype with no
    device dtype is a ValueError for load_safetensors and, as documented for
    the Loader, a TypeError there."""
    st = tmp_path / "c.safetensors"

    def write(entry):
        h = json.dumps({"t": entry}).encode()
        h += b" " * (-len(h) % 8)
        st.write_bytes(struct.pack("<Q", len(h)) + h + bytes(16))

    good = {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}
    for key, value, why in [("shape", "sixteen", "shape"), ("dtype", 8, "dtype"),
                            ("data_offsets", [0], "data_offsets"),
                            ("shape", [2**40, 2**40, 2**40], "overflows")]:
        write({**good, key: value})
        for load in (lambda: gpufeed.load_safetensors(st, device),
                     lambda: gpufeed.Loader(str(st), 16, device=device)):
            with pytest.raises(ValueError, match=why) as e:
                load()
            assert "c.safetensors" in str(e.value)
    write({**good, "dtype": "C64"})
    with pytest.raises(ValueError, match="C64"):
        gpufeed.load_safetensors(st, device)
    with pytest.raises(TypeError, match="C64"):
        gpufeed.Loader(str(st), 16, device=device)
    # The same file, well formed, loads both ways.
    write(good)
    assert gpufeed.load_safetensors(st, device)["t"].shape == (16,)
    assert len(list(gpufeed.Loader(str(st), 16, device=device))) == 1


def leftovers(path):
    """The temporary files a save of `path` left beside it (`path.partial-*`)."""
    d, name = os.path.split(str(path))
    return [f for f in os.listdir(d or ".") if f.startswith(name + ".partial")] if os.path.isdir(d or ".") else []


def test_a_failed_save_leaves_no_file_behind(device, tmp_path):
    d = gpufeed.to_device(np.arange(1000, dtype=np.float32), device)
    target = tmp_path / "no" / "such" / "dir" / "a.npy"
    with pytest.raises(OSError):
        gpufeed.save(target, d)
    assert not target.exists() and leftovers(target) == []
    # The header's own file object failing at close (its buffered header
    # flushed past a 64-byte file size limit; Python ignores SIGXFSZ):
    # OSError, and neither file left.
    import resource
    target = tmp_path / "b.npy"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        with pytest.raises(OSError):
            gpufeed.save(target, d)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not target.exists() and leftovers(target) == []


def test_two_saves_to_one_path_at_once_leave_one_whole_file(device, tmp_path):
    import threading
    a = gpufeed.to_device(np.full(24 << 20, 1, np.uint8), device)
    b = gpufeed.to_device(np.full(8 << 20, 2, np.uint8), device)
    target = tmp_path / "c.npy"
    for _ in range(3):
        errors = []

        def save(d):
            try:
                gpufeed.save(target, d)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=save, args=(d,)) for d in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        got = np.load(target)
        # Whichever rename came last, the file is that array, whole.
        assert np.array_equal(got, np.full(got.shape, got.flat[0], np.uint8))
        assert got.size == (24 << 20 if got.flat[0] == 1 else 8 << 20)
        assert leftovers(target) == []


@pytest.mark.parametrize("dims", ["(-3, 4)", "(99999999999999999999, 4)"])
def test_a_npy_header_with_a_negative_or_huge_dimension_is_a_value_error(device, tmp_path, dims):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % dims
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    p = tmp_path / "neg.npy"
    p.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + bytes(48))
    with pytest.raises(ValueError, match="negative or too large"):
        gpufeed.load(p, device)


def test_read_file_refuses_a_rest_that_is_not_whole_elements_and_a_negative_offset(device, tmp_path):
    p = tmp_path / "r.bin"
    p.write_bytes(bytes([1, 2, 3]))
    with pytest.raises(ValueError, match="whole number"):
        gpufeed.read_file(p, "uint16", device=device)
    with pytest.raises(ValueError, match="-4"):
        gpufeed.read_file(p, "uint8", offset=-4, device=device)
    # What is whole reads; shape= takes part of the rest.
    assert gpufeed.to_host(gpufeed.read_file(p, "uint8", device=device)).tolist() == [1, 2, 3]
    assert gpufeed.to_host(gpufeed.read_file(p, "uint16", shape=(1,), device=device)).tolist() == [513]


def _safetensors(path, entries, data):
    h = json.dumps(entries).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_a_cut_short_safetensors_file_is_an_os_error_for_load_and_loader(device, tmp_path):
    st = tmp_path / "cut.safetensors"
    _safetensors(st, {"a": {"dtype": "U8", "shape": [24], "data_offsets": [0, 24]}}, bytes(20))
    with pytest.raises(OSError, match="cut short"):
        gpufeed.load_safetensors(st, device)
    with pytest.raises(OSError, match="cut short"):
        gpufeed.Loader(str(st), 4, device=device)


def test_a_tensor_cut_short_at_a_nonzero_offset_is_an_os_error_for_load_and_loader(device, tmp_path):
    # The second tensor starts at 16 and ends at 32; the file holds 20 data
    # bytes. Its end, not its length (16, which fits), is past the file's.
    st = tmp_path / "cut2.safetensors"
    entries = {"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
               "b": {"dtype": "U8", "shape": [16], "data_offsets": [16, 32]}}
    _safetensors(st, entries, bytes(20))
    for load in (lambda: gpufeed.load_safetensors(st, device),
                 lambda: gpufeed.Loader(str(st), 4, device=device)):
        with pytest.raises(OSError, match="cut short") as e:
            load()
        assert '"b"' in str(e.value) and "[16, 32]" in str(e.value), str(e.value)
    # Whole, the same file loads.
    _safetensors(st, entries, bytes(range(32)))
    assert gpufeed.to_host(gpufeed.load_safetensors(st, device)["b"]).tolist() == list(range(16, 32))


def test_metadata_keys_that_are_not_strings_are_a_type_error_and_leave_no_file(device, tmp_path):
    path = tmp_path / "k.safetensors"
    d = gpufeed.to_device(np.arange(10, dtype=np.float32), device)
    for metadata in [{1: "x"}, {("a",): "x"}, {"ok": "x", None: "y"}]:
        with pytest.raises(TypeError, match="metadata"):
            gpufeed.save_safetensors(path, {"a": d}, metadata=metadata)
    assert list(tmp_path.iterdir()) == []
    gpufeed.save_safetensors(path, {"a": d}, metadata={"1": "x"})
    assert gpufeed.load_safetensors(path, device)["a"].shape == (10,)


def test_metadata_that_is_not_an_object_of_strings_is_refused_as_safetensors_refuses_it(device, tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    st = tmp_path / "m.safetensors"
    a = np.arange(6, dtype=np.float32)
    for metadata in ["abc", ["a"], 7, {"k": 3}, {"k": None}]:
        write_safetensors(st, {"a": a}, metadata=metadata)
        with pytest.raises(Exception):  # the format's own reader refuses it
            safetensors_numpy.load_file(str(st))
        for load in (lambda: gpufeed.load_safetensors(st, device),
                     lambda: gpufeed.Loader(str(st), 2, device=device)):
            with pytest.raises(ValueError, match="__metadata__") as e:
                load()
            assert "m.safetensors" in str(e.value)
    # An object of strings is read past, as the package reads it.
    write_safetensors(st, {"a": a}, metadata={"format": "np"})
    raw = st.read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"] == {"format": "np"}
    assert np.array_equal(safetensors_numpy.load_file(str(st))["a"], a)
    assert np.array_equal(host_copy(gpufeed.load_safetensors(st, device)["a"]), a)


def _npy_with_header(path, header):
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
                     + bytes(48))


@pytest.mark.parametrize("header", [
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), ",  # an unterminated dict
    "'" * 3 + "abc",  # an unterminated string literal
    "{\x00",  # a NUL byte in an unterminated dict
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), 'x': " + "'" * 3 + "y }",
])
def test_a_npy_header_numpys_parser_rejects_is_a_value_error_for_load_and_loader(device, tmp_path, header):
    import tokenize
    p = tmp_path / "h.npy"
    _npy_with_header(p, header)
    with pytest.raises(tokenize.TokenError):  # what NumPy's own parser raises
        np.load(p)
    for load in (lambda: gpufeed.load(p, device),
                 lambda: gpufeed.Loader(str(p), 1, device=device),
                 lambda: gpufeed.Loader([str(p)], 1, device=device)):
        with pytest.raises(ValueError, match="header") as e:
            load()
        assert "h.npy" in str(e.value) and isinstance(e.value.__cause__, tokenize.TokenError)


def test_a_directory_where_a_file_is_expected_is_an_is_a_directory_error(device, tmp_path):
    import errno
    d = tmp_path / "x.safetensors"
    d.mkdir()
    for call in (lambda: gpufeed.load_safetensors(d, device),
                 lambda: gpufeed.Loader(str(d), 4, device=device),
                 lambda: gpufeed.file_read_mode(d, device=device),
                 lambda: gpufeed.file_read_mode(d, direct=True, device=device),
                 lambda: gpufeed.load(d, device),
                 lambda: gpufeed.read_file(d, "uint8", device=device)):
        with pytest.raises(IsADirectoryError) as e:
            call()
        assert e.value.errno == errno.EISDIR and e.value.filename == str(d), e.value
    with pytest.raises(IsADirectoryError):  # as Python's own open() says
        open(d, "rb")


def test_safetensors_tensors_that_share_bytes_are_refused(device, tmp_path):
    st = tmp_path / "alias.safetensors"
    a = {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}
    _safetensors(st, {"a": a, "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}, bytes(8))
    with pytest.raises(ValueError, match="overlap"):
        gpufeed.load_safetensors(st, device)
    with pytest.raises(ValueError, match="overlap"):
        gpufeed.Loader(str(st), 4, device=device)
    # Adjacent tensors, and an empty one between them, share nothing.
    _safetensors(st, {"a": a, "e": {"dtype": "U8", "shape": [0], "data_offsets": [8, 8]},
                      "c": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}, bytes(range(12)))
    got = gpufeed.load_safetensors(st, device)
    assert gpufeed.to_host(got["c"]).tolist() == [8, 9, 10, 11]
    assert got["e"].shape == (0,)


@pytest.mark.parametrize("direct", [None, True, False])
def test_direct_and_buffered_reads_are_the_same_bytes(device, tmp_path, direct):
    rng = np.random.default_rng(77)
    a = rng.integers(0, 2**32, size=3_000_017, dtype=np.uint32)
    path = tmp_path / "d.npy"
    np.save(path, a)  # a 128-byte header: the data starts unaligned
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: None reads direct
    os.close(fd)
    try:
        d = gpufeed.load(path, device, direct=direct)
    except OSError as e:
        if direct and "O_DIRECT read refused" in str(e):
            pytest.skip(f"this file system refuses O_DIRECT: {e}")
        raise
    assert np.array_equal(host_copy(d), a)
    for first, n in [(0, 1), (1, 4097), (1023, 1_000_003), (5, a.size - 5)]:
        d = gpufeed.read_file(path, "uint32", shape=(n,), offset=128 + 4 * first,
                              device=device, direct=direct)
        assert np.array_equal(host_copy(d), a[first:first + n]), (first, n)


def test_safetensors_written_here_read_back_bit_exactly(device, tmp_path):
    rng = np.random.default_rng(5)
    tensors = {
        "w": rng.standard_normal((300, 77)).astype(np.float32),
        "b": rng.standard_normal(13).astype(np.float64),
        "ids": rng.integers(-2**62, 2**62, size=1001, dtype=np.int64),
        "m": rng.integers(0, 255, size=(3, 5, 7), dtype=np.uint8),
        "h": rng.standard_normal(99).astype(np.float16),
        "e": np.zeros((0, 3), dtype=np.int16),
    }
    # Device arrays and host arrays (copied to the device first) alike.
    given = {k: (gpufeed.to_device(v, device) if i % 2 else v) for i, (k, v) in enumerate(tensors.items())}
    path = tmp_path / "m.safetensors"
    calls = []
    gpufeed.save_safetensors(path, given, metadata={"format": "np", "step": "7"},
                             progress=lambda done, total: calls.append((done, total)))
    assert leftovers(path) == []
    total = sum(t.nbytes for t in tensors.values())
    assert calls and calls[-1] == (total, total) and len(calls) == len(tensors)
    got = gpufeed.load_safetensors(path, device)
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].shape == t.shape and got[k].dtype == t.dtype.name, k
        assert np.array_equal(host_copy(got[k]).view(np.uint8), t.view(np.uint8)), k
    header = json.loads(path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert header["__metadata__"] == {"format": "np", "step": "7"}
    st = pytest.importorskip("safetensors.numpy")
    back = st.load_file(str(path))
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert np.array_equal(back[k].view(np.uint8), t.view(np.uint8)), k


def test_bad_safetensors_arguments_are_typed_errors(device, tmp_path):
    path = tmp_path / "x.safetensors"
    d = gpufeed.to_device(np.arange(10, dtype=np.float32), device)
    with pytest.raises(TypeError):
        gpufeed.save_safetensors(path, {1: d})
    with pytest.raises(ValueError):
        gpufeed.save_safetensors(path, {"__metadata__": d})
    with pytest.raises(TypeError):
        gpufeed.save_safetensors(path, {"a": d}, metadata={"k": 3})
    with pytest.raises(TypeError):
        gpufeed.save_safetensors(path, {"a": object()})
    with pytest.raises(OSError):
        gpufeed.save_safetensors(tmp_path / "no" / "dir" / "x.safetensors", {"a": d})
    assert list(tmp_path.iterdir()) == []


class Stop(Exception):
    pass


def test_progress_is_reported_and_its_exception_stops_the_transfer(device, tmp_path):
    rng = np.random.default_rng(8)
    a = rng.integers(0, 255, size=(150 << 20) // 8, dtype=np.uint64)  # 150 MiB: 3 ranges
    path = tmp_path / "big.npy"
    np.save(path, a)
    calls = []
    d = gpufeed.load(path, device, progress=lambda done, total: calls.append((done, total)))
    assert [c[0] for c in calls] == [64 << 20, 128 << 20, 150 << 20]
    assert all(c[1] == a.nbytes for c in calls)
    assert np.array_equal(host_copy(d), a)

    def stop_at_second(done, total):
        if done > 64 << 20:
            raise Stop(done)

    with pytest.raises(Stop):
        gpufeed.load(path, device, progress=stop_at_second)
    with pytest.raises(Stop):
        gpufeed.read_file(path, "uint8", device=device, progress=stop_at_second)
    # A save stopped by its callback leaves no file behind.
    out = tmp_path / "out.npy"
    with pytest.raises(Stop):
        gpufeed.save(out, d, progress=stop_at_second)
    assert not out.exists() and leftovers(out) == []
    with pytest.raises(Stop):
        gpufeed.save_safetensors(tmp_path / "o.safetensors", {"a": d}, progress=stop_at_second)
    assert not (tmp_path / "o.safetensors").exists()
    with pytest.raises(TypeError):
        gpufeed.load(path, device, progress=3)
    # The array stays usable after a stopped save.
    gpufeed.save(out, d, progress=lambda done, total: None)
    assert np.array_equal(np.load(out), a)


def test_the_gpudirect_storage_probe_says_what_it_found(device):
    s = gpufeed.gds_status(device)
    assert set(s) == {"available", "reason", "message"}
    assert s["reason"] in {"available", "not_cuda", "no_kernel_module", "no_library", "driver_open_failed",
                           "compatibility_mode_only"}
    assert s["available"] == (s["reason"] == "available") and s["message"]
    if device.kind == "cpu":
        assert s["reason"] == "not_cuda"


def test_a_save_that_runs_out_of_space_raises_and_leaves_no_file(tmp_path):
    # A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the write fail
    # part-way, as a full disk does, in a child process of its own.
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        import numpy as np, gpufeed
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        a = np.arange(4 << 20, dtype=np.uint32)          # 16 MiB: past the 1 MiB limit
        d = gpufeed.to_device(a)
        for call in (lambda p: gpufeed.save(p, d), lambda p: gpufeed.save_safetensors(p, {{"a": d}})):
            path = os.path.join({str(tmp_path)!r}, "out")
            try:
                call(path)
            except OSError as e:
                print("OSError", e.errno)
            else:
                sys.exit("the save succeeded past the size limit")
            assert os.listdir({str(tmp_path)!r}) == [], os.listdir({str(tmp_path)!r})
        # The device array is intact.
        assert np.array_equal(gpufeed.to_host(d), a)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["OSError", "27", "OSError", "27", "ok"], r.stdout  # EFBIG


def test_a_file_that_shrinks_during_the_read_raises_and_the_device_stays_usable(device, tmp_path):
    rng = np.random.default_rng(9)
    a = rng.integers(0, 1 << 63, size=(150 << 20) // 8, dtype=np.uint64)  # 150 MiB: 3 ranges
    path = tmp_path / "shrinks.npy"

    def cut(done, total):
        if done == 64 << 20:
            os.truncate(path, 100 << 20)  # the next range runs past the new end

    for call in (lambda: gpufeed.load(path, device, progress=cut),
                 lambda: gpufeed.read_file(path, "uint8", device=device, progress=cut)):
        np.save(path, a)
        with pytest.raises(OSError, match="shrank during the read"):
            call()
        assert os.path.getsize(path) == 100 << 20  # the cut happened mid-read
    small = a[:1000]
    assert np.array_equal(host_copy(gpufeed.to_device(small, device)), small)


def test_a_file_without_read_permission_raises_permission_error(device, tmp_path):
    # Root reads anything: the check runs in a child process that becomes
    # `nobody` (uid 65534) when started as root, after its imports.
    import shutil
    import subprocess
    import sys
    import tempfile
    import textwrap
    d = tempfile.mkdtemp()
    try:
        os.chmod(d, 0o755)
        p = os.path.join(d, "secret.npy")
        np.save(p, np.arange(10, dtype=np.float32))
        os.chmod(p, 0)
        code = textwrap.dedent(f"""
            import os, sys
            import numpy as np, gpufeed
            dev = gpufeed.default_device()
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            for call in (lambda: gpufeed.load({p!r}, dev),
                         lambda: gpufeed.read_file({p!r}, "uint8", device=dev),
                         lambda: gpufeed.load_safetensors({p!r}, dev)):
                try:
                    call()
                except PermissionError as e:
                    print("PermissionError", e.errno)
                else:
                    sys.exit("read a file without permission")
            print("ok")
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.split() == ["PermissionError", "13"] * 3 + ["ok"], r.stdout  # EACCES
    finally:
        shutil.rmtree(d)


def test_save_safetensors_takes_the_dicts_items_as_they_were_when_called(device, tmp_path):
    tensors = {}

    class Grows:
        """Converting it adds a key to the dict being saved."""

        def __array__(self, dtype=None, copy=None):
            tensors["late"] = np.zeros(2, np.float32)
            return np.arange(4, dtype=np.float32)

    tensors["a"] = gpufeed.to_device(np.arange(4, dtype=np.float32), device)
    tensors["b"] = Grows()
    path = tmp_path / "grows.safetensors"
    gpufeed.save_safetensors(path, tensors)  # no panic at the dict's growth
    assert "late" in tensors
    got = gpufeed.load_safetensors(path, device)
    assert sorted(got) == ["a", "b"]
    assert np.array_equal(gpufeed.to_host(got["a"]), np.arange(4, dtype=np.float32))
    assert np.array_equal(gpufeed.to_host(got["b"]), np.arange(4, dtype=np.float32))


def test_file_names_that_are_not_utf8_are_kept_byte_for_byte(device, tmp_path):
    # A Latin-1 name: bytes that are not UTF-8, given as Python gives them
    # (a str with surrogate escapes, and a pathlib.Path of it).
    name = os.fsdecode(b"caf\xe9")
    rng = np.random.default_rng(11)
    a = rng.standard_normal((33, 7)).astype(np.float32)
    d = gpufeed.to_device(a, device)
    gpufeed.save(str(tmp_path / (name + ".npy")), d)
    gpufeed.save_safetensors(tmp_path / (name + ".safetensors"), {"a": d})
    # The files carry exactly those bytes (no U+FFFD in their place), and no
    # leftover `.partial`.
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"caf\xe9.npy", b"caf\xe9.safetensors"]
    for back in (
        gpufeed.load(tmp_path / (name + ".npy"), device),
        gpufeed.load_safetensors(str(tmp_path / (name + ".safetensors")), device)["a"],
    ):
        assert np.array_equal(host_copy(back).view(np.uint8), a.view(np.uint8))
    raw = gpufeed.read_file(tmp_path / (name + ".npy"), "uint8", device=device)
    assert np.array_equal(host_copy(raw), np.frombuffer((tmp_path / (name + ".npy")).read_bytes(), np.uint8))
    assert gpufeed.file_read_mode(tmp_path / (name + ".npy")) in ("direct", "buffered")
    # A missing file of such a name is reported by that name.
    with pytest.raises(FileNotFoundError, match="caf"):
        gpufeed.load(tmp_path / (name + "-missing.npy"), device)
    # The loader takes such a safetensors path too.
    ld = gpufeed.Loader(str(tmp_path / (name + ".safetensors")), 33, device=device, framework="gpufeed")
    (batch,) = list(ld)
    assert np.array_equal(host_copy(batch["a"]).view(np.uint8), a.view(np.uint8))


def test_a_missing_file_is_reported_as_python_s_own_open_reports_it(device, tmp_path):
    missing = tmp_path / "nope.safetensors"
    for load in (lambda: gpufeed.load_safetensors(missing, device),
                 lambda: gpufeed.Loader(str(missing), 4, device=device),
                 lambda: gpufeed.load(tmp_path / "nope.npy", device)):
        with pytest.raises(FileNotFoundError) as e:
            load()
        assert e.value.errno == 2 and e.value.filename is not None
        assert str(e.value).startswith("[Errno 2] No such file or directory: ")
