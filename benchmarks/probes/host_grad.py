"""Probe: where dropin's host (Python) microseconds go per call, measurable without a GPU: every kernel launch is
stubbed out (`_dispatch.Launch` and `_dispatch.launch` do nothing, launches counted), so a call costs its argument
checks, plan look-ups, autograd node and output allocations (CPU tensors here, cheaper than CUDA ones). The ops and
inputs are those of `dropin bench overhead`.

Columns (us of CPU time per call, the fastest of 7 loops): dropin's forward under no_grad; dropin's forward +
backward (the inputs that the bench marks require grad); the floor, a bare `torch.autograd.Function` of as many
inputs and outputs that allocates its outputs and gradients (empty_like) and launches nothing: the autograd node,
the engine's backward call and the allocations, which no custom op avoids; dropin's excess over that floor; torch's
own CPU op (forward + backward; it computes on the CPU, so only a bound where its op is tiny); the launches per
forward + backward.

Usage: PYTHONPATH=src python3 benchmarks/probes/host_grad.py [name substring] [--profile] [--calls N] [--launch]
(--profile: the top functions by own time over the grad loop of each case, cProfile; --launch: launches not
stubbed, for a GPU, where the floor holds what the CPU misses: CUDA allocations and autograd's device thread, which
runs a Python backward under the GIL). Outputs are garbage, only the time counts (launches counted only when
stubbed)."""
import argparse
import cProfile
import pstats
import sys
import time

import torch

from dropin.bench import overhead
from dropin.ops import _dispatch

launches = [0]


def _count(*args, **kwargs):
    launches[0] += 1


def stub_launches():
    """Every Triton launch a no-op that counts itself."""
    _dispatch.Launch.__call__ = lambda self, *args: _count()
    for module in list(sys.modules.values()):  # (the ops import `launch` by name)
        if getattr(module, "launch", None) is _dispatch.launch:
            module.launch = _count


class _Bare(torch.autograd.Function):
    """The floor: outputs and gradients allocated, nothing else."""

    @staticmethod
    def forward(ctx, n_out, *tensors):
        ctx.inputs = tensors
        return tuple(torch.empty_like(tensors[0]) for _ in range(n_out))

    @staticmethod
    def backward(ctx, *grads):
        return None, *(torch.empty_like(t) if need else None for t, need in zip(ctx.inputs, ctx.needs_input_grad[1:]))


def _floor(pair):
    """The bare Function standing in for pair's dropin op: as many tensor inputs and outputs."""
    inputs = pair.make()
    with torch.no_grad():
        n_out = len(out) if isinstance(out := pair.dropin(*inputs), tuple) else 1

    def bare(*tensors):
        out = _Bare.apply(n_out, *tensors)
        return out if n_out > 1 else out[0]
    return overhead.Pair(pair.name, pair.make, bare, bare, pair.n_grad)


def us(pair, provider, mode, calls) -> float:
    """us per call: the fastest of 7 loops, in this process's CPU time (the stubbed loop is all CPU work on one
    thread: the wall time of an idle machine; the minimum and CPU time hold where other jobs share the cores)."""
    call = overhead.timed_call(pair, provider, mode)
    for _ in range(max(3, calls // 10)):
        call()
    samples = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(calls):
            call()
        samples.append((time.process_time() - start) / calls * 1e6)
    return min(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("wanted", nargs="?", default="")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--launch", action="store_true", help="real launches (on a GPU: the floor with CUDA tensors)")
    args = parser.parse_args()
    calls = args.calls
    torch.set_num_threads(1)  # (the CPU ops of a tiny shape: threads add noise, not speed)
    if not args.launch:
        stub_launches()
    print(f"{'op':22s} {'no_grad':>8s} {'grad':>8s} {'floor':>7s} {'excess':>7s} {'torch':>7s} {'launches':>8s}"
          "  (us per call; grad: forward + backward)")
    for pair in overhead.pairs():
        if args.wanted not in pair.name:
            continue
        try:
            no_grad = us(pair, pair.dropin, "no_grad", calls)
            grad = us(pair, pair.dropin, "grad", calls)
            floor = us(_floor(pair), _floor(pair).dropin, "grad", calls)
            peer = us(pair, pair.torch, "grad", calls)
            call = overhead.timed_call(pair, pair.dropin, "grad")
            launches[0] = 0
            call()
        except Exception as e:  # noqa: BLE001 (a line with the error; the others still run)
            print(f"{pair.name:22s} error {type(e).__name__}: {e}")
            continue
        print(f"{pair.name:22s} {no_grad:8.1f} {grad:8.1f} {floor:7.1f} {grad - floor:7.1f} {peer:7.1f} "
              f"{launches[0]:8d}")
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(lambda: [call() for _ in range(calls)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
