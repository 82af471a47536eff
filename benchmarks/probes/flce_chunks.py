"""Probe (GPU): how many token chunks should the fused linear + cross-entropy cut? Each chunk's weight gradient is
added into the whole [vocab, hidden] gradient (read and written once a chunk: 8 chunks of 32000 x 4096 bf16 are 4.2
GB of traffic, ~1 ms, beside 3.2 TFLOP of products), and a chunk of few tokens makes that product's K short; fewer
chunks hold more logits at once (the suite's memory bar: at most 0.5x torch eager's peak).
For each CHUNKS value (argv, default 8 4 2 1) and the flce suite's shapes: dropin's forward + backward median
(do_bench) and its peak MiB beyond the inputs, beside torch eager's (F.linear, then F.cross_entropy).
Usage: PYTHONPATH=src python3 benchmarks/probes/flce_chunks.py [CHUNKS ...]"""
import sys

import torch
import triton

from dropin.ops import linear_cross_entropy as lce_module
from dropin.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

SHAPES = [(4096, 4096, 32000), (4096, 4096, 128256), (32768, 4096, 32000), (32768, 4096, 128256)]


def step(fn, hidden, weight, target):
    hidden.grad = weight.grad = None
    fn(hidden, weight, target).backward()


def measure(fn, hidden, weight, target):
    step(fn, hidden, weight, target)
    ms = triton.testing.do_bench(lambda: step(fn, hidden, weight, target))
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(fn, hidden, weight, target)
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main(chunk_counts):
    for tokens, dim, vocab in SHAPES:
        hidden = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weight = (torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5).requires_grad_()
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        torch_ms, torch_mib = measure(linear_cross_entropy_ref, hidden, weight, target)
        print(f"{tokens}x{dim}->{vocab}: torch {torch_ms:.3f} ms, {torch_mib:.0f} MiB", flush=True)
        for chunks in chunk_counts:
            lce_module.CHUNKS = chunks
            ms, mib = measure(linear_cross_entropy, hidden, weight, target)
            print(f"  CHUNKS={chunks}: dropin {ms:.3f} ms ({torch_ms / ms:.2f}x torch), {mib:.0f} MiB "
                  f"({mib / torch_mib:.2f}x torch's)", flush=True)
        del hidden, weight, target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8, 4, 2, 1])
