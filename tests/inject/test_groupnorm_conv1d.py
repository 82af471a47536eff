"""nn.GroupNorm and nn.Conv1d handlers (issue 26): dropin.ops.conv1d (conv2d on height-1 views) against F.conv1d,
a 1-D model of Conv1d + GroupNorm + activations injected and verified, its forward and gradients against float64,
the same Parameters and state_dict keys, padding modes, revert; GroupNorm in a channels_last 2-D model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dropin
from dropin import ops
from _check import CL, check
from _tol import DEVICE

from _models import assert_same_state, check_backward, check_forward, injected_pair, snapshot


CONV1D = {  # id -> (input shape, weight shape, bias, stride, padding, dilation, groups)
    "k3-p1": ((2, 4, 11), (6, 4, 3), True, 1, 1, 1, 1),
    "k5-s2-d2": ((2, 4, 17), (3, 4, 5), False, 2, 3, 2, 1),
    "same-even-k": ((2, 4, 9), (4, 2, 4), True, 1, "same", 1, 2),
    "valid-depthwise": ((2, 6, 10), (6, 1, 3), True, (1,), "valid", (1,), 6),
    "unbatched": ((4, 9), (5, 4, 3), True, 1, 2, 1, 1),
}


@pytest.mark.parametrize("case", CONV1D)
def test_conv1d_op(case):
    x_shape, w_shape, bias, stride, padding, dilation, groups = CONV1D[case]
    leaves = {"x": torch.randn(x_shape, device=DEVICE), "w": torch.randn(w_shape, device=DEVICE)}
    if bias:
        leaves["b"] = torch.randn(w_shape[0], device=DEVICE)
    geometry = (stride, padding, dilation, groups)
    check(lambda x, w, b=None: ops.conv1d(x, w, b, *geometry), lambda x, w, b=None: F.conv1d(x, w, b, *geometry),
          leaves)


def test_conv1d_activation_residual_and_length_last_input():
    """relu6(conv1d(x) + residual) fused, on an input that is a transposed [N, L, C] tensor (unit channel stride)."""
    x = torch.randn(2, 9, 4, device=DEVICE).transpose(1, 2)
    leaves = {"x": x, "w": torch.randn(6, 4, 3, device=DEVICE), "b": torch.randn(6, device=DEVICE),
              "r": torch.randn(2, 6, 9, device=DEVICE)}
    check(lambda x, w, b, r: ops.conv1d(x, w, b, padding=1, activation="relu6", residual=r),
          lambda x, w, b, r: F.relu6(F.conv1d(x, w, b, padding=1) + r), leaves, grad_layout=None)


@pytest.mark.parametrize("args,name", [
    pytest.param((torch.randn(2, 4, 3, 5), torch.randn(4, 4, 3)), "input", id="input-4d"),
    pytest.param((torch.randn(2, 4, 9), torch.randn(4, 4, 1, 3)), "weight", id="weight-4d"),
    pytest.param((torch.randn(2, 4, 9), torch.randn(4, 4, 3), None, (1, 2)), "stride", id="stride-pair"),
    pytest.param((torch.randn(2, 4, 9), torch.randn(4, 4, 3), None, 1, "full"), "padding", id="padding-string"),
    pytest.param((torch.randn(2, 4, 9), torch.randn(4, 3, 3)), "input", id="channels"),
])
def test_conv1d_errors(args, name):
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(RuntimeError, match=f"'{name}'"):
        ops.conv1d(*args)


def _audio_model():
    """A 1-D conv net in the style of audio encoders: Conv1d -> GroupNorm -> SiLU blocks, a reflect-padded grouped
    conv, GroupNorm without affine parameters, a strided 1x1 conv."""
    return nn.Sequential(
        nn.Conv1d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(),
        nn.Conv1d(8, 8, 5, padding="same", padding_mode="reflect", groups=2), nn.GroupNorm(2, 8, affine=False),
        nn.GELU(), nn.Conv1d(8, 4, 1, stride=2, bias=False), nn.GroupNorm(1, 4),
    ).to(DEVICE)


def test_conv1d_groupnorm_model_injected_verified_and_reverted():
    x = torch.randn(2, 3, 13, device=DEVICE)
    model = _audio_model()
    params, state = dict(model.named_parameters()), snapshot(model)
    injected, original, report = injected_pair(lambda: model, train=True, example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "conv1d", ()), ("1", "group_norm+silu", ("2",)), ("3", "pad(reflect)+conv1d", ()),
        ("4", "group_norm+gelu", ("5",)), ("6", "conv1d", ()), ("7", "group_norm", ())]
    assert report.left == [] and report.verification.startswith("verified")
    assert all(p is params[name] for name, p in injected.named_parameters()) and len(params) == len(
        list(injected.parameters()))
    assert_same_state(injected, state)
    check_forward(injected, original, x)
    check_backward(injected, original, x)
    dropin.revert_(injected)
    assert [type(m) for m in injected] == [type(m) for m in original]
    assert all(p is params[name] for name, p in injected.named_parameters())


@pytest.mark.parametrize("mode", ["replicate", "circular"])
def test_conv1d_padding_modes(mode):
    """Padding modes other than zeros: F.pad (torch), then the dropin conv; a following ReLU fused."""
    model = nn.Sequential(nn.Conv1d(4, 6, 3, padding=2, dilation=2, padding_mode=mode), nn.ReLU()).to(DEVICE)
    x = torch.randn(2, 4, 10, device=DEVICE)
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.kernel, r.fused) for r in report.replaced] == [(f"pad({mode})+conv1d+relu", ("1",))]
    check_backward(injected, original, x)


def test_groupnorm_channels_last_cnn():
    """GroupNorm after a conv2d on channels_last activations (a ResNet-GN / UNet block): the norm and its fused
    SiLU keep the layout; output and gradients against float64."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                          nn.Conv2d(8, 4, 1)).to(DEVICE).to(memory_format=CL)
    x = torch.randn(2, 3, 6, 5, device=DEVICE).contiguous(memory_format=CL)
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [r.kernel for r in report.replaced] == ["conv2d", "group_norm+silu", "conv2d"]
    assert injected[1](injected[0](x)).is_contiguous(memory_format=CL)
    check_backward(injected, original, x)
