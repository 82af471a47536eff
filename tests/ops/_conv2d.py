"""What tests/ops/test_conv2d.py and test_conv2d_kernels.py share: the convolutions compared (torch's, dropin's, with
a fused activation), their random leaves and the check."""
import torch
import torch.nn.functional as F

import _check
import dropin
from _tol import DEVICE, EPILOGUE_ACTIVATIONS
from dropin.ops.activations import activation_ref

ACTS = EPILOGUE_ACTIVATIONS


def torch_conv(activation=None, **kw):
    return lambda x, w, b=None: activation_ref(F.conv2d(x, w, b, **kw), activation)


def dropin_conv(activation=None, **kw):
    return lambda x, w, b=None: dropin.conv2d(x, w, b, activation=activation, **kw)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def leaves(x_shape, w_shape, bias=True, dtype=torch.float32, channels_last=False, weight_channels_last=False):
    x = torch.randn(*x_shape, dtype=dtype, device=DEVICE)
    w = torch.randn(*w_shape, dtype=dtype, device=DEVICE) / (w_shape[1] * w_shape[2] * w_shape[3]) ** 0.5
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    if weight_channels_last:
        w = w.to(memory_format=torch.channels_last)
    out = {"x": x, "w": w}
    if bias:
        out["b"] = torch.randn(w_shape[0], dtype=dtype, device=DEVICE)
    return out


def check(op, ref_op, inputs: dict, autocast=None):
    """The shared check, for an NCHW upstream gradient (also under a channels_last output), each gradient in its
    input's layout; a residual's gradient is the output's, in the output's layout (as torch's add gives)."""
    _check.check(op, ref_op, inputs, upstream_contiguous=True, autocast=autocast,
                 grad_layout={k: "torch" if k == "r" else "input" for k in inputs})
