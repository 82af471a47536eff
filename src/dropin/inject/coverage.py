"""How much of a model's work runs in dropin kernels, measured with the torch profiler on one step of the model.

FLOPs: those the profiler counts (`with_flops`: matrix products, 2-D convolutions, elementwise mul / add) and those
of torch's fused attention kernels, which it counts none for (`_attention_flops`: torch's FLOP counter's formulas for
scaled_dot_product_attention: two products forward, five backward), each op once, not again in the ops it calls, in
the torch ops of the injected model, against the same count for the original (a reverted copy). dropin's kernels
are Triton launches, which the profiler counts nothing for, so the share is 1 - torch's FLOPs left / the original's
FLOPs. GPU kernel time: the device time of dropin's Triton kernels (known by name) against all kernels (memset and
memcpy included); none under the interpreter.
"""
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .. import _runtime


@dataclass
class Coverage:
    flops: Optional[float]          # share of the original's FLOPs that no torch op ran in the injected model
    flops_total: int                # the original's FLOPs, as the profiler counts them
    flops_torch: int                # the FLOPs that torch ops still ran in the injected model
    kernel_time: Optional[float]    # share of the GPU kernel time in dropin kernels (None: interpreter)
    torch_kernels: list = field(default_factory=list)  # [(name, calls, ms)]: the torch kernels that ran; under
                                                        # the interpreter [(name, calls, FLOPs)]: torch's ops with FLOPs

    def __str__(self) -> str:
        flops = "-" if self.flops is None else f"{self.flops:.2%}"
        time = ("no GPU kernels (interpreter)" if self.kernel_time is None else
                f"{self.kernel_time:.1%} of the GPU kernel time in dropin kernels")
        gpu = self.kernel_time is not None
        lines = [f"coverage (torch profiler, one step): {flops} of the FLOPs in dropin ({self.flops_torch:.3g} of "
                 f"{self.flops_total:.3g} left to torch ops); {time}",
                 f"  {'torch kernels' if gpu else 'torch ops with FLOPs'} that still ran:"
                 + ("" if self.torch_kernels else " none")]
        lines += [f"    {f'{value:8.3f} ms' if gpu else f'{value:9.3g} FLOPs'}  x{calls:<4} {name[:100]}"
                  for name, calls, value in self.torch_kernels]
        return "\n".join(lines)


def dropin_kernels() -> frozenset:
    """Names of dropin's Triton kernels (the names the profiler gives their launches)."""
    names = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("dropin.ops") and module is not None:
            names.update(getattr(v, "fn", v).__name__ for v in vars(module).values()
                         if isinstance(v, (JITFunction, InterpretedFunction)))
    return frozenset(names)


def _attention_flops(event) -> int:
    """The FLOPs of one of torch's fused attention kernels (the backends scaled_dot_product_attention dispatches to:
    flash, efficient, cuDNN, the CPU's flash; not its math path, whose products the profiler counts), from the
    shapes of the query, key and value (the backward's after the output's gradient); 0 for any other op."""
    name = event.name
    if not name.startswith("aten::_scaled_dot_product_") or "_math" in name:
        return 0
    shapes = event.input_shapes
    if name.endswith("_backward"):
        return sdpa_backward_flop_count(*shapes[:4]) if len(shapes) >= 4 and all(shapes[:4]) else 0
    return sdpa_flop_count(*shapes[:3]) if len(shapes) >= 3 and all(shapes[:3]) else 0


def _flops(events) -> tuple:
    """(FLOPs of the ops not inside another counted op, {op name: [calls, FLOPs]})."""
    total, ops = 0, {}
    for e in events:
        parent = e.cpu_parent
        while parent is not None and not (parent.flops or _attention_flops(parent)):
            parent = parent.cpu_parent
        flops = e.flops or _attention_flops(e)
        if flops and parent is None:
            total += flops
            entry = ops.setdefault(e.name, [0, 0])
            entry[0] += 1
            entry[1] += flops
    return total, ops


def _profile(model: torch.nn.Module, run: Callable):
    # Kineto, the profiler's backend, logs each profile's start and stop (and, without a GPU, a failed device count)
    # on stderr: not for a user to read on every coverage measurement. Its level is read once, at its first use in
    # the process; one the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([] if _runtime.INTERPRET else [ProfilerActivity.CUDA])
    with warnings.catch_warnings():  # (torch's note that a profiler keeps one cycle's events: one is all it has)
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        with profile(activities=activities, with_flops=True, record_shapes=True) as p:
            run(model)
            if not _runtime.INTERPRET:
                torch.cuda.synchronize()
    return p


def measure(model: torch.nn.Module, original: torch.nn.Module, run: Callable) -> Coverage:
    """Coverage of the injected `model` against `original` (its torch counterpart), `run(m)` being one step of a
    model (a forward, or forward + backward). One unprofiled step first: the profiled one launches, not tunes."""
    run(model)
    total, _ = _flops(_profile(original, run).events())
    p = _profile(model, run)
    left, ops = _flops(p.events())
    coverage = Coverage(1 - left / total if total else None, total, left, None)
    if _runtime.INTERPRET:
        coverage.torch_kernels = sorted(((n, c, f) for n, (c, f) in ops.items()), key=lambda t: -t[2])
        return coverage
    ours, kernels = dropin_kernels(), {}
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            kernels[e.key] = (e.count, e.device_time_total / 1e3)
    all_ms = sum(ms for _, ms in kernels.values())
    torch_ms = sum(ms for name, (_, ms) in kernels.items() if name not in ours)
    coverage.kernel_time = 1 - torch_ms / all_ms if all_ms else None
    coverage.torch_kernels = sorted(((n, c, ms) for n, (c, ms) in kernels.items() if n not in ours),
                                    key=lambda t: -t[2])
    return coverage
