"""Drop-ins for torch.nn's attention layers: nn.MultiheadAttention (its projections through dropin linear, attention
through dropin attention), nn.TransformerEncoderLayer (torch's eager path, never its fused inference kernel) and
nn.TransformerEncoder (its layers without torch's nested-tensor path)."""
from typing import Optional

import torch
import torch.nn.functional as F

from ..ops import attention, linear
from .module import DropinModule


def merged_mask(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor], heads: int,
                dtype: torch.dtype) -> Optional[torch.Tensor]:
    """nn.MultiheadAttention's masks (bool: True = masked; float: added to the scores) as one SDPA mask (bool: True =
    attend; float: added) that broadcasts to [B, H, Lq, Lk]. attn_mask: [Lq, Lk] or [B * H, Lq, Lk];
    key_padding_mask: [B, Lk] or [Lk]. Two bool masks stay bool; otherwise a bool one becomes -inf where masked (in
    `dtype`, as torch's _canonical_mask) and the two are added, as torch merges them."""
    masks = []
    if attn_mask is not None:
        masks.append(attn_mask.unflatten(0, (-1, heads)) if attn_mask.dim() == 3 else attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask.view(-1, 1, 1, key_padding_mask.shape[-1]))
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        return ~masks[0] if len(masks) == 1 else ~(masks[0] | masks[1])
    floats = [m if m.is_floating_point() else torch.zeros_like(m, dtype=dtype).masked_fill_(m, float("-inf"))
              for m in masks]
    return floats[0] if len(floats) == 1 else floats[0] + floats[1]


class MultiheadAttention(DropinModule):
    """nn.MultiheadAttention.forward with need_weights=False: the q / k / v projections through dropin linear on the
    module's own in_proj_weight / in_proj_bias (one product for self-attention, query is key is value) or
    q/k/v_proj_weight, attention through dropin attention (the masks merged as torch merges them, is_causal as
    torch's hint), out_proj through dropin linear. Batch first or not, batched or not. A call that asks for the
    attention weights (need_weights=True, the default), or one in training mode with dropout, runs the original's
    forward (torch): dropin attention returns no weights and has no dropout. out_proj stays a child under its name
    (its forward is never called: this module reads its tensors)."""

    kernel = "linear(q, k, v) + attention + linear(out); need_weights=True and dropout run torch"

    def __init__(self, original: torch.nn.MultiheadAttention):
        super().__init__(original)
        self.add_module("out_proj", original.out_proj)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        a = self.original
        if need_weights or self.training and a.dropout:
            return a(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        if is_causal and key_padding_mask is None:
            attn_mask = None  # the hint alone: attention's causal masking
        else:
            is_causal = False
        q, k, v = self._in_projections(query, key, value)
        batched = query.dim() == 3
        # [B, L, H, D] -> [B, H, L, D]: from batch first, or from [L, B, E], or from an unbatched [L, E]
        order = (1, 2, 0, 3) if batched and not a.batch_first else (0, 2, 1, 3)
        q, k, v = (t.unflatten(-1, (a.num_heads, -1)) for t in (q, k, v))
        q, k, v = (t.unsqueeze(0) if not batched else t for t in (q, k, v))
        q, k, v = (t.permute(order) for t in (q, k, v))
        mask = merged_mask(attn_mask, key_padding_mask, a.num_heads, query.dtype)
        out = attention(q, k, v, mask, is_causal=is_causal)
        back = (2, 0, 1, 3) if batched and not a.batch_first else (0, 2, 1, 3)
        out = out.permute(back).flatten(-2)
        out_proj = self._modules["out_proj"]  # (not getattr: see DropinModule._weight_bias)
        out = linear(out if batched else out.squeeze(0), out_proj.weight, out_proj.bias)
        return out, None

    def _in_projections(self, query, key, value) -> tuple:
        a = self.original
        if a.in_proj_weight is not None and query is key and key is value:
            return linear(query, a.in_proj_weight, a.in_proj_bias).chunk(3, dim=-1)
        weights = (a.in_proj_weight.chunk(3) if a.in_proj_weight is not None else
                   (a.q_proj_weight, a.k_proj_weight, a.v_proj_weight))
        biases = a.in_proj_bias.chunk(3) if a.in_proj_bias is not None else (None,) * 3
        return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


class TransformerEncoderLayer(DropinModule):
    """nn.TransformerEncoderLayer.forward's eager path (masks canonicalized as torch does, then its _sa_block and
    _ff_block on this module's children), never torch's fused inference kernel (torch._transformer_encoder_layer_fwd,
    which the original takes in eval mode without autograd and which would bypass the drop-ins of its children).
    Its children stay its children under their names and inject_ injects each by its own handler."""

    kernel = "encoder layer (its children injected)"
    walks_children = True

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        layer = torch.nn.TransformerEncoderLayer
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(src_mask),
            other_name="src_mask", target_type=src.dtype)
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="",
                                     target_type=src.dtype, check_other=False)
        x = src
        if self.norm_first:
            x = x + layer._sa_block(self, self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            return x + layer._ff_block(self, self.norm2(x))
        x = self.norm1(x + layer._sa_block(self, x, src_mask, src_key_padding_mask, is_causal=is_causal))
        return self.norm2(x + layer._ff_block(self, x))


def _torch_pads_with_zeros(encoder, src, mask, key_padding_mask) -> bool:
    """Whether nn.TransformerEncoder.forward would run its layers on a nested tensor made from src and
    key_padding_mask (its conditions: eval mode, no autograd on the first layer's tensors, a left-aligned padding
    mask, no mask, ...), which gives zeros at the padded positions."""
    first = encoder.layers[0]
    if (key_padding_mask is None or mask is not None or src.dim() != 3 or first.training or src.is_nested
            or not getattr(encoder, "use_nested_tensor", False) or not torch.backends.mha.get_fastpath_enabled()
            or torch.is_autocast_enabled()):
        return False
    if getattr(encoder, "mask_check", True) and (torch.compiler.is_compiling() or not (
            torch._nested_tensor_from_mask_left_aligned(src, key_padding_mask.logical_not()))):
        return False
    return not (torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in first.parameters())))


class TransformerEncoder(DropinModule):
    """nn.TransformerEncoder.forward on its injected layers (its children, injected by their own handlers), without
    torch's nested-tensor path, which hands the layers a nested tensor that dropin's modules do not take: the layers
    get the padding mask instead, and where torch would take that path the padded positions' outputs are zeros, as
    torch's are."""

    kernel = "encoder (its layers injected)"
    walks_children = True

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        transformer = torch.nn.modules.transformer
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask", other_type=F._none_or_dtype(mask),
            other_name="mask", target_type=src.dtype)
        mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype,
                                 check_other=False)
        zero_padding = _torch_pads_with_zeros(self, src, mask, src_key_padding_mask)
        seq_len = transformer._get_seq_len(src, self.layers[0].self_attn.batch_first)
        is_causal = transformer._detect_is_causal_mask(mask, is_causal, seq_len)
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        if zero_padding:
            output = output.masked_fill((src_key_padding_mask != 0).unsqueeze(-1), 0.0)  # nonzero: padded
        return output if self.norm is None else self.norm(output)
