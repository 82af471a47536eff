"""Probe (GPU): the longest FMA chain of true fp32's "ieee" dots (`_gemm.FMA_CHAIN`, the BLOCK_K cap of products
with K under `_gemm.TF32X3_MIN_K` or fewer than TF32X3_MIN_MACS multiply-adds): accuracy against torch's on the
fuzz suite's SPREAD cases, and speed on products that take the FMAs.

For a chain CHAIN (argv[1]; 64 is the shipped `_gemm.FMA_CHAIN`, 16 the shorter one measured) it sets `_gemm.FMA_CHAIN` before any plan is
made and prints, for each fp32 SPREAD case of `fuzz_repro.py` (or the cases named), dropin's error over torch's on
its forward (or the check named in the case's note) over 24 seeds: median and max. A median over 2 is a kernel
less accurate than cuBLAS; at or under it, the order of a sum's terms (the 2x rule's noise).
With --speed instead: the median time (do_bench, tuned) of fp32 products that take the FMAs, TF32 off, against
torch's, each in a fresh plan cache.
Usage: for k in 64 16; do PYTHONPATH=src python benchmarks/probes/ieee_block_k.py $k [--speed | case ...]; done
"""
import os
import pathlib
import sys

SPEED = "--speed" in sys.argv
if SPEED:
    os.environ["DROPIN_AUTOTUNE"] = "1"  # (before fuzz_repro's default of no tuning)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import fuzz_repro  # noqa: E402  (sets the tests' paths and the fuzz tests' settings)
from dropin.ops import _gemm  # noqa: E402
from dropin.ops.swiglu import swiglu_mlp_ref  # noqa: E402

torch = fuzz_repro.torch
CHAIN = int(sys.argv[1])
# (M, K, N) products under TF32X3_MIN_K, and one of few multiply-adds over it
PRODUCTS = [(65536, 128, 128), (16384, 64, 256), (4096, 200, 4096), (8192, 255, 1024), (64, 441, 64)]
# (tokens, model dim, hidden) one-layer SwiGLU MLPs in fp32 with a short reduction, and one token (swiglu's one-row
# tiles; 1024 wide: FMAs by its few multiply-adds)
MLPS = [(8192, 128, 344), (4096, 192, 512), (1, 192, 512), (1, 1024, 2816)]


def speed():
    import triton
    import dropin
    for M, K, N in PRODUCTS:
        a, b = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
        ours = triton.testing.do_bench(lambda: dropin.ops.matmul(a, b))
        theirs = triton.testing.do_bench(lambda: a @ b)
        print(f"chain {CHAIN}: matmul {M}x{K} @ {K}x{N}: dropin {ours:.4f} ms, torch {theirs:.4f} ms "
              f"({theirs / ours:.2f}x)", flush=True)
    for tokens, dim, hidden in MLPS:
        x = torch.randn(tokens, dim, device="cuda")
        w = [torch.randn(hidden, dim, device="cuda") / dim ** 0.5, torch.randn(hidden, dim, device="cuda") / dim ** 0.5,
             torch.randn(dim, hidden, device="cuda") / hidden ** 0.5]
        ours = triton.testing.do_bench(lambda: dropin.ops.swiglu_mlp(x, *w))
        theirs = triton.testing.do_bench(lambda: swiglu_mlp_ref(x, *w))
        print(f"chain {CHAIN}: swiglu_mlp {tokens} x {dim}, hidden {hidden}: dropin {ours:.4f} ms, torch {theirs:.4f} "
              f"ms ({theirs / ours:.2f}x)", flush=True)


def accuracy(selected):
    for i, (module, test, dtype, case, seed, note) in enumerate(fuzz_repro.CASES):
        if (selected and str(i) not in selected) or (not selected and not note.startswith("SPREAD")):
            continue
        if dtype != torch.float32:
            continue
        print(f"chain {CHAIN}: {i:2d} {test}: {fuzz_repro.spread(module, test, dtype, case, seed, 'forward')}",
              flush=True)


if __name__ == "__main__":
    _gemm.FMA_CHAIN = CHAIN
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if SPEED:
        speed()
    else:
        accuracy([a for a in sys.argv[2:] if a != "--cpu"])
