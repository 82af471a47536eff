#!/usr/bin/env bash
# The one GPU job: on a CUDA machine whose python3 already has torch and triton (no install), run the whole
# test suite (GPU cases included) and then the benchmark suites given as arguments (default: matmul bmm).
# Logs, result files and plots land under $OUT (default ./out); the results also under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
suites=${*:-matmul bmm}
status=0
python3 -m pytest -q --durations=15 tests 2>&1 | tee "$OUT/pytest.log" || status=1
for suite in $suites; do
  python3 -m dropin.cli bench "$suite" --plot 2>&1 | tee "$OUT/bench-$suite.log" || status=1
done
slug=$(python3 -c "import dropin._runtime as r; print(r.gpu_slug())")
cp benchmarks/results/"$slug"/*.json benchmarks/results/"$slug"/*.png "$OUT"/ 2>/dev/null
exit $status
