"""Probe (GPU): the host time of one kernel launch, by the path it takes, on this machine's host. A CvT-13 training
step makes 818 launches; on the H200 of 2026-11-27 12:29 real launches cost ~21 us each over launches stubbed out
(docs/perf-notes.md): is that Triton's C launcher, the driver, or dropin's Python around them?

Rows (us of host time per call, the fastest of 5 loops of 2,000 calls without synchronisation; the GPU work of each
is a few threads, so the host sets the pace until the launch queue fills, which 2,000 calls do not):
  torch add_: an ATen elementwise kernel (cudaLaunchKernel through torch's dispatcher);
  triton kernel[grid]: Triton's own launch path (binding, cache look-up, C launcher);
  dropin Launch: `_dispatch.Launch` after its first call (`_runtime.raw_launcher`: the C launcher alone);
  dropin Launch, 13 args: the same with mm_tma_kernel's argument count (5 pointers, 8 integers, constexprs);
  raw, tensors / raw, addresses: that Launch's C launcher called directly with the tensors (the launcher calls each
    one's data_ptr() and checks the address with cuPointerGetAttribute) or with their addresses as ints (neither:
    what a plan whose devices are checked could pass);
  dropin.matmul 64x64: a whole eager op (shortcut, output allocation, launch);
  torch.empty: one CUDA allocation from the caching allocator.
Usage: PYTHONPATH=src python benchmarks/probes/launch_cost.py"""
import time

import torch
import triton
import triton.language as tl

import dropin
from dropin.ops._dispatch import Launch


@triton.jit
def _touch(x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, n0, n1, n2, n3, n4, n5, n6, n7, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + n0, mask=offs < n1)


@triton.jit
def _touch_small(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0, mask=offs < n)


def per_call_us(fn, calls: int = 2000, loops: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    print(dropin._runtime.info(), flush=True)
    x = torch.zeros(16, device="cuda")
    small = Launch(_touch_small, (1,), dict(BLOCK=16))
    wide = Launch(_touch, (1,), dict(BLOCK=16))
    args = (x, x, x, x, x, 1, 16, 0, 0, 0, 0, 0, 0)
    a = torch.randn(64, 64, device="cuda")
    rows = [("empty loop", lambda: None),
            ("torch add_", lambda: x.add_(1.0)),
            ("triton kernel[grid]", lambda: _touch_small[(1,)](x, 16, BLOCK=16)),
            ("dropin Launch", lambda: small(x, 16)),
            ("dropin Launch, 13 args", lambda: wide(*args)),
            ("torch.empty", lambda: torch.empty(64, 64, device="cuda"))]
    wide(*args)  # (its first call compiles and keeps the C launcher)
    stream = torch.cuda.current_stream().cuda_stream
    addresses = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    if wide.raw is not None:
        rows += [("raw, tensors", lambda: wide.raw(stream, None, None, None, *args, *wide.tail)),
                 ("raw, addresses", lambda: wide.raw(stream, None, None, None, *addresses, *wide.tail))]
    with torch.no_grad():
        rows.append(("dropin.matmul 64x64", lambda: dropin.matmul(a, a)))
        for name, fn in rows:
            print(f"{name:28s} {per_call_us(fn):7.2f} us", flush=True)
    print(f"raw launcher in use: {small.raw is not None}", flush=True)


if __name__ == "__main__":
    main()
