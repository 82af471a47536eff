"""Probe (GPU): how many token chunks should the fused linear + cross-entropy cut? Each chunk's weight gradient is
added into the whole [vocab, hidden] gradient (read and written once a chunk: 8 chunks of 32000 x 4096 bf16 are 4.2
GB of traffic, ~1 ms, beside 3.2 TFLOP of products), and a chunk of few tokens makes that product's K short; fewer
chunks hold more logits at once (the suite's memory bar: at most 0.5x torch eager's peak).
For each CHUNKS value (argv, default 8 4 2 1) and the flce suite's shapes: dropin's forward + backward median
(do_bench) and its peak MiB beyond the inputs, beside torch eager's (F.linear, then F.cross_entropy).
With --parts: one chunk's passes at 4096 tokens, 4096 -> 32000, bf16 (chunk rows as CHUNKS=8 gives, or argv):
the logits product, the loss kernel, the hidden gradient's product and the weight gradient's accumulating product,
each timed alone (do_bench) beside cuBLAS's same product (torch.mm, torch.addmm with beta 1), in TFLOP/s.
Usage: PYTHONPATH=src python3 benchmarks/probes/flce_chunks.py [CHUNKS ...] | --parts [ROWS ...]"""
import importlib
import sys

import torch
import triton

from dropin.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref

# the module (dropin.ops' attribute of that name is the function): CHUNKS is set on it
lce_module = importlib.import_module("dropin.ops.linear_cross_entropy")

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


def parts(chunk_rows):
    tokens, dim, vocab = SHAPES[0]
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
    for rows in chunk_rows:
        chunk = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (rows,), device="cuda")
        losses = torch.empty(rows, device="cuda")
        scale = torch.ones(1, device="cuda")
        logits = lce_module.mm_impl(chunk.unsqueeze(0), weight.t().unsqueeze(0), None, "none", False)[0][0]
        grad_weight = torch.empty_like(weight)
        product = 2 * rows * dim * vocab
        timed = {
            "logits = chunk @ W.T": (lambda: lce_module.mm_impl(chunk.unsqueeze(0), weight.t().unsqueeze(0), None,
                                                                "none", False), lambda: torch.mm(chunk, weight.t())),
            "loss kernel (in place)": (lambda: lce_module._cross_entropy(logits, target, scale, losses, -100, 0.0,
                                                                         True), None),
            "d hidden = grad @ W": (lambda: lce_module.mm_impl(logits.unsqueeze(0), weight.unsqueeze(0), None, "none",
                                                               False), lambda: torch.mm(logits, weight)),
            "d W += grad.T @ chunk": (lambda: lce_module.mm_impl(logits.t().unsqueeze(0), chunk.unsqueeze(0), None,
                                                                 "none", False,
                                                                 accumulate_into=grad_weight.unsqueeze(0)),
                                      lambda: grad_weight.addmm_(logits.t(), chunk)),
        }
        print(f"chunk of {rows} tokens ({tokens // rows} chunks a step):", flush=True)
        for name, (ours, cublas) in timed.items():
            ms = triton.testing.do_bench(ours)
            line = f"  {name}: dropin {ms:.3f} ms"
            if cublas is not None:
                theirs = triton.testing.do_bench(cublas)
                line += f" ({product / ms / 1e9:.0f} TFLOP/s), cuBLAS {theirs:.3f} ms ({product / theirs / 1e9:.0f})"
            print(line, flush=True)


if __name__ == "__main__":
    if "--parts" in sys.argv:
        parts([int(a) for a in sys.argv[1:] if a != "--parts"] or [512])
    else:
        main([int(a) for a in sys.argv[1:]] or [8, 4, 2, 1])
