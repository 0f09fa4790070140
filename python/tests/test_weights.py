"""Model weights: load_model (a sharded checkpoint by index, directory or
list; into= tensors that exist; tensor-parallel slices; dtype conversion)
and save_async (a background write from a snapshot). Every check compares
every byte with the `safetensors` package's own reading (or writing) of
fresh random data; targets are poisoned first; faults are planted in the
files (a shard missing, bytes cut short, a header that is not safetensors),
in the targets (a shape or dtype that doesn't match) and in the saves (a
file-size limit, a kill mid-save)."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file as st_load
from safetensors.numpy import save_file as st_save

import gpufeed
from conftest import torch_or_skip

POISON = 0xA5


def fresh(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def llama_like(rng, layers=2, hidden=32, inter=64, vocab=48):
    """A small Llama-like set of tensors (names and shapes as Hugging Face
    writes them), float32 and float16 (NumPy's; bfloat16 via torch below)."""
    t = {"model.embed_tokens.weight": fresh(rng, (vocab, hidden), np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            t[p + f"self_attn.{n}_proj.weight"] = fresh(rng, (hidden, hidden), np.float16)
        t[p + "mlp.gate_proj.weight"] = fresh(rng, (inter, hidden), np.float32)
        t[p + "mlp.up_proj.weight"] = fresh(rng, (inter, hidden), np.float32)
        t[p + "mlp.down_proj.weight"] = fresh(rng, (hidden, inter), np.float32)
        t[p + "input_layernorm.weight"] = fresh(rng, (hidden,), np.float32)
    t["model.norm.weight"] = fresh(rng, (hidden,), np.float32)
    t["lm_head.weight"] = fresh(rng, (vocab, hidden), np.float32)
    t["model.step"] = fresh(rng, (3,), np.int64)
    return t


def write_sharded(directory, tensors, shards=3):
    """The tensors in `shards` safetensors files (written by the safetensors
    package) and a model.safetensors.index.json; returns the shard paths."""
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map, paths = {}, []
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        st_save({n: tensors[n] for n in group}, str(directory / fname), metadata={"format": "pt"})
        paths.append(directory / fname)
        for n in group:
            weight_map[n] = fname
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return paths


def reference(paths):
    """Every tensor as the safetensors package reads it."""
    out = {}
    for p in paths:
        out.update(st_load(str(p)))
    return out


def host(a):
    out = np.empty(a.shape, dtype=a.dtype if a.dtype != "bfloat16" else "uint16")
    out.view(np.uint8)[...] = POISON
    return gpufeed.to_host(a, out=out)


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


@pytest.fixture()
def model(tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    tensors = llama_like(rng)
    paths = write_sharded(tmp_path, tensors)
    return tmp_path, paths, reference(paths)


# ---------------------------------------------------------------- loading


def test_a_sharded_checkpoint_loads_by_index_directory_or_list_bit_for_bit(device, model):
    directory, paths, ref = model
    for source in (directory, directory / "model.safetensors.index.json", [str(p) for p in paths], str(directory)):
        stats = {}
        got = gpufeed.load_model(source, device=device, stats=stats)
        assert set(got) == set(ref)
        for name, a in got.items():
            assert isinstance(a, gpufeed.DeviceArray)
            assert a.dtype == ref[name].dtype.name
            assert same_bits(host(a), ref[name]), name
        assert stats["bytes_read"] == sum(a.nbytes for a in ref.values())
        assert stats["files"] == len(paths) and stats["tensors"] == len(ref)


def test_a_name_filter_picks_tensors_by_list_or_callable(device, model):
    directory, _, ref = model
    picked = gpufeed.load_model(directory, device=device, names=["lm_head.weight", "model.norm.weight"])
    assert set(picked) == {"lm_head.weight", "model.norm.weight"}
    assert same_bits(host(picked["lm_head.weight"]), ref["lm_head.weight"])
    mlp = gpufeed.load_model(directory, device=device, names=lambda n: ".mlp." in n, framework="numpy")
    assert set(mlp) == {n for n in ref if ".mlp." in n}
    assert all(same_bits(mlp[n], ref[n]) for n in mlp)
    with pytest.raises(KeyError, match="no.such"):
        gpufeed.load_model(directory, device=device, names=["no.such"])


def test_into_device_arrays_writes_in_place_and_returns_the_same_objects(device, model):
    directory, _, ref = model
    into = {}
    for name, a in ref.items():
        d = gpufeed.to_device(np.full(a.shape, 0, a.dtype).view(np.uint8).reshape(-1)
                              if a.ndim == 0 else np.zeros(a.shape, a.dtype), device)
        d.upload(np.full(a.nbytes, POISON, np.uint8))
        into[name] = d
    ptrs = {n: d.ptr for n, d in into.items()}
    got = gpufeed.load_model(directory, device=device, into=into)
    assert all(got[n] is into[n] for n in ref)
    for n, d in into.items():
        assert d.ptr == ptrs[n]
        assert same_bits(host(d), ref[n]), n


def test_into_a_torch_modules_state_dict_fills_its_parameters_in_place(device, tmp_path):
    torch = torch_or_skip()
    if device.kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    from safetensors.torch import load_file as st_torch_load
    from safetensors.torch import save_file as st_torch_save

    where = "cuda" if device.kind == "cuda" else "cpu"
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8)).to(torch.bfloat16)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(torch.bfloat16))
    st_torch_save(src.state_dict(), str(tmp_path / "model.safetensors"))
    ref = st_torch_load(str(tmp_path / "model.safetensors"))
    dst = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8)).to(torch.bfloat16).to(where)
    with torch.no_grad():
        for p in dst.parameters():
            p.view(torch.int16).fill_(-0x5A5B)  # poison
    ptrs = {n: p.data_ptr() for n, p in dst.state_dict().items()}
    gpufeed.load_model(tmp_path, device=device, into=dst)  # the module: its state_dict()
    for n, p in dst.state_dict().items():
        assert p.data_ptr() == ptrs[n], n
        assert torch.equal(p.cpu().view(torch.int16), ref[n].view(torch.int16)), n


def test_a_mismatched_into_writes_nothing_and_names_the_tensor(device, model):
    directory, _, ref = model
    names = sorted(ref)
    bad = names[len(names) // 2]
    for wrong in ("shape", "dtype"):
        into = {}
        for n in names:
            a = ref[n]
            shape, dtype = a.shape, a.dtype
            if n == bad and wrong == "shape":
                shape = shape[:-1] + (shape[-1] + 1,)
            if n == bad and wrong == "dtype":
                dtype = np.float64 if dtype != np.float64 else np.float32
            d = gpufeed.to_device(np.zeros(shape, dtype), device)
            d.upload(np.full(d.nbytes, POISON, np.uint8))
            into[n] = d
        with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
            gpufeed.load_model(directory, device=device, into=into)
        for n, d in into.items():
            assert (host(d).view(np.uint8) == POISON).all(), f"{n} was written ({wrong} of {bad} wrong)"


def test_into_a_name_the_checkpoint_lacks_is_a_key_error_unless_not_strict(device, model):
    directory, _, ref = model
    name = "model.norm.weight"
    into = {name: gpufeed.to_device(np.zeros_like(ref[name]), device),
            "extra.buffer": gpufeed.to_device(np.zeros(3, np.float32), device)}
    with pytest.raises(KeyError, match="extra.buffer"):
        gpufeed.load_model(directory, device=device, into=into)
    assert (host(into[name]) == 0).all()
    got = gpufeed.load_model(directory, device=device, into=into, strict=False)
    assert set(got) == {name} and same_bits(host(into[name]), ref[name])


def test_a_shard_missing_from_the_index_is_file_not_found_naming_it(device, model):
    directory, paths, _ = model
    paths[1].unlink()
    with pytest.raises(FileNotFoundError) as e:
        gpufeed.load_model(directory, device=device)
    assert e.value.filename == str(paths[1]) and e.value.errno == 2


def test_a_tensor_cut_short_is_an_os_error_naming_the_file(device, model):
    directory, paths, _ = model
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[:-1])
    with pytest.raises(OSError, match="cut short") as e:
        gpufeed.load_model(directory, device=device)
    assert e.value.filename == str(paths[2])


def test_a_file_that_is_not_safetensors_is_a_value_error_naming_it(device, model):
    directory, paths, _ = model
    for junk in (b"\x00" * 3, (8).to_bytes(8, "little") + b"not json", (2).to_bytes(8, "little") + b"[]"):
        paths[0].write_bytes(junk)
        with pytest.raises(ValueError, match="not a safetensors file") as e:
            gpufeed.load_model(directory, device=device)
        assert str(paths[0]) in str(e.value)
    (directory / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="index"):
        gpufeed.load_model(directory, device=device)


def test_dtype_conversion_matches_torch_rounding(device, tmp_path):
    torch = torch_or_skip()
    from safetensors.torch import save_file as st_torch_save

    g = torch.Generator().manual_seed(5)
    src = {
        "bf": (torch.randn(33, 17, generator=g) * 100).to(torch.bfloat16),
        "h": (torch.randn(50, generator=g) * 1000).to(torch.float16),
        "f": torch.randn(7, 9, generator=g) * 1e5,
        "i": torch.arange(10, dtype=torch.int32),
    }
    st_torch_save(src, str(tmp_path / "m.safetensors"))
    for to, tdt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        stats = {}
        got = gpufeed.load_model(tmp_path, device=device, dtype=to, framework="torch", stats=stats)
        for n, t in src.items():
            want = t if t.dtype == torch.int32 else t.to(tdt)
            g_ = got[n].cpu()
            assert g_.dtype == want.dtype, n
            bits = torch.int16 if want.element_size() == 2 else torch.int32
            assert torch.equal(g_.view(bits), want.view(bits)), f"{n} to {to}"
        assert stats["converted"] == sum(1 for t in src.values() if t.is_floating_point() and t.dtype != tdt)
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        gpufeed.load_model(tmp_path, device=device, dtype="int8")


# ---------------------------------------------------------------- tensor-parallel slices

RULES = {
    "*.q_proj.weight": 0, "*.k_proj.weight": 0, "*.v_proj.weight": 0, "*.o_proj.weight": 1,
    "*.gate_proj.weight": 0, "*.up_proj.weight": 0, "*.down_proj.weight": 1,
    "model.embed_tokens.weight": 0, "lm_head.weight": -2, "model.norm.weight": None,
}


def rule_of(name):
    import fnmatch

    if name in RULES:
        return RULES[name]
    for k, v in RULES.items():
        if fnmatch.fnmatchcase(name, k):
            return v
    return None


def numpy_slice(a, dim, rank, world):
    if dim is None:
        return a
    dim = dim % a.ndim
    return np.split(a, world, axis=dim)[rank]


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_gets_its_slice_and_reads_its_share_of_the_bytes(device, model, world):
    directory, _, ref = model
    total = sum(a.nbytes for a in ref.values())
    replicated = sum(a.nbytes for n, a in ref.items() if rule_of(n) is None)
    read = 0
    for rank in range(world):
        stats = {}
        got = gpufeed.load_model(directory, device=device, rank=rank, world_size=world, rules=RULES,
                                 framework="numpy", stats=stats)
        for n, a in got.items():
            want = numpy_slice(ref[n], rule_of(n), rank, world)
            assert same_bits(a, want), f"{n} rank {rank} of {world}"
        assert stats["bytes_read"] == (total - replicated) // world + replicated
        read += stats["bytes_read"]
    assert read == total - replicated + replicated * world


def test_ranks_as_processes_take_rank_and_world_size_from_the_environment(device, model):
    directory, _, ref = model
    script = textwrap.dedent(f"""
        import numpy as np, gpufeed, sys
        rules = {RULES!r}
        got = gpufeed.load_model({str(directory)!r}, rules=rules, framework="numpy")
        np.savez(sys.argv[1], **got)
    """)
    for world in (2, 4):
        procs = []
        for rank in range(world):
            out = directory / f"rank{rank}of{world}.npz"
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
            procs.append((rank, out, subprocess.Popen([sys.executable, "-c", script, str(out)], env=env)))
        for rank, out, p in procs:
            assert p.wait(timeout=120) == 0
            got = np.load(out)
            assert set(got.files) == set(ref)
            for n in ref:
                assert same_bits(got[n], numpy_slice(ref[n], rule_of(n), rank, world)), f"{n} {rank}/{world}"


def test_uneven_splits_and_missing_dimensions_are_value_errors_naming_the_tensor(device, model):
    directory, _, _ = model
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*does not divide"):
        gpufeed.load_model(directory, device=device, rank=0, world_size=3, rules={"model.norm.weight": 0})
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*dimension 1"):
        gpufeed.load_model(directory, device=device, rank=0, world_size=2, rules={"model.norm.weight": 1})
    with pytest.raises(ValueError, match="both rank= and world_size="):
        gpufeed.load_model(directory, device=device, rank=1, rules=RULES)
    with pytest.raises(ValueError, match="rank 2 must be below world_size 2"):
        gpufeed.load_model(directory, device=device, rank=2, world_size=2, rules={})


# ---------------------------------------------------------------- saving


def saved(directory):
    """The checkpoint in `directory` as the safetensors package reads it,
    through its index."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    out = reference([directory / f for f in files])
    assert set(out) == set(index["weight_map"])
    return out, files


def leftovers(directory):
    return [f for f in os.listdir(directory) if ".partial-" in f]


def test_save_async_writes_shards_and_an_index_the_safetensors_package_reads(device, tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    tensors = llama_like(rng)
    sd = {n: (gpufeed.to_device(a, device) if i % 2 else a) for i, (n, a) in enumerate(tensors.items())}
    h = gpufeed.save_async(sd, tmp_path / "ck", max_shard_bytes=6000, metadata={"format": "pt"})
    assert h.wait() == tmp_path / "ck" / "model.safetensors.index.json"
    assert h.done() and h.nbytes == sum(a.nbytes for a in tensors.values())
    back, files = saved(tmp_path / "ck")
    assert len(files) == len(h.shards) > 3
    for n, a in tensors.items():
        assert same_bits(back[n], a), n
    assert leftovers(tmp_path / "ck") == []
    again = gpufeed.load_model(tmp_path / "ck", device=device, framework="numpy")
    assert all(same_bits(again[n], a) for n, a in tensors.items())


@pytest.mark.parametrize("bound", [None, 4096, 64])
def test_tensors_changed_as_soon_as_save_async_returns_are_saved_as_they_were(device, tmp_path, bound):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    old = {f"w{i}": fresh(rng, (300, 17 + i), np.float32) for i in range(6)}
    sd = {n: (gpufeed.to_device(a, device) if i % 2 else a.copy()) for i, (n, a) in enumerate(old.items())}
    h = gpufeed.save_async(sd, tmp_path, snapshot_bytes=bound, max_shard_bytes=50_000)
    # Training goes on: every tensor overwritten right away.
    for n, v in sd.items():
        if isinstance(v, np.ndarray):
            v[...] = -1.0
        else:
            v.upload(np.full(v.shape, -1.0, np.float32))
    h.wait()
    back, _ = saved(tmp_path)
    for n, a in old.items():
        assert same_bits(back[n], a), f"{n} (snapshot_bytes={bound})"


def test_save_async_saves_a_torch_module_and_is_awaitable(device, tmp_path):
    torch = torch_or_skip()
    from safetensors.torch import load_file as st_torch_load

    where = "cuda" if device.kind == "cuda" else "cpu"
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(torch.bfloat16).to(where)

    async def main():
        return await gpufeed.save_async(m, tmp_path / "ck")

    index = asyncio.run(main())
    assert index.name == "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    back = {}
    for f in files:
        back.update(st_torch_load(str(tmp_path / "ck" / f)))
    for n, p in m.state_dict().items():
        assert torch.equal(back[n].view(torch.int16), p.cpu().view(torch.int16)), n


def run_child(code, timeout=120, **popen):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, **popen)


def test_a_disk_that_fills_returns_the_error_through_the_handle_and_leaves_no_file(tmp_path):
    # A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the shard's
    # writes fail with EFBIG as a full disk would with ENOSPC.
    r = run_child(f"""
        import errno, os, resource, signal, numpy as np, gpufeed
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        d = {str(tmp_path / "ck")!r}
        good = {{"a": np.arange(1000, dtype=np.float32)}}
        gpufeed.save_async(good, d).wait()        # the checkpoint there before
        before = sorted(os.listdir(d))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        big = {{"a": np.ones(1 << 20, np.float32), "b": np.ones(10, np.float32)}}
        h = gpufeed.save_async(big, d, max_shard_bytes=1 << 30)
        try:
            h.wait()
        except OSError as e:
            assert e.errno == errno.EFBIG, e
            assert e.filename and e.filename.startswith(d), e.filename
            print("raised", e)
        else:
            raise SystemExit("no error came back")
        assert h.done()
        after = sorted(os.listdir(d))
        assert after == before, (before, after)
        got = gpufeed.load_model(d, framework="numpy")
        assert (got["a"] == good["a"]).all()
        print("ok")
    """, env=dict(os.environ, HOST_BACKEND=os.environ.get("HOST_BACKEND", "auto")))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_a_save_into_a_path_that_is_a_file_raises_at_once(device, tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    with pytest.raises(OSError) as e:
        gpufeed.save_async({"a": np.zeros(3, np.float32)}, f, device=device)
    assert e.value.filename == str(f)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_readable(tmp_path):
    d = tmp_path / "ck"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, numpy as np, gpufeed
        rng = np.random.default_rng(1)
        old = {{f"t{{i}}": rng.standard_normal(1000).astype(np.float32) for i in range(4)}}
        gpufeed.save_async(old, {str(d)!r}).wait()
        np.savez({str(tmp_path / "old.npz")!r}, **old)
        new = {{f"t{{i}}": np.full(16 << 20, i, np.float32) for i in range(4)}}
        h = gpufeed.save_async(new, {str(d)!r}, max_shard_bytes=64 << 20)
        print("writing", flush=True)
        h.wait()
        print("finished", flush=True)
    """)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    old = np.load(tmp_path / "old.npz")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4 * 4000, "the save finished before the kill"
    got = gpufeed.load_model(d, framework="numpy")
    assert set(got) == set(old.files)
    for n in old.files:
        assert same_bits(got[n], old[n]), n


def test_the_readme_example_runs_as_written(tmp_path):
    text = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    section = text.split("## Model weights: `load_model` and `save_async`", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith("ckpt/model.safetensors.index.json")
