"""Invalid arguments, op by op, for the public ops whose tests in tests/ops have no error table (conv1d, group_norm)
or none against torch (rms_norm vs F.rms_norm, adaptive_avg_pool2d's dtypes): dropin raises torch's exception
type for the same call, its message naming the argument."""
import pytest
import torch
import torch.nn.functional as F

import dropin
from _tol import DEVICE


def T(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def I(*shape):  # noqa: E743
    return torch.ones(*shape, dtype=torch.int64, device=DEVICE)


ERRORS = [  # (id, dropin's op, torch's, args, kwargs, the argument the message names; torch raises the same type)
    ("conv1d-input-4d", dropin.ops.conv1d, F.conv1d, (T(1, 2, 3, 8), T(4, 2, 3)), {}, "input"),
    ("conv1d-weight-4d", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3, 3)), {}, "weight"),
    ("conv1d-channels", dropin.ops.conv1d, F.conv1d, (T(1, 3, 8), T(4, 2, 3)), {}, "input"),
    ("conv1d-groups", dropin.ops.conv1d, F.conv1d, (T(1, 4, 8), T(3, 2, 3)), dict(groups=2), "weight"),
    ("conv1d-bias-shape", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3), T(5)), {}, "bias"),
    ("conv1d-int", dropin.ops.conv1d, None, (I(1, 2, 8), I(4, 2, 3)), {}, "input"),  # (torch's CPU conv takes it)
    ("conv1d-weight-dtype", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3, dtype=torch.float16)), {},
     "weight"),
    ("conv1d-same-strided", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3)), dict(padding="same", stride=2),
     "stride"),
    ("conv1d-padding-string", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3)), dict(padding="full"),
     "padding"),
    ("conv1d-stride-zero", dropin.ops.conv1d, F.conv1d, (T(1, 2, 8), T(4, 2, 3)), dict(stride=0), "stride"),
    ("conv1d-too-small", dropin.ops.conv1d, F.conv1d, (T(1, 2, 2), T(4, 2, 3)), {}, "weight"),
    ("group_norm-groups", dropin.ops.group_norm, F.group_norm, (T(2, 6, 4), 4), {}, "num_groups"),
    ("group_norm-input-1d", dropin.ops.group_norm, F.group_norm, (T(6), 2), {}, "input"),
    ("group_norm-weight-shape", dropin.ops.group_norm, F.group_norm, (T(2, 6, 4), 2, T(5)), {}, "weight"),
    ("group_norm-bias-shape", dropin.ops.group_norm, F.group_norm, (T(2, 6, 4), 2, T(6), T(7)), {}, "bias"),
    ("group_norm-int", dropin.ops.group_norm, F.group_norm, (I(2, 6, 4), 2), {}, "input"),
    ("group_norm-int-weight", dropin.ops.group_norm, F.group_norm, (T(2, 6, 4), 2, I(6)), {}, "weight"),
    ("rms_norm-weight-shape", dropin.ops.rms_norm, None, (T(3, 8), T(7)), {}, "weight"),
    ("adaptive-int", dropin.ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, (I(1, 2, 6, 6), 2), {}, "input"),
    ("adaptive-int-global", dropin.ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, (I(1, 2, 6, 6), 1), {},
     "input"),  # (torch's global pool is a mean: its dtype check's RuntimeError)
    ("layer_norm-int", dropin.ops.layer_norm, F.layer_norm, (I(2, 6), (6,)), {}, "input"),
    ("softmax-int", dropin.ops.softmax, F.softmax, (I(2, 6), -1), {}, "input"),
    # (torch's CPU linear takes ints; its CUDA one raises NotImplementedError: "addmm_cuda" not implemented)
    ("linear-int", dropin.ops.linear, F.linear if DEVICE == "cuda" else None, (I(2, 6), I(3, 6)), {}, "x"),
    ("linear-mixed", dropin.ops.linear, F.linear, (T(2, 6), I(3, 6)), {}, "weight"),
    ("adaptive-input-2d", dropin.ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, (T(6, 6), 2), {}, "input"),
]


def _param(e):
    return pytest.param(*e.values[1:], id=e.values[0], marks=e.marks) if hasattr(e, "marks") else \
        pytest.param(*e[1:], id=e[0])


@pytest.mark.parametrize("op,torch_op,args,kwargs,name", [_param(e) for e in ERRORS])
def test_invalid_args_raise_torchs_type(op, torch_op, args, kwargs, name):
    with pytest.raises(Exception, match=f"'{name}'") as ours:
        op(*args, **kwargs)
    if torch_op is not None:
        with pytest.raises(Exception) as theirs:
            torch_op(*args, **kwargs)
        assert type(ours.value) is type(theirs.value), (
            f"dropin raises {type(ours.value).__name__}, torch {type(theirs.value).__name__}: {theirs.value}")
