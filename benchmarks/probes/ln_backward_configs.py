"""Probe: layer_norm's `_ln_bwd_kernel` launched directly over a sweep of its settings (BLOCK_M, num_warps, the
persistent grid's size G), CUDA-graph timed (do_bench_cudagraph, median us), at CvT-13's token shapes (bf16), dy
contiguous and dy a permuted NCHW map; the settings `_common.row_config` picks marked *. Usage: PYTHONPATH=src
python3 benchmarks/probes/ln_backward_configs.py"""
import importlib

import torch
import triton

from dropin import _runtime
from dropin.ops import _common

layer_norm = importlib.import_module("dropin.ops.layer_norm")  # (the package's name is the public function)

SHAPES = [(64, 3136, 64), (64, 784, 192), (64, 197, 384), (4, 1024, 4096)]


def main():
    sms = _runtime.num_sms()
    for b, hw, c in SHAPES:
        M, N = b * hw, c
        x = torch.randn(b, hw, c, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        mean = x.float().mean(-1).reshape(-1)
        rstd = x.float().var(-1, unbiased=False).add(1e-5).rsqrt().reshape(-1)
        dx = torch.empty_like(x)
        picked = _common.row_config(N)
        for permuted in (False, True):
            dy = (torch.randn(b, c, hw, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1) if permuted
                  else torch.randn(b, hw, c, device="cuda", dtype=torch.bfloat16))
            strides = (hw, *dy.stride())
            block_n = _runtime.next_power_of_2(N)
            results = []
            for block_m in (1, 2, 4, 8, 16, 32):
                if block_m * block_n > 16384 or block_m * block_n < 256:
                    continue
                for warps in (4, 8, 16):
                    if warps * 32 > block_m * block_n:
                        continue
                    for g_per_sm in (4, 0):
                        G = _runtime.cdiv(M, block_m) if g_per_sm == 0 else min(_runtime.cdiv(M, block_m),
                                                                                 g_per_sm * sms)
                        part = torch.empty((G, 2, N), device="cuda", dtype=torch.float32)

                        def run():
                            layer_norm._ln_bwd_kernel[(G,)](x, w, dy, dx, mean, rstd, part, M, N, hw,
                                                            *x.stride(), *strides, HAS_W=True, PARTIALS=True,
                                                            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
                        us = triton.testing.do_bench_cudagraph(run) * 1e3
                        mark = "*" if (block_m, warps, g_per_sm) == (picked["BLOCK_M"], picked["num_warps"], 4) \
                            else ""
                        results.append((us, f"{mark}BM{block_m} w{warps} G{g_per_sm or 'all'}"))
            results.sort()
            floor = 3 * x.numel() * 2 / 4.8e12 * 1e6
            chosen = [r for r in results if r[1].startswith("*")]
            print(f"[{b}, {hw}, {c}] dy {'permuted' if permuted else 'contiguous'} (floor {floor:.1f} us): "
                  + ", ".join(f"{name} {us:.1f}" for us, name in results[:6])
                  + (f" ... picked {chosen[0][1]} {chosen[0][0]:.1f}" if chosen else ""))


if __name__ == "__main__":
    main()
