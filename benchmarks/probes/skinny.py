"""Probe: skinny products (decode: M = 1..16 rows, N x K weights) on the GPU, in CUDA graphs with the L2 flushed
before each call (a model streams its weights from memory): cuBLAS's F.linear, dropin.linear's tuned pick, and a
sweep of configs of a swapped tile kernel (W's rows as the tile's rows, the few input rows as its columns, optional
split-K: skinny_kernel's design, and a variant whose tiles come by TMA).
Usage: PYTHONPATH=src python3 benchmarks/probes/skinny.py [M,...]"""
import importlib
import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import dropin

mm = importlib.import_module("dropin.ops.matmul")


@triton.jit
def swapped_kernel(x_ptr, w_ptr, c_ptr, M, N, K, K_PER, sxm, sxk, swk, swn, split_stride,
                   USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k0 = pid_k * K_PER
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * swn + offs_k[None, :] * swk
    x_ptrs = x_ptr + offs_m[None, :] * sxm + offs_k[:, None] * sxk
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    k_end = tl.minimum(K, k0 + K_PER)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = offs_k < k_end - (k - k0)
        w = tl.load(w_ptrs, mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & (offs_m[None, :] < M), other=0.0)
        if USE_DOT:
            acc = tl.dot(w, x, acc)
        else:
            wf = w.to(tl.float32)
            xf = x.to(tl.float32)
            acc += tl.sum(wf[:, :, None] * xf[None, :, :], axis=1)
        w_ptrs += BLOCK_K * swk
        x_ptrs += BLOCK_K * sxk
    c_ptrs = c_ptr + pid_k * split_stride + offs_m[None, :] * N + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))


@triton.jit
def swapped_tma_kernel(x_ptr, w_ptr, c_ptr, M, N, K, K_PER, sxm, swn, split_stride,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """swapped_kernel's product with W's and x's tiles fetched by TMA (device-built descriptors)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [swn, 1], [BLOCK_N, BLOCK_K])
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [sxm, 1], [BLOCK_M, BLOCK_K])
    n0 = pid_n * BLOCK_N
    k0 = pid_k * K_PER
    k_end = tl.minimum(K, k0 + K_PER)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k in tl.range(k0, k_end, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([0, k])
        acc = tl.dot(w, tl.trans(x), acc)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    c_ptrs = c_ptr + pid_k * split_stride + offs_m[None, :] * N + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))


def swapped(x, w, c, cfg):
    """c [M, N] = x [M, K] @ w.T for w [N, K]; cfg: BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, USE_DOT."""
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M)) if cfg["USE_DOT"] else triton.next_power_of_2(M)
    split = cfg["SPLIT_K"]
    k_per = triton.cdiv(triton.cdiv(K, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split)
    meta = dict(USE_DOT=cfg["USE_DOT"], BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("TMA"):
        kernel = swapped_tma_kernel
        meta = dict(BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["num_stages"],
                    num_warps=cfg["num_warps"])
        args = lambda out, stride: (x, w, out, M, N, K, k_per, x.stride(0), w.stride(0), stride)  # noqa: E731
    else:
        kernel = swapped_kernel
        args = lambda out, stride: (x, w, out, M, N, K, k_per, *x.stride(), w.stride(1), w.stride(0),  # noqa: E731
                                    stride)
    if split == 1:
        return lambda: kernel[grid](*args(c, 0), **meta)
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    sum_meta = dict(SPLITS=split, HAS_BIAS=False, ACT="none", STORE_Z=False, BLOCK_R=32, BLOCK_N=64)
    sum_grid = (triton.cdiv(M, 32), triton.cdiv(N, 64))

    def run():
        kernel[grid](*args(part, M * N), **meta)
        mm.split_sum_kernel[sum_grid](part, c, c, c, M, N, **sum_meta)
    return run


_FLUSH = []  # (the L2-flushing buffer, its zeroing's us in a graph): a decoding step reads its weights from memory


def graph_us(fn):
    """GPU time of fn in a CUDA graph, L2 flushed before each call (the flush's own time taken off)."""
    if not _FLUSH:
        buffer = triton.runtime.driver.active.get_empty_cache_for_benchmark()
        _FLUSH.extend((buffer, do_bench_cudagraph(buffer.zero_, rep=50) * 1e3))
    buffer, flush_us = _FLUSH
    return do_bench_cudagraph(lambda: (buffer.zero_(), fn()), rep=50) * 1e3 - flush_us


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


def probe(M, N, K, sweep: bool):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = x.double() @ w.double().T
    t_cublas = graph_us(lambda: F.linear(x, w))
    dropin.linear(x, w)
    t_dropin = graph_us(lambda: dropin.linear(x, w))
    print(f"M={M} N={N} K={K}: cuBLAS {t_cublas:.1f} us ({M * N * K * 2 / t_cublas / 1e6:.2f} TB/s of W), "
          f"dropin.linear {t_dropin:.1f} us, err {rel(dropin.linear(x, w), ref):.1e}", flush=True)
    if not sweep:
        return
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    results = []
    grid = [(tma, True, *c) for tma in (False, True)
            for c in itertools.product([64, 128], [128, 256], [4], [3, 5], [1, 2, 4])]
    for tma, use_dot, bn, bk, warps, stages, split in grid:
        cfg = dict(TMA=tma, USE_DOT=use_dot, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split)
        try:
            run = swapped(x, w, c, cfg)
            c.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = rel(c, ref)
            t = graph_us(run)
        except Exception as e:  # a probe: report and go on
            print("   FAIL", cfg, type(e).__name__, str(e)[:120], flush=True)
            continue
        results.append((t, err, cfg))
    results.sort(key=lambda r: r[0])
    for t, err, cfg in results[:12]:
        print(f"   swapped {t:6.1f} us x{t_cublas / t:.2f} err {err:.1e} {cfg}", flush=True)


if __name__ == "__main__":
    ms = [int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8]
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    for M in ms:
        for N, K in [(4096, 4096), (4096, 11008)]:
            probe(M, N, K, sweep=True)
    for M in ms:
        for N, K in [(12288, 4096), (11008, 4096), (32000, 4096)]:
            probe(M, N, K, sweep=False)
