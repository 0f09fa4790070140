#!/usr/bin/env bash
# Builds a release abi3 wheel of `gpufeed` (one wheel for CPython 3.11+) into
# the directory given (default: python/dist). Install it elsewhere with
# `pip install --no-deps DIR/gpufeed-*.whl` (needs NumPy there).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="$(mkdir -p "${1:-$here/dist}" && cd "${1:-$here/dist}" && pwd)"
cd "$here"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==1.16.0"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/../target}"
# A manylinux_2_34 wheel (PyPI takes it, pip installs it on any x86_64 Linux with glibc 2.34 or
# later): maturin's audit fails the build if the module needs a newer glibc symbol or links a
# library outside the policy (it links libc and libgcc_s only; the CUDA driver is loaded at run
# time, never linked).
"$venv/bin/maturin" build --release --compatibility manylinux_2_34 --auditwheel check --out "$out"
ls -l "$out"/gpufeed-*-manylinux_2_34_x86_64.whl
