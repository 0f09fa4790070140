"""A small model trained on synthetic data, fed by gpufeed.Loader and by
torch's DataLoader(pin_memory=True) at its best worker count: per-step GPU
time, data-wait time, and GPU busy time / wall time for each.

    python python/examples/train.py            # on a GPU (needs torch)
    python python/examples/train.py --small    # seconds, on the CPU too

GPU time per step is measured with CUDA events around the step's compute
(forward, backward, optimizer step) on the current stream; data-wait time
is the host's time inside next(loader). Busy / wall: the sum of the steps'
GPU times over the wall time of the whole timed run (from the first event
to the last, synchronized). On the CPU (torch CPU, the CPU emulation) the
compute is timed on the host instead. The last line printed is JSON.
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

import gpufeed


def build(features, hidden, classes, device):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(features, hidden), torch.nn.ReLU()]
    for _ in range(2):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, classes))
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(batches, steps, model, opt, device, repeat):
    """Runs `steps` steps over `batches` (an iterable of (x, y), iterated
    again when it ends); returns timings."""
    cuda = device.type == "cuda"
    loss_fn = torch.nn.CrossEntropyLoss()
    waits, gpu, events = [], [], []
    it = iter(batches)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    first = last = None
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(batches)
            x, y = next(it)
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        waits.append(time.perf_counter() - t0)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        c0 = time.perf_counter()
        for _ in range(repeat):  # more compute per batch than its transfer
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        if cuda:
            e1.record()
            events.append((e0, e1))
            first = first or e0
            last = e1
        else:
            gpu.append(time.perf_counter() - c0)
    if cuda:
        torch.cuda.synchronize()
        gpu = [a.elapsed_time(b) / 1e3 for a, b in events]
        wall = first.elapsed_time(last) / 1e3
    else:
        wall = time.perf_counter() - start
    return {
        "steps": steps,
        "wall_s": wall,
        "gpu_ms_per_step_median": statistics.median(gpu) * 1e3,
        "data_wait_ms_per_step_median": statistics.median(waits) * 1e3,
        "data_wait_s_total": sum(waits),
        "busy_over_wall": sum(gpu) / wall if wall > 0 else 0.0,
        "loss": float(loss.detach().cpu()),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a few seconds, any machine")
    p.add_argument("--rows", type=int, default=1 << 18)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--workers", default="0,2,4,8", help="DataLoader worker counts to try")
    a = p.parse_args()
    if a.small:
        a.rows, a.features, a.hidden, a.batch, a.steps, a.repeat = 4096, 64, 128, 256, 20, 1
        a.workers = "0"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    classes = 10
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.rows, a.features), dtype=np.float32)
    w = rng.standard_normal((a.features, classes), dtype=np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int64)

    out = {"device": str(device), "rows": a.rows, "features": a.features, "batch": a.batch,
           "steps": a.steps}
    # Ours: batches gathered in native threads, on the device when handed out.
    model, opt = build(a.features, a.hidden, classes, device)
    ours = gpufeed.Loader({"x": x, "y": y}, a.batch, shuffle=True, seed=0, drop_last=True,
                          framework="torch")
    class Epochs:
        """Each iteration a new epoch (a new shuffled order)."""
        epoch = 0

        def __iter__(self):
            ours.set_epoch(Epochs.epoch)
            Epochs.epoch += 1
            return ((b["x"], b["y"]) for b in ours)

    train(Epochs(), min(5, a.steps), model, opt, device, a.repeat)  # warm-up
    out["gpufeed"] = train(Epochs(), a.steps, model, opt, device, a.repeat)

    # DataLoader(pin_memory=True), per-sample dataset (the usual way), at its
    # best worker count over a short trial.
    ds = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    best = None
    for workers in [int(v) for v in a.workers.split(",")]:
        dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, drop_last=True,
                                         num_workers=workers, pin_memory=device.type == "cuda",
                                         persistent_workers=workers > 0)
        model, opt = build(a.features, a.hidden, classes, device)
        trial = train(dl, min(10, a.steps), model, opt, device, a.repeat)
        if best is None or trial["wall_s"] < best[1]["wall_s"]:
            best = (workers, trial, dl)
    workers, _, dl = best
    model, opt = build(a.features, a.hidden, classes, device)
    out["dataloader"] = train(dl, a.steps, model, opt, device, a.repeat)
    out["dataloader"]["workers"] = workers
    print(json.dumps(out))


if __name__ == "__main__":
    main()
