"""Probe: conv2d's input gradient alone (dropin against torch), at CvT-13's strided patch embeddings (3x3, stride
2, padding 1; bf16, NCHW and channels_last) and a stride-1 control, timed with do_bench (median ms), with each
result's error against float64. Usage: PYTHONPATH=src python3 benchmarks/probes/conv_dgrad.py"""
import torch
import torch.nn.functional as F
import triton

import dropin

CASES = [  # (x shape, weight shape, stride, padding)
    ((64, 64, 56, 56), (192, 64, 3, 3), 2, 1),
    ((64, 192, 28, 28), (384, 192, 3, 3), 2, 1),
    ((64, 64, 56, 56), (64, 64, 3, 3), 1, 1),
    ((64, 3, 224, 224), (64, 3, 7, 7), 4, 2),
]


def main():
    for xs, ws, stride, padding in CASES:
        for channels_last in (False, True):
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            x = torch.randn(xs, device="cuda", dtype=torch.bfloat16).to(memory_format=fmt).requires_grad_()
            w = (torch.randn(ws, device="cuda", dtype=torch.bfloat16) / (ws[1] * ws[2] * ws[3]) ** 0.5)
            w = w.to(memory_format=fmt)
            y = F.conv2d(x, w, None, stride, padding)
            dy = torch.randn_like(y)
            ref = torch.autograd.grad(F.conv2d(x.double(), w.double(), None, stride, padding), x, dy.double())[0]
            row = []
            for name, conv in (("torch", F.conv2d), ("dropin", dropin.ops.conv2d)):
                grad = lambda: torch.autograd.grad(conv(x, w, None, stride, padding), x, dy)[0]
                forward = triton.testing.do_bench(lambda: conv(x, w, None, stride, padding))
                total = triton.testing.do_bench(grad)
                err = ((grad().double() - ref).norm() / ref.norm()).item()
                row.append(f"{name} fwd+dgrad {total:.3f} (fwd {forward:.3f}) err {err:.1e}")
            print(f"x{list(xs)} w{list(ws)} s{stride} {'NHWC' if channels_last else 'NCHW'}: " + "; ".join(row))


if __name__ == "__main__":
    main()
