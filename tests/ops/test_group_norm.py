"""dropin.ops.group_norm against F.group_norm (and an activation after it): forward and the gradients of input, weight
and bias vs float64 and the 2x rule (tests/_check.py); groups 1 / C / between, odd channels and spatial sizes, groups
of several tiles, channels_last and strided views, repeat calls through the eager shortcuts, the registered ops,
torch.compile, every error path."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import _check
import dropin.ops as ops
from _check import CL, check
from _tol import DEVICE, DTYPES, gpu
from dropin.ops.group_norm import group_norm_ref


def _leaves(shape, dtype=torch.float32, weight=True, bias=True, channels_last=False):
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 2 + 0.5
    out = {"x": x.contiguous(memory_format=CL) if channels_last else x}
    if weight:
        out["w"] = torch.randn(shape[1], dtype=dtype, device=DEVICE)
    if bias:
        out["b"] = torch.randn(shape[1], dtype=dtype, device=DEVICE)
    return out


def _gn(fn, groups, eps=1e-5, activation=None):
    return lambda x, w=None, b=None: fn(x, groups, w, b, eps, activation)


def _peer(groups, eps=1e-5, activation=None):
    """torch in the test dtype, its output in input's memory format (dropin's rule; torch's CUDA kernel gives
    channels_last inputs a contiguous output)."""
    def run(x, w=None, b=None):
        y = group_norm_ref(x, groups, w, b, eps, activation)
        return y.contiguous(memory_format=CL if x.dim() == 4 and x.is_contiguous(memory_format=CL) else
                            torch.contiguous_format)
    return run


def _check_gn(leaves, groups, eps=1e-5, activation=None, **kwargs):
    check(_gn(ops.group_norm, groups, eps, activation), _gn(group_norm_ref, groups, eps, activation), leaves,
          peer=_peer(groups, eps, activation), grad_layout="input", **kwargs)


SHAPES = {  # id -> (shape, groups)
    "between-2x6x5x7-g3": ((2, 6, 5, 7), 3),
    "one-group-3x5x11": ((3, 5, 11), 1),
    "instance-2x7x3x5-g7": ((2, 7, 3, 5), 7),
    "no-spatial-2x12-g4": ((2, 12), 4),
    "5d-1x4x2x3x3-g2": ((1, 4, 2, 3, 3), 2),
    "channel-tiles-2x130x4x4-g2": ((2, 130, 4, 4), 2),
    "pixel-tiles-1x2x70x70-g2": ((1, 2, 70, 70), 2),
}


@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes(case, dtype):
    """Groups of one channel, all of them and between; groups over several channel tiles or pixel tiles."""
    shape, groups = SHAPES[case]
    _check_gn(_leaves(shape, dtype), groups)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 7), 3), ((2, 8, 3, 3), 8), ((2, 96, 3, 5), 4)])
def test_channels_last(shape, groups, dtype):
    """channels_last input read through its strides, output and input gradient channels_last."""
    leaves = _leaves(shape, dtype, channels_last=True)
    _check_gn(leaves, groups)
    assert ops.group_norm(leaves["x"], groups).is_contiguous(memory_format=CL)


@pytest.mark.parametrize("view", ["length-last", "sliced-channels", "copied"])
def test_strided_inputs(view):
    """A [N, L, C] tensor transposed (unit channel stride), a slice of the channels, spatial dims that do not merge
    (copied once)."""
    base = torch.randn(2, 12, 6, 5, device=DEVICE)
    x = {"length-last": base[:, :, 0].transpose(1, 2).contiguous().transpose(1, 2),
         "sliced-channels": base[:, ::2], "copied": base.transpose(2, 3)}[view]
    _check_gn({"x": x, "w": torch.randn(x.shape[1], device=DEVICE), "b": torch.randn(x.shape[1], device=DEVICE)}, 3)


@pytest.mark.parametrize("weight,bias", [(True, False), (False, True), (False, False)])
def test_optional_affine(weight, bias):
    _check_gn(_leaves((2, 6, 4, 3), weight=weight, bias=bias), 2)


@pytest.mark.parametrize("activation", ["relu", "relu6", "gelu", "gelu_tanh", "silu", "tanh", "mish", "elu", "selu",
                                        "celu", "softplus"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_activation(activation, dtype):
    """activation(group_norm(x)), the activation's gradient inside the norm's backward; also without weight."""
    _check_gn(_leaves((2, 8, 5, 3), dtype), 4, activation=activation)
    _check_gn(_leaves((2, 8, 7), dtype, weight=False), 2, activation=activation)


# the module (dropin.ops.group_norm is the function)
group_norm_module = importlib.import_module("dropin.ops.group_norm")


def test_merge_steps(monkeypatch):
    """Groups of more tiles than one merge step takes (tiles and steps made small: 11 tiles of 2 x 8, merged 8 at a
    time), forward and backward."""
    monkeypatch.setattr(group_norm_module, "TILE", 16)
    monkeypatch.setattr(group_norm_module, "MERGE", 8)
    _check_gn(_leaves((1, 4, 9, 9)), 2, activation="silu")


def test_single_element_groups_and_eps():
    """Groups of one element: the output is the bias (x - mean = 0, and the gradients of x and w are exactly 0:
    float64 torch gives rounding noise, so only b is compared); a large eps."""
    _check_gn(_leaves((3, 4)), 4, constant=("x", "w"))
    _check_gn(_leaves((2, 6, 5)), 3, eps=0.5)


def test_mixed_precision_params():
    """fp16 input with fp32 weight and bias: fp16 output, fp32 parameter gradients."""
    leaves = {"x": torch.randn(2, 8, 5, device=DEVICE, dtype=torch.float16), "w": torch.randn(8, device=DEVICE),
              "b": torch.randn(8, device=DEVICE)}
    ref = lambda x, w, b: F.group_norm(x, 4, w.to(x.dtype), b.to(x.dtype))  # noqa: E731
    check(_gn(ops.group_norm, 4), ref, leaves, grad_layout="input")


def test_partial_gradients_no_grad_and_empty():
    leaves = _leaves((2, 6, 9), dtype=torch.float32)
    _check_gn(leaves, 3, constant=("x", "b"))
    _check_gn(leaves, 3, constant=("w",))
    with torch.no_grad():
        assert not ops.group_norm(leaves["x"].requires_grad_(), 3, leaves["w"], leaves["b"]).requires_grad
    assert ops.group_norm(torch.randn(0, 6, 4, device=DEVICE), 3).shape == (0, 6, 4)


def test_repeat_calls_through_the_shortcut(monkeypatch):
    """Repeat calls without autograd (contiguous, channels_last, a slice, fused activation) take the shortcut that
    the first call of their signature kept and give what it gave, in its layout (new allocations NaN-filled)."""
    base = torch.randn(2, 12, 6, 5, device=DEVICE)
    w, b = torch.randn(12, device=DEVICE), torch.randn(12, device=DEVICE)
    calls = [lambda: ops.group_norm(base, 3, w, b), lambda: ops.group_norm(base.contiguous(memory_format=CL), 4, w),
             lambda: ops.group_norm(base[:, ::2], 2, None, b[:6], 1e-3, "silu")]
    _check.assert_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """As above where autograd records the calls: forward and backward through the kept plans."""
    base = torch.randn(2, 12, 6, 5, device=DEVICE)
    calls = [(lambda x, w, b: ops.group_norm(x, 3, w, b), (base, torch.randn(12), torch.randn(12))),
             (lambda x, w: ops.group_norm(x, 4, w, None, 1e-5, "gelu"),
              (base.contiguous(memory_format=CL), torch.randn(12))),
             (lambda x, b: ops.group_norm(x, 2, None, b), (base[:, ::2, 0], torch.randn(6)))]
    calls = [(fn, tuple(t.to(DEVICE) for t in inputs)) for fn, inputs in calls]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    chain = lambda gn: lambda x, w, b: gn(gn(x, 2, w, b) * 2, 3, w, None, 1e-5, "silu")  # noqa: E731
    check(torch.compile(chain(ops.group_norm), fullgraph=True), chain(group_norm_ref), _leaves((2, 6, 4, 3)),
          grad_layout="input")


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


REGISTERED = {  # id -> (input, groups, weight, bias, activation, the parameters' gradient dtype or None)
    "affine": (lambda: _t(2, 6, 4, 3), 3, lambda: _t(6), lambda: _t(6), "none", torch.float32),
    "no-affine-silu": (lambda: _t(2, 6, 7), 2, lambda: None, lambda: None, "silu", None),
    "bias-only-fp16": (lambda: _t(2, 4, 5, dtype=torch.float16), 4, lambda: None,
                       lambda: _t(4, dtype=torch.float16), "relu", torch.float16),
    "channels-last": (lambda: _t(2, 6, 3, 4).contiguous(memory_format=CL), 2, lambda: _t(6), lambda: _t(6), "gelu",
                      torch.float32),
    "copied": (lambda: _t(2, 6, 5, 4).transpose(2, 3), 3, lambda: _t(6), lambda: None, "none", torch.float32),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case):
    """Schema, fake and dynamic-shape tracing of the forward and backward ops (what torch.compile sees)."""
    make_x, groups, make_w, make_b, act, wb_dtype = REGISTERED[case]
    x, w, b = make_x(), make_w(), make_b()
    _check.opcheck(torch.ops.dropin.group_norm.default, x, groups, w, b, 1e-5, act, True)
    _check.opcheck(torch.ops.dropin.group_norm.default, x, groups, w, b, 1e-5, act, False)
    _, mean, rstd = torch.ops.dropin.group_norm(x, groups, w, b, 1e-5, act, True)
    dy = torch.randn_like(x).transpose(0, -1).contiguous().transpose(0, -1)  # strided as torch may give it
    _check.opcheck(torch.ops.dropin.group_norm_backward.default, dy, x, groups, w, b, mean, rstd, act, wb_dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,groups,channels_last", [((8, 320, 64, 64), 32, False), ((8, 320, 64, 64), 32, True),
                                                        ((2, 512, 64, 64), 1, False), ((16, 64, 56, 56), 64, True)])
def test_large_gpu(shape, groups, channels_last, dtype):
    """Diffusion UNet and ResNet-GN sizes; one group of 512 tiles (two merge steps)."""
    _check_gn(_leaves(shape, dtype, channels_last=channels_last), groups, activation="silu")


# ----------------------------------------------------------------------------------------- errors
ERRORS = [  # (id, args, error, name in the message, torch also raises)
    ("groups-do-not-divide", (_t(2, 6, 3), 4), RuntimeError, "num_groups", True),
    ("groups-zero", (_t(2, 6, 3), 0), RuntimeError, "num_groups", True),
    ("groups-float", (_t(2, 6, 3), 2.0), RuntimeError, "num_groups", False),
    ("input-1d", (_t(6), 2), RuntimeError, "input", True),
    ("weight-shape", (_t(2, 6, 3), 2, _t(5)), RuntimeError, "weight", True),
    ("bias-2d", (_t(2, 6, 3), 2, None, _t(2, 3)), RuntimeError, "bias", False),
    ("int-input", (torch.ones(2, 6, 3, dtype=torch.int64, device=DEVICE), 2), NotImplementedError, "input", True),
    ("float64", (_t(2, 6, 3, dtype=torch.float64), 2), NotImplementedError, "input", False),
    ("int-weight", (_t(2, 6, 3), 2, torch.ones(6, dtype=torch.int32, device=DEVICE)), RuntimeError, "weight", False),
    ("activation", (_t(2, 6, 3), 2, None, None, 1e-5, "prelu"), ValueError, "activation", False),
    ("not-a-tensor", ([[1.0]], 1), TypeError, "input", True),
] + ([("spatial-empty", (_t(2, 4, 0), 2), RuntimeError, "input", True)] if DEVICE == "cpu" else [])


@gpu
def test_empty_spatial_size_on_the_gpu_gives_empty_results_as_torch():
    x = _t(2, 4, 0).requires_grad_()
    y = ops.group_norm(x, 2, _t(4), _t(4))
    assert y.shape == F.group_norm(x, 2).shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("args,error,name,torch_raises", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(args, error, name, torch_raises):
    with pytest.raises(error, match=f"'{name}'"):
        ops.group_norm(*args)
    if torch_raises:
        with pytest.raises(Exception):
            F.group_norm(*args[:5])
