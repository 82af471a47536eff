"""Probe (GPU): does a shorter fp32 FMA chain bring dropin's true-fp32 products ("ieee" precision: K below
`_gemm.TF32X3_MIN_K`) within 2x torch's error on the fuzz suite's SPREAD cases? Those cases are sums of few
terms, often of one repeated value (an expanded x or weight), where cuBLAS's sum is near exact and dropin's
chain of up to 64 FMAs (`_gemm.max_k`'s cap for "ieee", the inner level of `dot_acc`'s two-level sum) is not.

For a cap of BLOCK_K (argv[1]; 64 is the shipped rule) it patches `_gemm.max_k` before any plan is made and
prints, for each SPREAD case of `fuzz_repro.py` (and the cases named after the cap), dropin's error over torch's on
its forward (or the check named in the case's note) over 24 seeds: median and max. A median over 2 is a kernel
less accurate than cuBLAS; at or under it, the order of a sum's terms (the 2x rule's noise).
Usage: for k in 64 32 16; do PYTHONPATH=src python benchmarks/probes/ieee_block_k.py $k [case ...]; done
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import fuzz_repro  # noqa: E402  (sets the tests' paths and the fuzz tests' settings)
from dropin.ops import _gemm  # noqa: E402

CAP = int(sys.argv[1])
_shipped = _gemm.max_k


def capped(precision: str, size: int, tf32x3_k: int = 32) -> int:
    k = _shipped(precision, size, tf32x3_k)
    return min(k, CAP) if precision == "ieee" and size == 4 else k


def main(selected):
    _gemm.max_k = capped
    fuzz_repro.torch.backends.cuda.matmul.allow_tf32 = fuzz_repro.torch.backends.cudnn.allow_tf32 = False
    for i, (module, test, dtype, case, seed, note) in enumerate(fuzz_repro.CASES):
        if (selected and str(i) not in selected) or (not selected and not note.startswith("SPREAD")):
            continue
        if dtype != fuzz_repro.torch.float32:
            continue
        print(f"cap {CAP}: {i:2d} {test}: {fuzz_repro.spread(module, test, dtype, case, seed, 'forward')}", flush=True)


if __name__ == "__main__":
    main([a for a in sys.argv[2:] if a != "--cpu"])
