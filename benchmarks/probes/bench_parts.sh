# usage: bash benchmarks/probes/bench_parts.sh SUITE BUDGET_S CLASS...: runs each class with --update into benchmarks/results
# while the budget allows (a class not started past 80% of it), then copies the GPU's results to $OUT
suite=$1; budget=$2; shift 2
for c in "$@"; do
  if [ $SECONDS -gt $((budget * 8 / 10)) ]; then echo "SKIPPED $c (at ${SECONDS}s)"; continue; fi
  start=$SECONDS
  timeout -s INT $((budget - SECONDS)) python -m dropin.cli bench $suite --class $c --update --plot 2>&1 | grep -E "^\[(PASSED|FAILED)|geomean|wrote" 
  echo "CLASS $c took $((SECONDS - start))s"
done
mkdir -p $OUT && slug=$(python -c "from dropin import _runtime; print(_runtime.gpu_slug())"); cp -r benchmarks/results/$slug $OUT/
