#!/usr/bin/env bash
# One round of checks on the GPU machine, over the bundle that
# ../shared/tools/gpu-bundle built into .gpu/ (carry [".gpu"]).
#
#   bash bench/gpu-round.sh quick   GPU test suite (REQUIRE_GPU=1), examples, and
#                                   compute-sanitizer memcheck on the soundness,
#                                   randomized-API and cancellation suites
#   bash bench/gpu-round.sh bench   only what full adds to quick (below)
#   bash bench/gpu-round.sh full    the same, then the full demonstration, the peers
#                                   (CUDA C++, PyTorch), a 40 s load test, and
#                                   synccheck / racecheck on the soundness suite
#   bash bench/gpu-round.sh focus   quick, then the parts the open issues check, each
#                                   once, in one call: small transfers with the PyTorch
#                                   peer, compare at 10^7 and 10^8 with the CUDA C++
#                                   peer, the Python benchmark, fewer bytes, waits,
#                                   chunk-cost (no full demonstration, no load test)
#   bash bench/gpu-round.sh parts   only what focus adds to quick (a call's time is limited)
#   bash bench/gpu-round.sh staging ordinary memory: the staging tests (REQUIRE_GPU=1) and
#                                   memcheck on them, the wheel's staging tests, `host staging`
#                                   (four routes against size, the shape sweep) and its
#                                   Python peer (PyTorch, CuPy idioms beside to_device/to_host)
#   bash bench/gpu-round.sh final   the tests of the commit submitted, in one call: every GPU test
#                                   executable (REQUIRE_GPU=1), memcheck on the soundness, staging and
#                                   loader suites, the wheel's pytest, the is_pinned probe; its
#                                   figures come from a second call on the same bundle:
#                                   LOADER=1 FILES=1 bash bench/gpu-round.sh measure
#   bash bench/gpu-round.sh files   files to the GPU: the staging and file_pieces tests (REQUIRE_GPU=1,
#                                   the O_DIRECT ones included), the wheel's file tests, `host files` at 4 GiB
#                                   (warm, cold auto / O_DIRECT / buffered, the disk's own O_DIRECT rate)
#                                   and bench/peers/files.py (KvikIO, np.load, torch.load,
#                                   safetensors; 4 GiB) on the repository's disk. KvikIO's wheels
#                                   (kvikio-cu13, libkvikio-cu13, rapids-logger, cuda-pathfinder,
#                                   nvidia-cufile) come in .gpu/wheels/extra (EXTRA_WHEELS=... when
#                                   bundling); libcufile from nvidia-cufile is put on
#                                   LD_LIBRARY_PATH so that the GPUDirect Storage probe finds it
#   bash bench/gpu-round.sh loader  the loader round (its own call: final has no time left): the tests
#                                   (REQUIRE_GPU=1) and memcheck on them, the wheel's
#                                   test_loader.py, bench/peers/loader.py, examples/train.py
#   bash bench/gpu-round.sh measure the staging round's measurements alone (no tests, no sanitizer):
#                                   `host staging` and the Python peer (`host files` and the files
#                                   peer with FILES=1; the zero-copy gather probe with ZERO_COPY=1)
#   bash bench/gpu-round.sh kernels the block-level kernels: their tests (REQUIRE_GPU=1; the CUDA
#                                   halves compare with the CPU emulation bit for bit), memcheck,
#                                   racecheck and synccheck on them, `host ptx` inspected with the
#                                   machine's ptxas (sm_70 and sm_80 builds), the wheel's kernel
#                                   tests, and bench/kernels.py (gpufeed against CUDA C++ of the
#                                   same algorithms, PyTorch/cuBLAS and the device copy)
#   bash bench/gpu-round.sh weights model weights: the weights tests (REQUIRE_GPU=1) and memcheck on
#                                   them, the wheel's test_weights.py, python/bench/weights.py (a
#                                   Llama-like bf16 checkpoint of several shards loaded warm and
#                                   cold against safetensors, fastsafetensors and the Run:ai
#                                   streamer; saved against torch.save, safetensors and
#                                   torch.distributed.checkpoint.async_save). Their wheels come in
#                                   .gpu/wheels/extra (EXTRA_WHEELS=... when bundling)
#   bash bench/gpu-round.sh multi   the multi-device round (on nvidia-h200-x2 and up, or one
#                                   GPU): how the GPUs are linked (nvidia-smi topo -m, nvlink
#                                   status), the multi-device tests and memcheck on them,
#                                   `host topology`, `host multi-gpu` (ours against plain driver
#                                   copies and cuMemcpyPeerAsync), the PyTorch peer of it
#
# Bundle first: ../shared/tools/gpu-bundle, then `git rev-parse HEAD > .gpu/COMMIT`.
# Everything lands in $OUT/run (tarred to $OUT/run-<mode>.tgz at the end, so it comes back
# as one file). Exits non-zero if a test, a sanitizer or the demonstration failed.
set -uo pipefail
mode=${1:-quick}
cd "$(dirname "$0")/.."
R=${OUT:-/tmp}/run
mkdir -p "$R/logs/san"
fail=0
note() { echo "== $*" | tee -a "$R/logs/summary.log"; }
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } > "$R/logs/gpu.txt" 2>&1
# The binaries' commit: .gpu/COMMIT, written when bundling (`git rev-parse HEAD > .gpu/COMMIT`
# after ../shared/tools/gpu-bundle); the GPU machine's copy of the tree can report a stale HEAD.
{ cat .gpu/COMMIT 2>/dev/null || echo "unknown: no .gpu/COMMIT (the tree copy says $(git rev-parse HEAD 2>/dev/null))"; } > "$R/logs/commit.txt"

site=/tmp/gpufeed-site
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/wheels/gpufeed-*.whl $(ls .gpu/wheels/extra/*.whl 2>/dev/null) > "$R/logs/python-install.log" 2>&1 || { fail=1; note "WHEEL INSTALL FAILED"; }

san() {  # tool, test name, extra args
  local tool=$1 t=$2; shift 2
  local exe; exe=$(ls .gpu/tests/"$t"-* 2>/dev/null | head -1)
  [ -n "$exe" ] || { note "no test executable for $t"; fail=1; return; }
  REQUIRE_GPU=1 RANDOM_API_STEPS=${RANDOM_API_STEPS:-150} timeout 400 \
    compute-sanitizer --tool "$tool" "$@" --error-exitcode 9 "$exe" --include-ignored --test-threads=1 \
    > "$R/logs/san/$tool-$t.log" 2>&1 || { fail=1; note "$tool $t FAILED"; }
  grep -E "ERROR SUMMARY|LEAK SUMMARY|RACECHECK SUMMARY|^test result" "$R/logs/san/$tool-$t.log" | sed "s/^/$tool $t: /" | tee -a "$R/logs/summary.log"
}
if [ "$mode" = multi ]; then
  M="$R/multi"; mkdir -p "$M"
  note "multi-device: links, tests, topology, multi-gpu, PyTorch peer"
  { nvidia-smi -L; nvidia-smi topo -m; nvidia-smi nvlink -s; nvidia-smi topo -p2p r; nvidia-smi topo -p2p w; nvidia-smi topo -p2p n; } > "$M/links.txt" 2>&1
  exe=$(ls .gpu/tests/multi_device-* 2>/dev/null | head -1)
  REQUIRE_GPU=1 timeout 200 "$exe" --include-ignored > "$M/multi_device_tests.log" 2>&1 || { fail=1; note "MULTI-DEVICE TESTS FAILED"; }
  tail -3 "$M/multi_device_tests.log" | tee -a "$R/logs/summary.log"
  san memcheck multi_device --leak-check full
  timeout 60 .gpu/bin/host --out-dir "$M" topology > "$M/topology.log" 2>&1 || { fail=1; note "TOPOLOGY FAILED"; }
  timeout 400 .gpu/bin/host --out-dir "$M" multi-gpu > "$M/multi.log" 2>&1 || { fail=1; note "MULTI-GPU FAILED"; }
  grep -vE "^wrote" "$M/multi.log" | tee -a "$R/logs/summary.log"
  timeout 200 python3 bench/peers/torch_multi.py --out "$M/pytorch-multi.json" > "$M/torch-multi.log" 2>&1 || { fail=1; note "TORCH MULTI FAILED"; }
  cat "$M/torch-multi.log" | tee -a "$R/logs/summary.log"
fi

if [ "$mode" = kernels ]; then
  K="$R/kernels"; mkdir -p "$K"
  [ -f .gpu/tests.tar.xz ] && tar -C .gpu -xJf .gpu/tests.tar.xz
  note "kernels: tests (REQUIRE_GPU=1), sanitizers, ptx inspection, the wheel's kernel tests, bench/kernels.py"
  exe=$(ls .gpu/tests/kernels-* 2>/dev/null | head -1)
  if [ -n "$exe" ]; then
    REQUIRE_GPU=1 timeout 300 "$exe" --include-ignored > "$K/kernel_tests.log" 2>&1 || { fail=1; note "KERNEL TESTS FAILED"; }
    grep -E "^test result|FAILED|panicked" "$K/kernel_tests.log" | head -20 | tee -a "$R/logs/summary.log"
    KERNEL_TESTS_SMALL=1 san memcheck kernels
    KERNEL_TESTS_SMALL=1 san racecheck kernels
    KERNEL_TESTS_SMALL=1 san synccheck kernels
  else
    fail=1; note "no kernels test executable"
  fi
  for arch in "" --sm80; do
    PTXAS=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas) timeout 120 .gpu/bin/host ptx --out /dev/null $arch \
      --json "$K/ptx${arch:+-sm80}.json" > /dev/null 2> "$K/ptx${arch:+-sm80}.log" || { fail=1; note "PTX INSPECTION FAILED"; }
    tee -a "$R/logs/summary.log" < "$K/ptx${arch:+-sm80}.log"
  done
  save() { tar -C "$(dirname "$R")" -czf "$(dirname "$R")/run-$mode.tgz" run; }
  timeout 240 .gpu/bin/host --out-dir "$K" kernel-set ${KERNEL_SET_ARGS:-} > "$K/kernel-set.log" 2>&1 || { fail=1; note "KERNEL SET FAILED"; }
  grep -vE "^wrote" "$K/kernel-set.log" | tee -a "$R/logs/summary.log"
  save
  if [ -f python/tests/test_kernels.py ]; then
    PYTHONPATH="$site" REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_kernels.py > "$K/python-kernel-tests.log" 2>&1 || { fail=1; note "PYTHON KERNEL TESTS FAILED"; }
    tail -3 "$K/python-kernel-tests.log" | tee -a "$R/logs/summary.log"
  fi
  PYTHONPATH="$site" timeout 420 python3 bench/kernels.py --out "$K/bench" ${KERNELS_ARGS:-} > "$K/bench.log" 2>&1 || { fail=1; note "KERNELS BENCHMARK FAILED"; }
  tail -40 "$K/bench.log" | tee -a "$R/logs/summary.log"
  save
fi

if [ "$mode" = weights ]; then
  W="$R/weights"; mkdir -p "$W"
  [ -f .gpu/tests.tar.xz ] && tar -C .gpu -xJf .gpu/tests.tar.xz
  note "weights: tests (REQUIRE_GPU=1), memcheck, the wheel's weights tests, python/bench/weights.py"
  scratch="$PWD/.weights-scratch"; mkdir -p "$scratch"
  exe=$(ls .gpu/tests/weights-* 2>/dev/null | head -1)
  if [ -n "$exe" ]; then
    TMPDIR="$scratch" REQUIRE_GPU=1 timeout 120 "$exe" --include-ignored > "$W/weights_tests.log" 2>&1 || { fail=1; note "WEIGHTS TESTS FAILED"; }
    grep -E "^test result|FAILED" "$W/weights_tests.log" | tee -a "$R/logs/summary.log"
    TMPDIR="$scratch" san memcheck weights --leak-check full
  else
    fail=1; note "no weights test executable"
  fi
  PYTHONPATH="$site" REQUIRE_GPU=1 TMPDIR="$scratch" timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --basetemp "$scratch/pytest" python/tests/test_weights.py > "$W/python-weights-tests.log" 2>&1 || { fail=1; note "PYTHON WEIGHTS TESTS FAILED"; }
  tail -3 "$W/python-weights-tests.log" | tee -a "$R/logs/summary.log"
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$site" timeout 330 python3 python/bench/weights.py --out "$W/weights.json" --dir "$scratch/bench" ${WEIGHTS_ARGS:---gb 4 --shards 5 --reps 3} > "$W/weights.log" 2>&1 || { fail=1; note "WEIGHTS BENCHMARK FAILED"; }
  tail -40 "$W/weights.log" | tee -a "$R/logs/summary.log"
  rm -rf "$scratch"
fi

if [ "$mode" = final ]; then
  # Packed to fit one call's transfer: the test executables travel as .gpu/tests.tar.xz.
  [ -f .gpu/tests.tar.xz ] && tar -C .gpu -xJf .gpu/tests.tar.xz
  note "tests (REQUIRE_GPU=1)"
  OUT="$R/logs" timeout 300 bash .gpu/run-tests.sh > "$R/logs/tests-summary.log" 2>&1 || { fail=1; note "TESTS FAILED"; }
  tail -1 "$R/logs/tests-summary.log" | tee -a "$R/logs/summary.log"
  for t in soundness staging loader; do san memcheck "$t" --leak-check full; done
  note "python: the wheel's pytest with PyTorch and CuPy (REQUIRE_GPU=1)"
  mkdir -p .pytest-scratch
  PYTHONPATH="$site" REQUIRE_GPU=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --basetemp "$PWD/.pytest-scratch" python/tests > "$R/logs/python-tests.log" 2>&1 || { fail=1; note "PYTHON TESTS FAILED"; }
  tail -3 "$R/logs/python-tests.log" | tee -a "$R/logs/summary.log"
  rm -rf .pytest-scratch
  PYTHONPATH="$site" timeout 60 python3 bench/peers/is_pinned.py > "$R/logs/is_pinned.json" 2>&1 || note "IS_PINNED PROBE FAILED"
  cat "$R/logs/is_pinned.json" | tee -a "$R/logs/summary.log"
fi

# The measurements, each part tarred as it ends (a call stopped by its time
# limit still brings back what finished): measure with LOADER=1 FILES=1.
save() { tar -C "$(dirname "$R")" -czf "$(dirname "$R")/run-$mode.tgz" run; }
if [ "$mode" = measure ] && [ "${LOADER:-0}" = 1 ]; then
  L="$R/loader"; mkdir -p "$L"
  note "loader: host loader, the Python benchmark, the training demonstration"
  timeout 150 .gpu/bin/host --out-dir "$L" loader > "$L/host-loader.log" 2>&1 || { fail=1; note "HOST LOADER FAILED"; }
  grep -vE "^wrote" "$L/host-loader.log" | tee -a "$R/logs/summary.log"
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$site" timeout 200 python3 bench/peers/loader.py --out "$L/python-loader.json" ${LOADER_ARGS:-} > "$L/python-loader.log" 2>&1 || { fail=1; note "LOADER BENCHMARK FAILED"; }
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["checks"]))' "$L/python-loader.json" 2>&1 | tee -a "$R/logs/summary.log"
  save
  PYTHONPATH="$site" timeout 150 python3 python/examples/train.py ${TRAIN_ARGS:-} > "$L/train.log" 2>&1 || { fail=1; note "TRAINING DEMONSTRATION FAILED"; }
  tail -3 "$L/train.log" | tee -a "$R/logs/summary.log"
  save
fi

if [ "$mode" = measure ] && [ "${ZERO_COPY:-0}" = 1 ]; then
  Z="$R/zero_copy"; mkdir -p "$Z"
  note "zero-copy gather probe: load forms against the pinned DMA (CuPy)"
  PYTHONPATH="$site" timeout 120 python3 bench/peers/zero_copy.py --out "$Z/zero_copy.json" > "$Z/zero_copy.log" 2>&1 || { fail=1; note "ZERO-COPY PROBE FAILED"; }
  cat "$Z/zero_copy.log" | tee -a "$R/logs/summary.log"
  save
fi

if [ "$mode" = files ] || { [ "$mode" = measure ] && [ "${FILES:-0}" = 1 ]; }; then
  FD="$R/files"; mkdir -p "$FD"
  # The files on the repository's disk (not $OUT: nothing big comes back; /tmp may be tmpfs).
  scratch="$PWD/.files-scratch"; mkdir -p "$scratch"
  cufile_lib=$(ls -d "$site"/nvidia/cufile/lib 2>/dev/null | head -1)
  export LD_LIBRARY_PATH="${cufile_lib:+$cufile_lib:}${LD_LIBRARY_PATH:-}"
  if [ "$mode" = files ]; then
    note "files: staging tests (O_DIRECT ones included), the wheel's file tests"
    exe=$(ls .gpu/tests/staging-* 2>/dev/null | head -1)
    TMPDIR="$scratch" REQUIRE_GPU=1 timeout 200 "$exe" --include-ignored > "$FD/staging_tests.log" 2>&1 || { fail=1; note "STAGING TESTS FAILED"; }
    grep "^test result" "$FD/staging_tests.log" | tee -a "$R/logs/summary.log"
    exe=$(ls .gpu/tests/file_pieces-* 2>/dev/null | head -1)
    TMPDIR="$scratch" REQUIRE_GPU=1 timeout 200 "$exe" --include-ignored > "$FD/file_pieces_tests.log" 2>&1 || { fail=1; note "FILE PIECES TESTS FAILED"; }
    grep "^test result" "$FD/file_pieces_tests.log" | tee -a "$R/logs/summary.log"
    PYTHONPATH="$site" REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider --basetemp "$scratch/pytest" python/tests/test_files.py > "$FD/python-files-tests.log" 2>&1 || { fail=1; note "PYTHON FILES TESTS FAILED"; }
    tail -2 "$FD/python-files-tests.log" | tee -a "$R/logs/summary.log"
  fi
  note "files: host files (4 GiB), then the Python peers (KvikIO, np.load, torch.load, safetensors; 4 GiB)"
  if [ "${FILES_HOST:-1}" = 1 ]; then  # FILES_HOST=0: the Python peers alone
  timeout 300 .gpu/bin/host --out-dir "$FD" files --dir "$scratch" ${FILES_ARGS:---bytes 4294967296} > "$FD/files.log" 2>&1 || { fail=1; note "HOST FILES FAILED"; }
  grep -vE "^wrote" "$FD/files.log" | tee -a "$R/logs/summary.log"
  fi
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$site" timeout 250 python3 bench/peers/files.py --dir "$scratch" --out "$FD/python-files.json" ${FILES_PEER_ARGS:-} > "$FD/python-files.log" 2>&1 || { fail=1; note "FILES PEER FAILED"; }
  cat "$FD/python-files.log" | tee -a "$R/logs/summary.log"
  rm -rf "$scratch"
  save
fi

if [ "$mode" = staging ] || { [ "$mode" = measure ] && [ "${STAGING:-1}" = 1 ]; }; then
  S="$R/staging"; mkdir -p "$S"
  if [ "$mode" != measure ]; then
  note "staging: tests, memcheck, host staging, the Python peer"
  exe=$(ls .gpu/tests/staging-* 2>/dev/null | head -1)
  REQUIRE_GPU=1 timeout 200 "$exe" --include-ignored > "$S/staging_tests.log" 2>&1 || { fail=1; note "STAGING TESTS FAILED"; }
  grep "^test result" "$S/staging_tests.log" | tee -a "$R/logs/summary.log"
  san memcheck staging --leak-check full
  PYTHONPATH="$site" REQUIRE_GPU=1 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_staging.py > "$S/python-staging-tests.log" 2>&1 || { fail=1; note "PYTHON STAGING TESTS FAILED"; }
  tail -2 "$S/python-staging-tests.log" | tee -a "$R/logs/summary.log"
  fi
  if [ "${HOST_STAGING:-1}" = 1 ]; then  # HOST_STAGING=0: the Python peer alone
  timeout 400 .gpu/bin/host --out-dir "$S" staging ${STAGING_ARGS:-} > "$S/staging.log" 2>&1 || { fail=1; note "HOST STAGING FAILED"; }
  grep -vE "^wrote" "$S/staging.log" | tee -a "$R/logs/summary.log"
  fi
  # PASSIVE: PyTorch's OpenMP threads (the checks' CPU comparisons) sleep
  # at once after their work instead of spinning on the cores the copies use.
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$site" timeout 400 python3 bench/peers/staging.py --out "$S/python-staging.json" ${PEER_ARGS:-} > "$S/python-staging.log" 2>&1 || { fail=1; note "PYTHON STAGING PEER FAILED"; }
  cat "$S/python-staging.log" | tee -a "$R/logs/summary.log"
  # The targets against this round's figures (a miss is reported, not a failure of the round).
  if [ -f "$S/staging.json" ]; then
    python3 bench/peers/check_staging.py "$S/staging.json" $( [ -f "$S/python-staging.json" ] && echo "$S/python-staging.json") \
      --out "$S/checks.json" > "$S/checks.log" 2>&1 || true
    tee -a "$R/logs/summary.log" < "$S/checks.log"
  fi
  save
fi

if [ "$mode" = loader ]; then
  L="$R/loader"; mkdir -p "$L"
  note "loader: tests, memcheck, the wheel's loader tests, the benchmark, the training demonstration"
  exe=$(ls .gpu/tests/loader-* 2>/dev/null | head -1)
  REQUIRE_GPU=1 timeout 200 "$exe" --include-ignored > "$L/loader_tests.log" 2>&1 || { fail=1; note "LOADER TESTS FAILED"; }
  grep "^test result" "$L/loader_tests.log" | tee -a "$R/logs/summary.log"
  san memcheck loader --leak-check full
  PYTHONPATH="$site" REQUIRE_GPU=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider python/tests/test_loader.py > "$L/python-loader-tests.log" 2>&1 || { fail=1; note "PYTHON LOADER TESTS FAILED"; }
  tail -2 "$L/python-loader-tests.log" | tee -a "$R/logs/summary.log"
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$site" timeout 200 python3 bench/peers/loader.py --out "$L/python-loader.json" > "$L/python-loader.log" 2>&1 || { fail=1; note "LOADER BENCHMARK FAILED"; }
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["checks"]))' "$L/python-loader.json" 2>&1 | tee -a "$R/logs/summary.log"
  PYTHONPATH="$site" timeout 200 python3 python/examples/train.py > "$L/train.log" 2>&1 || { fail=1; note "TRAINING DEMONSTRATION FAILED"; }
  tail -1 "$L/train.log" | tee -a "$R/logs/summary.log"
fi

if [ "$mode" != bench ] && [ "$mode" != parts ] && [ "$mode" != multi ] && [ "$mode" != staging ] && [ "$mode" != final ] && [ "$mode" != files ] && [ "$mode" != loader ] && [ "$mode" != measure ] && [ "$mode" != kernels ] && [ "$mode" != weights ]; then
note "tests (REQUIRE_GPU=1)"
OUT="$R/logs" bash .gpu/run-tests.sh > "$R/logs/tests-summary.log" 2>&1 || { fail=1; note "TESTS FAILED"; }
tail -1 "$R/logs/tests-summary.log" | tee -a "$R/logs/summary.log"

note "examples"
for e in .gpu/examples/*; do
  [ -x "$e" ] || continue
  n=$(basename "$e")
  timeout 120 "$e" > "$R/logs/$n.log" 2>&1 || { fail=1; note "EXAMPLE $n FAILED"; }
done

note "compute-sanitizer memcheck"
for t in soundness random_api cancellation multi_device device_memory copy_batch; do san memcheck "$t" --leak-check full; done

note "python: the gpufeed wheel, pytest with PyTorch and CuPy (REQUIRE_GPU=1)"
PYTHONPATH="$site" REQUIRE_GPU=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider python/tests > "$R/logs/python-tests.log" 2>&1 || { fail=1; note "PYTHON TESTS FAILED"; }
tail -3 "$R/logs/python-tests.log" | tee -a "$R/logs/summary.log"
fi

if [ "$mode" = focus ] || [ "$mode" = parts ]; then
  F="$R/focus"; mkdir -p "$F"
  note "small transfers, with the PyTorch peer"
  timeout 300 .gpu/bin/host --out-dir "$F" small-transfers > "$F/small.log" 2>&1 || { fail=1; note "SMALL FAILED"; }
  timeout 200 python3 bench/peers/torch_small.py --out "$F/pytorch-small.json" > "$F/torch-small.log" 2>&1 || { fail=1; note "TORCH SMALL FAILED"; }
  python3 bench/peers/compare_small.py "$F/small_transfers.json" "$F/pytorch-small.json" --out "$F/comparison-small.json" > "$F/comparison-small.txt" 2>&1 || true
  grep -A12 "^checks" "$F/comparison-small.txt" | tee -a "$R/logs/summary.log"
  note "compare at 10^7 and 10^8, the CUDA C++ and PyTorch peers"
  timeout 200 .gpu/bin/host --out-dir "$F" compare --sizes 10000000,100000000 > "$F/compare.log" 2>&1 || { fail=1; note "COMPARE FAILED"; }
  grep -E "async |bound" "$F/compare.log" | tee -a "$R/logs/summary.log"
  HOST_JSON="$F/host-rust.json" SMALL=0 timeout 300 bash bench/peers/run_peers.sh "$F/peers" > "$F/peers.log" 2>&1 || { fail=1; note "PEERS FAILED"; }
  rm -f "$F/peers/cuda_pipeline"
  note "python: the pipeline from Python vs from Rust, the PyTorch peer, GIL, pinned vs pageable; per-run spread"
  PYTHONPATH="$site" timeout 300 python3 python/bench/bench.py "$F/python-bench.json" --sizes 10000000 100000000 --reps 10 > "$F/python-bench.log" 2>&1 || { fail=1; note "PYTHON BENCH FAILED"; }
  PYTHONPATH="$site" timeout 120 python3 python/bench/waits.py 10000000 "$F/python-waits.json" > "$F/python-waits.log" 2>&1 || { fail=1; note "PYTHON WAITS FAILED"; }
  cat "$F/python-waits.log" >> "$R/logs/summary.log"
  note "fewer bytes, waits, chunk-cost"
  timeout 200 .gpu/bin/host --out-dir "$F" fewer-bytes > "$F/fewer.log" 2>&1 || { fail=1; note "FEWER BYTES FAILED"; }
  timeout 100 .gpu/bin/host --out-dir "$F" waits > "$F/waits.log" 2>&1 || { fail=1; note "WAITS FAILED"; }
  timeout 150 .gpu/bin/host --out-dir "$F" chunk-cost > "$F/chunk.log" 2>&1 || { fail=1; note "CHUNK COST FAILED"; }
  tail -5 "$F/waits.log" >> "$R/logs/summary.log"
fi

if [ "$mode" = bench ] || [ "$mode" = full ]; then
  note "synccheck / racecheck"
  san synccheck soundness
  san racecheck soundness
  note "demonstration"
  .gpu/bin/host --out-dir "$R/demo" > "$R/logs/demo.log" 2>&1 || { fail=1; note "DEMO FAILED"; }
  tail -3 "$R/logs/demo.log" | tee -a "$R/logs/summary.log"
  note "peers"
  HOST_JSON="$R/demo/host-rust.json" HOST_SMALL_JSON="$R/demo/small_transfers.json" timeout 400 bash bench/peers/run_peers.sh "$R/peers" > "$R/logs/peers.log" 2>&1 || { fail=1; note "PEERS FAILED"; }
  rm -f "$R/peers/cuda_pipeline"
  note "python: pipeline from Python vs the same from Rust (same call), the PyTorch peer, GIL, pinned vs pageable"
  .gpu/bin/host --out-dir "$R/py-rust" compare --sizes 10000000,100000000 --reps 10 > "$R/logs/py-rust-compare.log" 2>&1 || { fail=1; note "RUST COMPARE FAILED"; }
  PYTHONPATH="$site" timeout 400 python3 python/bench/bench.py "$R/python-bench.json" --sizes 10000000 100000000 --reps 10 > "$R/logs/python-bench.log" 2>&1 || { fail=1; note "PYTHON BENCH FAILED"; }
  tail -20 "$R/logs/python-bench.log" >> "$R/logs/summary.log"
  note "load"
  .gpu/bin/host --out-dir "$R/load" load --seconds 40 > "$R/logs/load.log" 2>&1 || { fail=1; note "LOAD FAILED"; }
  tail -3 "$R/logs/load.log" | tee -a "$R/logs/summary.log"
fi

note "round done (fail=$fail)"
tar -C "$(dirname "$R")" -czf "$(dirname "$R")/run-$mode.tgz" run && rm -rf "$R"
exit $fail
