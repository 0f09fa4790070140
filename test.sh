#!/usr/bin/env bash
# The README's test command: every Rust test of the workspace (GPU halves
# are reported ignored without a GPU; REQUIRE_GPU=1 makes them run and fail),
# then the Python package's tests, in a virtual environment kept between runs
# (python/.venv) with the wheel built from this checkout and installed anew.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cargo test --workspace "$@"
bash python/run-tests.sh
