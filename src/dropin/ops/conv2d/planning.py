"""Host-side pieces every conv2d kernel family plans with: the output's size and layout, the problem's sizes and
geometry constexprs, tl.dot's precision, pipeline stages cut to the shared memory, the tuner's pick."""
from typing import Optional

import torch

from ... import _runtime
from .. import _autotune, _gemm
from .._common import is_channels_last

# The most one launch's temporary buffers may take (fp32 partials, padded copies, tensor descriptors' scratch):
# a conv's peak stays within torch's + 256 MiB (issue 25). Above it a pass loops over chunks or takes a
# kernel without the buffer.
WORKSPACE = 64 << 20


def precision(dtype: torch.dtype, k: Optional[int] = None) -> str:
    """tl.dot's input precision: tf32 where torch's convolutions allow it (cuDNN's rule, `_runtime.tf32_allowed`),
    else true fp32 (`_gemm.precision`'s rule for a reduction of length k: FMAs below TF32X3_MIN_K, where tf32x3's
    truncations went over 2x cuDNN's error, a 1-pixel weight gradient 10x; None: tf32x3)."""
    return _gemm.precision(dtype, _runtime.tf32_allowed("conv") and not _runtime.INTERPRET, k)


def conv_out_hw(H, W, KH, KW, stride, padding, dilation):
    """padding: (top, bottom, left, right)."""
    oh = (H + padding[0] + padding[1] - dilation[0] * (KH - 1) - 1) // stride[0] + 1
    ow = (W + padding[2] + padding[3] - dilation[1] * (KW - 1) - 1) // stride[1] + 1
    return oh, ow


def dims(x, w, stride, padding, dilation, groups):
    """The sizes the launchers take: (N, C_G, H, W, COUT_G, OH, OW, KH, KW)."""
    N, C, H, W = x.shape
    COUT, C_G, KH, KW = w.shape
    OH, OW = conv_out_hw(H, W, KH, KW, stride, padding, dilation)
    return N, C_G, H, W, COUT // groups, OH, OW, KH, KW


def out_format(x, w):
    return torch.channels_last if is_channels_last(x) or is_channels_last(w) else torch.contiguous_format


def geometry_meta(stride, padding, dilation):
    return dict(STRIDE_H=stride[0], STRIDE_W=stride[1], PAD_H=padding[0], PAD_W=padding[2],
                DIL_H=dilation[0], DIL_W=dilation[1])


def conv_meta(stride, padding, dilation, precision):
    return dict(geometry_meta(stride, padding, dilation), PRECISION=precision)


def spatial_tiles(oh: int, ow: int, cfg: dict) -> int:
    """Spatial tiles of TH x TW pixels in one oh x ow image (the depthwise and TMA kernels' tiles)."""
    return _runtime.cdiv(oh, cfg["TH"]) * _runtime.cdiv(ow, cfg["TW"])


def staged(configs: list, stage_bytes) -> list:
    """The TMA, rows and implicit GEMM configs with their pipeline stages cut to what 200 KB of shared memory holds
    (stage_bytes(config): one stage's tiles; fp32 doubles them), those with fewer than 2 stages left out."""
    out = []
    for c in configs:
        stages = min(c["num_stages"], 200 * 1024 // stage_bytes(c))
        if stages >= 2 and dict(c, num_stages=stages) not in out:
            out.append(dict(c, num_stages=stages))
    return out


def pick(name, key, configs, launcher, args):
    """launcher(config) for the config the tuner picks (`_autotune.pick`) among configs, timed on args."""
    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        launch = launcher(cfg)
        return lambda: launch(*args)
    return launcher(_autotune.pick(name, key, configs, prepare))
