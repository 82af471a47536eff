"""Probe (CPU, no GPU needed): the front half of torch.compile's first call on an injected model against the
original: Dynamo's tracing of the forward and AOT autograd's of its graph (functionalization, where torch analyses
each wrap_triton launch's TTIR for the tensors it writes), with dropin's memo of that analysis and without
(`_runtime.memoize_launch_analysis`). Kernels compile for a pretend sm_90 (tests/_kernel_writes.py's setup) and
never run: Inductor's lowering, code generation and Triton's compiles are the GPU probe's (compile_time.py). Also
replays Inductor's collection of kernel sources for these graphs, with and without dropin's memo of it
(`_runtime.memoize_kernel_source`).
Usage: PYTHONPATH=src python3 benchmarks/probes/compile_front.py [MODEL] [--batch 8]   (MODEL: a torchvision model,
default convnext_tiny)"""
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
from torch._higher_order_ops import triton_kernel_wrap as wrap  # noqa: E402


def front(model, x, graphs=None) -> tuple:
    """(Dynamo s, AOT autograd s, call nodes in AOT's forward graph) of the first torch.compile'd call of
    model(x), no grad, through a backend that stops after AOT autograd: its compiled forward returns empty tensors
    of the outputs' metadata (no kernel runs). graphs (a dict), where given, gets Dynamo's graph ("dynamo") and
    AOT autograd's forward graph ("aot")."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    marks, calls = {}, []

    def forward_compiler(graph, example_inputs):
        marks["aot"] = time.perf_counter()
        if graphs is not None:
            graphs["aot"] = graph
        calls.append(sum(n.op == "call_function" for n in graph.graph.nodes))
        outputs = [a.meta["val"] for a in next(n for n in graph.graph.nodes if n.op == "output").args[0]]
        return make_boxed_func(lambda *args: [torch.empty(o.shape, dtype=o.dtype) for o in outputs])

    aot = aot_autograd(fw_compiler=forward_compiler)

    def backend(graph, example_inputs):
        marks["dynamo"] = time.perf_counter()
        if graphs is not None:
            graphs["dynamo"] = graph
        return aot(graph, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        start = time.perf_counter()
        torch.compile(model, backend=backend)(x)
    return marks["dynamo"] - start, marks["aot"] - marks["dynamo"], sum(calls)


def kernel_sources(graphs: dict) -> tuple:
    """(calls, torch's own s, s through a new memo of dropin's) of Inductor's collection of kernel sources in a
    compile of these graphs, replayed: each op's kernels for the AOT autograd cache's key, each launch's kernel for
    the FX graph cache's key, each distinct launch's (kernel, constant arguments) for the generated code."""
    import triton
    from torch._inductor.codegen import wrapper
    from torch._library.triton import get_triton_kernels_for_op

    from dropin import _runtime

    table, own = wrap.kernel_side_table, getattr(wrapper, _runtime._KERNEL_SOURCE)
    own = getattr(own, "__wrapped__", own)
    kernels = [k for n in graphs["dynamo"].graph.nodes if isinstance(n.target, torch._ops.OpOverload)
               for k in get_triton_kernels_for_op(n.target._name)]
    launches = [(table.get_kernel(n.kwargs["kernel_idx"]), table.get_constant_args(n.kwargs["constant_args_idx"]))
                for n in graphs["aot"].graph.nodes if n.target is wrap.triton_kernel_wrapper_functional]
    distinct = {(id(k), repr(sorted(args.items()))): k for k, args in launches}
    calls = [k.fn if isinstance(k, triton.runtime.Autotuner) else k  # (as torch unwraps them)
             for k in [*kernels, *(k for k, _ in launches), *distinct.values()]]
    times = []
    for source in (own, _runtime._memoized_source(own)):
        start = time.perf_counter()
        for kernel in calls:
            source(kernel)
        times.append(time.perf_counter() - start)
    return len(calls), *times


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
    graphs = {}
    for label, model, analysis in (("original", original, memo), ("dropin", injected, memo),
                                   ("dropin without the memo", injected, memo.__wrapped__)):
        wrap.identify_accessed_tensors = analysis
        dynamo_s, aot_s, calls = front(model, x, graphs if label == "dropin" else None)
        print(f"{label}: Dynamo {dynamo_s:.1f} s, AOT autograd {aot_s:.1f} s ({calls} calls in its graph)")
    wrap.identify_accessed_tensors = memo
    print("memo:", memo.cache_info())
    calls, own_s, memo_s = kernel_sources(graphs)
    print(f"kernel sources (Inductor's, replayed): {calls} collections, {own_s:.2f} s; through the memo {memo_s:.2f} s")


if __name__ == "__main__":
    main()
