"""Every Python example of README.md and python/README.md runs as written on
the device at hand (the CPU emulation without a GPU): each README's
```python blocks, in order, in one namespace (as a reader goes down the
page), in a fresh directory. A line marked `# needs a GPU` runs on a CUDA
device only, where the README says so; tracebacks name the README's line."""
import os
import re

import pytest

from conftest import torch_or_skip

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READMES = ["README.md", os.path.join("python", "README.md")]
GPU_ONLY = "# needs a GPU"


def python_blocks(path):
    """(first line number, code) of each ```python block of `path`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        first = text.count("\n", 0, m.start(1)) + 1
        out.append((first, m.group(1)))
    return out


def test_the_blocks_are_found_and_gpu_lines_are_marked():
    for readme in READMES:
        blocks = python_blocks(os.path.join(ROOT, readme))
        assert len(blocks) >= 2, readme
        for first, code in blocks:
            for k, line in enumerate(code.splitlines()):
                # What the CPU emulation can't do is marked, line by line.
                if "from_dlpack" in line or "cupy" in line.split("#")[0]:
                    assert GPU_ONLY in line, f"{readme}:{first + k}: {line}"


@pytest.mark.parametrize("readme", READMES)
def test_every_python_example_of_the_readme_runs_as_written(readme, device, tmp_path, monkeypatch):
    path = os.path.join(ROOT, readme)
    blocks = python_blocks(path)
    cuda = device.kind == "cuda"
    if any("torch" in code for _, code in blocks):
        torch_or_skip()
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    for first, code in blocks:
        lines = code.splitlines()
        if not cuda:
            # The marked line's statement left out, its indentation kept.
            lines = [re.sub(r"\S.*", "pass", ln) if GPU_ONLY in ln else ln for ln in lines]
        # Padded so that a traceback names the README's own line.
        source = "\n" * (first - 1) + "\n".join(lines) + "\n"
        exec(compile(source, path, "exec"), namespace)
