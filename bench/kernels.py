#!/usr/bin/env python3
"""gpufeed's block-level kernels against their peers, in one process, on one GPU (issue 40, part 5).

Measured in one run:
  * PyTorch: torch.sum, torch.amax, torch.cumsum, torch.softmax(dim=1), torch.bincount (uint8 in,
    int64 counts; torch.histc for reference), torch.mm f32 with TF32 off (cuBLAS) and torch.mm bf16;
    the device-to-device copy dst.copy_(src) as the memory bound;
  * CUDA C++: bench/peers/kernels.cu, compiled here with nvcc (-O3, -arch=native, else sm_90; cached
    by source hash), run once at a small odd size (its checks only) and once at full size; its JSON
    rows are taken in as they are (it checks itself against a CPU reference). Without nvcc the rows
    are recorded as not run;
  * gpufeed: gpufeed.kernels.{sum, max, cumsum, softmax, histogram, matmul} called on torch CUDA
    tensors (zero-copy). The adapter is the block "gpufeed adapter" below, one function per op; a
    missing attribute gives a "not available" row, never a number.

Checks, every method, torch's included, recorded per method ("checks" of each row):
  * sample stage: small odd sizes (1_000_007 elements; softmax 33 x 4096; GEMM 257 x 383 x 129)
    against NumPy float64 references computed on the CPU;
  * full stage: the timed size, where it is cheap: sum and max exactly (see below), the scan every
    element exactly, softmax on ~256 sampled rows, the histogram every bin exactly, GEMMs on 64
    random rows and 64 random columns.
  The f32 inputs of sum/max/scan/softmax are small nonzero integers (+-1..+-8 as floats) with a unique
  maximum planted at the last element (and, in a second sample, at the first): every partial sum in
  any order is an integer far below 2^24, so sum, max and scan must be exact, and a dropped or
  repeated element shows. Softmax: |y - ref| <= 1e-5 ref. Histogram: exact. GEMMs (inputs uniform in
  [-1, 1)): |c - ref| <= 32 * 2^-24 * sum_k |a_ik b_kj| (+ 2^-7 |ref| for a bf16 output; an f32 result
  computed with TF32 inputs would fail this bound).

Timing: torch.cuda.Event pairs on the current stream, each rep's start event queued behind a
~0.5 ms torch.cuda._sleep so that the host's launch work is hidden (the GPU time of what the call
enqueues); warm-up, then the median of --reps reps, the methods of an op taking turns rep by rep in a
shuffled order. gpufeed is given the torch stream (stream=torch.cuda.current_stream(), else its raw
handle); if it takes neither, its rows are timed by the host wall clock around a batch of calls
between two device synchronizations ("timing": "wall"). Every row also has that wall time per call
("wall_ms") and the median host time of one call ("host_ms").

Units: GB/s of bytes read (sum, max, histogram), of bytes read + written (copy, scan, softmax);
TFLOPS = 2 M N K / s for the GEMMs.

Ratios (within this run) with the issue's targets and a met flag: gpufeed sum vs the copy (bytes read
against bytes read + written) >= 0.95; gpufeed vs the CUDA C++ of the same algorithm (best verified
variant) >= 0.95 for sum, max, scan, softmax, >= 0.9 for the histogram; softmax >= 1.0x torch.softmax;
scan >= 1.0x torch.cumsum; histogram >= 20x torch.bincount; SGEMM >= 0.7x cuBLAS (TF32 off); bf16
GEMM >= 0.5x cuBLAS bf16. Informational ratios (the peers among themselves) have no target.

Output (--out DIR): kernels.json (written after each section; "complete" false until the end),
kernels.svg and kernels.png (ratios against targets; skipped with a note without matplotlib),
kernels-cuda-cpp.json, kernels-cuda-cpp-sample.json, kernels-cuda-build.log.
--quick: small sizes, 2 reps (a smoke run). --budget-seconds (default 270): sections that would run
past it are skipped and listed in "budget"."skipped"; reps shrink to fit --method-seconds per method.
Exit status: 0 if every measured row was verified, 1 if a check failed, 2 without a GPU.
"""

import argparse
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CU_SRC = os.path.join(HERE, "peers", "kernels.cu")
U32 = 2.0 ** -24

torch = None  # imported in main()


# =====================================================================================================
# gpufeed adapter: the only place that knows gpufeed's kernel API. One small function per op; fix the
# names here. Each takes torch CUDA tensors (gpufeed reads them through __cuda_array_interface__ /
# DLPack), passes `stream` and `out` only when given, and returns what gpufeed returns (as_torch()
# below reads it back). A missing module or attribute raises NotAvailable: that row says
# "not available" and carries no number.
# =====================================================================================================

class NotAvailable(Exception):
    pass


class CallFailed(Exception):
    pass


_GF = {}


def gf_kernels():
    if "mod" not in _GF:
        try:
            import gpufeed
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            _GF["mod"] = None
            _GF["why"] = f"import gpufeed failed: {type(e).__name__}: {e}"
        else:
            k = getattr(gpufeed, "kernels", None)
            _GF["mod"] = k
            _GF["version"] = getattr(gpufeed, "__version__", None)
            _GF["why"] = None if k is not None else "gpufeed has no attribute 'kernels'"
    if _GF["mod"] is None:
        raise NotAvailable(_GF["why"])
    return _GF["mod"]


def gf_fn(name):
    f = getattr(gf_kernels(), name, None)
    if f is None or not callable(f):
        raise NotAvailable(f"gpufeed.kernels.{name} not available")
    return f


def _kw(stream, out):
    kw = {}
    if stream is not None:
        kw["stream"] = stream
    if out is not None:
        kw["out"] = out
    return kw


def gf_sum(x, stream=None):
    return gf_fn("sum")(x, **_kw(stream, None))


def gf_max(x, stream=None):
    return gf_fn("max")(x, **_kw(stream, None))


def gf_cumsum(x, out=None, stream=None):
    return gf_fn("cumsum")(x, **_kw(stream, out))


def gf_softmax(x2d, out=None, stream=None):
    return gf_fn("softmax")(x2d, **_kw(stream, out))


def gf_histogram(x_u8, stream=None):
    return gf_fn("histogram")(x_u8, **_kw(stream, None))


def gf_matmul(a, b, out=None, stream=None):
    return gf_fn("matmul")(a, b, **_kw(stream, out))


# How a stream is handed to gpufeed, tried in this order: the torch stream object (it has
# `cuda_stream`, and `__cuda_stream__` in recent PyTorch), its raw handle, nothing (then gpufeed
# runs on a stream of its own and its rows are timed by the wall clock).
GF_STREAM_KINDS = ("torch", "handle", None)


def gf_stream(kind):
    if kind == "torch":
        return torch.cuda.current_stream()
    if kind == "handle":
        return torch.cuda.current_stream().cuda_stream
    return None


def as_torch(res):
    """A kernel's result as a torch tensor (on the GPU when it is a device array), or a float64
    0-d CPU tensor for a Python number."""
    if res is None:
        return None
    if isinstance(res, torch.Tensor):
        return res
    if isinstance(res, (bool, int, float, np.integer, np.floating)):
        return torch.tensor(float(res), dtype=torch.float64)
    if isinstance(res, np.ndarray):
        return torch.from_numpy(res)
    errors = []
    if hasattr(res, "__cuda_array_interface__"):
        try:
            return torch.as_tensor(res, device="cuda")
        except Exception as e:  # noqa: BLE001
            errors.append(f"as_tensor: {e}")
    if hasattr(res, "__dlpack__"):
        try:
            return torch.from_dlpack(res)
        except Exception as e:  # noqa: BLE001
            errors.append(f"from_dlpack: {e}")
    raise TypeError(f"cannot read back a {type(res).__name__}: " + "; ".join(errors))


def to_int64(t):
    """Counts of any integer (or float) dtype as int64; uint32 through an int32 view if needed."""
    try:
        return t.to(torch.int64)
    except Exception:  # noqa: BLE001 - older torch: no uint32 conversion kernels
        return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


# =====================================================================================================
# Run bookkeeping
# =====================================================================================================

class Budget:
    def __init__(self, seconds):
        self.seconds = seconds
        self.t0 = time.monotonic()
        self.skipped = []

    def elapsed(self):
        return time.monotonic() - self.t0

    def left(self):
        return self.seconds - self.elapsed()

    def allow(self, what, need_s):
        if self.left() >= need_s:
            return True
        self.skipped.append({"what": what, "needed_s": round(need_s, 1), "left_s": round(self.left(), 1)})
        log(f"budget: skipping {what} (needs ~{need_s:.0f} s, {self.left():.0f} s left)")
        return False


def log(msg):
    print(msg, flush=True)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def commit_info():
    path = os.path.join(REPO, ".gpu", "COMMIT")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip(), ".gpu/COMMIT"
    try:
        c = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if c.returncode == 0:
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return c.stdout.strip() + ("-dirty" if dirty else ""), "git"
    except Exception:  # noqa: BLE001
        pass
    return None, None


def driver_version():
    try:
        c = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if c.returncode == 0 and c.stdout.strip():
            return c.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
            return m.group(1) if m else None
    except OSError:
        return None


# =====================================================================================================
# Checks (references computed on the CPU with NumPy in float64)
# =====================================================================================================

def chk(stage, ok, max_err=None, tol=None, detail=None):
    d = {"stage": stage, "ok": bool(ok)}
    if max_err is not None:
        d["max_err"] = float(max_err) if np.isfinite(max_err) else None
    if tol is not None:
        d["tol"] = float(tol)
    if detail:
        d["detail"] = detail
    return d


def check_scalar_exact(stage, res, ref):
    v = float(as_torch(res).reshape(-1)[0].double().item()) if not isinstance(res, (int, float)) else float(res)
    err = abs(v - ref)
    return chk(stage, err == 0, err, 0.0, f"got {v!r}, reference {ref!r} (exact: integer-valued input)")


def check_array_exact(stage, out, ref_dev):
    """out: the result (any float dtype), ref_dev: the float64 reference on the GPU; exact."""
    out = as_torch(out).reshape(-1)
    if out.numel() != ref_dev.numel():
        return chk(stage, False, detail=f"{out.numel()} elements, expected {ref_dev.numel()}")
    worst = 0.0
    chunk = 1 << 26
    for i in range(0, out.numel(), chunk):
        d = (out[i:i + chunk].to(ref_dev.device, torch.float64) - ref_dev[i:i + chunk]).abs()
        m = float(d.max().item()) if d.numel() else 0.0
        if d.isnan().any().item():
            m = float("nan")
        if not (m <= worst):
            worst = m
    return chk(stage, worst == 0, worst, 0.0, "every element, exact (integer-valued input)")


def softmax_ref_rows(x_rows64):
    m = x_rows64.max(axis=1, keepdims=True)
    e = np.exp(x_rows64 - m)
    return e / e.sum(axis=1, keepdims=True)


def check_softmax(stage, out, rows_idx, ref_rows):
    out = as_torch(out)
    got = out[torch.as_tensor(rows_idx, device=out.device)].double().cpu().numpy()
    if got.shape != ref_rows.shape:
        return chk(stage, False, detail=f"shape {got.shape}, expected {ref_rows.shape}")
    err = np.abs(got - ref_rows)
    tol = 1e-5 * ref_rows + 1e-30
    ok = bool(np.all(err <= tol))
    i = np.unravel_index(np.argmax(np.where(np.isnan(err), np.inf, err - tol)), err.shape)
    return chk(stage, ok, err[i], tol[i], f"{len(rows_idx)} rows, |y - ref| <= 1e-5 ref (entry nearest its bound)")


def check_hist(stage, out, ref):
    got = to_int64(as_torch(out).reshape(-1)).cpu().numpy()
    if got.shape[0] < 256:
        return chk(stage, False, detail=f"{got.shape[0]} bins, expected 256")
    extra = int(np.abs(got[256:]).sum()) if got.shape[0] > 256 else 0
    err = np.abs(got[:256] - ref).max()
    return chk(stage, err == 0 and extra == 0, err, 0.0, "every bin, exact" + (f"; {extra} counts past bin 255" if extra else ""))


def gemm_refs(a64, b64, rows, cols):
    """Float64 references of the given rows and columns of a b, and sum_k |a_ik b_kj|."""
    return {
        "rows": rows, "cols": cols,
        "ref_r": a64[rows] @ b64, "mag_r": np.abs(a64[rows]) @ np.abs(b64),
        "ref_c": a64 @ b64[:, cols], "mag_c": np.abs(a64) @ np.abs(b64[:, cols]),
    }


def check_gemm(stage, out, refs):
    out = as_torch(out)
    # a bf16 / f16 output: two ulps of the output's rounding (libraries may round partial sums too)
    rel = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(out.dtype, 0.0)
    if out.dim() != 2 or out.shape[0] != refs["ref_c"].shape[0] or out.shape[1] != refs["ref_r"].shape[1]:
        return chk(stage, False, detail=f"shape {tuple(out.shape)}")
    r = torch.as_tensor(refs["rows"], device=out.device)
    c = torch.as_tensor(refs["cols"], device=out.device)
    got_r = out[r].double().cpu().numpy()
    got_c = out[:, c].double().cpu().numpy()
    worst_excess, worst, worst_tol, ok = -np.inf, 0.0, 0.0, True
    for got, ref, mag in ((got_r, refs["ref_r"], refs["mag_r"]), (got_c, refs["ref_c"], refs["mag_c"])):
        err = np.abs(got - ref)
        tol = 32 * U32 * mag + rel * np.abs(ref)
        ok = ok and bool(np.all(err <= tol))
        ex = np.where(np.isnan(err), np.inf, err - tol)
        i = np.unravel_index(np.argmax(ex), ex.shape)
        if ex[i] > worst_excess:
            worst_excess, worst, worst_tol = ex[i], err[i], tol[i]
    return chk(stage, ok, worst, worst_tol,
               f"{len(refs['rows'])} rows + {len(refs['cols'])} columns, out {str(out.dtype).replace('torch.', '')}, "
               f"|c - ref| <= 32u sum|ab|" + (f" + {rel:g}|ref|" if rel else ""))


# =====================================================================================================
# Timing
# =====================================================================================================

class Method:
    """One way of doing an op: `fn()` enqueues it (and returns its result)."""

    def __init__(self, op, impl, variant, fn, events=True, note=""):
        self.op, self.impl, self.variant, self.fn = op, impl, variant, fn
        self.events = events  # timed by CUDA events on the torch stream (else wall clock)
        self.note = note
        self.ms, self.host_ms = [], []
        self.wall_ms = None
        self.est_s = None
        self.checks = []
        self.status = "ok"
        self.reps_target = 0


def sleep_ms(ctx):
    """GPU time of one torch.cuda._sleep(ctx.sleep_cycles), measured once."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    torch.cuda._sleep(ctx.sleep_cycles)
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def time_once_events(ctx, m):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if ctx.has_sleep:
        torch.cuda._sleep(ctx.sleep_cycles)
    s.record()
    h0 = time.perf_counter()
    m.fn()
    h1 = time.perf_counter()
    e.record()
    e.synchronize()
    torch.cuda.synchronize()  # gpufeed work on another stream too, before the next rep
    m.ms.append(s.elapsed_time(e))
    m.host_ms.append((h1 - h0) * 1e3)


def time_once_wall(m):
    torch.cuda.synchronize()
    h0 = time.perf_counter()
    m.fn()
    torch.cuda.synchronize()
    m.ms.append((time.perf_counter() - h0) * 1e3)
    m.host_ms.append(m.ms[-1])


def wall_batch(m, k):
    torch.cuda.synchronize()
    h0 = time.perf_counter()
    for _ in range(k):
        m.fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - h0) * 1e3 / k


def time_methods(ctx, methods):
    """Warm-up, then reps taking turns in a shuffled order; then a wall-clock batch per method."""
    live = [m for m in methods if m.status == "ok"]
    for m in live:
        try:
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            for _ in range(max(ctx.args.warmup, 1)):
                m.fn()
            torch.cuda.synchronize()
            m.est_s = (time.perf_counter() - h0) / max(ctx.args.warmup, 1)
            m.reps_target = int(max(3, min(ctx.args.reps, ctx.method_seconds / max(m.est_s, 1e-6))))
            if ctx.args.quick:
                m.reps_target = ctx.args.reps
        except Exception as e:  # noqa: BLE001
            m.status = "error"
            m.note = (m.note + "; " if m.note else "") + f"warm-up failed: {type(e).__name__}: {e}"
            log(f"  {m.impl} {m.variant}: {m.note}")
    live = [m for m in live if m.status == "ok"]
    rng = random.Random(sum(ord(c) for c in (methods[0].op if methods else "")) * 31 + len(methods))
    for r in range(max([m.reps_target for m in live], default=0)):
        order = [m for m in live if r < m.reps_target]
        rng.shuffle(order)
        for m in order:
            if m.events:
                time_once_events(ctx, m)
            else:
                time_once_wall(m)
    for m in live:
        k = int(max(3, min(m.reps_target, 0.5 / max(m.est_s, 1e-6))))
        m.wall_ms = wall_batch(m, k)


# =====================================================================================================
# The benchmark
# =====================================================================================================

class Ctx:
    pass


def new_row(m, unit, bytes_=None, flops=None, shape=None):
    row = {"op": m.op, "impl": m.impl, "variant": m.variant, "unit": unit, "shape": shape or {},
           "status": m.status, "timing": "events" if m.events else "wall", "note": m.note,
           "checks": m.checks}
    if bytes_ is not None:
        row["bytes"] = bytes_
    if flops is not None:
        row["flops"] = flops
    if m.ms:
        med = statistics.median(m.ms)
        row.update(median_ms=med, min_ms=min(m.ms), reps=len(m.ms),
                   host_ms=statistics.median(m.host_ms) if m.host_ms else None, wall_ms=m.wall_ms)
        work = bytes_ if bytes_ is not None else flops
        scale = 1e9 if unit == "GB/s" else 1e12
        row["value"] = work / (med * 1e-3) / scale
        row["wall_value"] = work / (m.wall_ms * 1e-3) / scale if m.wall_ms else None
        if m.events and ctx_global.sleep_ms and row["host_ms"] > 0.8 * ctx_global.sleep_ms:
            row["note"] = (row["note"] + "; " if row["note"] else "") + \
                "host call time exceeds the queued sleep: the event time may include host time"
        if m.events and m.wall_ms and med < 0.5 * m.wall_ms and m.wall_ms - med > 0.05:
            row["note"] = (row["note"] + "; " if row["note"] else "") + \
                "event time well under the wall time per call: check that the work runs on the torch stream"
    else:
        row.update(median_ms=None, min_ms=None, reps=0, value=None)
    row["verified"] = bool(m.checks) and all(c["ok"] for c in m.checks) and m.status == "ok"
    if m.status == "ok" and m.checks and not row["verified"]:
        row["status"] = "check failed"
    return row


ctx_global = None


def gf_probe(ctx, op, call, make_out=None):
    """Finds how gpufeed takes this op: the stream kind (events timing) and whether `out=` works.
    `call(stream, out)` runs it. Returns (method fields, first result) or raises NotAvailable."""
    errors = []
    outs = [True, False] if make_out else [False]
    for kind in GF_STREAM_KINDS:
        for use_out in outs:
            try:
                out = make_out() if use_out else None
                res = call(gf_stream(kind), out)
                torch.cuda.synchronize()
                if res is None and out is not None:
                    res = out
                return {"stream": kind, "out": use_out}, res
            except NotAvailable:
                raise
            except Exception as e:  # noqa: BLE001
                errors.append((f"stream={kind} out={use_out}", f"{type(e).__name__}: {e}"))
    if len({msg for _, msg in errors}) == 1:
        raise CallFailed(f"{errors[0][1]} (with every stream/out combination tried)")
    raise CallFailed("every way of calling it failed: " + " | ".join(f"{w}: {msg}" for w, msg in errors))


def gf_method(ctx, op, variant, call, make_out=None, sample_check=None):
    """A gpufeed Method: probed on the sample input (how it takes a stream and `out`), checked there
    by `sample_check(res)` (a list of check dicts), and a second sample call timed (m.sample_s);
    `call(stream, out)` is then rebound to the full-size input by the caller."""
    m = Method(op, "gpufeed", variant, None)
    m.how = None
    m.sample_s = None
    try:
        how, res = gf_probe(ctx, op, call, make_out)
    except NotAvailable as e:
        m.status = "not available"
        m.note = str(e)
        return m
    except CallFailed as e:
        m.status = "error"
        m.note = str(e)[:600]
        return m
    except Exception as e:  # noqa: BLE001
        m.status = "error"
        m.note = f"{type(e).__name__}: {e}"[:600]
        return m
    m.how = how
    m.events = how["stream"] is not None
    m.note = f"stream={how['stream']}, out={'yes' if how['out'] else 'no'}"
    if sample_check:
        try:
            m.checks.extend(sample_check(res))
        except Exception as e:  # noqa: BLE001
            m.checks.append(chk("sample", False, detail=f"{type(e).__name__}: {e}"[:600]))
    try:
        out = make_out() if (how["out"] and make_out) else None
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        call(gf_stream(how["stream"]), out)
        torch.cuda.synchronize()
        m.sample_s = time.perf_counter() - h0
    except Exception as e:  # noqa: BLE001
        m.status = "error"
        m.note += f"; second sample call failed: {type(e).__name__}: {e}"[:600]
    return m


def run_checked(m, stage, fn, check):
    """Runs fn() once, checks the result; an exception is a failed check."""
    try:
        res = fn()
        torch.cuda.synchronize()
        m.checks.append(check(res))
    except NotAvailable:
        raise
    except Exception as e:  # noqa: BLE001
        m.checks.append(chk(stage, False, detail=f"{type(e).__name__}: {e}"[:600]))


def int_data(n, seed, device):
    """n floats, nonzero integers in [-8, 8], the unique maximum 9.0 at the end."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    mag = torch.randint(1, 9, (n,), generator=g, device=device, dtype=torch.int32)
    sign = torch.randint(0, 2, (n,), generator=g, device=device, dtype=torch.int32) * 2 - 1
    x = (mag * sign).to(torch.float32)
    del mag, sign
    x[-1] = 9.0
    return x


def bincount_ref(b_host):
    counts = np.zeros(256, dtype=np.int64)
    step = 1 << 24
    for i in range(0, b_host.shape[0], step):
        counts += np.bincount(b_host[i:i + step], minlength=256)
    return counts


def main():
    global torch, ctx_global
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (kernels.json, plots, the CUDA C++ JSON and build log)")
    p.add_argument("--quick", action="store_true", help="small sizes, 2 reps: a smoke run")
    p.add_argument("--bytes", type=int, default=None, help="f32 ops' size in bytes (default 1 GiB; quick 16 MiB)")
    p.add_argument("--hist-bytes", type=int, default=None, help="histogram size in bytes (default 1 GiB; quick 16 MiB)")
    p.add_argument("--cols", type=int, default=4096, help="softmax row length")
    p.add_argument("--gemm", type=int, default=None, help="M = N = K (default 4096; quick 512)")
    p.add_argument("--reps", type=int, default=None, help="timed reps per method (default 30; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per method (default 3; quick 1)")
    p.add_argument("--method-seconds", type=float, default=2.0, help="at most about this many seconds of reps a method")
    p.add_argument("--budget-seconds", type=float, default=270.0, help="the whole run's time budget")
    p.add_argument("--ops", default="copy,sum,max,scan,softmax,histogram,sgemm,bf16gemm")
    p.add_argument("--nvcc", default=None, help="nvcc to use (default: PATH, then /usr/local/cuda/bin/nvcc)")
    p.add_argument("--no-cuda-cpp", action="store_true", help="do not build or run the CUDA C++ peers")
    p.add_argument("--cuda-cpp-json", default=None, help="take the CUDA C++ rows from this JSON instead of running")
    args = p.parse_args()
    q = args.quick
    args.bytes = args.bytes or ((16 << 20) if q else (1 << 30))
    args.hist_bytes = args.hist_bytes or ((16 << 20) if q else (1 << 30))
    args.gemm = args.gemm or (512 if q else 4096)
    args.reps = args.reps or (2 if q else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    ops = set(args.ops.split(","))

    budget = Budget(args.budget_seconds)
    outdir = args.out
    if outdir:
        os.makedirs(outdir, exist_ok=True)

    import torch as _torch
    torch = _torch
    if not torch.cuda.is_available():
        print("no GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda", 0)

    ctx = Ctx()
    ctx_global = ctx
    ctx.args = args
    ctx.budget = budget
    ctx.sleep_cycles = 1_000_000
    ctx.has_sleep = hasattr(torch.cuda, "_sleep")
    ctx.sleep_ms = sleep_ms(ctx)
    ctx.method_seconds = args.method_seconds
    rows, ratios = [], []
    commit, commit_src = commit_info()
    meta = {
        "schema": "gpufeed-kernels/1",
        "date": now_iso(),
        "gpu": torch.cuda.get_device_name(0),
        "cc": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "commit": commit,
        "commit_source": commit_src,
        "gpufeed": None,
        "gpufeed_kernels": None,
        "settings": {
            "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "allow_bf16_reduced_precision_reduction":
                getattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", None),
            "sleep_cycles": ctx.sleep_cycles if ctx.has_sleep else None,
            "sleep_ms": ctx.sleep_ms,
        },
        "args": {k: v for k, v in vars(args).items()},
        "sizes": {"f32_elements": args.bytes // 4, "hist_bytes": args.hist_bytes, "softmax_cols": args.cols,
                  "gemm": args.gemm, "sample_elements": 1_000_007, "sample_softmax": [33, args.cols],
                  "sample_gemm": [257, 383, 129]},
        "inputs": "f32 ops: nonzero integers in [-8, 8] as floats, unique maximum 9.0 at the last element; "
                  "histogram: uniform random bytes; GEMMs: uniform in [-1, 1) (bf16: rounded to bf16)",
    }
    try:
        gf_kernels()
    except NotAvailable:
        pass
    meta["gpufeed"] = _GF.get("version")
    meta["gpufeed_kernels"] = _GF.get("why") or "present"
    cuda_cpp = {"status": "not run"}

    def write(complete, aborted=None, tmp=".partial"):
        if not outdir:
            return
        doc = dict(meta)
        doc.update(complete=complete, budget={"seconds": budget.seconds, "elapsed_s": round(budget.elapsed(), 1),
                                              "skipped": budget.skipped},
                   cuda_cpp=cuda_cpp, rows=rows, ratios=ratios)
        if aborted:
            doc["aborted"] = aborted
        path = os.path.join(outdir, "kernels.json")
        with open(path + tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(path + tmp, path)

    # A watchdog: a GPU hang (a kernel that never ends) must not eat the whole call. Past the budget
    # plus a margin, the rows so far are written with "aborted" and the process exits (status 4).
    def watchdog():
        msg = f"watchdog: {budget.elapsed():.0f} s, past the budget; stopped during {ctx.current}"
        log(msg)
        try:
            write(False, aborted=msg, tmp=".watchdog")
        finally:
            os._exit(4)
    ctx.current = "setup"
    wd = threading.Timer(budget.seconds + 60, watchdog)
    wd.daemon = True
    wd.start()

    log(f"== {meta['gpu']} (cc {meta['cc']}), driver {meta['driver']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
        f"commit {commit} ({commit_src}); gpufeed {meta['gpufeed']}: kernels {meta['gpufeed_kernels']}")

    # ---- the CUDA C++ build, in the background while the data and references are made ----
    build = {"thread": None}
    if not args.no_cuda_cpp and not args.cuda_cpp_json:
        build["thread"] = threading.Thread(target=build_cuda_cpp, args=(args, outdir, build), daemon=True)
        build["thread"].start()

    try:
        n = args.bytes // 4
        ns = 1_000_007
        cols = args.cols
        sgen = np.random.default_rng(7)

        # ---- sample-size inputs and references ----
        xs = int_data(ns, 11, dev)
        xs_head = xs.clone()
        xs_head[0] = 10.0
        xs_h = xs.cpu().numpy().astype(np.float64)
        xsh_h = xs_head.cpu().numpy().astype(np.float64)
        s_ref = {"sum": float(xs_h.sum()), "max": float(xs_h.max()), "max_head": float(xsh_h.max()),
                 "cumsum": torch.from_numpy(np.cumsum(xs_h)).to(dev), "x": torch.from_numpy(xs_h).to(dev)}
        s_rows = 33
        xs2 = xs[: s_rows * cols].view(s_rows, cols)
        s_soft_idx = np.arange(s_rows)
        s_soft_ref = softmax_ref_rows(xs_h[: s_rows * cols].reshape(s_rows, cols))
        bs = torch.randint(0, 256, (ns,), dtype=torch.uint8, device=dev, generator=torch.Generator(device=dev).manual_seed(5))
        s_hist_ref = bincount_ref(bs.cpu().numpy())
        sm, sn, sk = 257, 383, 129
        as32 = torch.from_numpy(sgen.uniform(-1, 1, (sm, sk)).astype(np.float32)).to(dev)
        bs32 = torch.from_numpy(sgen.uniform(-1, 1, (sk, sn)).astype(np.float32)).to(dev)
        as16, bs16 = as32.to(torch.bfloat16), bs32.to(torch.bfloat16)
        s_gemm32 = gemm_refs(as32.double().cpu().numpy(), bs32.double().cpu().numpy(), np.arange(sm), np.arange(sn))
        s_gemm16 = gemm_refs(as16.double().cpu().numpy(), bs16.double().cpu().numpy(), np.arange(sm), np.arange(sn))
        torch.cuda.synchronize()

        # ---- full-size inputs and references ----
        log(f"== inputs: {n} f32, {args.hist_bytes} bytes, GEMM {args.gemm}^3 (elapsed {budget.elapsed():.0f} s)")
        need_f32 = ops & {"copy", "sum", "max", "scan", "softmax"}
        X = Y = Xh = ref_cum = None
        if need_f32:
            X = int_data(n, 1, dev)
            Y = torch.empty_like(X)
            Xh = X.cpu().numpy()
            f_ref = {"sum": float(Xh.sum(dtype=np.float64)), "max": float(Xh.max())}
            if "scan" in ops:
                ref_cum = torch.from_numpy(np.cumsum(Xh, dtype=np.float64)).to(dev)
            rows_n = n // cols
            X2 = X[: rows_n * cols].view(rows_n, cols)
            Y2 = Y[: rows_n * cols].view(rows_n, cols)
            soft_idx = np.unique(np.concatenate([np.linspace(0, rows_n - 1, min(rows_n, 256)).astype(np.int64), [rows_n - 1]]))
            soft_ref = softmax_ref_rows(Xh[: rows_n * cols].reshape(rows_n, cols)[soft_idx].astype(np.float64))
        B = hist_ref = None
        if "histogram" in ops:
            B = torch.randint(0, 256, (args.hist_bytes,), dtype=torch.uint8, device=dev,
                              generator=torch.Generator(device=dev).manual_seed(3))
            hist_ref = bincount_ref(B.cpu().numpy())
        G = args.gemm
        g_rows = np.sort(sgen.choice(G, size=min(G, 64), replace=False))
        g_cols = np.sort(sgen.choice(G, size=min(G, 64), replace=False))
        A32 = B32 = A16 = B16 = None
        if "sgemm" in ops:
            A32 = torch.rand(G, G, device=dev, generator=torch.Generator(device=dev).manual_seed(21)) * 2 - 1
            B32 = torch.rand(G, G, device=dev, generator=torch.Generator(device=dev).manual_seed(22)) * 2 - 1
            f_gemm32 = gemm_refs(A32.double().cpu().numpy(), B32.double().cpu().numpy(), g_rows, g_cols)
        if "bf16gemm" in ops:
            A16 = (torch.rand(G, G, device=dev, generator=torch.Generator(device=dev).manual_seed(23)) * 2 - 1).to(torch.bfloat16)
            B16 = (torch.rand(G, G, device=dev, generator=torch.Generator(device=dev).manual_seed(24)) * 2 - 1).to(torch.bfloat16)
            f_gemm16 = gemm_refs(A16.double().cpu().numpy(), B16.double().cpu().numpy(), g_rows, g_cols)
        torch.cuda.synchronize()
        log(f"== references ready (elapsed {budget.elapsed():.0f} s)")

        # ---- the CUDA C++ peers: wait for the build, run at a small odd size, then at full size ----
        if args.cuda_cpp_json:
            with open(args.cuda_cpp_json) as f:
                cuda_cpp = {"status": "from file", "path": args.cuda_cpp_json, "full": json.load(f)}
        elif args.no_cuda_cpp:
            cuda_cpp = {"status": "not run: --no-cuda-cpp"}
        else:
            ctx.current = "cuda-cpp"
            try:
                cuda_cpp = run_cuda_cpp(args, outdir, build, budget, ops)
            except Exception as e:  # noqa: BLE001
                cuda_cpp = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
                log(cuda_cpp["traceback"])
        try:
            rows.extend(cuda_cpp_rows(cuda_cpp))
        except Exception as e:  # noqa: BLE001
            rows.append({"op": "*", "impl": "cuda-cpp", "variant": "*", "status": "error", "verified": False,
                         "checks": [], "note": f"reading its JSON: {type(e).__name__}: {e}"})
        write(False)

        # ---- Python-side sections, one op at a time ----
        est = {"copy": 5, "sum": 5, "max": 5, "scan": 8, "softmax": 8, "histogram": 25, "sgemm": 15, "bf16gemm": 10}

        def section(op, build_methods, unit, bytes_=None, flops=None, shape=None):
            if op not in ops:
                return
            if not budget.allow(f"python {op}", est[op] + 15):
                rows.append({"op": op, "impl": "*", "variant": "*", "status": "skipped", "note": "time budget",
                             "verified": False, "checks": []})
                return
            ctx.method_seconds = min(args.method_seconds, max(0.3, (budget.left() - 30) / 40))
            log(f"== {op} (elapsed {budget.elapsed():.0f} s)")
            ctx.current = op
            try:
                methods = build_methods()
                run_section(op, methods, unit, bytes_, flops, shape)
            except Exception as e:  # noqa: BLE001 - a bug or a failure in one op must not end the run
                tb = traceback.format_exc()
                log(f"  {op}: section failed: {type(e).__name__}: {e}\n{tb}")
                rows.append({"op": op, "impl": "*", "variant": "*", "status": "error", "verified": False, "checks": [],
                             "note": f"section failed: {type(e).__name__}: {e}", "traceback": tb[-3000:]})
            torch.cuda.synchronize()
            write(False)

        def run_section(op, methods, unit, bytes_, flops, shape):
            # gpufeed: a full-size call that would take too long (extrapolated from the sample) is skipped
            for m in methods:
                limit = min(60.0, max(5.0, budget.left() / 4))
                if m.status == "ok" and getattr(m, "extrap_s", 0.0) > limit:
                    m.status = "skipped"
                    m.note += f"; a full-size call would take ~{m.extrap_s:.0f} s (from the sample call), over {limit:.0f} s"
                    budget.skipped.append({"what": f"gpufeed {op}", "extrapolated_s": round(m.extrap_s, 1)})
            # the full-size check of each method, before timing
            for m in methods:
                if m.status == "ok" and getattr(m, "full_check", None):
                    run_checked(m, "full", m.fn, m.full_check)
            time_methods(ctx, [m for m in methods if m.status == "ok"])
            for m in methods:
                r = new_row(m, unit, getattr(m, "bytes_override", None) or bytes_, flops, shape)
                rows.append(r)
                v = r.get("value")
                log(f"  {m.impl:8s} {m.variant:28s} " + (f"{v:9.1f} {unit}" if v else f"{'-':>9s}      ") +
                    f"  {r['status']}" + (f"  ({r['note']})" if r.get("note") else ""))

        def tm(op, variant, fn, sample_fn=None, sample_check=None, full_check=None, note=""):
            """A torch Method, checked on the sample input and, before timing, at full size."""
            m = Method(op, "torch", variant, fn, events=True, note=note)
            if sample_fn is not None:
                run_checked(m, "sample", sample_fn, sample_check)
            m.full_check = full_check
            return m

        def gm(op, variant, call, sample_args, full_args, scale, make_sample_out=None, make_full_out=None,
               sample_check=None, full_check=None):
            """A gpufeed Method: call(inputs, stream, out). `scale`: the full-size work over the sample's,
            to extrapolate the full-size call's time from the sample's (a call that would take too long,
            e.g. an op that fell back to the CPU, is skipped, not waited for)."""
            m = gf_method(ctx, op, variant, lambda s, o: call(sample_args, s, o), make_sample_out,
                          lambda res: [sample_check(res)])
            if m.status == "ok":
                out = make_full_out() if (m.how["out"] and make_full_out) else None
                stream = gf_stream(m.how["stream"])

                def fn():
                    res = call(full_args, stream, out)
                    return out if res is None else res
                m.fn = fn
                m.full_check = full_check
                m.extrap_s = (m.sample_s or 0.0) * scale
            return m

        nbytes = 4 * n

        # copy
        def copy_methods():
            m = tm("copy", "copy_", lambda: Y.copy_(X),
                   lambda: torch.empty_like(xs).copy_(xs), lambda r: check_array_exact("sample", r, s_ref["x"]),
                   lambda r: chk("full", bool(torch.equal(Y, X)), detail="bit for bit"), note="dst.copy_(src), device to device")
            return [m]
        section("copy", copy_methods, "GB/s", bytes_=2 * nbytes, shape={"n": n})

        # sum
        def sum_methods():
            ms = [tm("sum", "torch.sum", lambda: torch.sum(X), lambda: torch.sum(xs),
                     lambda r: check_scalar_exact("sample", r, s_ref["sum"]),
                     lambda r: check_scalar_exact("full", r, f_ref["sum"]))]
            ms.append(gm("sum", "kernels.sum", lambda a, s, o: gf_sum(a, stream=s), xs, X, n / ns,
                         sample_check=lambda r: check_scalar_exact("sample", r, s_ref["sum"]),
                         full_check=lambda r: check_scalar_exact("full", r, f_ref["sum"])))
            return ms
        section("sum", sum_methods, "GB/s", bytes_=nbytes, shape={"n": n})

        # max
        def max_methods():
            ms = [tm("max", "torch.amax", lambda: torch.amax(X), lambda: (torch.amax(xs), torch.amax(xs_head)),
                     lambda r: chk("sample", check_scalar_exact("s", r[0], s_ref["max"])["ok"] and
                                   check_scalar_exact("s", r[1], s_ref["max_head"])["ok"],
                                   detail="maximum at the last and at the first element, exact"),
                     lambda r: check_scalar_exact("full", r, f_ref["max"]))]
            g = gm("max", "kernels.max", lambda a, s, o: gf_max(a, stream=s), xs, X, n / ns,
                   sample_check=lambda r: check_scalar_exact("sample", r, s_ref["max"]),
                   full_check=lambda r: check_scalar_exact("full", r, f_ref["max"]))
            if g.status == "ok":
                run_checked(g, "sample", lambda: gf_max(xs_head, stream=gf_stream(g.how["stream"])),
                            lambda r: check_scalar_exact("sample", r, s_ref["max_head"]))
            ms.append(g)
            return ms
        section("max", max_methods, "GB/s", bytes_=nbytes, shape={"n": n})

        # scan
        def scan_methods():
            ms = [tm("scan", "torch.cumsum", lambda: torch.cumsum(X, 0, out=Y), lambda: torch.cumsum(xs, 0),
                     lambda r: check_array_exact("sample", r, s_ref["cumsum"]),
                     lambda r: check_array_exact("full", r, ref_cum))]
            ms.append(gm("scan", "kernels.cumsum", lambda a, s, o: gf_cumsum(a, out=o, stream=s), xs, X, n / ns,
                         make_sample_out=lambda: torch.empty_like(xs), make_full_out=lambda: Y,
                         sample_check=lambda r: check_array_exact("sample", r, s_ref["cumsum"]),
                         full_check=lambda r: check_array_exact("full", r, ref_cum)))
            return ms
        section("scan", scan_methods, "GB/s", bytes_=2 * nbytes, shape={"n": n})

        # softmax
        def softmax_methods():
            ms = [tm("softmax", "torch.softmax", lambda: torch.softmax(X2, dim=1), lambda: torch.softmax(xs2, dim=1),
                     lambda r: check_softmax("sample", r, s_soft_idx, s_soft_ref),
                     lambda r: check_softmax("full", r, soft_idx, soft_ref))]
            ms.append(gm("softmax", "kernels.softmax", lambda a, s, o: gf_softmax(a, out=o, stream=s), xs2, X2, (n // cols) / s_rows,
                         make_sample_out=lambda: torch.empty_like(xs2), make_full_out=lambda: Y2,
                         sample_check=lambda r: check_softmax("sample", r, s_soft_idx, s_soft_ref),
                         full_check=lambda r: check_softmax("full", r, soft_idx, soft_ref)))
            return ms
        if need_f32:
            section("softmax", softmax_methods, "GB/s", bytes_=2 * 4 * (n // cols) * cols,
                    shape={"rows": n // cols, "cols": cols})

        # histogram
        def hist_methods():
            ms = [tm("histogram", "bincount", lambda: torch.bincount(B, minlength=256), lambda: torch.bincount(bs, minlength=256),
                     lambda r: check_hist("sample", r, s_hist_ref), lambda r: check_hist("full", r, hist_ref),
                     note="torch.bincount(uint8, minlength=256) -> int64")]
            # histc's counts take the input's dtype (uint8 would wrap at 256): it runs on a float32 copy
            # made beforehand, and its GB/s counts the 4 bytes a sample it reads.
            hb, hs = B.float(), bs.float()
            h = tm("histogram", "histc", lambda: torch.histc(hb, bins=256, min=0, max=256),
                   lambda: torch.histc(hs, bins=256, min=0, max=256),
                   lambda r: check_hist("sample", r, s_hist_ref), lambda r: check_hist("full", r, hist_ref),
                   note="torch.histc(float32 copy, bins=256, min=0, max=256), for reference; GB/s of the float32 bytes read")
            h.bytes_override = 4 * args.hist_bytes
            ms.append(h)
            ms.append(gm("histogram", "kernels.histogram", lambda a, s, o: gf_histogram(a, stream=s), bs, B, args.hist_bytes / ns,
                         sample_check=lambda r: check_hist("sample", r, s_hist_ref),
                         full_check=lambda r: check_hist("full", r, hist_ref)))
            return ms
        section("histogram", hist_methods, "GB/s", bytes_=args.hist_bytes, shape={"n": args.hist_bytes})

        # GEMMs
        flops = 2.0 * G * G * G

        def sgemm_methods():
            C32 = torch.empty(G, G, device=dev)
            ms = [tm("sgemm", "mm_f32", lambda: torch.mm(A32, B32, out=C32), lambda: torch.mm(as32, bs32),
                     lambda r: check_gemm("sample", r, s_gemm32), lambda r: check_gemm("full", r, f_gemm32),
                     note="cuBLAS through torch.mm, allow_tf32=False")]
            ms.append(gm("sgemm", "kernels.matmul", lambda a, s, o: gf_matmul(a[0], a[1], out=o, stream=s),
                         (as32, bs32), (A32, B32), flops / (2.0 * sm * sn * sk), make_sample_out=lambda: torch.empty(sm, sn, device=dev),
                         make_full_out=lambda: C32,
                         sample_check=lambda r: check_gemm("sample", r, s_gemm32),
                         full_check=lambda r: check_gemm("full", r, f_gemm32)))
            return ms
        section("sgemm", sgemm_methods, "TFLOPS", flops=flops, shape={"m": G, "n": G, "k": G})

        def bf16_methods():
            C16 = torch.empty(G, G, device=dev, dtype=torch.bfloat16)
            ms = [tm("bf16gemm", "mm_bf16", lambda: torch.mm(A16, B16, out=C16), lambda: torch.mm(as16, bs16),
                     lambda r: check_gemm("sample", r, s_gemm16), lambda r: check_gemm("full", r, f_gemm16),
                     note="cuBLAS through torch.mm, bf16 in and out")]
            ms.append(gm("bf16gemm", "kernels.matmul", lambda a, s, o: gf_matmul(a[0], a[1], out=o, stream=s),
                         (as16, bs16), (A16, B16), flops / (2.0 * sm * sn * sk),
                         make_sample_out=lambda: torch.empty(sm, sn, device=dev, dtype=torch.bfloat16),
                         make_full_out=lambda: C16,
                         sample_check=lambda r: check_gemm("sample", r, s_gemm16),
                         full_check=lambda r: check_gemm("full", r, f_gemm16)))
            return ms
        section("bf16gemm", bf16_methods, "TFLOPS", flops=flops, shape={"m": G, "n": G, "k": G})

        # ---- ratios, output, plot ----
        ctx.current = "ratios"
        try:
            ratios.extend(compute_ratios(rows))
        except Exception as e:  # noqa: BLE001
            log(f"ratios failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        log("== ratios (this run)")
        for r in ratios:
            v = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            t = f">= {r['target']}" if r["target"] is not None else "(info)"
            met = {True: "met", False: "NOT MET", None: "n/a"}[r["met"]]
            log(f"  {r['name']:44s} {v:>8s} {t:>9s}  {met}" + (f"  ({r['note']})" if r.get("note") else ""))
        write(True)
        wd.cancel()
        if outdir:
            try:
                log(plot(ratios, outdir, meta))
            except Exception as e:  # noqa: BLE001
                log(f"no plot: {type(e).__name__}: {e}")
        bad = [r for r in rows if r.get("status") == "check failed" or
               (r.get("impl") == "cuda-cpp" and r.get("value") is not None and not r.get("verified"))]
        if bad:
            log("CHECKS FAILED: " + ", ".join(f"{r['op']}/{r['impl']}/{r['variant']}" for r in bad))
        log(f"== done in {budget.elapsed():.0f} s" + (f"; {outdir}/kernels.json" if outdir else ""))
        return 1 if bad else 0
    except Exception as e:  # noqa: BLE001 - whatever happened, the JSON says it
        tb = traceback.format_exc()
        log(tb)
        meta["fatal"] = f"{type(e).__name__}: {e}\n{tb[-4000:]}"
        write(False)
        return 3


# =====================================================================================================
# The CUDA C++ peers
# =====================================================================================================

def find_nvcc(args):
    if args.nvcc:
        return args.nvcc
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def parse_ptxas(log_text):
    """Registers, spills, smem per kernel from `ptxas -v` (CUB's kernels left out)."""
    out, cur = [], None
    for line in log_text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = {"function": m.group(1)}
            if "cub" not in cur["function"].lower():
                out.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            m2 = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(m2.group(1)) if m2 else 0
    names = [k["function"] for k in out]
    try:
        c = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=10)
        if c.returncode == 0:
            for k, d in zip(out, c.stdout.splitlines()):
                k["name"] = d
    except Exception:  # noqa: BLE001
        pass
    return out


def build_cuda_cpp(args, outdir, build):
    """Compiles kernels.cu (cached by the hash of the source, nvcc and flags); fills `build`."""
    t0 = time.monotonic()
    nvcc = find_nvcc(args)
    if nvcc is None:
        build.update(status="not built: no nvcc found")
        return
    try:
        ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
        build["nvcc"] = ver[-1] if ver else None
        with open(CU_SRC, "rb") as f:
            src = f.read()
        cache = os.environ.get("GPUFEED_KERNELS_CACHE", os.path.join(tempfile.gettempdir(), "gpufeed-kernels-build"))
        os.makedirs(cache, exist_ok=True)
        logs = []
        for arch in ("native", "sm_90"):
            flags = ["-O3", "-std=c++17", f"-arch={arch}", "-Xptxas=-v", "-lineinfo"]
            key = hashlib.sha256(src + nvcc.encode() + " ".join(flags).encode() + (build.get("nvcc") or "").encode()).hexdigest()[:16]
            exe = os.path.join(cache, f"kernels-{key}")
            cmd = [nvcc, *flags, "-o", exe, CU_SRC]
            build["cmd"] = " ".join(cmd)
            if os.path.isfile(exe) and os.path.isfile(exe + ".log"):
                with open(exe + ".log") as f:
                    text = f.read()
                build.update(status="built", exe=exe, cached=True, arch=arch, ptxas=parse_ptxas(text))
                logs.append(text)
                break
            c = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            text = f"$ {' '.join(cmd)}\n{c.stdout}{c.stderr}"
            logs.append(text)
            if c.returncode == 0:
                with open(exe + ".log", "w") as f:
                    f.write(text)
                build.update(status="built", exe=exe, cached=False, arch=arch, ptxas=parse_ptxas(text))
                if "error_tail" in build:  # the -arch=native attempt's error, kept under another name
                    build["native_error_tail"] = build.pop("error_tail")[-1500:]
                break
            build.update(status=f"build failed (rc {c.returncode})", error_tail=text[-3000:])
        if outdir:
            with open(os.path.join(outdir, "kernels-cuda-build.log"), "w") as f:
                f.write("\n".join(logs))
    except Exception as e:  # noqa: BLE001
        build.update(status=f"build error: {type(e).__name__}: {e}")
    finally:
        build["seconds"] = round(time.monotonic() - t0, 1)


def run_cuda_cpp(args, outdir, build, budget, ops):
    res = {"status": "not run"}
    if build["thread"] is not None:
        build["thread"].join(timeout=max(1.0, budget.left() - 150))
        if build["thread"].is_alive():
            res["status"] = "not run: the build did not finish within the budget"
            budget.skipped.append({"what": "cuda-cpp (build still running)"})
            return res
    for k in ("status", "cmd", "nvcc", "arch", "cached", "seconds", "ptxas", "error_tail", "native_error_tail"):
        if k in build:
            res["build_" + k if k != "ptxas" else "ptxas"] = build[k]
    if build.get("status") != "built":
        res["status"] = "not run: " + build.get("status", "not built")
        log(f"== CUDA C++: {res['status']}")
        if build.get("error_tail"):
            log(build["error_tail"])
        return res
    spills = [k for k in build.get("ptxas", []) if k.get("spill_stores") or k.get("spill_loads") or k.get("stack")]
    if spills:
        log(f"== CUDA C++ build: spills or stack in {[k.get('name', k['function']) for k in spills]}")
    exe = build["exe"]
    wanted = [o for o in ["copy", "sum", "max", "scan", "softmax", "histogram", "sgemm", "bf16gemm"] if o in ops]
    if args.gemm % 128:
        res["note_gemm"] = "GEMMs not run: the CUDA C++ kernels need M, N, K multiples of 128"
        wanted = [o for o in wanted if o not in ("sgemm", "bf16gemm")]
    if args.cols % 4 or args.cols > 8192 or args.cols > args.bytes // 4:
        res["note_softmax"] = "softmax not run: the CUDA C++ kernel needs cols a multiple of 4, at most 8192"
        wanted = [o for o in wanted if o != "softmax"]
    cpp_ops = ",".join(wanted)
    tmp = outdir or tempfile.mkdtemp()
    # sample: small odd sizes (the memory-bound ops; the GEMM kernels need tile multiples), checks only
    sample_ops = ",".join(o for o in cpp_ops.split(",") if o not in ("sgemm", "bf16gemm"))
    if sample_ops:
        sj = os.path.join(tmp, "kernels-cuda-cpp-sample.json")
        cmd = [exe, "--bytes", str(4 * 1_000_007), "--hist-bytes", "1000007", "--cols", str(args.cols),
               "--reps", "1", "--warmup", "0", "--ops", sample_ops, "--json", sj]
        c = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        res["sample_rc"] = c.returncode
        res["sample_log"] = (c.stdout + c.stderr)[-4000:]
        try:
            with open(sj) as f:
                res["sample"] = json.load(f)
        except (OSError, ValueError) as e:
            res["sample_error"] = str(e)
    fj = os.path.join(tmp, "kernels-cuda-cpp.json")
    reps = args.reps
    cmd = [exe, "--bytes", str(args.bytes), "--hist-bytes", str(args.hist_bytes), "--cols", str(args.cols),
           "--gemm", str(args.gemm), "--reps", str(reps), "--gemm-reps", str(max(2, min(reps, 10))),
           "--warmup", str(args.warmup), "--ops", cpp_ops, "--json", fj]
    timeout = min(240.0, budget.left() - 90)
    if timeout < 20:
        res["status"] = "not run: time budget"
        budget.skipped.append({"what": "cuda-cpp full run", "left_s": round(budget.left(), 1)})
        return res
    log(f"== CUDA C++: {' '.join(cmd)} (timeout {timeout:.0f} s)")
    t0 = time.monotonic()
    try:
        c = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        res["rc"] = c.returncode
        res["log"] = (c.stdout + c.stderr)[-6000:]
        log(c.stderr.rstrip())
    except subprocess.TimeoutExpired as e:
        res["rc"] = None
        res["log"] = f"timed out after {timeout:.0f} s: " + str(e.stderr or "")[-4000:]
        log(res["log"])
    res["seconds"] = round(time.monotonic() - t0, 1)
    try:
        with open(fj) as f:
            res["full"] = json.load(f)
        res["status"] = "ran" if res["rc"] == 0 else f"ran, exit {res['rc']}"
    except (OSError, ValueError) as e:
        res["status"] = f"no JSON (exit {res.get('rc')}): {e}"
    return res


def cuda_cpp_rows(cuda_cpp):
    """The binary's rows in this script's row format, with the sample run's check folded in."""
    full = cuda_cpp.get("full")
    if not full:
        return [{"op": "*", "impl": "cuda-cpp", "variant": "*", "status": "not run", "note": cuda_cpp.get("status"),
                 "verified": False, "checks": []}]
    sample = {(r["op"], r["variant"]): r for r in (cuda_cpp.get("sample") or {}).get("results", [])}
    out = []
    for r in full.get("results", []):
        checks = [chk("full", r.get("verified"), r.get("max_err"), r.get("tol"), "checked by the binary")]
        s = sample.get((r["op"], r["variant"]))
        if s is not None:
            checks.insert(0, chk("sample", s.get("verified"), s.get("max_err"), s.get("tol"),
                                 f"checked by the binary at n = {s.get('n')}"))
        elif cuda_cpp.get("sample") is not None and r["op"] not in ("sgemm", "bf16gemm"):
            checks.insert(0, chk("sample", False, detail="no sample-size run of this variant"))
        row = {"op": r["op"], "impl": "cuda-cpp", "variant": r["variant"], "unit": r["unit"],
               "value": r.get("value"), "median_ms": r.get("median_ms"), "min_ms": r.get("min_ms"),
               "reps": r.get("reps"), "timing": "events (the binary)", "note": r.get("note", ""),
               "checks": checks, "verified": all(c["ok"] for c in checks),
               "shape": {k: r[k] for k in ("n", "m", "k") if k in r}}
        if "bytes" in r:
            row["bytes"] = r["bytes"]
        if "flops" in r:
            row["flops"] = r["flops"]
        row["status"] = "ok" if row["verified"] else "check failed"
        out.append(row)
    return out


# =====================================================================================================
# Ratios and the plot
# =====================================================================================================

# (name, numerator (op, impl, variants or None), denominator, target, note)
RATIO_SPECS = [
    ("sum vs D2D copy", ("sum", "gpufeed", None), ("copy", "torch", ["copy_"]), 0.95,
     "GB/s read against the copy's GB/s read + written"),
    ("sum vs CUDA C++ two-pass", ("sum", "gpufeed", None), ("sum", "cuda-cpp", ["two_pass"]), 0.95, ""),
    ("max vs CUDA C++ two-pass", ("max", "gpufeed", None), ("max", "cuda-cpp", ["two_pass"]), 0.95, ""),
    ("scan vs CUDA C++ look-back", ("scan", "gpufeed", None), ("scan", "cuda-cpp", ["lookback_t4096", "lookback_t8192"]),
     0.95, "the better verified tile size"),
    ("scan vs torch.cumsum", ("scan", "gpufeed", None), ("scan", "torch", ["torch.cumsum"]), 1.0, ""),
    ("softmax vs CUDA C++", ("softmax", "gpufeed", None), ("softmax", "cuda-cpp", ["block_per_row"]), 0.95, ""),
    ("softmax vs torch.softmax", ("softmax", "gpufeed", None), ("softmax", "torch", ["torch.softmax"]), 1.0, ""),
    ("histogram vs CUDA C++", ("histogram", "gpufeed", None),
     ("histogram", "cuda-cpp", ["shared_atomics", "shared_atomics_per_warp"]), 0.9, "the better verified variant"),
    ("histogram vs torch.bincount", ("histogram", "gpufeed", None), ("histogram", "torch", ["bincount"]), 20.0, ""),
    ("SGEMM vs cuBLAS (TF32 off)", ("sgemm", "gpufeed", None), ("sgemm", "torch", ["mm_f32"]), 0.7, ""),
    ("bf16 GEMM vs cuBLAS bf16", ("bf16gemm", "gpufeed", None), ("bf16gemm", "torch", ["mm_bf16"]), 0.5, "moonshot"),
    # informational: the peers among themselves
    ("CUDA C++ memcpy vs torch copy_", ("copy", "cuda-cpp", ["memcpy_d2d"]), ("copy", "torch", ["copy_"]), None, ""),
    ("CUDA C++ sum vs D2D copy", ("sum", "cuda-cpp", ["two_pass"]), ("copy", "torch", ["copy_"]), None, ""),
    ("torch.sum vs D2D copy", ("sum", "torch", ["torch.sum"]), ("copy", "torch", ["copy_"]), None, ""),
    ("CUDA C++ look-back vs torch.cumsum", ("scan", "cuda-cpp", ["lookback_t4096", "lookback_t8192"]),
     ("scan", "torch", ["torch.cumsum"]), None, ""),
    ("CUB scan vs torch.cumsum", ("scan", "cuda-cpp", ["cub"]), ("scan", "torch", ["torch.cumsum"]), None, ""),
    ("CUDA C++ softmax vs torch.softmax", ("softmax", "cuda-cpp", ["block_per_row"]),
     ("softmax", "torch", ["torch.softmax"]), None, ""),
    ("CUDA C++ histogram vs torch.bincount", ("histogram", "cuda-cpp", ["shared_atomics", "shared_atomics_per_warp"]),
     ("histogram", "torch", ["bincount"]), None, ""),
    ("CUDA C++ SGEMM 128x128 vs cuBLAS", ("sgemm", "cuda-cpp", ["tile128_8x8_db"]), ("sgemm", "torch", ["mm_f32"]), None, ""),
    ("CUDA C++ SGEMM 64x64 vs cuBLAS", ("sgemm", "cuda-cpp", ["tile64_4x4"]), ("sgemm", "torch", ["mm_f32"]), None, ""),
    ("CUDA C++ mma.sync vs cuBLAS bf16", ("bf16gemm", "cuda-cpp", ["mma_m16n8k16_s3", "mma_m16n8k16_s4"]),
     ("bf16gemm", "torch", ["mm_bf16"]), None, ""),
]


def pick(rows, op, impl, variants):
    """The best verified measured row of (op, impl, one of variants); else a reason."""
    cands = [r for r in rows if r.get("op") == op and r.get("impl") == impl and
             (variants is None or r.get("variant") in variants)]
    measured = [r for r in cands if r.get("value")]
    good = [r for r in measured if r.get("verified")]
    if good:
        return max(good, key=lambda r: r["value"]), None
    if measured:
        return None, f"{impl} {op}: not verified"
    if cands:
        c = cands[0]
        note = str(c.get("note") or "")
        note = note if len(note) <= 160 else note[:157] + "..."
        return None, f"{impl} {op}: {c.get('status')}" + (f" ({note})" if note else "")
    return None, f"{impl} {op}: not run"


def compute_ratios(rows):
    out = []
    for name, num, den, target, note in RATIO_SPECS:
        a, why_a = pick(rows, *num)
        b, why_b = pick(rows, *den)
        r = {"name": name, "target": target, "note": note,
             "num": {"op": num[0], "impl": num[1], "variant": a["variant"] if a else None, "value": a["value"] if a else None},
             "den": {"op": den[0], "impl": den[1], "variant": b["variant"] if b else None, "value": b["value"] if b else None}}
        if a and b and b["value"]:
            r["ratio"] = a["value"] / b["value"]
            r["met"] = (r["ratio"] >= target) if target is not None else None
            if a["op"] == b["op"] and (a.get("bytes"), a.get("flops")) != (b.get("bytes"), b.get("flops")):
                r["note"] = "; ".join(x for x in (note, "the two rows measured different sizes") if x)
        else:
            r["ratio"] = None
            r["met"] = None
            r["note"] = "; ".join(x for x in (note, why_a, why_b) if x)
        out.append(r)
    return out


def plot(ratios, outdir, meta):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no plot: matplotlib not importable ({type(e).__name__}: {e})"
    items = list(reversed(ratios))
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(items) + 1.6))
    ys = range(len(items))
    vals = [r["ratio"] if r["ratio"] is not None else 0 for r in items]
    colors = []
    for r in items:
        if r["ratio"] is None:
            colors.append("#bbbbbb")
        elif r["target"] is None:
            colors.append("#7a9cc6")
        else:
            colors.append("#3a9a4a" if r["met"] else "#c8453b")
    ax.barh(list(ys), [v if v > 0 else 1e-3 for v in vals], color=colors)
    for y, r in zip(ys, items):
        if r["target"] is not None:
            ax.plot([r["target"], r["target"]], [y - 0.4, y + 0.4], color="black", lw=2)
        label = f"{r['ratio']:.3g}" if r["ratio"] is not None else "n/a"
        ax.text(max(r["ratio"] or 0.02, 0.02) * 1.04, y, label, va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["name"] for r in items], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(0.02, max([v for v in vals] + [30]) * 2)
    ax.axvline(1.0, color="#888888", lw=0.8, ls="--")
    ax.set_xlabel("ratio (this run; black tick: issue 40's target; green met, red not met, blue informational, grey n/a)",
                  fontsize=8)
    ax.set_title(f"gpufeed kernels vs peers - {meta['gpu']}, {meta['date']}, commit {str(meta['commit'])[:12]}", fontsize=9)
    fig.tight_layout()
    for ext in ("svg", "png"):
        fig.savefig(os.path.join(outdir, f"kernels.{ext}"), dpi=120)
    plt.close(fig)
    return f"plot: {outdir}/kernels.svg, kernels.png"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(3)
