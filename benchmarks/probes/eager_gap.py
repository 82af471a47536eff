"""Probe (GPU): why an eager product's do_bench time exceeds its CUDA-graph time. results/h200/matmul.json at 96189bc:
tf32 4096^3 dropin 0.491 ms eager against 0.412 in a graph (torch 0.378 / 0.383), fp32 2.224 / 2.163, odd tf32
0.827 / 0.721, bf16 0.192 / 0.183: the products on operand copies lose 60-100 us a call in eager alone.

For each case: do_bench's median (L2 flushed), harness.graph_time_ms, then a torch.profiler trace of 20 eager calls
with do_bench's flush between them: each kernel's mean time, the gap before it (from the previous kernel's end),
and the host time of one call (perf_counter, synchronised), so the loss shows as slower kernels, idle gaps (the
host behind the GPU) or neither. Cause found: each call made its operand copies twice (fixed at 53a2194).
(B's rounded copy alone at tf32 4096^3, A rounded in registers, made the kernel 506 us against 342: dearer than
A's 35 us copy; docs/perf-notes.md, 2026-11-27 15:50.)
Usage: PYTHONPATH=src python benchmarks/probes/eager_gap.py"""
import collections
import statistics
import time

import torch
import triton

import dropin
from dropin.bench.harness import allow_tf32, graph_time_ms

CASES = (("tf32", 4096, 4096, 4096), ("fp32", 4096, 4096, 4096), ("tf32", 6007, 4999, 3001), ("bf16", 4096, 4096, 4096))


def kernel_rows(fn, flush, calls: int = 20):
    """[(name, mean us, mean gap before it us, count)] over `calls` flushed calls, in first-seen order."""
    for _ in range(3):
        flush.zero_()
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    times, gaps = collections.defaultdict(list), collections.defaultdict(list)
    prev_end = None
    for e in events:
        name = e.name[:60]
        times[name].append(e.time_range.end - e.time_range.start)
        if prev_end is not None:
            gaps[name].append(e.time_range.start - prev_end)
        prev_end = e.time_range.end
    return [(n, statistics.fmean(t), statistics.fmean(gaps[n]) if gaps[n] else 0.0, len(t)) for n, t in times.items()]


def host_us(fn, calls: int = 20) -> float:
    """Host time of one call issued while the GPU is idle (synchronised before and after each)."""
    best = float("inf")
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return best


def main():
    print(dropin._runtime.info(), flush=True)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for dtype, M, K, N in CASES:
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        a = torch.randn(M, K, device="cuda", dtype=tdt)
        b = torch.randn(K, N, device="cuda", dtype=tdt)
        for name, fn in (("dropin", lambda: dropin.matmul(a, b)), ("torch", lambda: torch.matmul(a, b))):
            with allow_tf32(dtype == "tf32"):
                report(f"{dtype} {M}x{K} @ {K}x{N} {name}", fn, flush)


def report(title, fn, flush):
    bench = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    graph = graph_time_ms(fn)
    print(f"\n{title}: do_bench {bench * 1e3:.1f} us, graph {graph * 1e3:.1f} us, host (idle GPU) {host_us(fn):.1f} us",
          flush=True)
    for kname, mean, gap, count in kernel_rows(fn, flush):
        print(f"  {mean:9.1f} us  gap before {gap:8.1f} us  x{count:<3} {kname}", flush=True)


if __name__ == "__main__":
    main()
