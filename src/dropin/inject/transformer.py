"""Handlers for torch.nn's attention layers: nn.MultiheadAttention -> dropin linear + attention (calls that ask for
the attention weights run torch), nn.TransformerEncoderLayer -> its eager path on its injected children,
nn.TransformerEncoder -> its layers run without torch's nested-tensor path."""
from torch import nn

from .. import nn as dnn
from .registry import register

_MAX_HEAD_DIM = 256  # dropin attention's largest head dim


@register(nn.MultiheadAttention, op="attention")
def multihead_attention(module: nn.MultiheadAttention, site):
    if module.bias_k is not None:
        return "add_bias_kv=True: dropin attention takes no appended key / value bias"
    if module.add_zero_attn:
        return "add_zero_attn=True: dropin attention takes no appended zero key / value"
    if module.training and module.dropout:
        return f"attention dropout {module.dropout} in training mode: dropin attention has no dropout"
    if module.head_dim > _MAX_HEAD_DIM:
        return f"head_dim {module.head_dim}: dropin attention takes a head_dim up to {_MAX_HEAD_DIM}"
    if not site.config.uses("linear"):
        return "op 'linear' (its projections) is switched off by the config"
    return dnn.MultiheadAttention(module)


@register(nn.TransformerEncoderLayer, op="attention")
def transformer_encoder_layer(module: nn.TransformerEncoderLayer, site):
    return dnn.TransformerEncoderLayer(module)


@register(nn.TransformerEncoder, op="attention")
def transformer_encoder(module: nn.TransformerEncoder, site):
    return dnn.TransformerEncoder(module)
