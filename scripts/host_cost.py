"""Python (host) cost of dropin calls on the CPU machine, every kernel launch stubbed (Launcher, `kernel[grid]`).

Per op: us per call of the public function (no_grad, shapes already seen) vs small torch calls.
Per model: ms per injected forward (no_grad) and the number of module calls.
`--models-only`; `--profile MODEL [SORT]`: a cProfile of 10 forwards; `--grad`: ops with grad enabled and parameters
requiring it. Usage: PYTHONPATH=src python3 scripts/host_cost.py
"""
import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import dropin  # before triton: dropin._runtime switches the interpreter on
from triton.runtime.jit import KernelInterface  # noqa: E402
from dropin import _runtime as rt
from dropin import ops
from dropin.cli import LLAMA_TINY, _cvt, _llama, build_parser

print("dropin from", dropin.__file__, file=sys.stderr)
GRAD = "--grad" in sys.argv
REAL = {}


def stub():
    REAL["launcher"], REAL["getitem"] = rt.Launcher.__call__, KernelInterface.__getitem__
    rt.Launcher.__call__ = lambda self, *a: None
    KernelInterface.__getitem__ = lambda self, grid: (lambda *a, **k: None)


def unstub():
    rt.Launcher.__call__, KernelInterface.__getitem__ = REAL["launcher"], REAL["getitem"]


def per_call(fn, n=300):
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def op_cases():
    r = lambda *s, **k: torch.randn(*s, **k)
    p = lambda *s: torch.randn(*s, requires_grad=GRAD)
    x2, w, b = r(64, 256), p(256, 256), p(256)
    x3 = r(2, 16, 256)
    img = r(2, 64, 8, 8)
    img_cl = img.to(memory_format=torch.channels_last)
    w3, w1, wd = p(64, 64, 3, 3), p(64, 64, 1, 1), p(64, 1, 3, 3)
    q = r(2, 4, 16, 32)
    cos, sin = r(2, 16, 32), r(2, 16, 32)
    ln_w, ln_b = p(256), p(256)
    mean, var = r(64), r(64).abs()
    wg, wu, wdn = p(128, 256), p(128, 256), p(256, 128)
    tiny = r(4)
    return [
        ("torch.add (tiny)", lambda: torch.add(tiny, tiny)),
        ("torch F.linear (tiny 1x4)", lambda: F.linear(tiny[None], tiny[None])),
        ("linear 2-D + bias", lambda: ops.linear(x2, w, b)),
        ("linear 3-D + bias + gelu", lambda: ops.linear(x3, w, b, "gelu")),
        ("matmul 3-D", lambda: ops.matmul(x3, w)),
        ("conv2d 3x3", lambda: ops.conv2d(img, w3, None, 1, 1)),
        ("conv2d 3x3 + bias + relu + residual", lambda: ops.conv2d(img, w3, b[:64], 1, 1, activation="relu",
                                                                  residual=img)),
        ("conv2d 1x1 channels_last", lambda: ops.conv2d(img_cl, w1)),
        ("conv2d depthwise 3x3", lambda: ops.conv2d(img, wd, None, 1, 1, groups=64)),
        ("layer_norm", lambda: ops.layer_norm(x3, (256,), ln_w, ln_b)),
        ("batch_norm (eval)", lambda: ops.batch_norm(img, mean, var, ln_w[:64], ln_b[:64], False, 0.1, 1e-5)),
        ("rms_norm", lambda: ops.rms_norm(x3, ln_w)),
        ("attention (causal)", lambda: ops.attention(q, q, q, is_causal=True)),
        ("rope", lambda: ops.rope(q, q, cos, sin)),
        ("swiglu_mlp", lambda: ops.swiglu_mlp(x3, wg, wu, wdn)),
        ("activation gelu", lambda: ops.activation(x3, "gelu")),
        ("softmax", lambda: ops.softmax(x3, -1)),
        ("max_pool2d 3x3/2", lambda: ops.max_pool2d(img, 3, 2, 1)),
        ("adaptive_avg_pool2d 1", lambda: ops.adaptive_avg_pool2d(img, 1)),
    ]


def models():
    args = build_parser().parse_args(["inject", "cvt-13"])
    args.weights = None
    yield "CvT-13 (tiny config) 1x3x32x32", _cvt(args).eval(), (torch.randn(1, 3, 32, 32),)
    import torchvision
    yield "ResNet-50 1x3x64x64", torchvision.models.resnet50().eval(), (torch.randn(1, 3, 64, 64),)
    args = build_parser().parse_args(["inject", "llama"])
    args.weights = None
    for k, v in LLAMA_TINY.items():
        setattr(args, k, v)
    model = _llama(args).eval()
    yield "Llama (tiny, 1 layer) 2x8 tokens", model, (torch.randint(0, 32000, (2, 8)),)


def count_calls(model, inputs):
    n = [0]
    hooks = [m.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
             for m in model.modules() if isinstance(m, dropin.nn.DropinModule)]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    return n[0]


def main():
    torch.manual_seed(0)
    profile = sys.argv[sys.argv.index("--profile") + 1] if "--profile" in sys.argv else None
    if "--models-only" not in sys.argv:
        cases = op_cases()
        with torch.no_grad() if not GRAD else torch.enable_grad():
            for _, fn in cases:  # first calls: real launches (validation, plans, compiled interpreter paths)
                fn()
            stub()
            for name, fn in cases:
                print(f"| {name} | {per_call(fn):.1f} |")
            unstub()
    for name, model, inputs in models():
        if profile and profile.lower() not in name.lower():
            continue
        with torch.no_grad():
            eager = per_call(lambda: model(*inputs), n=5) / 1e3
        dropin.inject_(model, example_inputs=inputs, verify=False)
        calls = count_calls(model, inputs)
        stub()
        with torch.no_grad():
            ms = per_call(lambda: model(*inputs), n=20) / 1e3
            print(f"| {name} | {ms:.2f} ms | {calls} dropin module calls | eager original (real CPU compute) "
                  f"{eager:.2f} ms |")
            if profile:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(10):
                    model(*inputs)
                pr.disable()
                pstats.Stats(pr).sort_stats(sys.argv[sys.argv.index("--profile") + 2]
                                            if len(sys.argv) > sys.argv.index("--profile") + 2 else "tottime"
                                            ).print_stats(45)
        unstub()


main()
