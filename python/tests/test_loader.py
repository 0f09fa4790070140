"""gpufeed.Loader: every element of every batch is compared with NumPy's own
gather (`a[idx]`) of the rows the batch should hold, the order computed here
independently (a Python SplitMix64 Fisher-Yates and DistributedSampler's
sharding written out, and torch's own DistributedSampler when torch is
there), read back into poisoned outputs. Also: epochs, len, set_epoch,
resuming from a state dict, drop_last both ways, dict sources, .npy lists,
safetensors, typed errors, and two ranks under torch.distributed (gloo)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gpufeed
from conftest import torch_or_skip


POISON = 0xA5
MASK = (1 << 64) - 1
HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return state, z ^ (z >> 31)


def ref_permutation(n, seed, epoch):
    """The documented algorithm, written again: SplitMix64 from
    seed ^ splitmix64(epoch), Fisher-Yates with Lemire's bounded draws."""
    _, e = splitmix64(epoch)
    state = seed ^ e
    v = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = (-bound & MASK) % bound
        while True:
            state, x = splitmix64(state)
            m = x * bound
            if (m & MASK) >= threshold:
                j = m >> 64
                break
        v[i], v[j] = v[j], v[i]
    return v


def ref_indices(n, shuffle, seed, epoch, drop_last=False, rank=0, world=1):
    """DistributedSampler.__iter__, written out over our permutation."""
    order = ref_permutation(n, seed, epoch) if shuffle else list(range(n))
    if world == 1:
        return order
    if drop_last and n % world != 0:
        per = -(-(n - world) // world) if n > world else 0
    else:
        per = -(-n // world)
    total = per * world
    if not drop_last:
        pad = total - n
        order = order + (order * (pad // max(n, 1) + 1))[:pad] if n else []
    else:
        order = order[:total]
    return order[rank:total:world]


def ref_batches(n, batch, shuffle, seed, epoch, drop_last=False, rank=0, world=1):
    idx = ref_indices(n, shuffle, seed, epoch, drop_last, rank, world)
    out = [idx[i:i + batch] for i in range(0, len(idx), batch)]
    if drop_last and out and len(out[-1]) < batch:
        out.pop()
    return out


def fresh(rng, shape, dtype):
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def host_copy(d):
    """A DeviceArray read back into a poisoned array."""
    out = np.empty(d.shape, dtype=np.dtype(d.dtype) if d.dtype != "bfloat16" else np.uint16)
    out.view(np.uint8)[...] = POISON
    gpufeed.to_host(d, out=out)
    return out


def same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_permutation_is_the_documented_algorithm():
    a = np.arange(10)
    ld = gpufeed.Loader(a, 4, shuffle=True, seed=0, device=gpufeed.default_device())
    assert ld.indices(0) == ref_permutation(10, 0, 0) == [1, 2, 5, 7, 0, 8, 4, 3, 9, 6]
    for n, seed, epoch in [(1000, 1, 2), (1, 5, 5), (0, 1, 1), (4097, 2**64 - 1, 2**63)]:
        ld = gpufeed.Loader(np.arange(max(n, 1))[:n].reshape(n), 3, shuffle=True, seed=seed)
        assert ld.indices(epoch) == ref_permutation(n, seed, epoch)


@pytest.mark.parametrize("dtype", ["float32", "int8", "uint16", "float64"])
@pytest.mark.parametrize("shuffle,drop_last,batch", [
    (False, False, 64), (True, False, 100), (True, True, 64), (False, True, 999), (True, False, 5000)])
def test_every_batch_equals_numpys_gather_of_its_rows(device, dtype, shuffle, drop_last, batch):
    rng = np.random.default_rng(abs(hash((dtype, shuffle, drop_last, batch))) % 2**32)
    a = fresh(rng, (1001, 3, 7), dtype)  # rows of 21 values: pieces cut rows anywhere
    ld = gpufeed.Loader(a, batch, shuffle=shuffle, seed=7, drop_last=drop_last, device=device,
                        framework="gpufeed", prefetch=3)
    for epoch in [0, 3]:
        ld.set_epoch(epoch)
        want = ref_batches(1001, batch, shuffle, 7, epoch, drop_last)
        assert len(ld) == len(want)
        got = 0
        for k, b in enumerate(ld):
            assert isinstance(b, gpufeed.DeviceArray)
            same(host_copy(b), a[np.array(want[k], dtype=np.int64)])
            got += 1
        assert got == len(want)
        # An epoch whose rows don't fill the last batch: kept, or dropped.
        rows = sum(len(w) for w in want)
        assert rows == (1001 // batch * batch if drop_last else 1001)


def test_in_memory_arrays_are_gathered_on_the_device_and_others_on_the_host(device, tmp_path):
    rng = np.random.default_rng(12)
    a = fresh(rng, (513, 8), "float32")
    labels = fresh(rng, (513,), "int64")
    np.save(tmp_path / "a.npy", a)
    mapped = np.load(tmp_path / "a.npy", mmap_mode="r")
    paths = [str(tmp_path / "a.npy"), str(tmp_path / "a.npy")]
    cases = [
        ({"x": a, "y": labels}, "device", a),       # in memory, one piece each: pinned in place
        (mapped, "device", a),                      # a read-only memory map: pinned read-only
        ({"x": paths, "y": np.concatenate([labels, labels])}, "host", np.concatenate([a, a])),
    ]
    for source, where, whole in cases:
        ld = gpufeed.Loader(source, 40, shuffle=True, seed=3, device=device, framework="gpufeed")
        assert ld.gather == where
        want = ref_batches(len(whole), 40, True, 3, 0)
        for k, b in enumerate(ld):
            x = b["x"] if isinstance(b, dict) else b
            same(host_copy(x), whole[np.array(want[k])])
        del ld
    # Memory pinned elsewhere already is left as it is: the host gathers.
    c = fresh(rng, (100, 16), "float32")
    buf = gpufeed.pin(c)
    ld = gpufeed.Loader(c, 40, device=device, framework="gpufeed")
    assert ld.gather == "host"
    same(host_copy(next(iter(ld))), c[:40])
    del ld
    buf.unpin()
    # A loader's own pin lasts as long as the loader: then the array is free.
    ld = gpufeed.Loader(c, 40, device=device, framework="gpufeed")
    assert ld.gather == "device"
    del ld
    gpufeed.pin(c).unpin()


def test_a_dict_source_gives_dict_batches_of_features_and_labels(device):
    rng = np.random.default_rng(3)
    x = fresh(rng, (777, 16), "float32")
    y = fresh(rng, (777,), "int64")
    ld = gpufeed.Loader({"x": x, "y": y}, 50, shuffle=True, seed=1, device=device, framework="numpy")
    want = ref_batches(777, 50, True, 1, 0)
    n = 0
    for k, b in enumerate(ld):
        assert set(b) == {"x", "y"}
        idx = np.array(want[k])
        same(b["x"], x[idx])
        same(b["y"], y[idx])
        n += 1
    assert n == len(ld) == 16


def test_a_list_of_npy_files_is_one_source_concatenated(device, tmp_path):
    rng = np.random.default_rng(4)
    parts = [fresh(rng, (r, 5), "float32") for r in (100, 1, 0, 333)]
    paths = []
    for i, p in enumerate(parts):
        paths.append(str(tmp_path / f"p{i}.npy"))
        np.save(paths[-1], p)
    whole = np.concatenate(parts)
    labels = fresh(rng, (434,), "int32")
    ld = gpufeed.Loader({"x": paths, "y": labels}, 32, shuffle=True, seed=9, device=device,
                        framework="gpufeed")
    want = ref_batches(434, 32, True, 9, 0)
    for k, b in enumerate(ld):
        idx = np.array(want[k])
        same(host_copy(b["x"]), whole[idx])
        same(host_copy(b["y"]), labels[idx])
    # One path alone is a source too.
    ld = gpufeed.Loader(paths[0], 7, device=device, framework="numpy")
    same(np.concatenate(list(ld)), parts[0])


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    names = {"float32": "F32", "int64": "I64", "uint8": "U8", "float16": "F16"}
    for name, a in tensors.items():
        b = a.tobytes()
        header[name] = {"dtype": names[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"made": "test"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def test_a_safetensors_file_gives_a_field_per_tensor(device, tmp_path):
    rng = np.random.default_rng(5)
    t = {"image": fresh(rng, (300, 4, 4), "uint8"), "label": fresh(rng, (300,), "int64"),
         "w": fresh(rng, (300, 3), "float16")}
    path = tmp_path / "d.safetensors"
    write_safetensors(path, t)
    ld = gpufeed.Loader(str(path), 64, shuffle=True, seed=2, drop_last=True, device=device,
                        framework="gpufeed")
    want = ref_batches(300, 64, True, 2, 0, drop_last=True)
    assert len(ld) == 4
    for k, b in enumerate(ld):
        assert set(b) == set(t)
        for name in t:
            same(host_copy(b[name]), t[name][np.array(want[k])])


def test_epochs_len_and_set_epoch(device):
    a = np.arange(103, dtype=np.int64)
    ld = gpufeed.Loader(a, 10, shuffle=True, seed=5, device=device, framework="numpy")
    assert len(ld) == 11
    first = np.concatenate(list(ld))
    again = np.concatenate(list(ld))
    assert np.array_equal(first, again)  # the epoch does not advance by itself
    assert sorted(first.tolist()) == list(range(103))
    ld.set_epoch(1)
    assert ld.epoch == 1
    second = np.concatenate(list(ld))
    assert sorted(second.tolist()) == list(range(103)) and not np.array_equal(first, second)
    assert second.tolist() == ref_permutation(103, 5, 1)
    assert len(gpufeed.Loader(a, 10, drop_last=True, device=device)) == 10
    assert len(gpufeed.Loader(a, 1000, drop_last=True, device=device)) == 0
    assert list(gpufeed.Loader(a, 1000, drop_last=True, device=device, framework="numpy")) == []


def test_a_state_dict_resumes_mid_epoch(device):
    rng = np.random.default_rng(6)
    a = fresh(rng, (500, 8), "float32")
    mk = lambda: gpufeed.Loader(a, 32, shuffle=True, seed=11, device=device, framework="numpy")
    full = mk()
    full.set_epoch(4)
    whole = list(full)
    part = mk()
    part.set_epoch(4)
    it = iter(part)
    for _ in range(5):
        next(it)
    state = part.state_dict()
    assert state["epoch"] == 4 and state["batches"] == 5 and state["seed"] == 11
    del part, it
    resumed = mk()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a round trip to disk
    assert resumed.state_dict()["batches"] == 5
    rest = list(resumed)
    assert len(rest) == len(whole) - 5
    for got, want in zip(rest, whole[5:]):
        same(got, want)
    # The next iteration starts the epoch from its beginning again.
    assert len(list(resumed)) == len(whole)
    other = gpufeed.Loader(a, 32, shuffle=True, seed=12, device=device)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError):
        mk().load_state_dict({"epoch": 0})


def test_a_state_taken_after_resuming_and_at_an_epochs_end_counts_every_batch_and_reloads(device):
    # Row i holds i: a batch's rows are its indices.
    a = np.arange(500, dtype=np.int64).reshape(500, 1)
    mk = lambda: gpufeed.Loader(a, 32, shuffle=True, seed=3, device=device, framework="numpy")
    order = ref_indices(500, True, 3, 2)
    per_epoch = -(-500 // 32)  # 16
    part = mk()
    part.set_epoch(2)
    it = iter(part)
    for _ in range(5):
        next(it)
    state = part.state_dict()
    assert (state["epoch"], state["batches"]) == (2, 5)
    # Resumed at 5, three more taken: 8 consumed, the 5 skipped counted.
    resumed = mk()
    resumed.load_state_dict(state)
    it = iter(resumed)
    taken = [next(it) for _ in range(3)]
    assert np.concatenate(taken).ravel().tolist() == order[5 * 32:8 * 32]
    again = resumed.state_dict()
    assert (again["epoch"], again["batches"]) == (2, 8)
    third = mk()
    third.load_state_dict(again)
    assert np.concatenate(list(third)).ravel().tolist() == order[8 * 32:]
    # The resumed epoch run to its end: every batch consumed, a state
    # that reloads, and the loader it is loaded into has nothing left of
    # that epoch (then the next iteration runs it whole).
    rest = list(it)
    assert len(rest) == per_epoch - 8
    end = resumed.state_dict()
    assert (end["epoch"], end["batches"]) == (2, per_epoch)
    fourth = mk()
    fourth.load_state_dict(end)
    assert fourth.state_dict()["batches"] == per_epoch
    assert list(fourth) == []
    assert np.concatenate(list(fourth)).ravel().tolist() == order
    # An epoch run whole from the start ends at the same state.
    whole = mk()
    whole.set_epoch(2)
    assert len(list(whole)) == per_epoch
    assert whole.state_dict()["batches"] == per_epoch
    mk().load_state_dict(whole.state_dict())


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_each_rank_yields_as_many_batches_and_rows_as_its_indices(device, world):
    for n in [61, 1001]:
        assert n % world != 0
        a = np.arange(n, dtype=np.int64).reshape(n, 1)  # row i holds i
        for drop_last in [False, True]:
            for rank in range(world):
                ld = gpufeed.Loader(a, 4, shuffle=True, seed=8, drop_last=drop_last, rank=rank,
                                    world_size=world, device=device, framework="numpy")
                want = ref_batches(n, 4, True, 8, 0, drop_last, rank, world)
                assert ld.indices() == ref_indices(n, True, 8, 0, drop_last, rank, world)
                assert len(ld) == len(want), (n, world, rank, drop_last)
                got = [b.ravel().tolist() for b in ld]
                assert got == want, (n, world, rank, drop_last)


def test_a_source_whose_elements_have_no_device_dtype_is_a_type_error_as_for_to_device(device):
    for a in [np.zeros(100, "M8[s]"), np.zeros(100, "m8[ms]"), np.zeros((10, 2), object)]:
        with pytest.raises(TypeError):
            gpufeed.to_device(a, device)
        with pytest.raises(TypeError, match="device dtype") as e:
            gpufeed.Loader(a, 8, device=device)
        assert str(a.dtype) in str(e.value)
        with pytest.raises(TypeError, match="device dtype"):
            gpufeed.Loader({"x": a, "y": np.zeros(len(a), np.float32)}, 8, device=device)


def test_the_order_is_the_same_in_another_process():
    code = ("import gpufeed, numpy as np;"
            "ld = gpufeed.Loader(np.zeros((5000, 2), np.float32), 8, shuffle=True, seed=77);"
            "print(ld.indices(3))")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120).stdout for _ in range(2)]
    assert outs[0] == outs[1] == str(ref_permutation(5000, 77, 3)) + "\n"


def test_bad_input_is_a_typed_error(device, tmp_path):
    a = np.zeros((100, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpufeed.Loader(a[:, ::2], 10, device=device)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpufeed.Loader(np.asfortranarray(a), 10, device=device)
    with pytest.raises(ValueError, match="equal row counts"):
        gpufeed.Loader({"x": a, "y": np.zeros(99, np.int64)}, 10, device=device)
    with pytest.raises(ValueError, match="batch_size"):
        gpufeed.Loader(a, 0, device=device)
    with pytest.raises(ValueError, match="prefetch"):
        gpufeed.Loader(a, 1, prefetch=0, device=device)
    for bad in [np.zeros(10, np.complex64), np.zeros(10, bool), np.zeros(10, object)]:
        with pytest.raises(TypeError):
            gpufeed.Loader(bad, 2, device=device)
    with pytest.raises(ValueError, match="0-dimensional"):
        gpufeed.Loader(np.float32(1), 1, device=device)
    with pytest.raises(FileNotFoundError):
        gpufeed.Loader([str(tmp_path / "missing.npy")], 4, device=device)
    with pytest.raises(FileNotFoundError):
        gpufeed.Loader(str(tmp_path / "missing.safetensors"), 4, device=device)
    with pytest.raises(TypeError):
        gpufeed.Loader(object(), 4, device=device)
    with pytest.raises(TypeError):
        gpufeed.Loader([1, 2], 4, device=device)
    with pytest.raises(ValueError, match="framework"):
        gpufeed.Loader(a, 4, device=device, framework="jax")
    with pytest.raises(ValueError, match="rank"):
        gpufeed.Loader(a, 4, device=device, rank=2, world_size=2)
    with pytest.raises(ValueError):
        gpufeed.Loader(a, 4, device=device, rank=0)
    with pytest.raises(ValueError, match="world_size"):
        gpufeed.Loader(a, 4, device=device, rank=0, world_size=10**18)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", np.zeros((5, 3), np.float32))
    with pytest.raises(ValueError, match="row shape"):
        gpufeed.Loader([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], 4, device=device)
    with open(tmp_path / "bad.safetensors", "wb") as f:
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="safetensors"):
        gpufeed.Loader(str(tmp_path / "bad.safetensors"), 4, device=device)


def test_torch_tensors_come_out_when_torch_is_there(device):
    torch = torch_or_skip()
    rng = np.random.default_rng(8)
    x = fresh(rng, (200, 6), "float32")
    y = fresh(rng, (200,), "int64")
    ld = gpufeed.Loader({"x": x, "y": y}, 64, shuffle=True, seed=3, device=device)
    assert ld.framework == "torch"
    want = ref_batches(200, 64, True, 3, 0)
    for k, b in enumerate(ld):
        assert isinstance(b["x"], torch.Tensor) and b["x"].dtype == torch.float32
        assert b["x"].device.type == ("cuda" if device.kind == "cuda" else "cpu")
        same(b["x"].cpu().numpy(), x[np.array(want[k])])
        same(b["y"].cpu().numpy(), y[np.array(want[k])])


@pytest.mark.parametrize("n", [0, 1, 7, 10, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_are_distributed_samplers_own_indices(device, n, world, monkeypatch):
    torch = torch_or_skip()
    from torch.utils.data import DistributedSampler
    for shuffle in [False, True]:
        for drop_last in [False, True]:
            for epoch in [0, 2]:
                # DistributedSampler draws its permutation with torch.randperm
                # seeded seed + epoch; ours is fixed by (seed, epoch): give it
                # ours, and every other step (padding, cutting, striding) is
                # its own code.
                perm = ref_permutation(n, 21, epoch)
                monkeypatch.setattr(torch, "randperm", lambda m, generator=None: torch.tensor(perm, dtype=torch.int64))
                for rank in range(world):
                    s = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                           shuffle=shuffle, seed=21, drop_last=drop_last)
                    s.set_epoch(epoch)
                    ld = gpufeed.Loader(np.arange(max(n, 1), dtype=np.int64)[:n], 3, shuffle=shuffle,
                                        seed=21, drop_last=drop_last, rank=rank, world_size=world,
                                        device=device)
                    assert ld.indices(epoch) == list(s), (n, world, rank, shuffle, drop_last)
                    assert ld.shard == (rank, world)
                monkeypatch.undo()


RANKS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import gpufeed

    def run(rank, world, init, out):
        os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it: the rank's own device
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        n = 1003
        data = np.arange(n, dtype=np.int64) * 3 + 1  # row i holds 3i+1
        ld = gpufeed.Loader({"v": data, "i": np.arange(n, dtype=np.int64)}, 16, shuffle=True,
                            seed=1234, framework="torch")
        assert ld.shard == (rank, world), ld.shard
        epochs = []
        for epoch in range(3):
            ld.set_epoch(epoch)
            seen = []
            for b in ld:
                assert torch.equal(b["v"], b["i"] * 3 + 1)
                seen += b["i"].tolist()
            gathered = [None] * world
            dist.all_gather_object(gathered, seen)
            epochs.append(gathered)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(epochs, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        init, out = sys.argv[1], sys.argv[2]
        mp.spawn(run, args=(2, init, out), nprocs=2, join=True)
""")


def test_two_ranks_under_gloo_get_disjoint_complete_shards_in_the_same_order_each_run(tmp_path):
    torch_or_skip()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    runs = []
    for run in range(2):
        out = tmp_path / f"out{run}.json"
        init = f"file://{tmp_path}/rendezvous{run}"
        env = dict(os.environ, HOST_BACKEND="cpu", HOST_CPU_DEVICES="2")
        r = subprocess.run([sys.executable, str(script), init, str(out)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        runs.append(json.loads(out.read_text()))
    assert runs[0] == runs[1]  # the same order across restarts with the same seed
    n = 1003
    for epoch, (r0, r1) in enumerate(runs[0]):
        assert len(r0) == len(r1) == 502
        assert set(r0) | set(r1) == set(range(n))  # complete
        # Disjoint, but for the one row repeated to pad 1003 rows to 2 × 502
        # (DistributedSampler pads by wrapping around).
        assert len(set(r0) & set(r1)) == 1
        assert r0 + r1 != []
        want = ref_indices(n, True, 1234, epoch, rank=0, world=2)
        assert r0 == want
    assert runs[0][0] != runs[0][1]  # epochs differ


def test_a_batch_is_ready_on_a_delayed_consumer_stream(cuda_device, torch_cuda):
    torch = torch_cuda
    rng = np.random.default_rng(10)
    a = fresh(rng, (4096, 1024), "float32")  # 4 KiB rows
    ld = gpufeed.Loader(a, 2048, shuffle=True, seed=4, device=cuda_device)
    want = ref_batches(4096, 2048, True, 4, 0)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for k, b in enumerate(ld):
            torch.cuda._sleep(50_000_000)  # the consumer's stream runs behind
            got = (b * 1).cpu().numpy()
            same(got, a[np.array(want[k])])


def test_the_training_example_runs_small(tmp_path):
    torch_or_skip()
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train.py"), "--small"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["gpufeed"]["steps"] > 0 and result["dataloader"]["steps"] > 0


def test_an_epoch_left_midway_restarts_cleanly_and_a_dropped_loader_does_not_hang(device):
    rng = np.random.default_rng(12)
    a = fresh(rng, (1000, 4), "int32")
    ld = gpufeed.Loader(a, 10, shuffle=True, seed=3, device=device, framework="numpy", prefetch=4)
    want = ref_batches(1000, 10, True, 3, 0)
    it = iter(ld)
    for k, b in enumerate(it):
        if k == 7:
            break  # the producer has batches of this epoch ready or in flight
    # The iterator goes on with the epoch in progress.
    same(next(it), a[np.array(want[8])])
    # A new iteration starts the epoch afresh: nothing left over from before.
    it = iter(ld)
    for k, b in enumerate(it):
        same(b, a[np.array(want[k])])
    assert k == len(want) - 1
    with pytest.raises(StopIteration):
        next(it)
    # Dropped in the middle of an epoch (its thread blocked handing over a
    # batch): returns at once, and the source's memory is released after.
    ld2 = gpufeed.Loader(a, 10, device=device, framework="numpy")
    it = iter(ld2)
    next(it)
    del it, ld2
    import gc
    gc.collect()


def test_a_forked_child_gets_an_error_from_the_parents_loader_not_a_hang(device):
    import time
    ld = gpufeed.Loader(np.arange(100, dtype=np.int64), 10, device=device, framework="numpy")
    it = iter(ld)
    next(it)
    pid = os.fork()
    if pid == 0:
        code = 5
        try:
            next(it)
            code = 3
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
            pytest.fail("the forked child hung in next(loader)")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert next(it).tolist() == list(range(10, 20))  # the parent's goes on


def test_a_state_taken_after_set_epoch_resumes_that_epoch_from_its_start(device):
    x = np.arange(1000, dtype=np.float32).reshape(1000, 1)
    ld = gpufeed.Loader(x, 100, shuffle=True, device=device, framework="numpy")
    ld.set_epoch(0)
    for _ in ld:
        pass
    ld.set_epoch(1)  # the next epoch prepared, then a checkpoint
    assert (ld.state_dict()["epoch"], ld.state_dict()["batches"]) == (1, 0)
    again = gpufeed.Loader(x, 100, shuffle=True, device=device, framework="numpy")
    again.load_state_dict(ld.state_dict())
    got = np.concatenate([b.ravel() for b in again])
    assert np.array_equal(got, x.ravel()[np.array(ld.indices(1))])  # all of epoch 1
    # Mid-epoch, the same: the position is of the running epoch only.
    it = iter(ld)
    for _ in range(3):
        next(it)
    assert (ld.state_dict()["epoch"], ld.state_dict()["batches"]) == (1, 3)
    ld.set_epoch(2)
    assert (ld.state_dict()["epoch"], ld.state_dict()["batches"]) == (2, 0)
    # A loaded position survives set_epoch of its own epoch, not of another.
    again.load_state_dict({**ld.state_dict(), "epoch": 5, "batches": 4})
    again.set_epoch(5)
    assert again.state_dict()["batches"] == 4
    again.set_epoch(6)
    assert again.state_dict()["batches"] == 0


def test_negative_or_too_large_counts_are_value_errors(device):
    x = np.zeros((8, 2), np.float32)
    for kwargs in [dict(rank=-1, world_size=2), dict(world_size=-2, rank=0), dict(seed=-5),
                   dict(prefetch=-1), dict(batch_size=2**64)]:
        args = {"batch_size": 2, **kwargs}
        with pytest.raises(ValueError, match="not a count"):
            gpufeed.Loader(x, device=device, framework="numpy", **args)
    ld = gpufeed.Loader(x, 2, device=device, framework="numpy")
    with pytest.raises(ValueError, match="not a count"):
        ld.set_epoch(-1)
    with pytest.raises(ValueError, match="not a count"):
        ld.indices(2**64)
    assert sorted(ld.indices(2**63)) == list(range(8))


def test_an_iterator_of_a_loader_goes_on_with_its_epoch_when_iterated_again(device):
    a = np.arange(10, dtype=np.float32).reshape(10, 1)
    ld = gpufeed.Loader(a, 3, device=device, framework="numpy")
    it = iter(ld)
    assert iter(it) is it
    first = next(it)
    same(first, a[0:3])
    rest = list(it)  # iter(it) again: the same epoch, not a restart
    assert [r.ravel().tolist() for r in rest] == [[3, 4, 5], [6, 7, 8], [9]]
    # A later iter(loader) starts afresh; the older iterator says so.
    old = iter(ld)
    new = iter(ld)
    with pytest.raises(RuntimeError, match="later iter"):
        next(old)
    same(next(new), a[0:3])


def test_a_loader_is_used_and_dropped_on_another_thread_without_a_panic(device):
    import gc
    import threading
    a = np.empty((20, 2), dtype=np.int32)  # owns its memory: resize() can tell an export
    a[:] = np.arange(40).reshape(20, 2)
    ld = gpufeed.Loader(a, 4, device=device, framework="numpy")
    got, errors = [], []

    def use():
        try:
            got.append(len(ld))
            got.append([b.copy() for b in ld])
        except BaseException as e:  # noqa: BLE001 - a PanicException is no Exception
            errors.append(e)

    t = threading.Thread(target=use)
    t.start()
    t.join()
    assert errors == []
    assert got[0] == 5
    assert len(got[1]) == 5
    for k, b in enumerate(got[1]):
        same(b, a[4 * k:4 * k + 4])
    # The last reference dropped on another thread: the loader goes, and with
    # it the export of the source (the array can be resized again).
    with pytest.raises(ValueError):
        a.resize((10, 2))  # exported to the loader
    holder = [ld]
    del ld
    t = threading.Thread(target=lambda: (holder.clear(), gc.collect()))
    t.start()
    t.join()
    gc.collect()
    a.resize((10, 2))


@pytest.mark.parametrize("batch_size", [11, 2**40, 2**62])
def test_a_batch_size_above_the_rows_is_one_batch_of_every_row(device, batch_size):
    a = np.random.default_rng(23).standard_normal((10, 3)).astype(np.float32)
    ld = gpufeed.Loader(a, batch_size, device=device, framework="numpy")
    assert len(ld) == 1
    batches = list(ld)
    assert len(batches) == 1 and np.array_equal(batches[0], a)
    dropped = gpufeed.Loader(a, batch_size, drop_last=True, device=device, framework="numpy")
    assert len(dropped) == 0 and list(dropped) == []


def test_a_strided_source_is_a_value_error_and_a_tensor_a_type_error(device):
    x = np.zeros((10, 4), np.float32)
    with pytest.raises(ValueError, match="C-contiguous"):
        gpufeed.Loader(x[:, ::2], 2, device=device, framework="numpy")
    with pytest.raises(ValueError, match="C-contiguous"):
        gpufeed.Loader(np.asfortranarray(x), 2, device=device, framework="numpy")
    torch = torch_or_skip()
    with pytest.raises(TypeError, match="numpy"):
        gpufeed.Loader(torch.zeros(10, 3), 2, device=device, framework="numpy")
