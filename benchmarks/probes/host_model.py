"""Probe: an injected model's host (Python) time against the original's, in one process, by cProfile.
Without a GPU every kernel launch is stubbed out (host_grad.py's `stub_launches`, the original's torch ops then
compute on the CPU), so an injected step costs the modules' Python, argument checks, plan look-ups and output
allocations. With --launch (a GPU) launches run. A step is a no_grad forward, or with --train the bench's training
step (`dropin inject --train --bench`: the loss, backward and fused AdamW of bench.models). Prints per model, in
alternating rounds, the ms a step and the ms until its last launch returned (equal: host-bound), then per model
the top functions by own time. Usage: PYTHONPATH=src:benchmarks/probes python3 benchmarks/probes/host_model.py
resnet50|cvt-13|llama [--train] [--launch] [dropin inject's arguments: --batch 2 for BatchNorm's training mode,
--dtype bfloat16, ...] (with launches stubbed the outputs are garbage, only the time counts)."""
import copy
import cProfile
import pstats
import sys
import time

import torch

import dropin
from dropin import _runtime, cli
from dropin.bench import models
from host_grad import launches, stub_launches

_FLAGS = ("--train", "--launch")


def build(argv):
    args = cli.build_parser().parse_args(["inject", *argv])
    assert cli._check_inject_args(args) is None
    model = cli.MODELS[args.model](args).eval()
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = model.to(_runtime.KERNEL_DEVICE, getattr(torch, args.dtype), memory_format=memory_format)
    return model, cli._inputs(args, model)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(model, inputs, train: bool, grad):
    if not train:
        def forward():
            with torch.no_grad():
                model(*inputs)
        return forward
    optimizer = models.timing_optimizer(model)
    return lambda: models.train_step(model, model, inputs, grad, optimizer)


def main():
    train, launch = (flag in sys.argv for flag in _FLAGS)
    original, inputs = build([a for a in sys.argv[1:] if a not in _FLAGS])
    if train:
        labels = models.training_labels(original, inputs)
        original = models.TrainingLoss(original.train(), labels)
    injected = copy.deepcopy(original)
    dropin.inject_(injected)
    grad = models.upstream_gradient(original, inputs) if train else None
    if not launch:
        stub_launches()
    steps = {"original": _step(original, inputs, train, grad), "dropin": _step(injected, inputs, train, grad)}
    for step in steps.values():
        for _ in range(3):
            step()
    _sync()
    n = 10
    for round in range(3):
        for name, step in steps.items():
            launches[0] = 0
            start = time.perf_counter()
            for _ in range(n):
                step()
            host = (time.perf_counter() - start) / n * 1e3
            _sync()
            wall = (time.perf_counter() - start) / n * 1e3
            print(f"round {round} {name}: {wall:.2f} ms a step ({host:.2f} until its last launch returned), "
                  f"{launches[0] / n:.0f} launches (counted when stubbed)")
    for name, step in steps.items():
        print(f"\n{name}, functions by own time over 5 steps:")
        profile = cProfile.Profile()
        profile.runcall(lambda: [step() for _ in range(5)] and _sync())
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
