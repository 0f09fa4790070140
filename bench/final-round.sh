#!/usr/bin/env bash
# The last GPU round of a submission, in one call under 9 minutes: every GPU
# test executable (REQUIRE_GPU=1, each under its own time bound), `host
# kernel-set` (the block-level kernels against the device copy, 1 GiB),
# the wheel's kernel and weights tests on the GPU, and bench/kernels.py (gpufeed
# against CUDA C++ of the same algorithms and PyTorch/cuBLAS). Results in
# $OUT/final.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:-/tmp}/final
mkdir -p "$R"
[ -f .gpu/tests.tar.xz ] && tar -C .gpu -xJf .gpu/tests.tar.xz
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; cat .gpu/COMMIT; date -u; } > "$R/machine.txt" 2>&1
site=/tmp/gpufeed-site
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/wheels/gpufeed-*.whl .gpu/wheels/extra/*.whl > "$R/pip.log" 2>&1
pack() { tar -C "$(dirname "$R")" -czf "$(dirname "$R")/final.tgz" final; }
start=$SECONDS
: > "$R/tests.log"
for t in .gpu/tests/*; do
  [ $((SECONDS - start)) -lt "${TESTS_BUDGET:-180}" ] || { echo "=== $t SKIPPED (budget)" >> "$R/tests.log"; continue; }
  rc=0
  REQUIRE_GPU=1 timeout 90 "$t" --include-ignored > "$R/last.log" 2>&1 || rc=$?
  { echo "=== $(basename "$t") (exit $rc)"; grep -E '^test result|FAILED|panicked|running for over' "$R/last.log"; } >> "$R/tests.log"
  [ "$rc" = 0 ] || cp "$R/last.log" "$R/failed-$(basename "$t").log"
done
rm -f "$R/last.log"
pack
timeout 60 .gpu/bin/host --out-dir "$R" kernel-set --reps 10 > "$R/kernel-set.log" 2>&1
echo "kernel-set exit $?" >> "$R/kernel-set.log"
pack
PYTHONPATH="$site" REQUIRE_GPU=1 timeout 70 python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_kernels.py python/tests/test_weights.py > "$R/pytest.log" 2>&1
echo "pytest exit $?" >> "$R/pytest.log"
pack
PYTHONPATH="$site" timeout 145 python3 bench/kernels.py --out "$R/bench" --budget-seconds 80 > "$R/bench.log" 2>&1
echo "bench exit $?" >> "$R/bench.log"
pack
