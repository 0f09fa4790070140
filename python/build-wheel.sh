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
# manylinux auditing off: the module links nothing but libc (the CUDA driver
# is loaded at run time).
"$venv/bin/maturin" build --release --compatibility linux --out "$out"
ls -l "$out"/gpufeed-*.whl
