#!/usr/bin/env bash
# The library as its users get it, on a machine without a GPU:
# 1. `cargo package --workspace`: every publishable crate packaged and built
#    against the others' packages, as a registry would (the crates marked
#    `publish = false` excluded); gpufeed's PTX is built from the packaged
#    kernel crate.
# 2. A crate outside the repository (.ci/outside) depending on gpufeed with
#    its default features, once through a git dependency on this commit and
#    once on the packaged crates: `cargo tree -e normal` lists none of the
#    demonstration's dependencies, and the program runs a checked job.
# 3. The README's own-kernels project (a kernel crate with a block reduction,
#    an app launching it, built with kernel-builder), made from the README's
#    blocks as written and run on the CPU emulation.
# 4. The Python package installed into fresh venvs by `pip install ./python`
#    and from the sdist `maturin sdist` makes, each importing and running a
#    to_device/to_host round trip on the CPU emulation.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$root/target/ci-package
rm -rf "$work"
mkdir -p "$work"
export HOST_BACKEND=cpu

excludes=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(" ".join("--exclude " + p["name"] for p in m["packages"] if p["publish"] == []))')
echo "package: cargo package --workspace $excludes"
# shellcheck disable=SC2086
cargo package --workspace $excludes --allow-dirty --quiet

demo_deps="tokio clap plotters rayon indicatif csv serde_json humansize half serde fastrand"
check_tree() { # <manifest dir> <what>
  local tree bad=""
  tree=$(cd "$1" && cargo tree -e normal --prefix none --format '{p}' | awk '{print $1}' | sort -u)
  for d in $demo_deps; do
    if grep -qx "$d" <<<"$tree"; then bad+=" $d"; fi
  done
  if [ -n "$bad" ]; then echo "package: $2 pulls in demonstration dependencies:$bad"; exit 1; fi
  grep -qx gpufeed <<<"$tree" || { echo "package: $2 has no gpufeed in its tree"; exit 1; }
  echo "package: $2: $(wc -l <<<"$tree") crates, none of: $demo_deps"
}
outside() { # <name> <dependency lines> [patch section]
  local dir=$work/$1
  mkdir -p "$dir/src"
  cp .ci/outside/src/main.rs "$dir/src/"
  cp rust-toolchain.toml "$dir/"
  printf '[package]\nname = "outside"\nversion = "0.1.0"\nedition = "2021"\npublish = false\n\n[dependencies]\n%s\n\n[workspace]\n%s\n' "$2" "${3:-}" > "$dir/Cargo.toml"
  check_tree "$dir" "a crate outside the repository ($1)"
  (cd "$dir" && CARGO_TARGET_DIR=$work/target cargo run -q)
}
# A git dependency on this commit (a clone of HEAD: what is committed).
outside git "gpufeed = { git = \"file://$root\", rev = \"$(git rev-parse HEAD)\" }"
# The packaged crates, unpacked as a registry would hand them over: outside
# this repository (a nested cargo build inside it would take its workspace).
pkg=$(mktemp -d)/crates
trap 'rm -rf "$(dirname "$pkg")"' EXIT
mkdir -p "$pkg"
for c in target/package/*.crate; do tar -xzf "$c" -C "$pkg"; done
v=0.1.0
outside packaged "gpufeed = \"$v\"" "[patch.crates-io]
gpufeed = { path = \"$pkg/gpufeed-$v\" }
gpufeed-kernels = { path = \"$pkg/gpufeed-kernels-$v\" }
gpufeed-kernel-abi = { path = \"$pkg/gpufeed-kernel-abi-$v\" }
gpufeed-kernel-builder = { path = \"$pkg/gpufeed-kernel-builder-$v\" }"

# The README's own-kernels project, from its blocks in order: the workspace
# manifest, my-kernels' manifest and source, my-app's manifest, build.rs and
# main.rs.
proj=$(dirname "$pkg")/my-project
python3 - "$root/README.md" "$proj" "$root" <<'PY'
import os, re, sys
readme, proj, root = sys.argv[1:]
text = open(readme).read()
section = text[text.index("## Your own kernels"):]
section = section[:section.index("\n## ", 3)]
blocks = re.findall(r"```(toml|rust)\n(.*?)```", section, re.S)
names = ["Cargo.toml", "my-kernels/Cargo.toml", "my-kernels/src/lib.rs",
         "my-app/Cargo.toml", "my-app/build.rs", "my-app/src/main.rs"]
if len(blocks) != len(names):
    sys.exit(f"readme kernels: {len(blocks)} code blocks in 'Your own kernels', expected {len(names)}")
for name, (_, body) in zip(names, blocks):
    path = os.path.join(proj, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").write(body.replace("ROOT", root))
PY
cp rust-toolchain.toml "$proj/"
echo "package: the README's own-kernels project (my-kernels, my-app), on the CPU emulation"
(cd "$proj" && CARGO_TARGET_DIR=$work/target cargo run -q -p my-app)

# Python: one command from the checkout, and the sdist.
roundtrip='import numpy as np, gpufeed
a = np.random.default_rng(7).standard_normal(100_003).astype(np.float32)
out = np.full_like(a, np.nan)
gpufeed.to_host(gpufeed.to_device(a), out=out)
assert np.array_equal(a, out), "round trip differs"
print("package: gpufeed", gpufeed.__version__, "installed; to_device/to_host round trip of", a.size, "floats checked")'
# A debug build into the shared target dir: what the tests built is reused.
export MATURIN_PEP517_ARGS="--profile dev" CARGO_TARGET_DIR=$root/target
for how in checkout sdist; do
  python3 -m venv "$work/venv-$how"
  if [ $how = checkout ]; then
    src=./python
  else
    "$work/venv-$how/bin/pip" install --quiet --disable-pip-version-check "maturin==1.16.0"
    "$work/venv-$how/bin/maturin" sdist --manifest-path python/Cargo.toml --out "$work/sdist" > /dev/null
    src=$(ls "$work"/sdist/gpufeed-*.tar.gz)
  fi
  echo "package: pip install $src (fresh venv)"
  "$work/venv-$how/bin/pip" install --quiet --disable-pip-version-check "$src"
  (cd "$work" && "$work/venv-$how/bin/python" -c "$roundtrip")
done
echo "package: all checks passed"
