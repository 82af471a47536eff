"""Drop-ins for torchvision's window attentions: Swin's shifted windows (V1 and V2) and MaxViT's relative positional
attention, each window's scores, relative position bias (and shift mask), softmax and context product as one dropin
attention call."""
import math

import torch
import torch.nn.functional as F

from .. import _runtime, route
from ..ops import attention, linear
from .functional import Routed
from .module import DropinModule


_SHIFT_MASKS: dict = {}


def shift_mask(padded_h: int, padded_w: int, window: list, shift: list, device) -> torch.Tensor:
    """torchvision's mask of a shifted window ([windows, tokens, tokens] float32: 0 within a region, -100 across):
    the cyclic shift brings up to three regions of each axis into the last windows (rows [0, H - window), [H -
    window, H - shift), [H - shift, H) before the shift), whose tokens must not attend to each other. A function of
    its sizes alone: kept per sizes and device for eager calls (a dozen launches each time otherwise); made anew
    while torch.compile traces or a CUDA graph captures (the graph makes it in each replay)."""
    key = (padded_h, padded_w, *window, *shift, torch.device(device))
    kept = not torch.compiler.is_compiling() and not _runtime.capturing()
    if kept and key in _SHIFT_MASKS:
        return _SHIFT_MASKS[key]

    def region(size, window_size, shift_size):
        index = torch.arange(size, device=device)
        return (index >= size - window_size).long() + (index >= size - shift_size).long()

    ids = region(padded_h, window[0], shift[0])[:, None] * 3 + region(padded_w, window[1], shift[1])[None, :]
    ids = ids.view(padded_h // window[0], window[0], padded_w // window[1], window[1]).permute(0, 2, 1, 3)
    ids = ids.reshape(-1, window[0] * window[1])
    mask = (ids[:, None, :] != ids[:, :, None]) * -100.0
    if kept:
        _SHIFT_MASKS[key] = mask
    return mask


class WindowAttention(Routed):
    """torchvision's ShiftedWindowAttention(V2).forward (`shifted_window_attention`) with its scores, relative
    position bias, shift mask, softmax and context product as one dropin attention call (bias and mask its additive
    float mask, materialized per window where the shift needs one), the qkv and output projections as dropin
    linear; padding, cyclic shift and window partition as torchvision's (views and copies). V2's cosine attention
    scales the normalized queries by its logit scale (attention's scale 1); its bias MLP runs under dropin's route.

    dropin attention gives its mask no gradient: where autograd needs the bias's (grad mode with a trainable bias
    table or bias MLP), or the attention dropout is active, the forward runs as nn.Routed's does (the original's
    forward under dropin's route)."""

    kernel = "linear(qkv) + attention (relative position bias and shift mask as its mask) + linear(proj)"

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        self.cosine = hasattr(original, "logit_scale")

    def _routed(self) -> bool:
        a = self.original
        bias_parameters = a.cpb_mlp.parameters() if self.cosine else [a.relative_position_bias_table]
        return (a.training and a.attention_dropout > 0) or (
            torch.is_grad_enabled() and any(p.requires_grad for p in bias_parameters))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._routed():
            return super().forward(x)
        a, children = self.original, self._modules  # (not getattr: see DropinModule._weight_bias)
        B, H, W, C = x.shape
        window, heads = a.window_size, a.num_heads
        tokens, head_dim = window[0] * window[1], C // heads
        x = F.pad(x, (0, 0, 0, (window[1] - W % window[1]) % window[1], 0, (window[0] - H % window[0]) % window[0]))
        padded_h, padded_w = x.shape[1], x.shape[2]
        shift = [0 if window[0] >= padded_h else a.shift_size[0], 0 if window[1] >= padded_w else a.shift_size[1]]
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
        rows, cols = padded_h // window[0], padded_w // window[1]
        x = x.view(B, rows, window[0], cols, window[1], C).permute(0, 1, 3, 2, 4, 5).reshape(-1, tokens, C)
        qkv_bias = children["qkv"].bias
        if self.cosine and qkv_bias is not None:  # (V2: no key bias)
            qkv_bias = torch.cat([qkv_bias[:C], torch.zeros_like(qkv_bias[C:2 * C]), qkv_bias[2 * C:]])
        qkv = linear(x, children["qkv"].weight, qkv_bias).view(-1, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.cosine:
            with route.use():
                mask = a.get_relative_position_bias()
            scale = torch.clamp(a.logit_scale, max=math.log(100.0)).exp()
            q, k, scale = F.normalize(q, dim=-1) * scale.to(q.dtype), F.normalize(k, dim=-1), 1.0
        else:
            mask, scale = a.get_relative_position_bias(), head_dim ** -0.5
        if sum(shift) > 0:
            windows = shift_mask(padded_h, padded_w, window, shift, x.device)
            mask = (mask + windows[:, None].to(mask.dtype)).expand(B, rows * cols, heads, tokens, tokens)
            mask = mask.reshape(-1, heads, tokens, tokens)
        out = attention(q, k, v, mask.to(q.dtype), scale=scale).transpose(1, 2).reshape(-1, tokens, C)
        x = F.dropout(linear(out, children["proj"].weight, children["proj"].bias), a.dropout, a.training)
        x = x.view(B, rows, cols, window[0], window[1], C).permute(0, 1, 3, 2, 4, 5).reshape(B, padded_h, padded_w, C)
        if sum(shift) > 0:
            x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
        return x[:, :H, :W, :].contiguous()


class MaxVitAttention(DropinModule):
    """torchvision's MaxViT RelativePositionalMultiHeadAttention: to_qkv, one dropin attention over each window's
    (or grid's) P tokens, the groups as batch, with the relative position bias as its additive mask at the module's
    scale (feat_dim ** -0.5, as it scales the keys), then merge. Where autograd needs the bias table's gradient
    (dropin attention gives its mask none), torchvision's forward."""

    kernel = ("linear(qkv) + attention (relative position bias as its mask) + linear(merge) (torchvision's forward "
              "where the bias table needs a gradient)")
    walks_children = True

    def forward(self, x):
        a, m = self.original, self._modules
        bias = a.get_relative_positional_bias()
        if bias.requires_grad:
            return a(x)
        B, G, P, _ = x.shape
        qkv = m["to_qkv"](x).reshape(B * G, P, 3, a.n_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        out = attention(*qkv.unbind(0), bias, scale=a.scale_factor)
        return m["merge"](out.transpose(1, 2).reshape(B, G, P, -1))
