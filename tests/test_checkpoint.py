"""Activation checkpointing (torch.utils.checkpoint.checkpoint, use_reentrant=False) through dropin ops and injected
modules: the gradients are those of the same calls without checkpointing (bit for bit on the CPU, where the kernels
are deterministic and the backward recomputes the same forward) and within tolerance of float64 PyTorch."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dropin
from dropin.bench.models import float64_step, step_errors, train_step, upstream_gradient
from dropin.ops.attention import attention_ref
from dropin.ops.conv2d import conv2d_ref
from dropin.ops.matmul import linear_ref
from dropin.ops.rms_norm import rms_norm_ref
from dropin.ops.rope import rope_ref
from dropin.ops.swiglu import swiglu_mlp_ref
from _check import check
from _tol import DEVICE, ON_GPU, gpu, tolerance

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16", marks=gpu)]
# float32 in true fp32: the tolerance table's tf32 row follows cuda.matmul.allow_tf32, the convolutions cudnn's
pytestmark = pytest.mark.usefixtures("true_fp32")

# name -> (the dropin call, its reference, {argument: shape}[, arguments without a gradient]). Shapes that no other
# test uses: the first call of a signature runs under the checkpoint, the backward's recomputation is the second
# (the one that an eager shortcut kept by the first call serves).
OPS = {
    # (the linear's fp32 products sum 21-40 terms: with 10-term sums its input gradient went over the 2x rule by a
    # rare draw, 1.05x, in one GPU suite)
    "linear": (functools.partial(dropin.linear, activation="gelu"), functools.partial(linear_ref, activation="gelu"),
               {"x": (3, 7, 40), "weight": (36, 40), "bias": (36,)}),
    "conv2d": (functools.partial(dropin.conv2d, padding=1, activation="relu"),
               functools.partial(conv2d_ref, padding=1, activation="relu"),
               {"input": (2, 5, 5, 5), "weight": (10, 5, 3, 3), "bias": (10,)}),
    "rms_norm": (lambda x, w, r: dropin.rms_norm(x, w, 1e-6, residual=r), lambda x, w, r: rms_norm_ref(x, w, 1e-6, r),
                 {"x": (3, 5, 24), "weight": (24,), "residual": (3, 5, 24)}),
    # recompute=False keeps the projections on the autograd node, out of the checkpoint's reach (their memory stays),
    # and still gives the gradients; recompute=True keeps nothing of that size
    "swiglu_mlp": (functools.partial(dropin.swiglu_mlp, recompute=False), swiglu_mlp_ref,
                   {"x": (3, 5, 24), "gate_weight": (40, 24), "up_weight": (40, 24), "down_weight": (24, 40)}),
    "swiglu_mlp_recompute": (functools.partial(dropin.swiglu_mlp, recompute=True), swiglu_mlp_ref,
                             {"x": (3, 5, 24), "gate_weight": (40, 24), "up_weight": (40, 24),
                              "down_weight": (24, 40)}),
    "attention": (functools.partial(dropin.attention, is_causal=True), functools.partial(attention_ref, is_causal=True),
                  {"q": (1, 3, 10, 16), "k": (1, 3, 10, 16), "v": (1, 3, 10, 16)}),
    "rope": (dropin.rope, rope_ref, {"q": (1, 3, 10, 16), "k": (1, 3, 10, 16), "cos": (10, 16), "sin": (10, 16)},
             ("cos", "sin")),
    "layer_norm": (lambda x, w, b: dropin.ops.layer_norm(x, (24,), w, b), lambda x, w, b: F.layer_norm(x, (24,), w, b),
                   {"x": (3, 5, 24), "weight": (24,), "bias": (24,)}),
}


def checkpointed(fn):
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def outputs_and_gradients(fn, leaves: dict, constant: tuple, upstream: list) -> list:
    """fn's outputs and the gradients of the leaves not in `constant` for the upstream gradients `upstream`."""
    ins = {k: t.detach().requires_grad_(k not in constant) for k, t in leaves.items()}
    outs = fn(*ins.values())
    outs = outs if isinstance(outs, tuple) else (outs,)
    return [*outs, *torch.autograd.grad(outs, [t for t in ins.values() if t.requires_grad], upstream)]


def assert_same_as_without_checkpointing(got: list, plain: list) -> None:
    """Bit for bit on the CPU; on the GPU (where a backward's atomic adds may reorder sums) the float64 comparisons
    (check) bound both."""
    if not ON_GPU:
        for i, (a, b) in enumerate(zip(got, plain, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"output or gradient {i}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPS))
def test_checkpointed_op(name, dtype):
    op, ref, shapes, *constant = OPS[name]
    constant = constant[0] if constant else ()
    leaves = {k: torch.randn(shape, device=DEVICE, dtype=dtype) for k, shape in shapes.items()}
    check(checkpointed(op), ref, leaves, constant=constant, grad_layout=None)  # float64, 2x PyTorch's own error
    plain = op(*leaves.values())
    upstream = [torch.randn_like(t) for t in (plain if isinstance(plain, tuple) else (plain,))]
    assert_same_as_without_checkpointing(outputs_and_gradients(checkpointed(op), leaves, constant, upstream),
                                         outputs_and_gradients(op, leaves, constant, upstream))


def injected_llama(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=6,
                                      num_key_value_heads=3, intermediate_size=160, vocab_size=72, use_cache=False)
    original = transformers.LlamaForCausalLM(config).to(DEVICE, dtype).train()
    model = copy.deepcopy(original)
    dropin.inject_(model, verify=False)
    ids = torch.randint(0, 72, (2, 6), device=DEVICE)
    checkpointed_model = copy.deepcopy(model)
    # HF's own switch: each decoder layer through torch.utils.checkpoint (renamed in transformers 5.2x)
    enable = getattr(checkpointed_model, "activation_checkpointing_enable", None)
    (enable or checkpointed_model.gradient_checkpointing_enable)({"use_reentrant": False})
    return original, model, checkpointed_model, checkpointed_model, (ids,)


def injected_conv_bn(dtype):
    """An eval-mode conv + BatchNorm (folded, the fold computed in the call for autograd), ReLU, conv + GELU."""
    original = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3),
                             nn.GELU()).to(DEVICE, dtype).eval()
    model = copy.deepcopy(original)
    dropin.inject_(model, verify=False)
    return original, model, checkpointed(model), model, (torch.randn(2, 3, 6, 6, device=DEVICE, dtype=dtype),)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [injected_llama, injected_conv_bn], ids=["llama", "conv_bn"])
def test_checkpointed_injected_model(make, dtype):
    """A training step's output and parameter gradients (bench.models.train_step) through checkpointed injected
    modules, the model's first step: those of the injected model without checkpointing, and of the original in
    float64 within the backward tolerance."""
    original, model, forward, forward_model, inputs = make(dtype)
    grad = upstream_gradient(original, inputs)
    got = train_step(forward, forward_model, inputs, grad)
    plain = train_step(model, model, inputs, grad)
    assert_same_as_without_checkpointing([got[0], *got[1].values()], [plain[0], *plain[1].values()])
    assert got[1].keys() == plain[1].keys()
    errors = step_errors(got, float64_step(original, inputs, grad))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance(dtype, "bwd"), f"{worst}: relative error {errors[worst]:.2e}"
