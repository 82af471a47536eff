"""Probe (GPU): the guards that make torch.compile(dynamic=True) of an injected MLP recompile over changing
batch sizes, eager calls in between (TORCH_LOGS=recompiles prints each guard that failed).
Usage: TORCH_LOGS=recompiles PYTHONPATH=src python3 benchmarks/probes/compile_guards.py"""
import torch
from torch import nn
from torch._dynamo.utils import counters

import dropin

DEVICE = "cuda"


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).to(DEVICE).eval()
    dropin.inject_(model, example_inputs=torch.randn(8, 32, device=DEVICE))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True)
    for batch in (3, 5, 8, 13, 21, 34, 55, 89):
        x = torch.randn(batch, 32, device=DEVICE)
        with torch.no_grad():
            compiled(x)
            model(x)  # eager calls between: new signatures in dropin's caches must not recompile
    print(dict(counters["stats"]))


if __name__ == "__main__":
    main()
