#!/usr/bin/env bash
# Planted faults: each patch in .ci/mutations/ breaks the library or a kernel
# in one known way, and every check listed for it below must then fail. A
# check that still passes with its fault planted checks nothing: this script
# then fails. Each patch is applied with `git apply`, its checks are run (the
# CPU emulation, debug builds: the library, one test binary or two and the
# demonstration's binary), and the patch is reverted, also on failure or
# interruption.
#
# Python checks (`$pytest ...`) run the Python package's tests in
# python/.venv (made by python/run-tests.sh: run it once first) against the
# extension built with the fault planted: a debug wheel unpacked into
# target/ci-mutants/python, put first on PYTHONPATH (the venv's own install
# is left alone).
#
# Usage: .ci/mutants.sh [NAME...]   (default: every patch in .ci/mutations)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never HOST_BACKEND=cpu
out=target/ci-mutants
mkdir -p "$out"

# The checks each fault must fail, one command a line.
demo="cargo run -q -p host -- --backend cpu --out-dir $out"
venv=python/.venv
pytest="env PYTHONPATH=$out/python $venv/bin/python -m pytest -q -p no:cacheprovider python/tests"
checks() {
  case $1 in
  skip-one-d2h)
    echo "cargo test -q -p gpufeed --test pipeline_stages -- --exact saxpy_through_the_pipeline_matches_the_cpu_bit_for_bit::cpu"
    echo "$demo compare --sizes 100000 --reps 1"
    echo "$demo compare-sync-async --size 1000000"
    echo "$demo sweep --sizes 1000000"
    echo "$demo fewer-bytes --sizes 100000 --reps 1"
    ;;
  skip-chained-kernel)
    echo "cargo test -q -p gpufeed --test pipeline_stages -- --exact saxpy_through_the_pipeline_matches_the_cpu_bit_for_bit::cpu"
    echo "$demo compare --sizes 100000 --reps 1"
    ;;
  no-end-of-run-waits)
    echo "cargo test -q -p gpufeed --test pipeline_stages -- --exact a_run_ends_only_when_every_stream_has_finished_its_chunks::cpu"
    ;;
  scale-off-by-1e-4)
    echo "$demo kernels --n 100000"
    echo "$demo compare --sizes 100000 --reps 1"
    echo "cargo test -q -p gpufeed --test pipeline_stages -- --exact arrays_of_different_element_types_travel_together_and_type_errors_hand_them_back::cpu"
    ;;
  staging-skip-one-block)
    echo "cargo test -q -p gpufeed --test staging -- --exact every_byte_lands_both_ways_by_every_route_at_any_offset::cpu"
    ;;
  sliced-skip-last-window)
    echo "cargo test -q -p gpufeed --test staging -- --exact a_pipeline_over_ordinary_slices_computes_every_element::cpu"
    ;;
  loader-gather-wrong-row)
    echo "cargo test -q -p gpufeed --test loader -- --exact every_batch_holds_the_rows_of_its_indices::cpu"
    echo "cargo test -q -p gpufeed --test loader -- --exact a_resumed_epoch_yields_the_rest_and_a_dropped_one_is_safe::cpu"
    echo "$demo loader --small"
    ;;
  loader-device-gather-wrong-row)
    echo "cargo test -q -p gpufeed --test loader -- --exact every_batch_holds_the_rows_of_its_indices::cpu"
    echo "cargo test -q -p gpufeed --test loader -- --exact a_loader_gathers_on_the_device_only_when_every_field_is_pinned_in_place::cpu"
    echo "$demo loader --small"
    ;;
  staging-direct-blocking-no-length-check)
    echo "cargo test -q -p gpufeed --test staging -- --exact the_blocking_forms_refuse_mismatched_lengths_on_every_route::cpu"
    ;;
  loader-shard-batches-rounded-down)
    echo "cargo test -q -p gpufeed --test loader -- --exact each_rank_yields_as_many_batches_and_rows_as_its_shard_holds::cpu"
    ;;
  loader-segment-boundary-off-by-one)
    echo "cargo test -q -p gpufeed --test loader -- --exact a_source_of_separate_allocations_yields_the_first_row_of_each_segment::cpu"
    ;;
  loader-resumed-state-forgets-skipped)
    echo "$pytest/test_loader.py -k test_a_state_taken_after_resuming_and_at_an_epochs_end_counts_every_batch_and_reloads"
    ;;
  loader-end-of-epoch-state-refused)
    echo "$pytest/test_loader.py -k test_a_state_taken_after_resuming_and_at_an_epochs_end_counts_every_batch_and_reloads"
    ;;
  save-safetensors-metadata-keys-unchecked)
    echo "$pytest/test_files.py -k test_metadata_keys_that_are_not_strings_are_a_type_error_and_leave_no_file"
    ;;
  safetensors-cut-short-checks-the-length)
    echo "$pytest/test_files.py -k test_a_tensor_cut_short_at_a_nonzero_offset_is_an_os_error_for_load_and_loader"
    ;;
  weights-dma-joins-apart-pieces)
    echo "cargo test -q -p gpufeed --test weights -- --exact many_files_and_gathered_pieces_land_byte_for_byte::cpu"
    ;;
  weights-slice-wrong-rank-offset)
    echo "cargo test -q -p gpufeed --test weights -- --exact checkpoints_load_whole_and_sliced_for_2_and_4_ranks::cpu"
    echo "$pytest/test_weights.py -k test_each_rank_gets_its_slice_and_reads_its_share_of_the_bytes"
    ;;
  weights-into-unchecked)
    echo "$pytest/test_weights.py -k test_a_mismatched_into_writes_nothing_and_names_the_tensor"
    ;;
  weights-failed-save-keeps-temporary)
    echo "$pytest/test_weights.py -k test_a_disk_that_fills_returns_the_error_through_the_handle_and_leaves_no_file"
    ;;
  weights-index-before-shards)
    echo "$pytest/test_weights.py -k test_a_kill_during_a_save_leaves_the_previous_checkpoint_readable"
    ;;
  weights-snapshot-not-copied)
    echo "$pytest/test_weights.py -k test_tensors_changed_as_soon_as_save_async_returns_are_saved_as_they_were"
    ;;
  vec-is-pinned)
    # rustdoc checks compile_fail error codes only with RUSTC_BOOTSTRAP.
    echo "env RUSTC_BOOTSTRAP=1 cargo test -q -p gpufeed --doc guarantees"
    ;;
  *)
    return 1
    ;;
  esac
}

if [ $# -gt 0 ]; then
  names=("$@")
else
  names=()
  for p in .ci/mutations/*.patch; do
    names+=("$(basename "$p" .patch)")
  done
fi
[ "${#names[@]}" -gt 0 ] || { echo "mutants: no patches in .ci/mutations"; exit 1; }

# The extension, built from the tree as it is now into $out/python.
build_python() {
  [ -x "$venv/bin/python" ] || {
    echo "mutants: $venv is missing: run python/run-tests.sh once to make it"
    exit 1
  }
  rm -rf "$out/wheel" "$out/python"
  "$venv/bin/maturin" build --quiet --profile dev --auditwheel skip \
    --interpreter "$venv/bin/python" -m python/Cargo.toml --out "$out/wheel"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$out/python" "$out/wheel"/gpufeed-*.whl
}

applied=""
revert() {
  if [ -n "$applied" ]; then
    git apply -R "$applied" || echo "mutants: could not revert $applied: revert it by hand"
    applied=""
  fi
}
trap revert EXIT INT TERM

failed=0
for name in "${names[@]}"; do
  patch=.ci/mutations/$name.patch
  list=$(checks "$name") || { echo "mutants: $name: no checks listed in $0"; exit 1; }
  start=$SECONDS
  echo "== mutant $name"
  git apply --check "$patch" || { echo "mutants: $patch does not apply: update it"; exit 1; }
  git apply "$patch"
  applied=$patch
  # Build first, so that a fault that breaks the build is not taken for a
  # caught one.
  cargo build -q -p host --bin host
  if grep -qF "$pytest" <<< "$list"; then
    build_python
  fi
  while IFS= read -r check; do
    log="$out/$name.$(printf '%s' "$check" | tr -c 'A-Za-z0-9_-' '_' | cut -c1-80).log"
    rc=0
    timeout 300 bash -c "$check" > "$log" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
      echo "   NOT CAUGHT: $check (passed with the fault planted; log $log)"
      failed=1
    elif [ "$rc" = 124 ]; then
      echo "   TIMED OUT: $check (log $log)"
      failed=1
    elif grep -q "^error: could not compile" "$log"; then
      echo "   BUILD FAILED: $check (log $log)"
      failed=1
    elif grep -q "^running 0 tests" "$log" && ! grep -qE "^running [1-9]" "$log"; then
      echo "   RAN NO TEST: $check (log $log)"
      failed=1
    elif [ "$rc" = 5 ] && grep -qE "no tests ran|deselected" "$log"; then
      # pytest's exit status when -k selected nothing.
      echo "   RAN NO TEST: $check (log $log)"
      failed=1
    elif grep -qE "^(ImportError|ModuleNotFoundError|E +(ImportError|ModuleNotFoundError))" "$log"; then
      echo "   DID NOT IMPORT: $check (log $log)"
      failed=1
    else
      echo "   caught: $check (exit $rc)"
    fi
  done <<< "$list"
  revert
  echo "   ($name: $((SECONDS - start)) s)"
done
[ "$failed" = 0 ] || { echo "mutants: a planted fault went unnoticed"; exit 1; }
echo "mutants: every planted fault caught (${names[*]})"
