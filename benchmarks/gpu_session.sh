#!/usr/bin/env bash
# One device call of a session: a list of steps, each logged; everything tarred into $OUT/all.tgz as it goes
# (a timeout loses nothing already done). Usage: benchmarks/gpu_session.sh 'STEP' ['STEP' ...]
# where a STEP is a shell command run from the repository root with PYTHONPATH=src. COPY_TO=DIR (the device's
# $OUT, with OUT a folder of its own): all.tgz and summary.txt copied there after each step, so that a call cut by
# its time limit still returns the steps done.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=src:scratch/pylib PYTHONUNBUFFERED=1 DROPIN_CACHE_DIR=$OUT/tune
mkdir -p "$DROPIN_CACHE_DIR"  # empty: the shipped choices (src/dropin/ops/tuned) hold (a .tune/ left on the
# device is not read: it may be stale)
i=0
for step in "$@"; do
  i=$((i + 1)); t0=$(date +%s)
  echo "=== step $i: $step" | tee -a "$OUT/summary.txt"
  bash -c "$step" > "$OUT/step$i.log" 2>&1; rc=$?
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|Traceback|Error:" "$OUT/step$i.log" | tail -20 >> "$OUT/summary.txt"
  echo "rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  slug=$(python3 -c "import dropin._runtime as r; print(r.gpu_slug())" 2>/dev/null)
  mkdir -p "$OUT/results"; cp benchmarks/results/"$slug"/*.json benchmarks/results/"$slug"/*.png "$OUT/results/" 2>/dev/null
  archive=$(mktemp) && tar czf "$archive" -C "$OUT" --exclude all.tgz . && mv "$archive" "$OUT/all.tgz"
  if [ -n "${COPY_TO:-}" ]; then cp "$OUT/all.tgz" "$OUT/summary.txt" "$COPY_TO/"; fi
done
