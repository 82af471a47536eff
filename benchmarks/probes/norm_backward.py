"""Probe: the GPU kernel time (torch profiler, ms a call) of the LayerNorm and BatchNorm training backward at
CvT-13's shapes (batch 64, bf16), dropin against torch, with the layouts the model gives them: LayerNorm over
tokens [B, HW, C] that are a permuted NCHW feature map (and dy so too) or contiguous; BatchNorm of NCHW maps.
Each backward's error against float64. Usage: PYTHONPATH=src python3 benchmarks/probes/norm_backward.py"""
import torch
import torch.nn.functional as F

import dropin
from compile_profile import kernel_times

LN_SHAPES = [(64, 3136, 64), (64, 784, 192), (64, 197, 384)]
BN_SHAPES = [(64, 64, 56, 56), (64, 192, 28, 28), (64, 384, 14, 14)]


def gpu_ms(fn, iters=10):
    """(GPU kernel ms a call, {kernel: ms a call}) of fn, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    kernels = {name: ms for name, (_, ms) in kernel_times(fn, iters).items()}
    return sum(kernels.values()), kernels


def tokens(shape, permuted):
    b, hw, c = shape
    if permuted:
        return torch.randn(b, c, hw, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1)
    return torch.randn(b, hw, c, device="cuda", dtype=torch.bfloat16)


def compare(label, make, ops):
    """make() -> (inputs requiring grad, dy); ops: {name: f(*inputs) -> y}."""
    inputs, dy = make()
    ref = torch.autograd.grad(ops["float64"](*[t.double() for t in inputs]), inputs, dy.double())
    row = []
    for name, op in ops.items():
        if name == "float64":
            continue
        y = op(*inputs)
        grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
        err = max(((g.double() - r).norm() / r.norm()).item() for g, r in zip(grads, ref))
        ms, kernels = gpu_ms(lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True))
        top = ", ".join(f"{k[:40]} {v:.3f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
        row.append(f"{name} {ms:.3f} ms (err {err:.1e}; {top})")
    print(f"{label}:\n  " + "\n  ".join(row))


def main():
    for shape in LN_SHAPES:
        c = shape[-1]
        for x_perm, dy_perm in ((False, False), (True, True), (True, False), (False, True)):
            def make():
                x = tokens(shape, x_perm).requires_grad_()
                w = (1 + 0.1 * torch.randn(c, device="cuda", dtype=torch.bfloat16)).requires_grad_()
                b = (0.1 * torch.randn(c, device="cuda", dtype=torch.bfloat16)).requires_grad_()
                return (x, w, b), tokens(shape, dy_perm)
            compare(f"layer_norm {shape} x {'permuted' if x_perm else 'contiguous'}, dy "
                    f"{'permuted' if dy_perm else 'contiguous'}", make,
                    {"float64": lambda x, w, b: F.layer_norm(x, (c,), w, b),
                     "torch": lambda x, w, b: F.layer_norm(x, (c,), w, b),
                     "dropin": lambda x, w, b: dropin.ops.layer_norm(x, (c,), w, b)})
    for shape in BN_SHAPES:
        c = shape[1]

        def make():
            x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
            w = (1 + 0.1 * torch.randn(c, device="cuda", dtype=torch.bfloat16)).requires_grad_()
            b = (0.1 * torch.randn(c, device="cuda", dtype=torch.bfloat16)).requires_grad_()
            return (x, w, b), torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        compare(f"batch_norm train {shape}", make,
                {"float64": lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
                 "torch": lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
                 "dropin": lambda x, w, b: dropin.ops.batch_norm(x, None, None, w, b, True)})


if __name__ == "__main__":
    main()
