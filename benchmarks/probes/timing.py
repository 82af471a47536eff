"""Where does a dropin call's time go? For a few benchmark cases: do_bench's median/min/max (L2 flushed, as
the harness times), the CPU cost of one call (a loop of calls, no sync inside), and the GPU time alone (the
call replayed from a CUDA graph). A median far above the graph time with a CPU cost near it means the launch
path, not the kernel, sets the figure. Usage: PYTHONPATH=src python3 benchmarks/probes/timing.py"""
import statistics
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import dropin


def cpu_us(fn, calls=200):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cpu = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return cpu


def graph_ms(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return statistics.median(do_bench(graph.replay, return_mode="all"))


def probe(name, fn):
    times = do_bench(fn, return_mode="all")
    print(f"{name:58s} do_bench med {statistics.median(times) * 1e3:8.1f} us  min {min(times) * 1e3:8.1f}  "
          f"max {max(times) * 1e3:8.1f}  | cpu/call {cpu_us(fn):6.1f} us | graph {graph_ms(fn) * 1e3:8.1f} us",
          flush=True)


def conv_cases():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    cl = torch.channels_last
    for cin, cout, hw, k, s, p, groups in ((512, 2048, 7, 1, 1, 0, 1), (64, 256, 56, 1, 1, 0, 1),
                                           (3, 64, 224, 7, 2, 3, 1), (64, 64, 56, 3, 2, 1, 64),
                                           (64, 64, 56, 3, 1, 1, 1)):
        x = torch.randn(64, cin, hw, hw, **bf16).to(memory_format=cl)
        w = torch.randn(cout, cin // groups, k, k, **bf16).to(memory_format=cl)
        name = f"conv {cin}->{cout} @{hw} k{k} s{s} g{groups}"
        yield name, (lambda x=x, w=w, s=s, p=p, g=groups: dropin.conv2d(x, w, None, s, p, 1, g)), \
            (lambda x=x, w=w, s=s, p=p, g=groups: F.conv2d(x, w, None, s, p, 1, g))
    a = torch.randn(200704, 576, device="cuda", dtype=torch.bfloat16)  # the GEMM of the 3x3 64-channel conv
    b = torch.randn(576, 64, device="cuda", dtype=torch.bfloat16)
    yield "matmul bf16 200704x576x64 (3x3 conv's GEMM)", (lambda a=a, b=b: dropin.matmul(a, b)), \
        (lambda a=a, b=b: torch.matmul(a, b))
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    yield "matmul bf16 16x4096x4096", lambda: dropin.matmul(a, b), lambda: torch.matmul(a, b)
    a = torch.randn(50000, 784, device="cuda")
    b = torch.randn(784, 10, device="cuda")
    yield "matmul fp32 50000x784x10 (seed 004)", (lambda a=a, b=b: dropin.matmul(a, b)), \
        (lambda a=a, b=b: torch.matmul(a, b))


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, ours, theirs in conv_cases():
        probe("dropin " + name, ours)
        probe("torch  " + name, theirs)
