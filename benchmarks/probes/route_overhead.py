"""Probe: the host cost of `dropin.use()` (a TorchFunctionMode) per call, measurable without a GPU: kernel launches
are stubbed out as in host_grad.py, so a call costs its Python (the CPU tensors' allocations are cheaper than CUDA
ones). Per case: the plain call, the same call under the route, and for routed calls dropin's op called directly.
Usage: PYTHONPATH=src python3 benchmarks/probes/route_overhead.py (outputs are garbage, only the time counts)."""
import statistics

import torch
import torch.nn.functional as F

import dropin
from dropin.bench import overhead
from host_grad import stub_launches


def us(call, routed: bool) -> float:
    with torch.no_grad(), (dropin.use() if routed else torch.no_grad()):
        return statistics.median(overhead.host_us(call, 2000, 7))


def main():
    stub_launches()
    torch.set_num_threads(1)  # (two threads on this 2-core machine: 8 ms per small CPU op once triton is imported)
    x = torch.randn(8, 64)
    w = torch.randn(32, 64)
    x64 = x.double()
    cases = [  # name, the torch call, dropin's op called directly (None: not a routed call)
        ("F.gelu (routed)", lambda: F.gelu(x), lambda: dropin.ops.gelu(x)),
        ("F.linear (routed)", lambda: F.linear(x, w), lambda: dropin.ops.linear(x, w)),
        ("x @ w.T (routed)", lambda: x @ w.T, lambda: dropin.ops.matmul(x, w.T)),
        ("F.gelu fp64 (fallback)", lambda: F.gelu(x64), None),
        ("torch.add (not routed)", lambda: torch.add(x, x), None),
        ("x.shape (not routed)", lambda: x.shape, None),
    ]
    print(f"{'case':26s} {'torch':>8s} {'routed':>8s} {'extra':>8s} {'dropin op':>10s} {'op in use()':>12s}  (us)")
    for name, call, op in cases:
        plain, routed = us(call, False), us(call, True)
        line = f"{name:26s} {plain:8.2f} {routed:8.2f} {routed - plain:8.2f}"
        if op is not None:  # the op alone, and the op called under the route (inject_'s modules under use())
            line += f" {us(op, False):10.2f} {us(op, True):12.2f}"
        print(line)
    dropin.route_report(reset=True)


if __name__ == "__main__":
    main()
