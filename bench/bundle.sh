#!/usr/bin/env bash
# Builds what a GPU round needs into .gpu/ (git-ignored): ../shared/tools/gpu-bundle
# (release binaries, examples, test executables), minus the test executables that
# have no GPU half (they run in CI on the CPU emulation), plus the gpufeed wheel
# (.gpu/wheels) and the commit (.gpu/COMMIT). The tree and .gpu together must stay
# under the 64 MiB a call carries. Then: run `bash bench/gpu-round.sh ...` there
# with carry [".gpu"].
set -euo pipefail
cd "$(dirname "$0")/.."
../shared/tools/gpu-bundle "$@"
# No GPU half: the build helper, the kernel ABI, the kernel bodies on the host,
# the host-side bf16 conversion, the Python crate's unit tests, the demonstration's
# unit tests, the CPU emulation's lock limit, and the README check (it reads the
# tree's files by the path they had at build time).
for t in kernel_builder kernel_abi gpu_kernels bf16_kernels bodies conversion gpufeed_python host lock_limit readme emulation tensor block_demo; do
  rm -f .gpu/tests/"$t"-*
done
bash python/build-wheel.sh "$PWD/.gpu/wheels" > /dev/null
# PACK=1: the test executables travel as one xz archive (17 MiB in all instead of 56; the final
# round unpacks it), and the examples stay behind. EXTRA_WHEELS: a folder of other wheels the
# round installs (e.g. safetensors, fetched here with `pip download --only-binary=:all:`).
if [ "${PACK:-0}" = 1 ]; then
  rm -rf .gpu/examples
  tar -C .gpu -cJf .gpu/tests.tar.xz tests && rm -rf .gpu/tests
fi
if [ -n "${EXTRA_WHEELS:-}" ]; then
  mkdir -p .gpu/wheels/extra && cp "$EXTRA_WHEELS"/*.whl .gpu/wheels/extra/
fi
git rev-parse HEAD > .gpu/COMMIT
git diff --quiet HEAD || echo "bundle: the tree has uncommitted changes (COMMIT names HEAD)" >&2
du -sh .gpu
