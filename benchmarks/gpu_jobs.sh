#!/usr/bin/env bash
# gpu_session.sh jobs side by side on a machine with several GPUs: each group of steps (groups separated by `--`)
# runs on a GPU of its own (the first group on GPU 0, ...), pinned to an equal share of the cores (taskset, where
# present) with at most 16 test workers. Each job's all.tgz and summary.txt come back under $OUT/a, $OUT/b, ...
# ($OUT: the device call's folder), copied after each step, so that a call cut by its time limit still returns what
# every job did. Usage: benchmarks/gpu_jobs.sh 'STEP' ... [-- 'STEP' ...]...
set -u
out_dev=${OUT:?OUT must name the folder whose files come back}
groups=(""); for arg in "$@"; do
  if [ "$arg" = "--" ]; then groups+=(""); else groups[-1]+="$(printf '%q ' "$arg")"; fi
done
count=${#groups[@]}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$count" -le "${gpus:-0}" ] || { echo "gpu_jobs.sh: $count groups of steps, $gpus GPU(s)" >&2; exit 2; }
share=$(( $(nproc) / count )); [ "$share" -ge 1 ] || share=1
workers=$share; [ "$workers" -gt 16 ] && workers=16
letters=(a b c d e f g h)
job() {  # job GPU STEP...
  local gpu=$1 letter=${letters[$1]}; shift
  [ $# -gt 0 ] || return 0
  mkdir -p "$out_dev/$letter"
  # a warm machine keeps the previous call's folder: its files go, its tuning cache (tune/) stays
  find "/tmp/gpu_job_$letter" -mindepth 1 -maxdepth 1 ! -name tune -exec rm -rf {} + 2>/dev/null
  local pin=()
  [ $(( (gpu + 1) * share )) -le "$(nproc)" ] && command -v taskset > /dev/null &&
    pin=(taskset -c "$(( gpu * share ))-$(( (gpu + 1) * share - 1 ))")
  CUDA_VISIBLE_DEVICES=$gpu GPU_WORKERS=$workers COPY_TO=$out_dev/$letter OUT=/tmp/gpu_job_$letter \
    "${pin[@]}" "$(dirname "$0")/gpu_session.sh" "$@"
}
for gpu in "${!groups[@]}"; do
  eval "job $gpu ${groups[$gpu]}" &
done
wait
for gpu in "${!groups[@]}"; do cat "$out_dev/${letters[$gpu]}/summary.txt" 2>/dev/null; done
