"""Small models and checks shared by the inject tests (the Triton interpreter is slow: few channels).

Whole models are checked against float64 with the dtype's tolerance alone: the "not worse than 2x PyTorch's
error" rule is the op tests' (through a deep model, and a training BatchNorm over a few numbers per channel,
the ratio of two rounding errors is noise: it failed about one run in three at errors near 1e-6 in float32). Where
PyTorch's own error is over the tolerance (an ill-conditioned reference), `check_backward` takes the original's
gradients as the peer: 2x its error then.
"""
import copy
import logging
import re

import torch
from torch import nn

import dropin
from _tol import DEVICE, assert_close, rel_err, tolerance


def randomize_batchnorms(model: nn.Module) -> nn.Module:
    """Running statistics and affine parameters away from the identity, so that folding them shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def cnn(conv_bias: bool = False) -> nn.Module:
    """(conv_bias: a conv bias before a training-mode BatchNorm has a zero gradient, which no relative error fits)"""
    return randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=conv_bias), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 2 * 2, 16), nn.GELU(), nn.Linear(16, 4),
    )).to(DEVICE)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(approximate="tanh"),
                         nn.Linear(32, 16), nn.SiLU(), nn.Linear(16, 8)).to(DEVICE)


def snapshot(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, expected: dict) -> None:
    state = model.state_dict()
    assert list(state) == list(expected)
    for k, v in expected.items():
        assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


def check_forward(injected: nn.Module, original: nn.Module, x: torch.Tensor, reference_grad: bool = False) -> None:
    """The injected model's output against the original's in float64 (both without autograd; with
    reference_grad the reference runs with it: torch's fused inference kernels, e.g. nn.TransformerEncoderLayer's,
    are 3e-5 off in float64 too)."""
    with torch.no_grad():
        out = injected(x)
    with torch.set_grad_enabled(reference_grad):
        ref = copy.deepcopy(original).double()(x.double()).detach()
    assert_close(out, ref, x.dtype, "fwd")


def check_backward(injected: nn.Module, original: nn.Module, x: torch.Tensor) -> None:
    """Output, input gradient and every trainable parameter's gradient against the original's in float64 for a random
    upstream gradient. The original runs too: in training mode each model updates its own BatchNorm statistics; its
    gradients are the peer where the reference is ill-conditioned (PyTorch's own error over the tolerance: a
    training BatchNorm's weight over a 1x1 stage, torch 2.3e-4 against 1e-4, dropin 2.0e-4)."""
    runs = []
    for model, dtype in ((injected, x.dtype), (original, x.dtype), (copy.deepcopy(original).double(), torch.float64)):
        xi = x.to(dtype).requires_grad_()
        names, params = zip(*sorted((n, p) for n, p in model.named_parameters() if p.requires_grad))
        runs.append((model(xi), [xi, *params]))
    grad = torch.randn_like(runs[0][0])
    (out, grads), (_, grads_t), (ref, grads_64) = [(out, torch.autograd.grad(out, leaves, grad.to(out.dtype)))
                                                   for out, leaves in runs]
    assert_close(out, ref, x.dtype, "fwd")
    for name, g, g_t, g_64 in zip(["input", *names], grads, grads_t, grads_64):
        peer = g_t if rel_err(g_t, g_64) > tolerance(x.dtype, "bwd") else None
        assert_close(g, g_64, x.dtype, "bwd", torch_out=peer, what=f"gradient of {name}")


def injected_pair(make, train=False, **inject_kw):
    """(injected model, its original as a deep copy, the report)."""
    model = make().train(train)
    original = copy.deepcopy(model)
    report = dropin.inject_(model, **inject_kw)
    return model, original, report


def assert_same_random_draws(injected: nn.Module, original: nn.Module, call, seeds: int = 3) -> None:
    """call(model)'s output of the injected and the original model (training mode: stochastic depth, dropout) from
    the same seeds: the same (their random draws made alike)."""
    for seed in range(seeds):
        outs = []
        for model in (injected, original):
            torch.manual_seed(seed)
            outs.append(call(model))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


def check_hf_backward(injected: nn.Module, original: nn.Module, inputs: dict, key: str, params: list) -> None:
    """Output `key` of a HF model called with `inputs` (keyword arguments), and the gradients of the named
    parameters for a random upstream gradient, against the original's in float64."""
    reference = copy.deepcopy(original).double()
    inputs_64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    out, ref = injected(**inputs)[key], reference(**inputs_64)[key]
    grad = torch.randn_like(ref)
    grads = torch.autograd.grad(out, [injected.get_parameter(p) for p in params], grad.to(out.dtype))
    grads_64 = torch.autograd.grad(ref, [reference.get_parameter(p) for p in params], grad)
    assert_close(out, ref, out.dtype, "fwd")
    for name, g, g_64 in zip(params, grads, grads_64):
        assert_close(g, g_64, out.dtype, "bwd", what=f"gradient of {name}")


def compiled_guards(model, x) -> list:
    """The guards torch.compile (Dynamo, no Inductor: the captured graph runs eagerly) puts on a call of model."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.guards.__guards")  # (the "guards" artifact's logger)
    torch._dynamo.reset()
    torch._logging.set_logs(guards=True)
    log.addHandler(handler)
    log.propagate = False  # (here, not on stderr)
    try:
        with torch.no_grad():
            torch.compile(model, backend="eager")(x)
    finally:
        log.removeHandler(handler)
        log.propagate = True
        torch._logging.set_logs()
        torch._dynamo.reset()
    return [line for record in records for line in record.splitlines() if re.search(r"\+- [A-Z_]+: ", line)]
