"""Registers, spills and warp shuffles of every sparse_linear candidate config, compiled for sm_90 (H100/H200)
without a GPU: Triton compiles ahead of time for a GPUTarget and its bundled cuobjdump reads the cubin.
A config that spills (STACK > 0) or needs more than ~128 registers at 4 warps is a poor candidate.
Usage: PYTHONPATH=src python3 scripts/sparse_resources.py [fp16|bf16|fp32]"""
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (no kernel runs here)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dropin.ops import sparse  # noqa: E402

KERNEL = sparse._sparse_linear_kernel
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(dtype: str, cfg: dict, block_m: int) -> str:
    split = cfg["SPLIT_K"] > 1
    constexprs = dict(stride_xk=1, HAS_BIAS=False, SPLIT=split, BLOCK_K=256, BLOCK_M=block_m,
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_P=cfg["BLOCK_P"])
    signature = dict(x_ptr=f"*{dtype}", val_ptr=f"*{dtype}", off_ptr="*u8", chunk_ptr="*i32", bias_ptr=f"*{dtype}",
                     y_ptr="*fp32" if split else f"*{dtype}", M="i32", N="i32", chunks="i32", chunks_per_split="i32",
                     stride_xm="i32", **{name: "constexpr" for name in constexprs})
    source = ASTSource(fn=KERNEL, signature=signature,
                       constexprs={(KERNEL.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return f"regs {regs:>3}  stack {stack:>3}  shfl (static) {compiled.asm['ptx'].count('shfl'):>3}"


if __name__ == "__main__":
    dtype = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}[sys.argv[1] if len(sys.argv) > 1 else "fp16"]
    for tokens, configs in sparse._CONFIGS.items():
        for cfg in (c for c in configs if "DENSE" not in c):
            for block_m in (1,) if tokens == "one" else (2, 16) if tokens == "few" else (16,):
                print(f"{tokens:<5} BLOCK_M {block_m:>2}  {cfg}: {resources(dtype, cfg, block_m)}", flush=True)
