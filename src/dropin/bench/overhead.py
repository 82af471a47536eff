"""Suite "overhead": the host (CPU) time of one call of every public op against its PyTorch peer, at a tiny shape
where the GPU is idle most of the time, so that the time per call of a long loop of calls is the Python and launch
cost alone. For a fused op the peer is the sequence of torch ops it replaces (HF's RMSNorm, rotary embedding and
MLP; conv + bias + residual add + ReLU).

Two modes: `no_grad` (the forward under torch.no_grad: inference) and `grad` (forward and backward of inputs that
require grad: training). Each figure is the median over `repeats` loops of `calls` calls (min and max beside it).
DESIGN.md's eager contract: after the first call with a signature, dropin's host cost is at most torch's + 5 us.
Under the Triton interpreter the kernels run on the CPU: the figures are not host costs there.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import dropin
from dropin import _runtime, ops
from dropin.ops.rms_norm import rms_norm_ref
from dropin.ops.rope import rope_ref
from dropin.ops.swiglu import swiglu_mlp_ref

from . import harness

BUDGET_US = 5.0  # DESIGN.md: dropin's host cost <= torch's own + 5 us


@dataclass
class Pair:
    """One public op at a tiny shape: make() gives fresh inputs (float tensors first, the ones a gradient flows to
    are the first `n_grad`); dropin and torch take them and return a tensor or a tuple of tensors."""
    name: str
    make: Callable[[], tuple]
    dropin: Callable
    torch: Callable
    n_grad: int = 1


def _t(*shape, dtype=None, channels_last=False):
    t = harness.randn(*shape, dtype=dtype or _dtype())
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def _dtype():
    return torch.float32 if _runtime.INTERPRET else torch.bfloat16


def _rope_tables(seq, dim):
    angles = torch.outer(torch.arange(seq, device=_runtime.KERNEL_DEVICE, dtype=torch.float32),
                         torch.rand(dim // 2, device=_runtime.KERNEL_DEVICE))
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(_dtype()), angles.sin().to(_dtype())


def _sparse_weight(n, k):
    w = _t(n, k)
    return w * (torch.rand_like(w, dtype=torch.float32) > 0.9)


def pairs() -> list[Pair]:
    """The public ops (dropin.ops.__all__) at tiny shapes, with their torch peers."""
    conv_w = _t(16, 16, 3, 3, channels_last=True)
    sparse_conv_w = _sparse_weight(16, 144).view(16, 16, 3, 3)
    linear_w = _sparse_weight(64, 256)
    # sparsify runs once per weight (at inject time), not per call nor under torch.compile: dropin's ops take these
    sparse_conv_sw, linear_sw = ops.sparsify(sparse_conv_w), ops.sparsify(linear_w)
    return [
        Pair("matmul", lambda: (_t(64, 64), _t(64, 64)), dropin.matmul, torch.matmul, 2),
        Pair("bmm", lambda: (_t(4, 32, 32), _t(4, 32, 32)), dropin.bmm, torch.bmm, 2),
        Pair("linear+gelu", lambda: (_t(64, 128), _t(128, 128), _t(128)),
             lambda x, w, b: dropin.linear(x, w, b, activation="gelu"),
             lambda x, w, b: F.gelu(F.linear(x, w, b)), 3),
        Pair("conv2d", lambda: (_t(2, 16, 8, 8, channels_last=True), conv_w.clone(), _t(16)),
             lambda x, w, b: dropin.conv2d(x, w, b, padding=1), lambda x, w, b: F.conv2d(x, w, b, padding=1), 3),
        Pair("conv2d+residual+relu", lambda: (_t(2, 16, 8, 8, channels_last=True), conv_w.clone(), _t(16),
                                              _t(2, 16, 8, 8, channels_last=True)),
             lambda x, w, b, r: dropin.conv2d(x, w, b, padding=1, activation="relu", residual=r),
             lambda x, w, b, r: F.relu(F.conv2d(x, w, b, padding=1) + r), 3),
        Pair("attention", lambda: (_t(1, 2, 64, 64), _t(1, 2, 64, 64), _t(1, 2, 64, 64)),
             lambda q, k, v: dropin.attention(q, k, v, is_causal=True),
             lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), 3),
        Pair("rms_norm", lambda: (_t(64, 256), _t(256)), lambda x, w: dropin.rms_norm(x, w, 1e-6),
             lambda x, w: rms_norm_ref(x, w, 1e-6), 2),
        Pair("rms_norm+residual", lambda: (_t(64, 256), _t(256), _t(64, 256)),
             lambda x, w, r: dropin.rms_norm(x, w, 1e-6, residual=r),
             lambda x, w, r: rms_norm_ref(x, w, 1e-6, residual=r), 3),
        Pair("rope", lambda: (_t(1, 2, 64, 64), _t(1, 2, 64, 64), *_rope_tables(64, 64)),
             dropin.rope, rope_ref, 2),
        Pair("swiglu_mlp", lambda: (_t(64, 128), _t(256, 128), _t(256, 128), _t(128, 256)),
             dropin.swiglu_mlp, swiglu_mlp_ref, 4),
        Pair("max_pool2d", lambda: (_t(2, 16, 16, 16, channels_last=True),),
             lambda x: ops.max_pool2d(x, 3, 2, 1), lambda x: F.max_pool2d(x, 3, 2, 1)),
        Pair("avg_pool2d", lambda: (_t(2, 16, 16, 16, channels_last=True),),
             lambda x: ops.avg_pool2d(x, 2), lambda x: F.avg_pool2d(x, 2)),
        Pair("adaptive_avg_pool2d", lambda: (_t(2, 16, 16, 16, channels_last=True),),
             lambda x: ops.adaptive_avg_pool2d(x, 1), lambda x: F.adaptive_avg_pool2d(x, 1)),
        Pair("layer_norm", lambda: (_t(64, 256), _t(256), _t(256)),
             lambda x, w, b: ops.layer_norm(x, (256,), w, b), lambda x, w, b: F.layer_norm(x, (256,), w, b), 3),
        Pair("batch_norm eval", lambda: (_t(2, 16, 8, 8, channels_last=True), _t(16), _t(16),
                                         _t(16, dtype=torch.float32), _t(16, dtype=torch.float32).abs() + 1),
             lambda x, w, b, m, v: ops.batch_norm(x, m, v, w, b, training=False),
             lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=False), 3),
        Pair("batch_norm train", lambda: (_t(2, 16, 8, 8, channels_last=True), _t(16), _t(16),
                                          _t(16, dtype=torch.float32), _t(16, dtype=torch.float32).abs() + 1),
             lambda x, w, b, m, v: ops.batch_norm(x, m, v, w, b, training=True),
             lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=True), 3),
        Pair("softmax", lambda: (_t(64, 256),), lambda x: ops.softmax(x, -1), lambda x: torch.softmax(x, -1)),
        Pair("log_softmax", lambda: (_t(64, 256),), lambda x: ops.log_softmax(x, -1),
             lambda x: torch.log_softmax(x, -1)),
        Pair("relu", lambda: (_t(64, 256),), ops.relu, F.relu),
        Pair("gelu", lambda: (_t(64, 256),), ops.gelu, F.gelu),
        Pair("silu", lambda: (_t(64, 256),), ops.silu, F.silu),
        Pair("sparse_linear", lambda: (_t(4, 256), linear_w),
             lambda x, w: ops.sparse_linear(x, linear_sw), lambda x, w: F.linear(x, w)),
        Pair("sparse_conv2d", lambda: (_t(1, 16, 8, 8), sparse_conv_w),
             lambda x, w: ops.sparse_conv2d(x, sparse_conv_sw, padding=1), lambda x, w: F.conv2d(x, w, padding=1)),
    ]


def _sync():
    if not _runtime.INTERPRET:
        torch.cuda.synchronize()


def host_us(call: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """us of host time per call: `repeats` loops of `calls` calls each, the device synchronized only between
    loops (a tiny op's kernels finish long before the host has launched the next call's)."""
    for _ in range(max(3, calls // 10)):
        call()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return samples


def timed_call(pair: Pair, provider: Callable, mode: str) -> Callable[[], object]:
    inputs = pair.make()
    if mode == "no_grad":
        def forward():
            with torch.no_grad():
                return provider(*inputs)
        return forward
    leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
    out = provider(*leaves)
    grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

    def forward_backward():
        out = provider(*leaves)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)
    return forward_backward


def measure(calls: int = 1000, repeats: int = 5, names: list[str] | None = None, log=print) -> list[dict]:
    """One row per (op, mode, provider): host_us (median of the loops), min, max, and for dropin the difference to
    torch's and whether it is within BUDGET_US."""
    rows = []
    for pair in pairs():
        if names and not any(n in pair.name for n in names):
            continue
        for mode in ("no_grad", "grad"):
            found = {}
            for provider in ("torch", "dropin"):
                try:
                    samples = host_us(timed_call(pair, getattr(pair, provider), mode), calls, repeats)
                except Exception as e:  # noqa: BLE001 (a row with the error; the others still run)
                    rows.append(dict(case=pair.name, mode=mode, provider=provider, error=f"{type(e).__name__}: {e}"))
                    continue
                row = dict(case=pair.name, mode=mode, provider=provider, host_us=statistics.median(samples),
                           host_us_min=min(samples), host_us_max=max(samples), samples=samples)
                found[provider] = row
                rows.append(row)
            if len(found) == 2:
                extra = found["dropin"]["host_us"] - found["torch"]["host_us"]
                found["dropin"].update(over_torch_us=extra, within_budget=extra <= BUDGET_US)
                log(f"{pair.name:22s} {mode:8s} torch {found['torch']['host_us']:7.1f} us  "
                    f"dropin {found['dropin']['host_us']:7.1f} us  ({extra:+.1f})")
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'op':22s} {'mode':8s} {'torch us':>9s} {'dropin us':>10s} {'diff':>7s}  within +{BUDGET_US:g} us"]
    by_key = {}
    for r in rows:
        by_key.setdefault((r["case"], r["mode"]), {})[r["provider"]] = r
    for (case, mode), found in by_key.items():
        t, d = found.get("torch", {}), found.get("dropin", {})
        if "host_us" not in t or "host_us" not in d:
            err = d.get("error") or t.get("error")
            lines.append(f"{case:22s} {mode:8s} error: {err}")
            continue
        lines.append(f"{case:22s} {mode:8s} {t['host_us']:9.1f} {d['host_us']:10.1f} {d['over_torch_us']:+7.1f}  "
                     f"{'yes' if d['within_budget'] else 'NO'}")
    return "\n".join(lines)


def run(args) -> int:
    """`dropin bench overhead`: measure, print the table, write <results_dir>/<gpu>/overhead.json."""
    calls, repeats = (20, 3) if _runtime.INTERPRET or args.quick else (1000, 5)
    names = [args.cases] if args.cases else None
    rows = measure(calls, repeats, names, log=lambda line: print(line, file=sys.stderr))
    if not rows:
        print(f"dropin bench: no case of suite 'overhead' matches --cases {args.cases!r}; cases: "
              + ", ".join(p.name for p in pairs()), file=sys.stderr)
        return 2
    env = harness.environment("overhead", " ".join(["dropin", *args.argv]), {})
    env["timing"] = (f"host time per call: median of {repeats} loops of {calls} calls (perf_counter), device "
                     "synchronized between loops" + ("; Triton interpreter: kernels run on the CPU, not host costs"
                                                     if _runtime.INTERPRET else ""))
    print(format_table(rows))
    if _runtime.INTERPRET:
        print("note: under the Triton interpreter the kernels run on the CPU; these are not host costs.")
    result = {"env": env, "rows": rows}
    if not args.no_save:
        path = harness.write_json(f"{args.results_dir}/{_runtime.gpu_slug()}/overhead.json", result)
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        harness.write_json(args.json, result)
    return 0
