"""Per-config timing of the matmul kernels on the GPU (a tuning aid, not the benchmark): for each shape and
operand layout, every candidate config of both kernels against torch, with its error vs float64."""
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

import dropin

mm = sys.modules["dropin.ops.matmul"]


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


def probe(name, B, M, N, K, dt, tf32=False, layouts=("nn",)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(B, M, K, device="cuda", dtype=dt)
    b = torch.randn(B, K, N, device="cuda", dtype=dt)
    ref = torch.bmm(a.double(), b.double()) if B * M * N * K < 2**33 else None
    flops = 2 * B * M * N * K
    t_torch = do_bench(lambda: torch.bmm(a, b), return_mode="median")
    lines = [f"{name:28s} torch {t_torch * 1e3:8.1f}us {flops / t_torch / 1e9:6.1f}TF"]
    for lay in layouts:
        aa = a.mT.contiguous().mT if lay[0] == "t" else a
        bb = b.mT.contiguous().mT if lay[1] == "t" else b
        al, bl = mm._tma_layout(aa), mm._tma_layout(bb)
        for tma in (True, False):
            if tma and (al is None or bl is None):
                continue
            size = min(a.element_size(), 4)
            configs = mm._fits((mm._TMA_CONFIGS if tma else mm._PTR_CONFIGS)[size], M, N, 64 if tma else 16)
            common = dict(HAS_BIAS=False, ACT="none", STORE_Z=False, PRECISION=mm._precision(dt), GROUP_M=8)
            c = torch.full((B, M, N), float("nan"), device="cuda", dtype=dt)
            best = None
            for cfg in configs:
                if tma:
                    ns = dropin._runtime.num_sms()
                    tiles = B * triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
                    run = lambda: mm._mm_tma_kernel[(min(ns, tiles),)](  # noqa: E731
                        aa, bb, c, c, c, M, N, K, B, al[2], al[1], bl[2], bl[1], A_T=al[0], B_T=bl[0],
                        NUM_SMS=ns, **common, **cfg)
                else:
                    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), B)
                    run = lambda: mm._mm_kernel[grid](  # noqa: E731
                        aa, bb, c, c, c, M, N, K, *aa.stride(), *bb.stride(), **common, **cfg)
                try:
                    c.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    err = rel(c, ref) if ref is not None else float("nan")
                    t = do_bench(run, return_mode="median")
                except Exception as e:  # report and go on: this is a probe
                    print("   FAIL", name, lay, tma, cfg, type(e).__name__, str(e)[:300], flush=True)
                    continue
                print(f"   {lay}{'T' if tma else 'P'} {t * 1e3:8.1f}us x{t_torch / t:.2f} err {err:.1e} {cfg}",
                      flush=True)
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            if best:
                lines.append(f"  {lay}{'T' if tma else 'P'} {best[0] * 1e3:8.1f}us x{t_torch / best[0]:.2f} "
                             f"err {best[2]:.1e} {best[1]}")
    print("\n".join(lines), flush=True)


CASES = [
    ("bf16 4096^3", 1, 4096, 4096, 4096, torch.bfloat16, False, ("nn", "nt", "tn")),
    ("bf16 8192^3", 1, 8192, 8192, 8192, torch.bfloat16, False, ("nt",)),
    ("bf16 4096x11008x4096", 1, 4096, 11008, 4096, torch.bfloat16, False, ("nn", "nt")),
    ("bf16 8192x1024x8192", 1, 8192, 1024, 8192, torch.bfloat16, False, ("nn",)),
    ("bf16 16x4096x4096", 1, 16, 4096, 4096, torch.bfloat16, False, ("nn", "nt")),
    ("fp16 4096^3", 1, 4096, 4096, 4096, torch.float16, False, ("nn",)),
    ("tf32 4096^3", 1, 4096, 4096, 4096, torch.float32, True, ("nn", "nt")),
    ("fp32x3 4096^3", 1, 4096, 4096, 4096, torch.float32, False, ("nn",)),
    ("fp32 50000x10x784", 1, 50000, 10, 784, torch.float32, False, ("nn",)),
    ("bmm 32x512^3 fp32", 32, 512, 512, 512, torch.float32, False, ("nn",)),
    ("bmm 2x1x1000x512", 2, 1, 1000, 512, torch.float32, False, ("nn",)),
    ("bmm 2x1x10x512", 2, 1, 10, 512, torch.float32, False, ("nn",)),
    ("bmm 2x512x16x32", 2, 512, 16, 32, torch.float32, False, ("nn",)),
    ("bmm 64x2048x2048x128 bf16", 64, 2048, 2048, 128, torch.bfloat16, False, ("nn",)),
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
    common = dict(HAS_BIAS=False, ACT="none", STORE_Z=False, PRECISION="tf32x3", GROUP_M=8)
    cfg = mm._PTR_CONFIGS[4][-1]
    raw = lambda: mm._mm_kernel[(1, 2)](a, b, c, c, c, 1, 10, 512, *a.stride(), *b.stride(), **common, **cfg)  # noqa
    for name, fn in [("torch.bmm", lambda: torch.bmm(a, b)), ("dropin.bmm", lambda: dropin.bmm(a, b)),
                     ("_mm_impl", lambda: mm._mm_impl(a, b, None, "none", False)), ("raw launch", raw),
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
