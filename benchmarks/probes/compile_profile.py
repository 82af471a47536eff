"""Probe: where an injected model's time goes under torch.compile against eager. For one model (arguments as for
`dropin inject`), each of original compiled, injected eager and injected compiled (default mode) runs a few
forwards under the torch profiler; per variant it prints the wall ms a forward and the GPU kernels by total time
(count, ms a forward), so a kernel that compile makes slower, or one it adds, shows. With --train: training steps
as `dropin inject --train --bench` times them (loss, backward, fused AdamW), the original in eager too.
Usage: PYTHONPATH=src python3 <this file> llama --layers 4 --hidden 4096 --heads 32 --intermediate 11008 --seq 1024
--batch 4 --dtype bfloat16 [--train] (or resnet50 --channels-last --batch 64 --dtype bfloat16, cvt-13 ...). With llama's
--generate N --bench: HF generate() of N tokens with a static cache under reduce-overhead (HF compiles the decoding step),
original against injected, per generate() call. EAGER_ONLY=1 with --train: the eager steps alone."""
import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dropin
from dropin import cli
from dropin.bench import decode, models


def _forward(model, inputs):
    def run():
        with torch.no_grad():
            return model(*inputs)
    return run


def _train_step(forward, model, inputs, grad):
    optimizer = models.timing_optimizer(model)
    return lambda: models.train_step(forward, model, inputs, grad, optimizer)


def _profile(label: str, run, iters: int = 5) -> None:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / iters * 1e3
    kernels = kernel_times(run, iters)
    gpu = sum(ms for _, ms in kernels.values())
    print(f"\n{label}: wall {wall:.2f} ms a call, GPU kernels {gpu:.2f} ms")
    for name, (count, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"  {ms:8.3f} ms  x{count:<4d} {name[:110]}")


def kernel_times(run, iters: int) -> dict:
    """{GPU kernel name: (launches, ms) a call} over `iters` calls of run (warmed up by the caller) under the torch
    profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count, total = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (count + 1, total + e.device_time / 1e3)
    return {name: (count // iters, total / iters) for name, (count, total) in kernels.items()}


def main():
    args = cli.build_parser().parse_args(["inject", *sys.argv[1:]])
    args.argv = sys.argv[1:]
    assert cli._check_inject_args(args) is None
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    original = cli.MODELS[args.model](args).train(args.train).to("cuda", getattr(torch, args.dtype),
                                                                   memory_format=fmt)
    inputs = cli._inputs(args, original)
    injected = copy.deepcopy(original)
    dropin.inject_(injected, example_inputs=inputs)
    if args.train:
        labels = models.training_labels(original, inputs)
        original, injected = models.TrainingLoss(original, labels), models.TrainingLoss(injected, labels)
        grad = models.upstream_gradient(original, inputs)
        _profile("original eager", _train_step(original, original, inputs, grad))
        _profile("injected eager", _train_step(injected, injected, inputs, grad))
        if os.environ.get("EAGER_ONLY"):
            return
        _profile("original compiled", _train_step(torch.compile(original, dynamic=False), original, inputs, grad))
        torch._dynamo.reset()
        _profile("injected compiled", _train_step(torch.compile(injected, dynamic=False), injected, inputs, grad))
        return
    if args.generate:
        ids = inputs[0]
        with torch.no_grad():
            for label, model in (("original reduce-overhead", original), ("injected reduce-overhead", injected)):
                _profile(label, lambda: decode._generate(model, ids, args.generate, True))
        return
    _profile("original compiled", _forward(torch.compile(original, dynamic=False), inputs))
    _profile("injected eager", _forward(injected, inputs))
    torch._dynamo.reset()
    _profile("injected compiled", _forward(torch.compile(injected, dynamic=False), inputs))


if __name__ == "__main__":
    main()
