#!/usr/bin/env python3
"""Model weights in and out (issue 41), gpufeed against the peers, in one
process, on one Llama-like bfloat16 checkpoint written by the `safetensors`
package (several GB in 4+ shards; --small: a tiny one, seconds on the CPU
emulation, for CI).

    python bench/weights.py --out weights.json [--gb 4] [--shards 5] [--reps 3] [--small]
                            [--dir /path/on/the/disk/to/measure]

Loads, warm (pages cached: each method runs once unmeasured first) and cold
(every shard's pages evicted with posix_fadvise(POSIX_FADV_DONTNEED) after
os.sync before each run), methods interleaved run by run (the order rotates
each round, so that the disk's drift hits all alike):
  * safetensors.torch.load_file(shard, device="cuda") for each shard;
  * fastsafetensors (if importable): SafeTensorsFileLoader, nogds=True,
    max_threads=16 (disable_cache=False where the version takes it), and with
    GDS (nogds=False) where `gpufeed.gds_status()` finds it available;
  * the Run:ai Model Streamer (if importable): to the CPU, then .to("cuda")
    per tensor, as vLLM does;
  * gpufeed.load_model(dir, framework="torch") into new tensors;
  * gpufeed.load_model(dir, into=model) into a model's tensors made before
    (torch.empty on the device): no second allocation.
Beside them: the pinned copy of the same bytes (torch, one pinned buffer to
the device) and the disk's own O_DIRECT rate (dd iflag=direct bs=16M over
the shards, before and after the cold runs).

Saves (each into a fresh directory on the same disk, interleaved the same
way): torch.save(state_dict), safetensors.torch.save_file per shard,
torch.distributed.checkpoint.async_save (if it runs in one process), and
gpufeed.save_async: "blocked_s" (until the call returns: training may go
on), "done_s" (until the files are complete: the call plus wait()/result()),
"durable_s" (done plus os.sync()). gpufeed's saves fsync each shard; the
peers' don't (durable_s puts them on equal terms). The disk's own write
rate: dd oflag=direct bs=16M of as many bytes.

Every method's result is checked bit for bit against the safetensors
package's own reading (loads: every tensor on the device, compared as int16
words with a reference copy; saves: every file read back by
safetensors.torch.load_file / torch.load / DCP's load and compared).

Figures per run: GB/s, CPU seconds per GB (this process's user + system
time), peak host memory (RSS above the run's start, sampled every 2 ms) and
peak device memory (used device memory above the run's start, sampled every
2 ms through torch.cuda.mem_get_info). Medians over --reps.

Peers that are not installed are skipped with the reason in the JSON
("skipped"), never faked. Exit status 1 if a check failed.
"""
import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import gpufeed

GB = 1e9


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the checkpoint


def llama_shapes(gb, small):
    """Names and shapes of a Llama-like model of about `gb` GB of bf16."""
    if small:
        hidden, inter, vocab, layers = 64, 176, 256, 2
    else:
        hidden, inter, vocab = 3072, 8192, 32000
        per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
        layers = max(1, round((gb * GB - 2 * 2 * vocab * hidden) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            shapes[p + f"self_attn.{n}_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_checkpoint(torch, directory, shapes, shards):
    """The checkpoint, written by safetensors.torch.save_file: `shards`
    files of about equal size, an index; returns the shard paths."""
    from safetensors.torch import save_file

    names = list(shapes)
    total = sum(2 * int(np.prod(s)) for s in shapes.values())
    groups, cur, acc = [], [], 0
    for n in names:
        cur.append(n)
        acc += 2 * int(np.prod(shapes[n]))
        if acc >= total * (len(groups) + 1) / shards and len(groups) < shards - 1:
            groups.append(cur)
            cur = []
    groups.append(cur)
    groups = [g for g in groups if g]
    g = torch.Generator().manual_seed(41)
    weight_map, paths = {}, []
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: torch.randint(-32768, 32767, shapes[n], generator=g, dtype=torch.int16).view(torch.bfloat16)
                   for n in group}
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        del tensors
        paths.append(os.path.join(directory, fname))
        for n in group:
            weight_map[n] = fname
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return paths, total


def evict(paths):
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_rate(args, nbytes):
    """dd's own rate (bytes / wall time of the command)."""
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        return None, r.stderr.strip()[-300:]
    return nbytes / dt / GB, None


def disk_read_direct(paths):
    rates = []
    for p in paths:
        n = os.path.getsize(p)
        r, err = dd_rate(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct"], n)
        if r is None:
            return {"error": err}
        rates.append((n, n / r))
    n, t = sum(x[0] for x in rates), sum(x[1] for x in rates)
    return {"gbps": n / t}


def disk_write_direct(directory, nbytes):
    p = os.path.join(directory, "dd-write.bin")
    count = max(1, nbytes // (16 << 20))
    r, err = dd_rate(["dd", "if=/dev/zero", f"of={p}", "bs=16M", f"count={count}", "oflag=direct", "conv=fsync"],
                     count * (16 << 20))
    if os.path.exists(p):
        os.unlink(p)
    return {"gbps": r} if r is not None else {"error": err}


# ---------------------------------------------------------------- measuring


class Sampler:
    """Peak host RSS and device memory in use above the start, every 2 ms."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda = torch, cuda

    @staticmethod
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def device_used(self):
        if not self.cuda:
            return 0
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def __enter__(self):
        self.rss0, self.dev0 = self.rss(), self.device_used()
        self.peak_rss, self.peak_dev = self.rss0, self.dev0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.cpu0 = os.times()
        self.t0 = time.perf_counter()
        self.t.start()
        return self

    def run(self):
        while not self.stop.wait(0.002):
            self.peak_rss = max(self.peak_rss, self.rss())
            self.peak_dev = max(self.peak_dev, self.device_used())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        c = os.times()
        self.cpu = (c.user - self.cpu0.user) + (c.system - self.cpu0.system)
        self.stop.set()
        self.t.join()
        self.peak_rss = max(self.peak_rss, self.rss())
        self.peak_dev = max(self.peak_dev, self.device_used())
        return False

    def figures(self, nbytes):
        return {"seconds": self.seconds, "gbps": nbytes / self.seconds / GB,
                "cpu_s_per_gb": self.cpu / (nbytes / GB),
                "peak_host_bytes": self.peak_rss - self.rss0, "peak_device_bytes": self.peak_dev - self.dev0}


def summarize(runs, key="gbps"):
    ok = [r for r in runs if "error" not in r]
    out = {"runs": runs}
    if ok:
        for k in ok[0]:
            if isinstance(ok[0][k], (int, float)) and not isinstance(ok[0][k], bool):
                out["median_" + k] = statistics.median(r[k] for r in ok)
    return out


# ---------------------------------------------------------------- loads


def load_methods(torch, dev, directory, paths, gds):
    """name -> (load() -> {name: tensor}, release(result)) or a skip reason."""
    from safetensors.torch import load_file

    methods = {}

    def st_load():
        out = {}
        for p in paths:
            out.update(load_file(p, device=dev))
        return out

    methods["safetensors.load_file"] = (st_load, None)

    try:
        import inspect

        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def fst(nogds):
            def run():
                kw = {"nogds": nogds}
                params = inspect.signature(SafeTensorsFileLoader).parameters
                if "max_threads" in params:
                    kw["max_threads"] = 16
                if "disable_cache" in params:
                    kw["disable_cache"] = False
                loader = SafeTensorsFileLoader(SingleGroup(), torch.device(dev), **kw)
                loader.add_filenames({0: paths})
                fb = loader.copy_files_to_device()
                out = {k: fb.get_tensor(k) for k in loader.get_keys()}
                return out, (fb, loader)
            return run

        def fst_release(keep):
            fb, loader = keep
            fb.close()
            loader.close()

        methods["fastsafetensors.nogds"] = (fst(True), fst_release)
        if gds:
            methods["fastsafetensors.gds"] = (fst(False), fst_release)
        else:
            methods["fastsafetensors.gds"] = "GPUDirect Storage is not available here (gpufeed.gds_status())"
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        methods["fastsafetensors.nogds"] = f"not installed: {type(e).__name__}: {e}"

    try:
        from runai_model_streamer import SafetensorsStreamer

        def runai():
            out = {}
            with SafetensorsStreamer() as s:
                if hasattr(s, "stream_files"):
                    s.stream_files(paths)
                    for name, t in s.get_tensors():
                        out[name] = t.to(dev)
                else:
                    for p in paths:
                        s.stream_file(p)
                        for name, t in s.get_tensors():
                            out[name] = t.to(dev)
            return out

        methods["runai_streamer"] = (runai, None)
    except Exception as e:  # noqa: BLE001
        methods["runai_streamer"] = f"not installed: {type(e).__name__}: {e}"

    methods["gpufeed.load_model"] = (lambda: gpufeed.load_model(directory, framework="torch"), None)
    return methods


def check_loaded(torch, got, ref):
    """Every tensor bit for bit (int16 words) against the reference."""
    if set(got) != set(ref):
        return f"names differ: {sorted(set(got) ^ set(ref))[:5]}"
    for n, r in ref.items():
        t = got[n]
        if t.shape != r.shape or t.dtype != r.dtype:
            return f"{n}: {tuple(t.shape)} {t.dtype} instead of {tuple(r.shape)} {r.dtype}"
        if not torch.equal(t.view(torch.int16), r.view(torch.int16)):
            return f"{n}: values differ"
    return None


def run_load(torch, cuda, method, nbytes, ref, cold, paths):
    fn, release = method
    if cold:
        evict(paths)
    gc.collect()
    with Sampler(torch, cuda) as s:
        r = fn()
        if cuda:
            torch.cuda.synchronize()
    keep = None
    if isinstance(r, tuple):
        r, keep = r
    fig = s.figures(nbytes)
    fig["verified"] = (err := check_loaded(torch, r, ref)) is None
    if err:
        fig["error"] = err
    del r
    if release and keep is not None:
        release(keep)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return fig


def run_into(torch, cuda, directory, shapes, dev, nbytes, ref, cold, paths):
    """load_model(into=) a model whose tensors exist already."""
    model = {n: torch.empty(s, dtype=torch.bfloat16, device=dev) for n, s in shapes.items()}
    if cuda:
        torch.cuda.synchronize()
    if cold:
        evict(paths)
    gc.collect()
    with Sampler(torch, cuda) as s:
        gpufeed.load_model(directory, into=model)
        if cuda:
            torch.cuda.synchronize()
    fig = s.figures(nbytes)
    fig["verified"] = (err := check_loaded(torch, model, ref)) is None
    if err:
        fig["error"] = err
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return fig


def pinned_copy(torch, cuda, nbytes):
    if not cuda:
        return {"skipped": "no CUDA device"}
    n = min(nbytes, 4 << 30)
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        runs.append(n / (time.perf_counter() - t0) / GB)
    return {"bytes": n, "gbps": statistics.median(runs), "runs": runs}


# ---------------------------------------------------------------- saves


def save_methods(torch, cuda):
    methods = {}

    def torch_save(sd, d):
        t0 = time.perf_counter()
        torch.save(sd, os.path.join(d, "model.pt"))
        return time.perf_counter() - t0, lambda: None

    def st_save(sd, d, groups):
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        for i, g in enumerate(groups):
            save_file({n: sd[n] for n in g}, os.path.join(d, f"model-{i:05d}.safetensors"))
        return time.perf_counter() - t0, lambda: None

    def gf_save(sd, d):
        t0 = time.perf_counter()
        h = gpufeed.save_async(sd, d, max_shard_bytes=1 << 30)
        return time.perf_counter() - t0, h.wait

    methods["torch.save"] = torch_save
    methods["safetensors.save_file"] = st_save
    methods["gpufeed.save_async"] = gf_save
    try:
        import torch.distributed.checkpoint as dcp

        if not hasattr(dcp, "async_save"):
            raise ImportError("this torch has no torch.distributed.checkpoint.async_save")

        def dcp_save(sd, d):
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=d)
            return time.perf_counter() - t0, fut.result

        methods["dcp.async_save"] = dcp_save
    except Exception as e:  # noqa: BLE001
        methods["dcp.async_save"] = f"not available: {type(e).__name__}: {e}"
    return methods


def check_saved(torch, name, d, ref):
    """The files read back, every tensor bit for bit."""
    got = {}
    if name == "torch.save":
        got = torch.load(os.path.join(d, "model.pt"), map_location="cpu")
    elif name == "dcp.async_save":
        import torch.distributed.checkpoint as dcp

        got = {n: torch.empty_like(t, device="cpu") for n, t in ref.items()}
        dcp.load(got, checkpoint_id=d)
    else:
        from safetensors.torch import load_file

        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                got.update(load_file(os.path.join(d, f)))
    for n, r in ref.items():
        if n not in got or not torch.equal(got[n].view(torch.int16), r.view(torch.int16)):
            return f"{n}: missing or different"
    if len(got) != len(ref):
        return "extra tensors"
    return None


def run_save(torch, cuda, name, fn, sd, ref_host, base, groups, nbytes):
    d = tempfile.mkdtemp(prefix=f"save-{name}-", dir=base)
    try:
        if cuda:
            torch.cuda.synchronize()
        gc.collect()
        with Sampler(torch, cuda) as s:
            t0 = time.perf_counter()
            if name == "safetensors.save_file":
                blocked, finish = fn(sd, d, groups)
            else:
                blocked, finish = fn(sd, d)
            finish()
            done = time.perf_counter() - t0
            os.sync()
            durable = time.perf_counter() - t0
        fig = s.figures(nbytes)
        fig.update({"blocked_s": blocked, "done_s": done, "durable_s": durable,
                    "write_gbps": nbytes / done / GB, "durable_gbps": nbytes / durable / GB})
        err = check_saved(torch, name, d, ref_host)
        fig["verified"] = err is None
        if err:
            fig["error"] = err
        return fig
    finally:
        shutil.rmtree(d, ignore_errors=True)


def d2d_copy(torch, cuda, sd):
    """The device-to-device copy of the whole state dict (the snapshot's floor)."""
    if not cuda:
        return {"skipped": "no CUDA device"}
    dst = {n: torch.empty_like(t) for n, t in sd.items()}
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n, t in sd.items():
            dst[n].copy_(t)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    del dst
    torch.cuda.empty_cache()
    return {"seconds": statistics.median(runs), "runs": runs}


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a tiny checkpoint: seconds on the CPU emulation")
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (the disk measured); default: a temp dir")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available() and gpufeed.default_device().kind == "cuda"
    dev = "cuda" if cuda else "cpu"
    base = tempfile.mkdtemp(prefix="gpufeed-weights-", dir=args.dir)
    ckpt = os.path.join(base, "ckpt")
    os.makedirs(ckpt)
    result = {"device": gpufeed.default_device().banner() if hasattr(gpufeed.default_device(), "banner") else dev,
              "cuda": cuda, "small": args.small, "reps": args.reps, "dir": base,
              "gds": gpufeed.gds_status(), "versions": {"torch": torch.__version__}}
    failed = False
    try:
        import safetensors

        result["versions"]["safetensors"] = safetensors.__version__
        shapes = llama_shapes(args.gb, args.small)
        t0 = time.perf_counter()
        paths, nbytes = write_checkpoint(torch, ckpt, shapes, 4 if args.small else args.shards)
        result["checkpoint"] = {"bytes": nbytes, "tensors": len(shapes), "shards": len(paths),
                                "write_s": time.perf_counter() - t0}
        log(f"checkpoint: {nbytes / GB:.2f} GB, {len(shapes)} tensors, {len(paths)} shards")
        from safetensors.torch import load_file

        ref_host = {}
        for p in paths:
            ref_host.update(load_file(p, device="cpu"))
        ref = {n: t.to(dev) for n, t in ref_host.items()}
        for mod in ("fastsafetensors", "runai_model_streamer"):
            try:
                m = __import__(mod)
                result["versions"][mod] = getattr(m, "__version__", "?")
            except Exception as e:  # noqa: BLE001
                result["versions"][mod] = f"not installed: {e}"
        gds = result["gds"].get("available", False) and cuda
        methods = load_methods(torch, dev, ckpt, paths, gds)
        runnable = {k: v for k, v in methods.items() if not isinstance(v, str)}
        result["load"] = {"skipped": {k: v for k, v in methods.items() if isinstance(v, str)}}
        result["pinned_copy"] = pinned_copy(torch, cuda, nbytes)
        names = list(runnable) + ["gpufeed.load_model(into=)"]
        for cache in ("warm", "cold"):
            runs = {n: [] for n in names}
            if cache == "cold":
                result["disk_direct_before"] = disk_read_direct(paths)
            for rep in range(args.reps + (1 if cache == "warm" else 0)):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for n in order:
                    try:
                        if n == "gpufeed.load_model(into=)":
                            fig = run_into(torch, cuda, ckpt, shapes, dev, nbytes, ref, cache == "cold", paths)
                        else:
                            fig = run_load(torch, cuda, runnable[n], nbytes, ref, cache == "cold", paths)
                    except Exception as e:  # noqa: BLE001 - reported, never hidden
                        fig = {"error": f"{type(e).__name__}: {e}", "verified": False}
                    if cache == "warm" and rep == 0:
                        continue  # the warm-up run
                    failed |= not fig.get("verified", False)
                    runs[n].append(fig)
                    log(f"load {cache} {n}: {fig.get('gbps', 0):.2f} GB/s {fig.get('error', '')}")
            result["load"][cache] = {n: summarize(r) for n, r in runs.items()}
            if cache == "cold":
                result["disk_direct_after"] = disk_read_direct(paths)
        if not args.no_save:
            sd = {n: t.clone() for n, t in ref.items()}
            groups, cur, acc = [], [], 0
            for n in sd:
                cur.append(n)
                acc += sd[n].numel() * 2
                if acc >= nbytes * (len(groups) + 1) / len(paths):
                    groups.append(cur)
                    cur = []
            if cur:
                groups.append(cur)
            smethods = save_methods(torch, cuda)
            result["save"] = {"skipped": {k: v for k, v in smethods.items() if isinstance(v, str)},
                              "d2d_copy": d2d_copy(torch, cuda, sd),
                              "disk_write_direct": disk_write_direct(base, nbytes)}
            snames = [k for k, v in smethods.items() if not isinstance(v, str)]
            runs = {n: [] for n in snames}
            for rep in range(args.reps + 1):
                order = snames[rep % len(snames):] + snames[:rep % len(snames)]
                for n in order:
                    try:
                        fig = run_save(torch, cuda, n, smethods[n], sd, ref_host, base, groups, nbytes)
                    except Exception as e:  # noqa: BLE001
                        fig = {"error": f"{type(e).__name__}: {e}", "verified": False}
                    if rep == 0:
                        continue  # warm-up (gpufeed's engine, DCP's threads, allocator)
                    failed |= not fig.get("verified", False)
                    runs[n].append(fig)
                    log(f"save {n}: blocked {fig.get('blocked_s', 0) * 1e3:.1f} ms, "
                        f"done {fig.get('done_s', 0):.2f} s {fig.get('error', '')}")
            result["save"].update({n: summarize(r) for n, r in runs.items()})
        result["failed"] = failed
    finally:
        shutil.rmtree(base, ignore_errors=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
