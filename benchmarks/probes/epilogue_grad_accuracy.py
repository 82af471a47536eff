"""How often a linear with an activation epilogue gives an fp32 input or weight gradient over the 2x rule, and which
part of its chain carries the excess (the GPU suite's rare failures: celu / selu / tanh in
tests/inject/test_handlers.py, gelu in tests/test_checkpoint.py). Per trial, fresh inputs at the tests' shapes; the
relative errors against float64 of
  full: the input gradient, dropin's whole chain against torch's;
  full_w: the weight gradient, the same;
  z: the pre-activation (forward product + bias);
  gz: the activation's gradient dy * act'(z), each side from its own z;
  dgrad: gz @ w alone, both sides from torch's fp32 gz;
  wgrad: gz^T @ x alone, the same.
Prints quantiles of dropin/torch per part and the share of trials over 2x + noise (as tests/_tol.py).
Usage: PYTHONPATH=src python benchmarks/probes/epilogue_grad_accuracy.py [TRIALS [ACTIVATION ...]]"""
import sys

import torch
import torch.nn.functional as F

import dropin

ACTS = {"gelu": F.gelu, "celu": F.celu, "selu": F.selu, "silu": F.silu, "tanh": torch.tanh}
SHAPES = [((5, 16), 8, 2.0, 0.5), ((15, 24), 10, 1.0, 0.5), ((33, 48), 24, 2.0, 48 ** -0.5 * 2)]
# (x shape, out features, x scale, w scale): the tests' sizes, test_handlers' now the last
NOISE = 2 * 2.0 ** -24  # tests/_tol.py NOISE_ULPS unit roundoffs


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


def trial(act_name, x_shape, n_out, scale, w_scale):
    act = ACTS[act_name]
    x = (torch.randn(x_shape, device="cuda") * scale).requires_grad_()
    w = (torch.randn(n_out, x_shape[1], device="cuda") * w_scale).requires_grad_()
    b = torch.randn(n_out, device="cuda").requires_grad_()
    dy = torch.randn(x_shape[0], n_out, device="cuda")
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    z64 = F.linear(x64, w64, b64)
    y64 = act(z64)
    gx64, gw64, gz64 = torch.autograd.grad(y64, (x64, w64, z64), dy.double())
    out = {}
    y_d = dropin.linear(x, w, b, activation=act_name)
    gx_d, gw_d = torch.autograd.grad(y_d, (x, w), dy)
    z_t = F.linear(x, w, b)
    y_t = act(z_t)
    gx_t, gw_t, gz_t = torch.autograd.grad(y_t, (x, w, z_t), dy)
    out["full"] = (rel(gx_d, gx64), rel(gx_t, gx64))
    out["full_w"] = (rel(gw_d, gw64), rel(gw_t, gw64))
    z_d = dropin.linear(x.detach(), w.detach(), b.detach())
    out["z"] = (rel(z_d, z64), rel(z_t, z64))
    zd = z_d.detach().requires_grad_()
    gz_d, = torch.autograd.grad(sys.modules["dropin.ops.activations"].activation(zd, act_name), zd, dy)
    out["gz"] = (rel(gz_d, gz64), rel(gz_t, gz64))
    ref = gz_t.double() @ w64.detach()
    out["dgrad"] = (rel(dropin.matmul(gz_t, w.detach()), ref), rel(gz_t @ w.detach(), ref))
    ref = gz_t.double().T @ x64.detach()
    out["wgrad"] = (rel(dropin.matmul(gz_t.T, x.detach()), ref), rel(gz_t.T @ x.detach(), ref))
    return out


def main(trials, names):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    for act_name in names or ACTS:
        for x_shape, n_out, scale, w_scale in SHAPES:
            rows = [trial(act_name, x_shape, n_out, scale, w_scale) for _ in range(trials)]
            line = [f"{act_name:5s} x{x_shape} w{(n_out, x_shape[1])}"]
            for part in rows[0]:
                ratios = sorted(d / t for d, t in (r[part] for r in rows))
                over = sum(d > 2 * t + NOISE for d, t in (r[part] for r in rows))
                q = lambda p: ratios[min(len(ratios) - 1, int(p * len(ratios)))]  # noqa: E731
                line.append(f"{part}: med {q(0.5):.2f} p95 {q(0.95):.2f} max {ratios[-1]:.2f} over {over}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300, sys.argv[2:])
