#!/usr/bin/env bash
# Two gpu_session.sh jobs side by side on a machine with two GPUs: the steps before `--` on GPU 0, those after it
# on GPU 1, each job with half the cores (at most 16 test workers). Each job's all.tgz and summary.txt come back
# under $OUT/a and $OUT/b ($OUT: the device call's folder), copied after each step, so that a call cut by its time
# limit still returns what both jobs did. Usage: benchmarks/gpu_pair.sh 'STEP' ... -- 'STEP' ...
set -u
out_dev=${OUT:?OUT must name the folder whose files come back}
gpu0=(); gpu1=(); second=0
for arg in "$@"; do
  if [ "$arg" = "--" ]; then second=1; elif [ $second = 0 ]; then gpu0+=("$arg"); else gpu1+=("$arg"); fi
done
workers=$(( $(nproc) / 2 )); [ "$workers" -gt 16 ] && workers=16
job() {  # job GPU LETTER STEP...
  local gpu=$1 letter=$2; shift 2
  [ $# -gt 0 ] || return 0
  mkdir -p "$out_dev/$letter"
  # a warm machine keeps the previous call's folder: its files go, its tuning cache (tune/) stays
  find "/tmp/gpu_pair_$letter" -mindepth 1 -maxdepth 1 ! -name tune -exec rm -rf {} + 2>/dev/null
  CUDA_VISIBLE_DEVICES=$gpu GPU_WORKERS=$workers COPY_TO=$out_dev/$letter OUT=/tmp/gpu_pair_$letter \
    "$(dirname "$0")/gpu_session.sh" "$@"
}
job 0 a "${gpu0[@]}" &
job 1 b "${gpu1[@]}" &
wait
cat "$out_dev"/a/summary.txt "$out_dev"/b/summary.txt 2>/dev/null
