"""Handlers for HF CvT (transformers.models.cvt): the self-attention's products and softmax -> dropin attention
(its projections are injected one by one inside it), the depthwise conv projection (conv -> BatchNorm2d) and the
MLP's Linear -> GELU declared chains, so the generic handlers fuse them (the BatchNorm folded into the conv in eval
mode; the GELU into the linear's epilogue). The other Linear and Conv2d layers go through the generic handlers."""
from .. import nn as dnn
from .registry import chain, passive, register, when_imported


@when_imported("transformers.models.cvt.modeling_cvt")
def _register():
    from transformers.models.cvt.modeling_cvt import (CvtIntermediate, CvtSelfAttention,
                                                      CvtSelfAttentionConvProjection, CvtSelfAttentionLinearProjection)

    chain(CvtSelfAttentionConvProjection, "convolution", "normalization")
    chain(CvtIntermediate, "dense", "activation")
    passive(CvtSelfAttentionLinearProjection)  # a view and a permute
    # (CvtDropPath: passive as any *DropPath in eval mode, registry.is_passive)

    @register(CvtSelfAttention, op="attention")
    def cvt_self_attention(module, site):
        if module.training and module.dropout.p:
            return f"attention dropout {module.dropout.p} in training mode: dropin attention has no dropout"
        if module.embed_dim % module.num_heads:
            return f"embed_dim {module.embed_dim} is not a multiple of its {module.num_heads} heads"
        return dnn.CvtSelfAttention(module)
