#!/usr/bin/env bash
# Builds the `gpufeed` extension into a local venv (python/.venv) and runs its
# pytest suite. The venv is kept between runs: made when missing, its pinned
# test packages (re)installed only when the list below changes (a stamp file
# records it), so a second run downloads nothing; the wheel is built and
# installed anew each time (cargo rebuilds nothing when nothing changed). Needs only rustup, python3 (>= 3.11) and pip, with access to
# PyPI. The CPU emulation is used unless a GPU is present (HOST_BACKEND wins
# when set); REQUIRE_GPU=1 makes the GPU tests fail instead of skipping.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
py="${PYTHON:-python3}"
venv="$here/.venv"
vpy="$venv/bin/python"
[ -x "$vpy" ] || "$py" -m venv "$venv"
# The test packages, pinned; installed when the list differs from the one
# the venv was last set up with. gpufeed itself is reinstalled every run
# (--force-reinstall below), so an older wheel can't make the tests pass.
reqs="maturin==1.16.0 numpy==2.2.6 pytest==8.3.5 safetensors==0.8.0"
stamp="$venv/.gpufeed-test-packages"
if [ "$(cat "$stamp" 2>/dev/null)" != "$reqs" ]; then
    # shellcheck disable=SC2086
    "$vpy" -m pip install --quiet --disable-pip-version-check $reqs
    echo "$reqs" > "$stamp"
fi
# PyTorch, for the loader's tests against torch.utils.data (DistributedSampler,
# a 2-rank gloo run, the training example). PyPI's wheel: the only index these
# machines reach (it brings CUDA libraries, unused without a GPU): about 2
# minutes and 5 GB on a fresh machine (117 s measured here). TEST_TORCH=0 leaves
# it out and the tests that need it skip; with TEST_TORCH=1 (the default) they
# fail if torch does not import, never skip.
export TEST_TORCH="${TEST_TORCH:-1}"
torch_pin="2.15.0"
if [ "$TEST_TORCH" = 1 ] && [ "$("$vpy" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$torch_pin" ]; then
    t0=$SECONDS
    "$vpy" -m pip install --quiet --disable-pip-version-check "torch==$torch_pin"
    echo "gpufeed tests: torch installed in $((SECONDS - t0)) s"
fi
# A debug build keeps CI short; the shared target dir avoids rebuilding `host`.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/../target}"
# Build the abi3 wheel (debug profile: CI time) and install it into the venv,
# as a user would install it (numpy is there already: --no-deps).
wheels="$CARGO_TARGET_DIR/wheels-test"
rm -rf "$wheels"
# Tagged manylinux_2_34, as build-wheel.sh's release wheel: maturin's audit fails the build if the
# module needs a newer glibc or links a library outside the policy (libcuda is loaded at run time).
"$venv/bin/maturin" build --quiet --profile dev --compatibility manylinux_2_34 --auditwheel check \
    --interpreter "$vpy" --out "$wheels"
# The tag pip and PyPI see: the file name and the WHEEL metadata inside it.
"$vpy" - "$wheels"/gpufeed-*.whl <<'PY'
import re, sys, zipfile
want = "cp311-abi3-manylinux_2_34_x86_64"
path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
tags = re.findall(r"^Tag: (.+)$", meta, re.M)
if not path.endswith(f"-{want}.whl") or tags != [want]:
    sys.exit(f"gpufeed tests: the wheel is not tagged {want}: {path}, WHEEL tags {tags}")
print(f"gpufeed tests: wheel tagged {want}")
PY
"$vpy" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/gpufeed-*.whl
if [ -z "${HOST_BACKEND:-}" ]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        export HOST_BACKEND=cpu
    fi
fi
echo "gpufeed tests: HOST_BACKEND=${HOST_BACKEND:-auto}"
exec "$vpy" -m pytest -q -rs "$here/tests" "$@"
