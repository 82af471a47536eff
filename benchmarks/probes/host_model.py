"""Probe: the Python part of an injected model's forward, measurable without a GPU: every kernel launch is stubbed
out (host_grad.py's `stub_launches`), so a forward costs the modules' Python, argument checks, plan look-ups and output
allocations (CPU tensors). Prints ms per forward (eager, no_grad), the number of dropin op calls, and the top
functions by own time (cProfile). Usage: PYTHONPATH=src TRITON_INTERPRET=1 python3
benchmarks/probes/host_model.py resnet50|cvt-13|llama [--grad] (outputs are garbage, only the time counts)."""
import cProfile
import pstats
import sys
import time

import torch

import dropin
from dropin import cli
from host_grad import launches, stub_launches


def build(name: str):
    args = cli.build_parser().parse_args(["inject", name])
    assert cli._check_inject_args(args) is None
    model = cli.MODELS[name](args).eval()
    inputs = cli._inputs(args, model)
    return model, inputs


def main():
    name = sys.argv[1]
    grad = "--grad" in sys.argv
    model, inputs = build(name)
    dropin.inject_(model)
    stub_launches()

    def forward():
        if grad:
            out = model(*inputs)
            out = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", None) or out.logits
            out.float().sum().backward()
        else:
            with torch.no_grad():
                model(*inputs)
    if grad:
        model.train()
    for _ in range(3):
        forward()
    launches[0] = 0
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        forward()
    print(f"{name}: {(time.perf_counter() - start) / n * 1e3:.2f} ms a forward{' + backward' if grad else ''}, "
          f"{launches[0] / n:.0f} launches")
    profile = cProfile.Profile()
    profile.runcall(lambda: [forward() for _ in range(5)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
