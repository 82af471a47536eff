#!/usr/bin/env bash
# Probe: where in a Triton kernel's machine code compute-sanitizer (memcheck) places a fault. Runs COMMAND under
# memcheck with a fresh Triton cache, then prints, for each "KERNEL+0xPC" the sanitizer names, the SASS around that
# PC (nvdisasm, with line info) of every cached cubin of that kernel.
# Usage (on the GPU machine): benchmarks/probes/sass_at_fault.sh COMMAND ...
set -u
CUDA=${CUDA_HOME:-/usr/local/cuda}/bin
export TRITON_CACHE_DIR=$(mktemp -d)
"$CUDA/compute-sanitizer" --tool memcheck --print-limit 3 "$@" > /tmp/sanitizer.log 2>&1
grep -v "^=========         Host Frame" /tmp/sanitizer.log | grep "^=====" | head -40
grep -v "Host Frame" /tmp/sanitizer.log | grep -o "[A-Za-z_0-9]*+0x[0-9a-f]*" | grep -v "^0x" | sort -u | head -5 | while read -r at; do
  kernel=${at%+0x*}; pc=$(printf "%04x" $((16#${at#*+0x})))
  find "$TRITON_CACHE_DIR" -name "$kernel.cubin" | while read -r cubin; do
    echo "== $at in $cubin"
    "$CUDA/nvdisasm" -c -gi "$cubin" | grep -n "" | grep -B 30 -A 6 "/\*$pc\*/"
  done
done
