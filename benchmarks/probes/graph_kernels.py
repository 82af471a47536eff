"""Probe (GPU): where a zoo model's CUDA-graph time goes, kernel by kernel, original beside injected. The zoo's
"best mode" loses where the original's kernels in one graph (or Inductor's under reduce-overhead) beat dropin's:
hf/convnext's graph 1.55 ms against the original's 1.23, swin_t 2.13 against 1.92 (bf16, batch 8, H200). Each
model (the zoo's builder, bf16, eval, no_grad) is captured in one CUDA graph, its replays profiled (torch.profiler,
CUDA activity); per kernel name: launches and microseconds per replay, largest first, each side's total and the
replay's wall time (CUDA events) beside it, so that gaps between kernels show too.
Usage: PYTHONPATH=src python3 benchmarks/probes/graph_kernels.py MODEL [MODEL ...] [--top N] [--reps N]
(MODEL: a zoo name, e.g. hf/convnext torchvision/swin_t)"""
import argparse
import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import dropin
from dropin.bench import zoo_models
from dropin.bench.models import main_output


def captured(model, inputs):
    """A replay function of model(*inputs) captured in one CUDA graph (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = main_output(model(*inputs))
    graph.replay()
    return graph.replay, out


def kernels(replay, reps: int) -> tuple:
    """({kernel name: (launches, us) per replay}, wall us per replay)."""
    replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1e3 / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table[event.name]
            entry[0] += 1
            entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return {name: (n / reps, us / reps) for name, (n, us) in table.items()}, wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    for name in args.models:
        torch.manual_seed(0)
        model, inputs = zoo_models.entry(name).build(False)
        model = model.eval().cuda().to(torch.bfloat16)
        inputs = tuple(t.cuda().to(torch.bfloat16) if t.is_floating_point() else t.cuda() for t in inputs)
        injected = copy.deepcopy(model)
        with torch.no_grad():
            dropin.inject_(injected, example_inputs=inputs, verify=False)
            sides = {label: kernels(captured(m, inputs)[0], args.reps) for label, m in
                     (("original", model), ("injected", injected))}
        print(f"== {name} (bf16, inputs {[tuple(t.shape) for t in inputs]}): us per replay")
        for label, (table, wall) in sides.items():
            total = sum(us for _, us in table.values())
            launches = sum(n for n, _ in table.values())
            print(f"-- {label}: kernels {total:.1f} us in {launches:.0f} launches, replay {wall:.1f} us")
            for kernel, (n, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"   {us:8.1f} us {n:5.0f}x  {kernel[:110]}")


if __name__ == "__main__":
    main()
