"""Probe (GPU or CPU): the guards that make torch.compile(dynamic=True) of an injected MLP recompile over changing
batch sizes (TORCH_LOGS=recompiles prints each guard that failed, with the source line that installed it).
Usage: TORCH_LOGS=recompiles PYTHONPATH=src python3 benchmarks/probes/compile_guards.py"""
import torch
from torch import nn
from torch._dynamo.utils import counters

import dropin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).to(DEVICE).eval()
    dropin.inject_(model, example_inputs=torch.randn(8, 32, device=DEVICE))
    torch._dynamo.reset()
    counters.clear()
    # without a GPU the kernels run interpreted, which Inductor cannot compile: aot_eager traces the same guards
    compiled = torch.compile(model, dynamic=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    for batch in (3, 5, 8, 13, 21, 34, 55, 89):
        with torch.no_grad():
            compiled(torch.randn(batch, 32, device=DEVICE))
    print(dict(counters["stats"]))


if __name__ == "__main__":
    main()
