#!/usr/bin/env bash
# Runs the benchmark peers (CUDA C++ and PyTorch) on a GPU machine.
#
# usage: bench/peers/run_peers.sh [OUTDIR] [--intensity]
#   OUTDIR        where the binary, logs and JSON go (default ${OUT:-/tmp/peers})
#   --intensity   also run kernel intensity, k = 1,64,1024, at n = 100000000
# environment:
#   HOST_JSON       our results (peer "host-rust", same schema); if set,
#                   compare.py writes OUTDIR/comparison.json
#   HOST_SMALL_JSON our small_transfers.json (`host small-transfers`); if set,
#                   compare_small.py writes OUTDIR/comparison-small.json
#   SMALL           0 skips the small-transfer peer (torch_small.py, under a
#                   minute; writes OUTDIR/pytorch-small.json); default 1
#   REPS            timed runs per configuration for scale (default 20)
#   INTENSITY_REPS  timed runs per configuration for intensity (default 10:
#                   eager PyTorch makes 2k passes over the data per run, about
#                   0.4 s a run at k=1024, n=1e8, so 20 reps would push the
#                   total past ~3 minutes)
#   NVCC, PYTHON    compilers/interpreters to use (default nvcc, python3)
#   SIZES, INTENSITY_SIZES, KS, CHUNKS, STREAMS
#                   override the sweep (defaults 10000000,100000000 /
#                   100000000 / 1,64,1024 / 4,8,16,32 / 2,4)
#
# Writes OUTDIR/cuda-cpp.json, OUTDIR/pytorch.json (and comparison.json),
# OUTDIR/pytorch-small.json (and comparison-small.json), plus a .log per peer.
# Exit status 1 if a peer failed its verification or did not run; the other
# peers still run.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
INTENSITY=0
OUTDIR=""
for arg in "$@"; do
    case "$arg" in
        --intensity) INTENSITY=1 ;;
        -h|--help) sed -n '2,29p' "${BASH_SOURCE[0]}"; exit 0 ;;
        -*) echo "error: unknown option $arg" >&2; exit 64 ;;
        *)
            if [[ -n "$OUTDIR" ]]; then echo "error: more than one OUTDIR" >&2; exit 64; fi
            OUTDIR=$arg ;;
    esac
done
OUTDIR=${OUTDIR:-${OUT:-/tmp/peers}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
fi
REPS=${REPS:-20}
INTENSITY_REPS=${INTENSITY_REPS:-10}
SIZES=${SIZES:-10000000,100000000}
INTENSITY_SIZES=${INTENSITY_SIZES:-100000000}
KS=${KS:-1,64,1024}
CHUNKS=${CHUNKS:-4,8,16,32}
STREAMS=${STREAMS:-2,4}
SMALL=${SMALL:-1}

echo "== peers -> $OUTDIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$NVCC" --version | tail -n 2
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' ||
    echo "warning: $PYTHON cannot import torch" >&2

echo "== build: $NVCC -O3 -arch=sm_90 -o $OUTDIR/cuda_pipeline cuda_pipeline.cu"
"$NVCC" -O3 -arch=sm_90 -o "$OUTDIR/cuda_pipeline" "$HERE/cuda_pipeline.cu"

FAILED=()

# run_peer NAME CMD...: runs the peer for kernel scale (and intensity), then
# merges its JSON files into OUTDIR/NAME.json.
run_peer() {
    local name=$1
    shift
    local parts=()
    local rc=0
    rm -f "$OUTDIR/$name.json" "$OUTDIR/$name.scale.json" "$OUTDIR/$name.intensity.json"

    echo "== $name: scale"
    "$@" --sizes "$SIZES" --kernel scale --chunks "$CHUNKS" --streams "$STREAMS" \
        --reps "$REPS" --json "$OUTDIR/$name.scale.json" 2>&1 | tee "$OUTDIR/$name.scale.log" || rc=$?
    [[ $rc -eq 0 ]] || FAILED+=("$name/scale (exit $rc)")
    if [[ -f "$OUTDIR/$name.scale.json" ]]; then parts+=("$OUTDIR/$name.scale.json"); fi

    if [[ $INTENSITY -eq 1 ]]; then
        rc=0
        echo "== $name: intensity"
        "$@" --sizes "$INTENSITY_SIZES" --kernel intensity --k "$KS" --chunks "$CHUNKS" \
            --streams "$STREAMS" --reps "$INTENSITY_REPS" --json "$OUTDIR/$name.intensity.json" \
            2>&1 | tee "$OUTDIR/$name.intensity.log" || rc=$?
        [[ $rc -eq 0 ]] || FAILED+=("$name/intensity (exit $rc)")
        if [[ -f "$OUTDIR/$name.intensity.json" ]]; then
            parts+=("$OUTDIR/$name.intensity.json")
        fi
    fi

    if [[ ${#parts[@]} -gt 0 ]]; then
        "$PYTHON" - "$OUTDIR/$name.json" "${parts[@]}" <<'EOF'
import json, sys
out, *parts = sys.argv[1:]
docs = [json.load(open(p)) for p in parts]
merged = {"peer": docs[0]["peer"], "gpu": docs[0]["gpu"], "driver": docs[0]["driver"],
          "results": [r for d in docs for r in d["results"]]}
with open(out, "w") as f:
    json.dump(merged, f, indent=1)
    f.write("\n")
print("wrote", out)
EOF
    fi
}

SECONDS=0
run_peer cuda-cpp "$OUTDIR/cuda_pipeline"
run_peer pytorch "$PYTHON" "$HERE/torch_pipeline.py"

if [[ -n "${HOST_JSON:-}" ]]; then
    echo "== compare"
    inputs=("$HOST_JSON")
    for name in cuda-cpp pytorch; do
        if [[ -f "$OUTDIR/$name.json" ]]; then inputs+=("$OUTDIR/$name.json"); fi
    done
    rc=0
    "$PYTHON" "$HERE/compare.py" "${inputs[@]}" --out "$OUTDIR/comparison.json" || rc=$?
    [[ $rc -eq 0 ]] || FAILED+=("compare (exit $rc)")
fi

if [[ $SMALL -eq 1 ]]; then
    rc=0
    echo "== pytorch: small transfers"
    rm -f "$OUTDIR/pytorch-small.json"
    "$PYTHON" "$HERE/torch_small.py" --out "$OUTDIR/pytorch-small.json" 2>&1 |
        tee "$OUTDIR/pytorch-small.log" || rc=$?
    [[ $rc -eq 0 ]] || FAILED+=("pytorch/small (exit $rc)")
    if [[ -n "${HOST_SMALL_JSON:-}" && -f "$OUTDIR/pytorch-small.json" ]]; then
        echo "== compare small transfers"
        rc=0
        "$PYTHON" "$HERE/compare_small.py" "$HOST_SMALL_JSON" "$OUTDIR/pytorch-small.json" \
            --out "$OUTDIR/comparison-small.json" || rc=$?
        [[ $rc -eq 0 ]] || FAILED+=("compare small (exit $rc)")
    fi
fi

echo "== done in ${SECONDS}s; files in $OUTDIR"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${FAILED[@]}" >&2
    exit 1
fi
