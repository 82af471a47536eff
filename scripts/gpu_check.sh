#!/usr/bin/env bash
# The one GPU job: on a CUDA machine whose python3 already has torch and triton (no install), run the whole
# test suite (GPU cases included) and then the benchmark suites given as arguments (default: matmul bmm).
#   scripts/gpu_check.sh [--no-tests] [SUITE ...]      (SUITE "none": tests only)
# Logs, result files and plots land under $OUT (default ./out), and all of them in $OUT/all.tgz; the
# results also under benchmarks/results/; $OUT/summary.txt has the test verdicts.
# A cold machine compiles every kernel config the tests touch: allow several minutes for the tests alone.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
run_tests=1
if [ "${1:-}" = "--no-tests" ]; then run_tests=0; shift; fi
suites=${*:-matmul bmm}
status=0
if [ $run_tests = 1 ]; then
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 14 -p no:benchmark")  # pytest-xdist when present
  python3 -m pytest -q --durations=15 -p no:warnings $workers tests 2>&1 | tee "$OUT/pytest.log" || status=1
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/pytest.log" > "$OUT/summary.txt"
fi
for suite in $suites; do
  [ "$suite" = none ] && continue
  python3 -m dropin.cli bench "$suite" --plot 2>&1 | tee "$OUT/bench-$suite.log" || status=1
done
slug=$(python3 -c "import dropin._runtime as r; print(r.gpu_slug())")
cp benchmarks/results/"$slug"/*.json benchmarks/results/"$slug"/*.png "$OUT"/ 2>/dev/null
# the device tool brings back only a few files: everything also in one archive
archive=$(mktemp) && tar czf "$archive" -C "$OUT" --exclude all.tgz . && mv "$archive" "$OUT/all.tgz"
exit $status
