"""Probe (CPU, no GPU needed): the front half of torch.compile on an injected model against the original: Dynamo's
export of the forward and AOT autograd's export of that graph (functionalization, where torch analyses each
wrap_triton launch's TTIR for the tensors it writes), with dropin's memo of that analysis and without
(`_runtime.memoize_launch_analysis`). Kernels compile for a pretend sm_90 (tests/_kernel_writes.py's setup) and
never run: Inductor's lowering, code generation and Triton's compiles are the GPU probe's (compile_time.py).
Usage: PYTHONPATH=src python3 benchmarks/probes/compile_front.py [torchvision model, default convnext_tiny] [--batch 8]"""
import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import _kernel_writes  # noqa: E402  (the pretend sm_90 that tests/test_kernel_writes.py uses)

_kernel_writes.setup(record=False)
import dropin  # noqa: E402
import dropin.ops  # noqa: E402,F401 (registers the ops, which installs the memo)
from torch._functorch.aot_autograd import aot_export_module  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap as wrap  # noqa: E402


class _Tuple(torch.nn.Module):
    """An exported graph returning a tuple, as aot_export_module takes it."""

    def __init__(self, graph):
        super().__init__()
        self.graph_module = graph

    def forward(self, x):
        return (self.graph_module(x),)


def front(model, x) -> tuple:
    """(Dynamo export s, AOT export s, call nodes in the AOT graph) of model(x), no grad."""
    torch._dynamo.reset()
    with torch.no_grad():
        start = time.perf_counter()
        graph, _ = torch._dynamo.export(model)(x)
        exported = time.perf_counter()
        aot, _ = aot_export_module(_Tuple(graph), [x], trace_joint=False)
    return exported - start, time.perf_counter() - exported, sum(n.op == "call_function" for n in aot.graph.nodes)


def main() -> None:
    import torchvision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="convnext_tiny")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    original = getattr(torchvision.models, args.model)().eval().to(torch.bfloat16)
    x = torch.randn(args.batch, 3, 224, 224, dtype=torch.bfloat16)
    injected = copy.deepcopy(original)
    dropin.inject_(injected, verify=False)
    memo = wrap.identify_accessed_tensors
    for label, model, analysis in (("original", original, memo), ("dropin", injected, memo),
                                   ("dropin without the memo", injected, memo.__wrapped__)):
        wrap.identify_accessed_tensors = analysis
        dynamo_s, aot_s, calls = front(model, x)
        print(f"{label}: Dynamo export {dynamo_s:.1f} s, AOT export {aot_s:.1f} s ({calls} calls in its graph)")
    wrap.identify_accessed_tensors = memo
    print("memo:", memo.cache_info())


if __name__ == "__main__":
    main()
