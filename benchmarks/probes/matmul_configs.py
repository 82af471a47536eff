"""Per-config timing of the matmul kernels on the GPU (a tuning aid, not the benchmark): for each shape and
operand layout, every candidate config of both kernels against torch, with its error vs float64.
Usage: PYTHONPATH=src ONLY=long-k,few-rows python3 benchmarks/probes/matmul_configs.py (ONLY: substrings of the
case names; default: every case)"""
import importlib
import os
import time

import torch
from triton.testing import do_bench

import dropin

mm = importlib.import_module("dropin.ops.matmul")
_gemm = importlib.import_module("dropin.ops._gemm")


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


def candidates(aa, bb, c, z):
    """The configs `_make_plan` would tune over for these operands."""
    seen = []
    real = mm._autotune.pick
    mm._autotune.pick = lambda name, key, configs, run, **timing: seen.extend(configs) or configs[0]
    try:
        mm._make_plan(aa, bb, c, None, z, "none", False, None, _gemm.precision(aa.dtype), False, False)
    finally:
        mm._autotune.pick = real
    return seen


def plan_for(aa, bb, c, z, cfg):
    real = mm._autotune.pick
    mm._autotune.pick = lambda name, key, configs, run, **timing: cfg
    try:
        return mm._make_plan(aa, bb, c, None, z, "none", False, None, _gemm.precision(aa.dtype), False, False)
    finally:
        mm._autotune.pick = real


def probe(name, B, M, N, K, dt, tf32=False, layouts=("nn",)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(B, M, K, device="cuda", dtype=dt)
    b = torch.randn(B, K, N, device="cuda", dtype=dt)
    ref = torch.bmm(a.double(), b.double()) if B * M * N * K < 2**37 else None
    flops = 2 * B * M * N * K
    t_torch = do_bench(lambda: torch.bmm(a, b), return_mode="median")
    lines = [f"{name:28s} torch {t_torch * 1e3:8.1f}us {flops / t_torch / 1e9:6.1f}TF"]
    c = torch.empty((B, M, N), device="cuda", dtype=dt)
    z = c.new_empty(0)
    for lay in layouts:
        aa = a.mT.contiguous().mT if lay[0] == "t" else a
        bb = b.mT.contiguous().mT if lay[1] == "t" else b
        best = {}
        for cfg in candidates(aa, bb, c, z):
            try:
                plan = plan_for(aa, bb, c, z, cfg)
                c.fill_(float("nan"))
                plan(aa, bb, c, c, z)
                torch.cuda.synchronize()
                err = rel(c, ref) if ref is not None else float("nan")
                t = do_bench(lambda: plan(aa, bb, c, c, z), return_mode="median")
            except Exception as e:  # report and go on: this is a probe
                print("   FAIL", name, lay, cfg, type(e).__name__, str(e)[:300], flush=True)
                continue
            print(f"   {lay} {t * 1e3:8.1f}us x{t_torch / t:.2f} err {err:.1e} {cfg}", flush=True)
            k = cfg["KERNEL"]
            if k not in best or t < best[k][0]:
                best[k] = (t, cfg, err)
        for k, (t, cfg, err) in best.items():
            lines.append(f"  {lay} {k} {t * 1e3:8.1f}us x{t_torch / t:.2f} err {err:.1e} {cfg}")
    print("\n".join(lines), flush=True)


CASES = [
    ("bf16 4096^3", 1, 4096, 4096, 4096, torch.bfloat16, False, ("nn", "nt", "tn")),
    ("bf16 8192^3", 1, 8192, 8192, 8192, torch.bfloat16, False, ("nt",)),
    ("bf16 4096x11008x4096", 1, 4096, 11008, 4096, torch.bfloat16, False, ("nn", "nt")),
    ("bf16 8192x1024x8192", 1, 8192, 1024, 8192, torch.bfloat16, False, ("nn",)),
    ("bf16 16x4096x4096", 1, 16, 4096, 4096, torch.bfloat16, False, ("nn", "nt")),
    ("fp16 4096^3", 1, 4096, 4096, 4096, torch.float16, False, ("nn",)),
    ("tf32 4096^3", 1, 4096, 4096, 4096, torch.float32, True, ("nn", "nt")),
    ("fp32 4096^3", 1, 4096, 4096, 4096, torch.float32, False, ("nn",)),
    ("fp32 50000x10x784", 1, 50000, 10, 784, torch.float32, False, ("nn",)),
    ("bmm 32x512^3 fp32", 32, 512, 512, 512, torch.float32, False, ("nn",)),
    ("bmm 2x1x1000x512", 2, 1, 1000, 512, torch.float32, False, ("nn",)),
    ("bmm 2x1x10x512", 2, 1, 10, 512, torch.float32, False, ("nn",)),
    ("bmm 2x512x16x32", 2, 512, 16, 32, torch.float32, False, ("nn",)),
    ("bmm 64x2048x2048x128 bf16", 64, 2048, 2048, 128, torch.bfloat16, False, ("nn",)),
    # bench matmul's long-k and few-rows cases below 0.9x cuBLAS (H200, 2026-11-28 re-measurement)
    ("long-k bf16 16x16x2^20", 1, 16, 16, 2**20, torch.bfloat16, False, ("nn",)),
    ("long-k bf16 1024x1024x65536", 1, 1024, 1024, 65536, torch.bfloat16, False, ("nn",)),
    ("long-k tf32 1024x1024x65536", 1, 1024, 1024, 65536, torch.float32, True, ("nn",)),
    ("long-k bf16 256x256x262144", 1, 256, 256, 262144, torch.bfloat16, False, ("nn",)),
    ("long-k bf16 64x128x2^20", 1, 64, 128, 2**20, torch.bfloat16, False, ("nn",)),
    ("few-rows bf16 8192x1x8192", 1, 8192, 1, 8192, torch.bfloat16, False, ("nn",)),
    ("few-rows fp32 1x4096x4096", 1, 1, 4096, 4096, torch.float32, False, ("nn",)),
]

if __name__ == "__main__":
    print(dropin._runtime.info(), flush=True)
    only = os.environ.get("ONLY")
    for case in CASES:
        if not only or any(o in case[0] for o in only.split(",")):
            probe(*case)
    a = torch.randn(2, 1, 512, device="cuda")
    b = torch.randn(2, 512, 10, device="cuda")
    c = torch.empty(2, 1, 10, device="cuda")
    common = dict(HAS_BIAS=False, ACT="none", STORE_Z=False, PRECISION="tf32x3", SHARES=False, GROUP_M=8)
    cfg = dict(mm.PTR_CONFIGS[4][0])
    raw = lambda: mm.mm_kernel[(1, 2, 1)](a, b, c, c, c, 1, 10, 512, *a.stride(), *b.stride(), **common, **cfg)  # noqa
    for name, fn in [("torch.bmm", lambda: torch.bmm(a, b)), ("dropin.bmm", lambda: dropin.bmm(a, b)),
                     ("mm_impl", lambda: mm.mm_impl(a, b, None, "none", False)), ("raw launch", raw),
                     ("allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
                     ("is_autocast", lambda: torch.is_autocast_enabled("cuda")),
                     ("is_compiling", torch.compiler.is_compiling), ("new_empty", lambda: a.new_empty((2, 1, 10)))]:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1000):
            fn()
        print(f"launch {name}: {(time.perf_counter() - t) * 1e3:.1f} us CPU per call", flush=True)
    for shape_a, shape_b in [((2, 1, 512), (2, 512, 1000)), ((2, 1, 512), (2, 512, 10)), ((2, 512, 32), (2, 32, 16))]:
        a = torch.randn(shape_a, device="cuda")
        b = torch.randn(shape_b, device="cuda")
        for name, fn in [("torch", torch.bmm), ("dropin", dropin.bmm)]:
            fn(a, b)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn(a, b)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_us = sum(e.device_time for e in kernels) / 50
            names = sorted({e.name[:40] for e in kernels})
            bench = do_bench(lambda: fn(a, b), return_mode="median") * 1e3
            print(f"{name} {shape_a}@{shape_b}: kernel {gpu_us:.1f} us/call, do_bench {bench:.1f} us, {names}",
                  flush=True)
