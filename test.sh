#!/usr/bin/env bash
# The README's test command: every Rust test of the workspace (GPU halves
# skip with a notice without a GPU; REQUIRE_GPU=1 makes them fail instead),
# then the Python package's tests, in a local virtual environment
# (python/.venv) with the wheel built from this checkout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
cargo test --workspace "$@"
bash python/run-tests.sh
