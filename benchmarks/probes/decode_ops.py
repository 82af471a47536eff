"""Probe: GPU time of each op of one Llama-7B-shaped decoding step (one token per sequence, batch 1 and 8, static
cache of 640 keys, bf16), dropin against torch, each timed inside a CUDA graph (host cost excluded, as under
reduce-overhead). Usage: PYTHONPATH=src python3 benchmarks/probes/decode_ops.py"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

import dropin


def cases(batch):
    d, h, inter, vocab, cache = 4096, 32, 11008, 32000, 640
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, 1, d, **bf)
    w = {n: torch.randn(o, d, **bf) * 0.02 for n, o in (("qkv", 3 * d), ("o", d), ("lm", vocab))}
    gate, up, down = (torch.randn(inter, d, **bf) * 0.02, torch.randn(inter, d, **bf) * 0.02,
                      torch.randn(d, inter, **bf) * 0.02)
    q = torch.randn(batch, h, 1, 128, **bf)
    k, v = torch.randn(batch, h, cache, 128, **bf), torch.randn(batch, h, cache, 128, **bf)
    mask = (torch.arange(cache, device="cuda") < 600).expand(batch, 1, 1, cache)
    nw = torch.ones(d, **bf)
    yield "linear qkv", lambda: F.linear(x, w["qkv"]), lambda: dropin.linear(x, w["qkv"])
    yield "linear o", lambda: F.linear(x, w["o"]), lambda: dropin.linear(x, w["o"])
    yield "lm_head", lambda: F.linear(x, w["lm"]), lambda: dropin.linear(x, w["lm"])
    yield ("mlp", lambda: F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down),
           lambda: dropin.swiglu_mlp(x, gate, up, down))
    yield ("attention", lambda: F.scaled_dot_product_attention(q, k, v, mask),
           lambda: dropin.attention(q, k, v, mask))
    yield "rms_norm", lambda: F.rms_norm(x, (d,), nw, 1e-6), lambda: dropin.rms_norm(x, nw, 1e-6)


def main():
    with torch.no_grad():
        for batch in (1, 8):
            for name, theirs, ours in cases(batch):
                ours(), theirs()  # tunes and compiles outside the graph
                t_torch = do_bench_cudagraph(theirs, rep=50)
                t_dropin = do_bench_cudagraph(ours, rep=50)
                print(f"b{batch} {name:12s} torch {t_torch * 1e3:7.1f} us  dropin {t_dropin * 1e3:7.1f} us  "
                      f"{t_torch / t_dropin:5.2f}x")


if __name__ == "__main__":
    main()
