"""Probe: what a materialized causal mask costs dropin's attention (torch.compile of HF Llama passes one: its mask
code does not skip while tracing on torch < 2.14). At Llama-7B's prefill shape, eager and under torch.compile:
is_causal, the same causal pattern as a bool mask, as an additive float mask, against SDPA with that mask; then
forward + backward of each (training under torch.compile meets the same masks).
Usage: PYTHONPATH=src python3 benchmarks/probes/attention_mask.py [B H L D]"""
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import dropin


def main():
    B, H, L, D = (int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else (4, 32, 1024, 128)
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    causal = torch.ones(L, L, device="cuda", dtype=torch.bool).tril().expand(B, 1, L, L)
    additive = torch.zeros(B, 1, L, L, device="cuda", dtype=torch.bfloat16).masked_fill(~causal, float("-inf"))
    cases = {
        "dropin is_causal": lambda: dropin.attention(q, k, v, is_causal=True),
        "dropin bool mask": lambda: dropin.attention(q, k, v, causal),
        "dropin float mask": lambda: dropin.attention(q, k, v, additive),
        "sdpa is_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa bool mask": lambda: F.scaled_dot_product_attention(q, k, v, causal),
    }
    compiled = torch.compile(lambda q, k, v, m: dropin.attention(q, k, v, m), dynamic=False)
    cases["dropin bool mask, compiled"] = lambda: compiled(q, k, v, causal)
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
        for name, fn in cases.items():
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            print(f"{name:28s} {do_bench(fn, warmup=25, rep=200):7.3f} ms   rel err {err:.1e}")
    for t in (q, k, v):
        t.requires_grad_(True)
    grad = torch.randn_like(q)
    for name, fn in cases.items():
        if "compiled" not in name:
            step = lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad)  # noqa: E731
            print(f"{name + ', fwd + bwd':28s} {do_bench(step, warmup=25, rep=200):7.3f} ms")


if __name__ == "__main__":
    main()
