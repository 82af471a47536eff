"""Probe: the Python part of each public op's host cost, measurable without a GPU: every kernel launch is stubbed out
(`_dispatch.Launch` and `_dispatch.launch` do nothing), so a call costs its argument checks, plan look-ups, autograd
node and output allocations (CPU tensors here, cheaper than CUDA ones). The ops and inputs are those of
`dropin bench overhead`. Usage: PYTHONPATH=src python3 benchmarks/probes/host_python.py [name substring]
(on a machine without a GPU; outputs are garbage, only the time counts)."""
import statistics
import sys

import torch

from dropin.bench import overhead
from dropin.ops import _dispatch


def main():
    _dispatch.Launch.__call__ = lambda self, *args: None
    for module in list(sys.modules.values()):  # (the ops import `launch` by name)
        if getattr(module, "launch", None) is _dispatch.launch:
            module.launch = lambda *args, **kwargs: None
    wanted = sys.argv[1] if len(sys.argv) > 1 else ""
    for pair in overhead.pairs():
        if wanted not in pair.name:
            continue
        for mode in ("no_grad", "grad"):
            try:
                call = overhead.timed_call(pair, pair.dropin, mode)
                samples = overhead.host_us(call, 300, 5)
                torch_call = overhead.timed_call(pair, pair.torch, mode)
                torch_samples = overhead.host_us(torch_call, 300, 5)
            except Exception as e:  # noqa: BLE001
                print(f"{pair.name:22s} {mode:8s} error {type(e).__name__}: {e}")
                continue
            print(f"{pair.name:22s} {mode:8s} dropin python {statistics.median(samples):7.1f} us   "
                  f"(torch CPU op {statistics.median(torch_samples):7.1f} us)")


if __name__ == "__main__":
    main()
